"""A job's pipeline inside a probe: its parts, which of them are on the device, its LoRA.

Loading follows AI Toolkit's order and placement: the denoiser(s) first, then the text
encoder(s), then the VAE (or the family's Family.load_order). By default each part goes onto the
device as it is loaded and is quantized there (the full-precision weights sit on the device until
their layer is swapped, which is why quantizing a large model can run out of memory at load), and
stays. Where a family's loader departs from that, with or without `low_vram`, its Family.placement
and Family.low_vram say so (models/_family.py, Placement): FLUX.1 quantizes its transformer in host
memory under low_vram, Wan 2.1 parks it there while UMT5 loads, and so on; Family.load_plan reads
those rules, this module carries them out. What a family drops from a part before placing it is
Family.dropped.
"""

from __future__ import annotations

import contextlib
import re

import torch

from fitfinder.models import FAMILIES, _fake, _lokr, _offload
from fitfinder.models._common import Inputs
from fitfinder.models._weights import QUANTO_TYPES, build_part, lora_targets, quantize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Pipeline:
    """Parts by diffusers folder name, each in host memory or on the meter's device."""

    def __init__(self, spec: dict, settings: dict, meter):
        self.family = FAMILIES[spec["family"]]
        self.arch = spec["arch"]
        self.dtype = DTYPES[settings["dtype"]]
        self.meter = meter
        self.parts: dict[str, torch.nn.Module] = {}
        self.on_device: set[str] = set()
        self.inputs = Inputs(meter.device, self.dtype, settings.get("seed", 0), int(self.arch.get("text_seq_len", 512)))
        self.settings = settings
        # Recipe code that reads tensor values runs under it (a fake tensor has none: the estimate).
        self.inputs.concrete = meter.concrete
        self.recipe = self.family.recipe(self.arch, self.inputs)
        self.recipe.pipeline = self  # a recipe that calls a companion part (LTX-2's connectors) finds it here
        # The device's staging rings of offloaded layers (models/_offload.py), one for every part.
        self.offload_rings = _offload.Rings(_offload.ring_depth())
        self.offloaded: set[str] = set()

    def place(self, wanted: set[str]) -> None:
        """Exactly the loaded parts in `wanted` on the device: leaving parts go first, then arriving ones.
        A leaving part's LoRA stays on the device (`keep_lora_on_device`)."""
        for name in sorted(self.on_device - wanted):
            self.parts[name] = self.meter.to_host(self.parts[name])
            self.on_device.discard(name)
            self.keep_lora_on_device(name)
        for name in sorted((wanted & self.parts.keys()) - self.on_device):
            self.parts[name] = self.meter.to_device(self.parts[name])
            self.on_device.add(name)

    def keep_lora_on_device(self, name: str) -> None:
        """The part's LoRA (its peft adapters, with their gradients) on the device wherever the part is.

        AI Toolkit's LoRA is a network of its own, not a submodule of the model: BaseSDTrainProcess.run
        moves it to the device once (`network.force_to(self.device_torch, dtype=torch.float32)`), and
        what moves the model afterwards moves the model alone: the device presets of the caching passes
        (toolkit/stable_diffusion_model.py set_device_state_preset) and Wan 2.2's expert swap
        (wan22_14b_model.py DualWanTransformer3DModel, `transformer.to("cpu")`). AI Toolkit commit 27a03a91.
        """
        from peft.tuners.tuners_utils import BaseTunerLayer

        for layer in self.parts[name].modules():
            if isinstance(layer, BaseTunerLayer):
                for adapters in layer.adapter_layer_names:
                    self.meter.to_device(getattr(layer, adapters))
            elif isinstance(layer, _lokr.Lokr):
                self.meter.to_device(layer)

    @contextlib.contextmanager
    def lora_off(self, name: str):
        """The part's LoRA skipped while inside, as `network.is_active = False` makes AI Toolkit's
        modules forward the base layer alone (toolkit/network_mixins.py ToolkitModuleMixin.forward)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        def switch(on: bool) -> None:
            for layer in self.parts[name].modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.enable_adapters(on)
                elif isinstance(layer, _lokr.Lokr):
                    layer.active = on

        switch(False)
        try:
            yield
        finally:
            switch(True)

    def unload(self, name: str) -> None:
        """Drop a part for good (AI Toolkit's unloaded text encoders): its memory is freed."""
        self.place(self.on_device - {name})
        del self.parts[name]
        if name in self.offloaded:  # MemoryManager.free drops the device's rings (toolkit/unloader.py)
            self.offloaded.discard(name)
            self.offload_rings.clear()

    def trainable_parameters(self, names) -> list[torch.nn.Parameter]:
        """What the optimizer trains: the parts' parameters that need gradients, but an accuracy-
        recovery adapter's (quantize_model's network is no part of the trained one)."""
        return [p for name in names for key, p in self.parts[name].named_parameters()
                if p.requires_grad and f".{RECOVERY}." not in key]

    def recovery_parameters(self, names) -> list[torch.nn.Parameter]:
        """An accuracy-recovery adapter's parameters (`_recovered`): gradients, never trained."""
        return [p for name in names for key, p in self.parts[name].named_parameters() if f".{RECOVERY}." in key]


def load(spec: dict, settings: dict, meter) -> Pipeline:
    """Every part, quantized as the job says, with a LoRA on each trained denoiser.

    Each part goes where its Placement says (Family.load_plan, models/_family.py): onto the device
    whole and quantized there, or quantized in host memory first; then it stays, waits in host
    memory until the later parts are loaded, or leaves for a phase to bring back. A part that
    follows another comes with it (Family.after_load).
    """
    pipe = Pipeline(spec, settings, meter)
    if settings.get("trainer"):  # a kohya trainer's own loading, fp8 and block swap (models/_kohya.py)
        from fitfinder.models import _kohya

        return _kohya.load(pipe, spec, settings)
    family, low_vram = pipe.family, settings["low_vram"]
    qtypes = {part: _quantization(family, part, settings) for part in family.parts}
    quantized = {part for part, qtype in qtypes.items() if qtype}
    for loading in family.load_plan(low_vram, quantized):
        with meter.owning(f"weights:{loading.part}"):
            _load_part(pipe, spec, settings, loading, qtypes[loading.part])
    pipe.place(family.after_load(low_vram, quantized))
    # BaseSDTrainProcess.run, right after load_model and before the network is made: `vae.to('cpu')`,
    # whatever the model (AI Toolkit 27a03a91); each phase's presets bring it back when they want it.
    pipe.place(pipe.on_device - {"vae"})
    make_trainable = _add_lora if settings["rank"] else _train_whole
    for name in settings["trained"]:
        with meter.owning("lora" if settings["rank"] else f"weights:{name}"):
            if name in pipe.on_device:
                make_trainable(pipe, name, settings)
            else:
                with meter.host():
                    make_trainable(pipe, name, settings)
                pipe.keep_lora_on_device(name)  # network.force_to: the LoRA of a part left in host memory too
    return pipe


def _load_part(pipe: Pipeline, spec: dict, settings: dict, loading, qtype: str | None) -> None:
    """One part built, quantized and offloaded where its family's loader does it (`load_pipeline`)."""
    family, meter, part = pipe.family, pipe.meter, loading.part
    share = _offload_share(family, part, settings)
    offloaded_first = bool(share) and loading.offloaded_on_host
    with meter.host():
        module = _build(spec, part, pipe.dtype,
                        "cpu" if loading.built_on_host or offloaded_first else meter.device, meter)
        for path in family.dropped.get(part, ()):  # gone before anything counts it
            owner, _, name = path.rpartition(".")
            setattr(module.get_submodule(owner), name, None)
        meter.to_host(module)  # in host memory until placed (a library may make its weights unseen)
        pipe.parts[part] = module
        if qtype and loading.built_on_host:
            _quantize(pipe, part, qtype, settings)
        if offloaded_first:  # its offloaded layers never reach the device (Placement.offloaded_on_host)
            _offload_in_host_memory(pipe, part, share, None if loading.built_on_host else qtype)
    if loading.comes_on:
        pipe.place(pipe.on_device | {part})  # whole, to be quantized here, or quantized already
        if qtype and not loading.built_on_host:
            _quantize(pipe, part, qtype, settings)  # offloaded layers are quantized already
    if not offloaded_first:
        _offload_layers(pipe, part, share)  # after quantizing, before the LoRA, wherever the part is
    if loading.leaves:
        pipe.place(pipe.on_device - {part})


def _quantize(pipe: Pipeline, part: str, qtype: str, settings: dict) -> None:
    """The part quantized where it is: every Linear layer but those a denoiser's loader keeps in full
    precision (Family.unquantized_layers), or, for a denoiser with the job's accuracy-recovery
    adapter, the adapter first and then the layers it covers (`_recovered`)."""
    denoiser = part in pipe.family.denoisers
    adapter = settings.get("recovery_adapter") if denoiser else None
    if adapter is None:
        kept = pipe.family.unquantized_layers if denoiser else ()  # get_quantization_exclude_modules
        quantize(pipe.parts[part], qtype, pipe.meter.repeated, exclude=kept)
    else:
        _recovered(pipe, part, qtype, adapter)


# peft's name of the accuracy-recovery adapter, beside the trained LoRA's "default".
RECOVERY = "recovery"


def _wrapped_by_recovery(names: list[str]) -> list[str]:
    """Layer names with peft's wrapping of an accuracy-recovery adapter undone: a covered layer is
    `NAME.base_layer` inside peft's wrapper `NAME`, beside the adapter's own `NAME.lora_A.recovery`...;
    the trained LoRA takes `NAME`, the original layer, as AI Toolkit's network does (its adapter
    modules live outside the model)."""
    unwrapped = []
    for name in names:
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        unwrapped.append(name.removesuffix(".base_layer"))
    return unwrapped


def _recovered(pipe: Pipeline, part: str, qtype: str, adapter: dict) -> None:
    """toolkit/util/quantize.py quantize_model with an accuracy-recovery adapter (AI Toolkit 27a03a91):
    a LoRA of the file's rank (alpha the rank) on the file's layers, moved to the device in the model's
    dtype (`network.force_to(device, dtype=torch_dtype)`), its parameters left requiring gradients (no
    requires_grad_(False) anywhere: each backward gives them gradients, which no optimizer clears);
    then each covered layer quantized with the qtype, and every other layer with `uint8`, which AI
    Toolkit's UIntXQuantizer.can_quantize refuses: those stay in the model's dtype. Without the file
    (trainers.aitoolkit.recovery_adapter), the adapter covers the LoRA's own layers."""
    from peft import LoraConfig

    denoiser = pipe.parts[part]
    linear = set(lora_targets(denoiser, r".*")[0])
    covered = sorted(linear & set(adapter["layers"] or ())) or lora_targets(denoiser, pipe.family.lora_blocks)[0]
    config = LoraConfig(r=adapter["rank"], lora_alpha=adapter["rank"], target_modules=covered,
                        init_lora_weights="gaussian")
    with pipe.meter.host():
        if getattr(pipe.meter, "fake", False):
            _fake.add_adapter(denoiser, config, adapter_name=RECOVERY)
        else:
            denoiser.add_adapter(config, adapter_name=RECOVERY)
        for name, param in denoiser.named_parameters():
            if f".{RECOVERY}." in name:
                param.data = param.data.to(pipe.dtype)
                param.requires_grad_(True)
    pipe.keep_lora_on_device(part)
    quantize(denoiser, qtype, pipe.meter.repeated, only={f"{name}.base_layer" for name in covered})


def _offload_share(family, part: str, settings: dict) -> float:
    """The share of the part's layers the family's loader offloads (Family.layer_offloading): the
    denoisers' percent, or the text encoders' for them and Family.offloaded_with_text_encoders; 0: none."""
    shares = settings.get("layer_offloading") or {}
    if part in family.denoisers:
        return shares.get("denoiser", 0.0)
    if part in family.text_encoders or part in family.offloaded_with_text_encoders:
        return shares.get("text_encoder", 0.0)
    return 0.0


def _offload_layers(pipe: Pipeline, part: str, share: float) -> None:
    """AI Toolkit's block swap on a loaded, quantized part, before its LoRA (models/_offload.py)."""
    if share and _offload.attach(pipe.parts[part], share, pipe.meter, pipe.offload_rings):
        pipe.offloaded.add(part)


def _offload_in_host_memory(pipe: Pipeline, part: str, share: float, qtype: str | None) -> None:
    """The block swap attached while the part is in host memory, before it moves and, with `qtype`,
    before it is quantized (QwenImageModel.load_model and the loaders Placement.offloaded_on_host
    names: MemoryManager.attach, then `.to(device)`, then `quantize`; AI Toolkit commit 27a03a91).

    The managed layers' weights stay in host memory and are quantized there: torchao's float8 and
    int8 (what `qfloat8` becomes under layer offloading, toolkit/config_modules.py ModelConfig) swap
    the weight of the same Linear, whose bounced forward reads it at each call, so the layer stays
    offloaded with its quantized bytes. AI Toolkit's grouped uint formats swap the class in place
    (toolkit/util/ostris_quant.py convert_linear_to_ostris) and the bounce then reads OstrisLinear's
    `weight` property, the weight dequantized in host memory: the device sees the bf16 weight either
    way, so those layers stay in bf16 here. The other layers come to the device and are quantized
    there, with the rest of the part (`load`)."""
    module = pipe.parts[part]
    layers = _offload.chosen(_offload.offloadable(module), share)
    if qtype and _weights_quantized_in_place(qtype):
        names = {id(layer): name for name, layer in module.named_modules()}
        chosen = [names[id(layer)] for layer in layers]
        quantize(module, qtype, pipe.meter.repeated, only=set(chosen))
        layers = [module.get_submodule(name) for name in chosen]
    _offload.attach_layers(module, layers, pipe.meter, pipe.offload_rings)
    if layers:
        pipe.offloaded.add(part)


def _weights_quantized_in_place(qtype: str) -> bool:
    """Whether a qtype keeps a quantized weight on the layer (torchao's and quanto's names), rather
    than AI Toolkit's grouped uint formats, whose layers hold no weight (models._weights.GroupedLinear)."""
    return qtype.split("|")[0].strip().lower() in QUANTO_TYPES


def _build(spec: dict, part: str, dtype: torch.dtype, device, meter) -> torch.nn.Module:
    """The part's weights; under a fake meter (the estimate) its architecture as fake tensors."""
    if getattr(meter, "fake", False):
        module = _fake.build_part(spec, part, dtype)
        _fake.read_whole(meter, spec, part)
        return module
    return build_part(spec, part, dtype, device)


def _quantization(family, part: str, settings: dict) -> str | None:
    """The qtype AI Toolkit's loader gives this part, or None (Family.qtype_of)."""
    return family.qtype_of(part, settings)


def _add_lora(pipe: Pipeline, name: str, settings: dict) -> None:
    """A fresh peft LoRA on the family's targets, in fp32; gradient checkpointing as asked.

    AI Toolkit trains the LoRA in fp32 whatever `train.dtype` says (jobs/process/BaseSDTrainProcess.py:
    `self.network.force_to(self.device_torch, dtype=torch.float32)`, AI Toolkit commit 27a03a91), and
    its forward casts each adapted layer's input to fp32 (toolkit/network_mixins.py, forward: "always
    cast to float32"), which autograd keeps for the backward. peft does the same with fp32 adapters
    (it casts the input to the adapter's dtype). peft builds each adapter in host memory and moves it
    next to its base layer; the device counts it from that move on, and the cast happens there.
    """
    from peft import LoraConfig

    denoiser = pipe.parts[name]
    torch.manual_seed(settings.get("seed", 0))
    conv_rank = settings.get("conv_rank")
    kind = settings.get("network_type", "lora")
    own = settings.get("trainer") or {}  # a kohya trainer's LoRA targets its own modules (trainers/)
    if kind == "locon":
        targets, conv_targets = _locon_targets(denoiser, conv_rank)
    else:
        targets, conv_targets = (_wrapped_by_recovery(names) for names in lora_targets(
            denoiser, own.get("lora_blocks", pipe.family.lora_blocks),
            own.get("lora_convs", pipe.family.lora_convs), conv_rank))
        # network.network_kwargs.ignore_if_contains: AI Toolkit skips every layer whose name holds one
        # (toolkit/lora_special.py, LoRASpecialNetwork.create_modules; HiDream's example leaves the MoE out).
        ignored = settings.get("lora_ignore") or []
        targets, conv_targets = ([name for name in names if not any(word in name for word in ignored)]
                                 for names in (targets, conv_targets))
    if kind == "lokr":
        _add_lokr(pipe, name, targets, conv_targets, settings)
        return
    # The convolutions network.conv asks for take its rank and alpha (peft: a pattern per layer name).
    at_conv = [f"^{re.escape(name)}$" for name in conv_targets]
    config = LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], target_modules=targets + conv_targets,
                        rank_pattern=dict.fromkeys(at_conv, conv_rank),
                        alpha_pattern=dict.fromkeys(at_conv, settings.get("conv_alpha")),
                        init_lora_weights="gaussian")
    with pipe.meter.host():
        if getattr(pipe.meter, "fake", False):
            _fake.add_adapter(denoiser, config)
        else:
            denoiser.add_adapter(config)
        if pipe.recovery_parameters([name]):  # both networks act (add_adapter made the new one alone active)
            denoiser.set_adapter([RECOVERY, "default"])
    if name in pipe.on_device:
        # Counts the adapters; on a card it moves them there too: peft puts them next to the base
        # weight, which an offloaded layer keeps in host memory.
        pipe.parts[name] = pipe.meter.to_device(denoiser)
    for param in pipe.trainable_parameters([name]):
        param.data = param.data.to(torch.float32)
    if settings["gradient_checkpointing"]:
        denoiser.enable_gradient_checkpointing()


