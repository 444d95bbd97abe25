"""A kohya trainer's pipeline inside a probe: every part in host memory, fp8 and block swap as
sd-scripts and musubi-tuner do them, then the parts the trainer's first phase holds on the device.

The request's `trainer` field (fitfinder.trainers: sd_scripts.recipe, musubi_tuner.recipe) says, per
part, the weights' form, and which blocks swap. What each form is:

- a dtype ("bf16", "fp16", "fp32"): the part built in it;
- "fp8": every Linear weight (and bias) in float8_e4m3fn, the rest (norms, embeddings) in the
  weight dtype; the forward runs under autocast, which upcasts each Linear's weight to the compute
  dtype for that one op (sd-scripts train_network.py: `unet.to(dtype=torch.float8_e4m3fn)` and
  accelerator.autocast() around each DiT call; prepare_text_encoder_fp8 keeps T5XXL's norms and
  embeddings in the weight dtype and calls its gated MLP without the cast to wo's dtype);
- "fp8_scaled": musubi-tuner's scaled fp8 (modules/fp8_optimization_utils.py): the Linear weights
  of the transformer blocks, "norm" layers excepted, in float8_e4m3fn with a scale per 64 weights of
  a row in the weight dtype (quantize_weight, block mode; per row where a row is no whole number of
  64s), dequantized to the scale's dtype in each forward (fp8_linear_forward_patch).

Block swap (both trainers' ModelOffloader, library/custom_offloading_utils.py and
modules/custom_offloading_utils.py): of each block list, the last `n` blocks' Linear weights wait in
host memory, and each swap exchanges a block's weights in place with one that has run, so the device
holds the other blocks' weights at every moment, with every swapped block's biases, norms and
buffers. The sim meter and the estimate count exactly that: the swapped blocks' Linear weights are
host memory (marked as AI Toolkit's offloaded layers are, models/_offload.py), the rest is the
device's. On a card the weights are copied in for each call of their block and dropped after, one
block at a time beyond the trainer's exchange (not yet measured on a card).
"""

from __future__ import annotations

import types

import torch

from fitfinder.models import _offload

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 64  # fp8_optimization_utils.py: block_size 64
_SCALED_TARGETS, _SCALED_EXCLUDED = ("transformer_blocks",), ("norm", "time_text_embed")  # qwen_image_model.py


def build_dtype(form: str, fallback: torch.dtype) -> torch.dtype:
    from fitfinder.models._pipeline import DTYPES

    return DTYPES.get(form, fallback)


def load(pipe, spec: dict, settings: dict):
    """Every part built in host memory in its form, swapped blocks marked, the LoRA added; then the
    parts of the trainer's load phase placed on the device (`residency.load`)."""
    from fitfinder.models._pipeline import _add_lora, _build

    trainer, meter, family = settings["trainer"], pipe.meter, pipe.family
    for part in family.load_order or family.parts:
        form = trainer["weights"].get(part, settings["dtype"])
        with meter.host(), meter.owning(f"weights:{part}"):
            module = _build(spec, part, build_dtype(form, pipe.dtype), "cpu", meter)
            for path in family.dropped.get(part, ()):
                owner, _, name = path.rpartition(".")
                setattr(module.get_submodule(owner), name, None)
            meter.to_host(module)  # in host memory until placed (a library may make its weights unseen)
            if form == "fp8":
                cast_fp8(module)
            elif form == "fp8_scaled":
                scale_fp8(module, **trainer.get("scaled", {}))
        if part == "vae" and build_dtype(form, pipe.dtype) != pipe.dtype:
            takes_its_dtype(module)
        pipe.parts[part] = module
    for name in family.denoisers:  # every expert the trainer holds swaps the same blocks (Wan 2.2's two)
        if name in pipe.parts:
            swap_blocks(pipe, name, trainer.get("swapped") or {})
    for name in settings["trained"]:
        with meter.host(), meter.owning("lora"):
            _add_lora(pipe, name, settings)
        if not trainer.get("lora_input_cast", True):
            keep_lora_input(pipe.parts[name])
    pipe.place(set(trainer["residency"]["load"]))
    return pipe


