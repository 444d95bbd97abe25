"""FLUX.1 (dev, schnell, Flex.1): pooled CLIP + T5 sequence, 16-channel latents packed 2x2 into
tokens, guidance embedded when the transformer has guidance_embeds (dev, Flex), none for schnell.

AI Toolkit: toolkit/stable_diffusion_model.py (load_model's is_flux branch; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._common import FlowImageLatents
from fitfinder.models._family import Family, Placement

# LoRA targets follow AI Toolkit's LoRA network (toolkit/lora_special.py): every Linear layer of
# both block kinds (attention, MLP, modulation). Quantization (load_model): the transformer with
# model.qtype, T5 with model.qtype too; CLIP never.
FAMILY = Family(
    name="flux",
    denoisers=("transformer",),
    text_encoders=("text_encoder", "text_encoder_2"),
    classes={"transformer": "diffusers.FluxTransformer2DModel", "text_encoder": "transformers.CLIPTextModel",
             "text_encoder_2": "transformers.T5EncoderModel", "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r"(single_)?transformer_blocks\.\d+\..*",
    arch_values=("flux", "flex1"),
    flags=("is_flux",),
    name_hints=("flux", "flex1"),
    quantized_text_encoders=("text_encoder_2",),
    text_seq_len=512,  # FluxPipeline's max_sequence_length
    # load_model (is_flux): the transformer, then T5 (quantized on the device), then CLIP; the VAE, read
    # before T5, reaches the device last (`pipe.vae.to(self.vae_device_torch)`)
    load_order=("transformer", "text_encoder_2", "text_encoder", "vae"),
    tokenizer="tokenizer_2",
    # load_model (is_flux): with low_vram the transformer stays in host memory while quanto quantizes
    # it ("for low v ram, we leave it on the cpu"), then moves to the device; T5 still comes in bf16
    # and is quantized there, CLIP comes too, and every part stays: low_vram lowers the load peak only.
    low_vram={"transformer": Placement(quantized_on="host")},
)


class Recipe(FlowImageLatents):
    """What FLUX.1 computes; built by probe children (its methods import torch)."""

    def __init__(self, arch: dict, inputs):
        self.inputs = inputs
        self.read_autoencoder_kl(arch["parts"]["vae"], scaling=0.3611, shift=0.1159)
        self.guidance_embeds = bool(arch["parts"]["transformer"].get("guidance_embeds"))
        self.divisor = self.scale_factor * 2  # latents are packed 2x2

    def encode_prompts(self, parts, batch) -> dict:
        clip, t5 = parts["text_encoder"], parts["text_encoder_2"]
        pooled = clip(input_ids=self.inputs.clip_ids(clip.config, batch)).pooler_output
        text = t5(input_ids=self.inputs.t5_ids(t5.config, batch)).last_hidden_state
        dtype = self.inputs.dtype
        return {"pooled_projections": pooled.to(dtype), "encoder_hidden_states": text.to(dtype)}

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call: latents packed 2x2 into tokens as FluxPipeline packs them."""
        import torch

        from fitfinder.models._common import batched

        batch = latents.shape[0]
        tokens, ids = pack(latents), image_ids(latents, self.inputs)
        cond = batched(cond, batch)
        text_ids = torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=self.inputs.device,
                               dtype=self.inputs.dtype)
        out = denoiser(hidden_states=tokens, timestep=t, guidance=self.guidance(guidance_scale, batch), img_ids=ids,
                       txt_ids=text_ids, return_dict=False, **cond)[0]
        return unpack(out, latents.shape)

    def guidance(self, guidance_scale: float, batch: int):
        """The distilled guidance scale as an input (dev, Flex), or None (schnell)."""
        import torch

        if not self.guidance_embeds:
            return None
        return torch.full((batch,), guidance_scale, device=self.inputs.device, dtype=self.inputs.dtype)

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        # FLUX.1-dev is guidance-distilled: the scale is an input, one call per step, no negative.
        return self.predict(denoiser, latents, t, cond, guidance_scale)


# -- packing, shared by the families built on FLUX.1's transformer (flux_kontext, flex2, chroma) ----
def pack(latents):
    """(B, C, H, W) latents -> (B, H/2 * W/2, 4C) tokens, 2x2 patches as FluxPipeline._pack_latents."""
    batch, channels, height, width = latents.shape
    tokens = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack(tokens, shape):
    """The transformer's tokens back to latents of `shape` (B, C, H, W)."""
    batch, channels, height, width = shape
    out = tokens.view(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return out.reshape(batch, channels, height, width)


def image_ids(latents, inputs, index: float = 0.0):
    """Positions (index, row, column) of the packed tokens; `index` tells a reference image apart (Kontext)."""
    import torch

    _, _, height, width = latents.shape
    rows, cols = height // 2, width // 2
    ids = torch.zeros(rows, cols, 3, device=inputs.device, dtype=inputs.dtype)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(rows, device=inputs.device)[:, None]
    ids[..., 2] = torch.arange(cols, device=inputs.device)[None, :]
    return ids.view(-1, 3)