# toolkit/lycoris_special.py LycorisSpecialNetwork.UNET_TARGET_REPLACE_MODULE: the classes whose layers
# a LoCon wraps (its UNET_TARGET_REPLACE_NAME, conv_in, conv_out and the time embedding, is never passed
# to create_modules for the UNet).
LOCON_BLOCKS = ("Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D")


def _locon_targets(denoiser: torch.nn.Module, conv_rank: int | None) -> tuple[list[str], list[str]]:
    """A LoCon's layers (network.type locon or lycoris: BaseSDTrainProcess.run builds a
    LycorisSpecialNetwork, toolkit/lycoris_special.py create_modules): in each module of LOCON_BLOCKS,
    every Linear and 1x1 convolution at the rank, the larger convolutions at `network.conv`'s when set.
    The layers train as a LoRA's do (LoConSpecialModule: lora_down, lora_up, ToolkitModuleMixin's fp32
    forward); the probe leaves out the one fp32 scalar each LoConSpecialModule multiplies its update by."""
    at_rank, at_conv = [], []
    for block_name, block in denoiser.named_modules():
        if type(block).__name__ not in LOCON_BLOCKS:
            continue
        for child_name, child in block.named_modules():
            full = f"{block_name}.{child_name}" if child_name else block_name
            if type(child).__name__ == "Linear":
                at_rank.append(full)
            elif type(child).__name__ == "Conv2d":
                if child.kernel_size[0] == 1:
                    at_rank.append(full)
                elif conv_rank:
                    at_conv.append(full)
    return at_rank, at_conv