# -- fp8 ------------------------------------------------------------------------------------------
def cast_fp8(module: torch.nn.Module) -> int:
    """Every Linear and convolution weight and bias in float8_e4m3fn (the rest keeps its dtype: the
    trainers cast whole models, `unet.to(dtype=torch.float8_e4m3fn)`, and autocast upcasts a conv's
    weight for its op as a Linear's; a norm's scale stays, see the module docstring); T5's gated MLP
    called without its cast to wo's dtype (sd-scripts flux_train_network.py prepare_text_encoder_fp8)."""
    count = 0
    for child in module.modules():
        if isinstance(child, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            for param in (child.weight, child.bias):
                if param is not None and param.dtype.is_floating_point:
                    param.data = param.data.to(FP8)
            count += 1
        if type(child).__name__ == "T5DenseGatedActDense":
            child.forward = types.MethodType(_t5_gated_forward, child)
    return count


def _t5_gated_forward(self, hidden_states):
    hidden_gelu = self.act(self.wi_0(hidden_states))
    hidden_states = self.dropout(hidden_gelu * self.wi_1(hidden_states))
    return self.wo(hidden_states)


def scale_fp8(module: torch.nn.Module, targets=_SCALED_TARGETS, excluded=_SCALED_EXCLUDED) -> int:
    """musubi-tuner's scaled fp8 on the Linear weights of the modules whose names hold a target and no
    excluded word (each model's FP8_OPTIMIZATION_TARGET_KEYS and EXCLUDE_KEYS; Qwen-Image's by
    default); see the module docstring."""
    count = 0
    for name, child in module.named_modules():
        targeted = any(t in name for t in targets) and not any(e in name for e in excluded)
        if targeted and isinstance(child, torch.nn.Linear):
            _scaled(child)
            count += 1
    return count


def _scaled(linear: torch.nn.Linear) -> None:
    weight = linear.weight.data
    out_features, in_features = weight.shape
    blocks = in_features // SCALE_BLOCK if in_features % SCALE_BLOCK == 0 else 0
    with torch.no_grad():
        grouped = weight.view(out_features, blocks, SCALE_BLOCK) if blocks else weight
        scale = grouped.abs().amax(dim=-1, keepdim=True).float() / torch.finfo(FP8).max
        scale = scale.clamp(min=1e-8)
        codes = (grouped.float() / scale).clamp(torch.finfo(FP8).min, torch.finfo(FP8).max).to(FP8)
    linear.weight.data = codes.view(out_features, in_features)
    linear.register_buffer("scale_weight", scale.to(weight.dtype))
    linear.forward = types.MethodType(_scaled_forward, linear)


def _scaled_forward(self, x):
    """fp8_linear_forward_patch without scaled_mm: the weight dequantized to the scale's dtype."""
    dtype = self.scale_weight.dtype
    if self.scale_weight.ndim < 3:
        weight = self.weight.to(dtype) * self.scale_weight
    else:
        out_features, blocks, _ = self.scale_weight.shape
        weight = self.weight.to(dtype).contiguous().view(out_features, blocks, -1) * self.scale_weight
        weight = weight.view(self.weight.shape)
    return torch.nn.functional.linear(x, weight, self.bias)


def takes_its_dtype(vae: torch.nn.Module) -> None:
    """A VAE in its own dtype (sd-scripts' --no_half_vae: fp32; musubi-tuner's --vae_dtype) gets its
    input in that dtype, as the trainers cast the images and latents they hand it (train_network.py:
    `images.to(device, dtype=vae_dtype)`; the caching passes use `vae.dtype`)."""
    dtype = next(vae.parameters()).dtype
    for name in ("encode", "decode"):
        method = getattr(vae, name)
        setattr(vae, name, lambda x, *args, _method=method, **kwargs: _method(x.to(dtype), *args, **kwargs))


# -- the LoRA ---------------------------------------------------------------------------------------
def keep_lora_input(denoiser: torch.nn.Module) -> None:
    """kohya's LoRA modules take a layer's input as it comes (networks/lora_flux.py and musubi-tuner's
    networks/lora.py LoRAModule.forward: lora_down(x)); peft casts it to the adapter's fp32 first,
    which under autocast would be a second copy of each input. Its switch turns that off."""
    for module in denoiser.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


# -- block swap -------------------------------------------------------------------------------------
def swap_blocks(pipe, part: str, swapped: dict[str, int]) -> int:
    """The last `n` blocks of each list: their Linear weights in host memory (see the module docstring)."""
    module, meter, count = pipe.parts[part], pipe.meter, 0
    for attribute, n in swapped.items():
        blocks = list(getattr(module, attribute))
        for block in blocks[len(blocks) - int(n):] if n else []:
            held = []
            for layer in block.modules():
                if isinstance(layer, torch.nn.Linear):
                    param = layer._parameters["weight"]
                    if meter.kind == "cuda":
                        param = torch.nn.Parameter(param.detach().to("cpu"), requires_grad=False)
                        layer._parameters["weight"] = param
                    else:  # used in place by its layer: no view of it may count it again
                        meter.hold_in_host(param)
                    param._is_memory_managed = True  # the meters count it as host memory (meter.tensors_of)
                    held.append(layer)
            if meter.kind == "cuda":
                block.register_forward_pre_hook(_bring_weights(held, meter))
                block.register_forward_hook(_drop_weights(held))
            count += 1
    if count:
        module.to = _offload._managed_to(module)  # placing the part leaves the swapped weights be
    return count


def _bring_weights(layers, meter):
    def hook(block, args):
        for layer in layers:
            host = layer._parameters["weight"]
            layer._host_weight = host
            layer._parameters["weight"] = torch.nn.Parameter(host.detach().to(meter.device), requires_grad=False)
    return hook


def _drop_weights(layers):
    def hook(block, args, output):
        for layer in layers:
            layer._parameters["weight"] = layer._host_weight
    return hook
