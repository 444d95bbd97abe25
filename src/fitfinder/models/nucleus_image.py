"""Nucleus-Image: Qwen3-VL 8B's hidden states eight layers from the top as the prompt, 16-channel
latents of Qwen-Image's VAE run on single frames, packed 2x2 into tokens; a single-stream
transformer whose image tokens attend to per-block keys and values of the text, with
mixture-of-experts feed-forwards routed by expert choice; flow matching; true CFG (a negative
prompt, a second transformer call) in previews.

AI Toolkit: extensions_built_in/diffusion_models/nucleus_image/nucleus_image_model.py
(NucleusImageModel; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._family import Family, Placement
from fitfinder.models.qwen_image import LORA_BLOCKS
from fitfinder.models.qwen_image import Recipe as QwenImageRecipe

CLASSES = {"transformer": "diffusers.NucleusMoEImageTransformer2DModel",
           "text_encoder": "transformers.Qwen3VLForConditionalGeneration",
           "vae": "diffusers.AutoencoderKLQwenImage"}
# LoRA targets: NucleusImageModel sets target_lora_modules ["NucleusMoEImageTransformer2DModel"] and
# get_transformer_block_names ["transformer_blocks"]; with transformer_only (NetworkConfig's default)
# toolkit/lora_special.py keeps the Linear layers inside transformer_blocks. The routed experts are
# SwiGLUExperts parameters, not Linear layers: no LoRA; the router (`img_mlp.gate`) and the shared
# expert are Linear (the UI's job leaves the router out with ignore_if_contains). Qwen-Image's LORA_BLOCKS.
# NucleusImageModel.load_model: the transformer is read into host memory and, with model.quantize,
# quantized by quantize_model (toolkit/util/quantize.py: block by block on the device and back to the
# CPU; optimum-quanto swaps Linear layers only, so the experts' parameters stay in bf16); low_vram
# sends it to the CPU. Qwen3-VL then comes to the device in bf16, vision tower and all, and is
# quantized there with model.qtype_te when model.quantize_te; the VAE comes to the device; last,
# the transformer comes unless low_vram (with it, get_noise_prediction brings it at the first step).
FAMILY = Family(
    name="nucleus_image",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes=CLASSES,
    lora_blocks=LORA_BLOCKS,
    arch_values=("nucleus_image",),
    name_hints=("nucleusimage", "nucleusmoeimage"),
    quantized_text_encoders=("text_encoder",),
    te_qtype_key="qtype_te",
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    # get_prompt_embeds: the processor pads to the longest prompt (a multiple of 8) and truncates at
    # max_length=1024; the probe encodes 1024 tokens, the longest prompt a job can have.
    text_seq_len=1024,
    tokenizer="processor",
    placement={"transformer": Placement(quantized_on="host", after_load="waits")},
)

# NucleusMoEImagePipeline.default_return_index: the prompt is hidden_states[-8].
RETURN_INDEX = -8


class Recipe(QwenImageRecipe):
    """What Nucleus-Image computes; built by probe children (its methods import torch). The VAE side
    (latent shape, encode_images, decode: one frame through AutoencoderKLQwenImage, normalized per
    channel) is Qwen-Image's, as NucleusImageModel.encode_images and the pipeline's decode are."""

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        self.divisor = 32  # NucleusImageModel.get_bucket_divisibility: 16 * 2
        self.patch = int(arch["parts"]["transformer"].get("patch_size", 2))

    # -- prompts ----------------------------------------------------------------------------------
    def encode_prompts(self, parts, batch) -> dict:
        """NucleusImageModel.get_prompt_embeds: the chat-formatted prompt through the whole Qwen3-VL
        (logits included, no cache) with every hidden state returned; hidden_states[-8] is the
        prompt, all of its tokens, with the processor's attention mask."""
        import torch

        encoder = parts["text_encoder"]
        ids = self._prompt_ids(encoder.config, batch, self.inputs.text_seq_len)
        out = encoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                      output_hidden_states=True)
        hidden = out.hidden_states[RETURN_INDEX]
        del out
        return self._embeds(hidden)

    # -- the transformer --------------------------------------------------------------------------
    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """NucleusImageModel.get_noise_prediction: the latents packed 2x2 (the pipeline's
        _pack_latents), timesteps on the 0-1 scale, the prompt's mask passed, the prediction negated
        and unpacked."""
        from fitfinder.models._common import batched

        text = batched(self.text_conditioning(cond), latents.shape[0])
        return self._call(denoiser, latents, t, text["encoder_hidden_states"], text["encoder_hidden_states_mask"])

    def _call(self, denoiser, latents, t, text, mask):
        _prepare(denoiser, latents.device)
        batch, channels, height, width = latents.shape
        rows, cols = height // self.patch, width // self.patch
        out = denoiser(hidden_states=self.pack(latents), timestep=t, encoder_hidden_states=text,
                       encoder_hidden_states_mask=mask, img_shapes=[(1, rows, cols)] * batch, return_dict=False)[0]
        _forget_rope_frequencies()
        return self._unpack(-out, batch, channels, rows, cols)

    def _unpack(self, tokens, batch, channels, rows, cols):
        """The pipeline's _unpack_latents, the frame axis dropped."""
        p = self.patch
        out = tokens.view(batch, rows, cols, channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(batch, channels, rows * p, cols * p)

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """NucleusMoEImagePipeline.__call__ as NucleusImageModel.generate_single_image runs it: the
        prompts' masks are dropped (all ones: encode_prompt keeps none), the negative prompt is a
        second call when guidance_scale > 1, the combination is rescaled per token to the
        conditional prediction's norm, then negated."""
        import torch

        from fitfinder.models._common import batched

        _prepare(denoiser, latents.device)
        batch, channels, height, width = latents.shape
        rows, cols = height // self.patch, width // self.patch
        tokens = self.pack(latents)

        def call(text):
            text = batched(text, batch)["encoder_hidden_states"]
            out = denoiser(hidden_states=tokens, timestep=t, encoder_hidden_states=text,
                           encoder_hidden_states_mask=None, img_shapes=[(1, rows, cols)] * batch,
                           return_dict=False)[0]
            _forget_rope_frequencies()
            return out

        prediction = call(cond)
        if guidance_scale > 1:
            negative = call(uncond)
            combined = negative + guidance_scale * (prediction - negative)  # negative lives on, as in the loop
            conditional_norm = torch.norm(prediction, dim=-1, keepdim=True)
            prediction = combined * (conditional_norm / torch.norm(combined, dim=-1, keepdim=True))
        return self._unpack(-prediction, batch, channels, rows, cols)

    @staticmethod
    def without_gradient(denoiser) -> list:
        """Every LoRA parameter gets a gradient: the text feeds each block's keys and values."""
        return []


def _prepare(denoiser, device) -> None:
    """Once per transformer, before its first call: its experts as batched matmuls, its RoPE tables on the device."""
    if getattr(denoiser, "_fitfinder_prepared", False):
        return
    _experts_as_batched_matmuls(denoiser)
    _rope_tables_on_the_device(denoiser, device)
    denoiser._fitfinder_prepared = True


def _rope_tables_on_the_device(denoiser, device) -> None:
    """NucleusMoEEmbedRope keeps its frequency tables (`pos_freqs`, `neg_freqs`: 4096 rows of complex64,
    2 MiB each at full size) as plain attributes, which `module.to` leaves in host memory: on a GPU
    each call copies them to the device (`_compute_video_freqs`, `forward`) for a moment. Here they
    are copied to the device once, on the first call, and stay: both meters count the same bytes, a
    few MiB held where the GPU holds them only briefly at the start of each call. Left where they are,
    the meters would disagree: the sim meter copies nothing (host and device are one) but counts the
    host tables once an op returns a view of them; the estimate, whose transformer was built on
    meta, copies them at every call (measured on the tiny arch: 0.5 MiB apart in previews, 0.45 MiB
    in training).
    """
    rope = denoiser.pos_embed
    rope.pos_freqs = rope.pos_freqs.to(device, copy=True)
    rope.neg_freqs = rope.neg_freqs.to(device, copy=True)


def _experts_as_batched_matmuls(denoiser) -> None:
    """Each MoE layer's experts run as batched matmuls over the experts: the same products, shapes and bytes.

    AI Toolkit runs torch 2.13, which has F.grouped_mm, so NucleusImageModel.load_model leaves the
    config's use_grouped_mm (true) and SwiGLUExperts._run_experts_grouped_mm multiplies each expert's
    tokens by its weights (diffusers transformer_nucleusmoe_image.py). Routing is by expert choice
    (NucleusMoELayer.forward: top-C tokens per expert, C = ceil(capacity_factor * tokens / experts)),
    so every expert holds exactly batch * C rows and the grouped matmul is a batched one over the
    experts: the same gate-up, SwiGLU and down products, no tensor more or larger. This is done because
    the fake tensors of the estimate cannot run grouped_mm outside bf16 (its meta kernel checks
    for bf16) and the sim meter must run the ops the estimate runs; the for-loop fallback would need
    the token counts' values (`.tolist()`), which fake tensors lack.
    """
    import types

    for module in denoiser.modules():
        if type(module).__name__ == "SwiGLUExperts" and module.use_grouped_mm:
            module._run_experts_grouped_mm = types.MethodType(_batched_experts, module)


def _batched_experts(self, x, num_tokens_per_expert):
    """SwiGLUExperts._run_experts_grouped_mm with equal groups: (experts, rows, width) batched matmuls."""
    import torch
    import torch.nn.functional as F

    rows = x.shape[0] // self.num_experts
    gate_up = torch.bmm(x.view(self.num_experts, rows, -1), self.gate_up_proj)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, self.down_proj)
    return out.view(x.shape[0], -1).type_as(x)


def _forget_rope_frequencies() -> None:
    """Empty diffusers' per-shape cache of NucleusMoEEmbedRope frequencies (`_compute_video_freqs`, an
    lru_cache of device tensors), for the reason qwen_image._forget_rope_frequencies gives."""
    from diffusers.models.transformers import transformer_nucleusmoe_image

    transformer_nucleusmoe_image.NucleusMoEEmbedRope._compute_video_freqs.cache_clear()