def _add_lokr(pipe: Pipeline, name: str, targets: list[str], conv_targets: list[str], settings: dict) -> None:
    """AI Toolkit's LoKr (models/_lokr.py) on the LoRA's layers: made in host memory in fp32, then on
    the device with the part (`network.force_to(device, torch.float32)`)."""
    denoiser = pipe.parts[name]
    arguments = (denoiser, targets, conv_targets, settings["rank"], settings["alpha"], settings.get("conv_rank"),
                 settings.get("conv_alpha"), settings.get("lokr_factor", -1))
    with pipe.meter.host():
        if getattr(pipe.meter, "fake", False):
            with _fake.plain_meta():
                _lokr.add(*arguments)
            _fake.materialize(denoiser)
        else:
            _lokr.add(*arguments)
    if name in pipe.on_device:
        pipe.parts[name] = pipe.meter.to_device(denoiser)
    if settings["gradient_checkpointing"]:
        denoiser.enable_gradient_checkpointing()


def _train_whole(pipe: Pipeline, name: str, settings: dict) -> None:
    """A full fine-tune (no `network`): the denoiser's own weights train, in the dtype they were
    loaded in, as AI Toolkit's `prepare_optimizer_params` picks them: every parameter whose
    "PART.NAME" contains one of `only_if_contains` (all when unset) and none of `ignore_if_contains`.
    No fp32 master copy: AI Toolkit steps bf16 weights in place (its Adafactor rounds stochastically).
    """
    only, ignore = settings.get("only_if_contains") or [], settings.get("ignore_if_contains") or []
    denoiser = pipe.parts[name]
    for param_name, param in denoiser.named_parameters():
        full_name = f"{name}.{param_name}"
        wanted = (not only or any(text in full_name for text in only)) and not any(text in full_name for text in ignore)
        if wanted and param.dtype.is_floating_point:  # a quantized weight cannot train
            param.requires_grad_(True)
    if settings["gradient_checkpointing"]:
        denoiser.enable_gradient_checkpointing()
