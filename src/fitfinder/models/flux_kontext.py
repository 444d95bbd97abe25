"""FLUX.1 Kontext dev: FLUX.1-dev's parts and computation, with the reference (control) image's
latents packed into tokens of their own after the noisy ones: one reference at the bucket's size
doubles the image sequence, in training and in previews.

AI Toolkit: extensions_built_in/diffusion_models/flux_kontext/flux_kontext.py (FluxKontextModel;
commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models import flux
from fitfinder.models._family import Family, Placement

# FluxKontextModel.load_model: FluxTransformer2DModel quantized with model.qtype (quantize, freeze)
# and moved to the device; T5 moved to the device in bf16, then quantized with model.qtype when
# quantize_te; CLIP on the device, never quantized; the VAE. LoRA: target_lora_modules
# ['FluxTransformer2DModel'] with AI Toolkit's default transformer_only, the blocks only
# (toolkit/lora_special.py), as for FLUX.1.
FAMILY = Family(
    name="flux_kontext",
    denoisers=("transformer",),
    text_encoders=("text_encoder", "text_encoder_2"),
    classes=dict(flux.FAMILY.classes),
    lora_blocks=flux.FAMILY.lora_blocks,
    arch_values=("flux_kontext",),
    name_hints=("kontext",),
    quantized_text_encoders=("text_encoder_2",),
    text_seq_len=512,  # get_prompt_embeds: encode_prompts_flux(max_length=512)
    load_order=flux.FAMILY.load_order,  # FluxKontextModel.load_model: T5 before CLIP, the VAE last
    tokenizer="tokenizer_2",
    # condition_noisy_latents moves the VAE to the device and encodes the control image at every
    # training step, cached latents or not.
    # (FluxKontextModel's loader never reads low_vram.)
    placement={"vae": Placement(also_in=frozenset({"train"}))},
)


class Recipe(flux.Recipe):
    """FLUX.1's computation with the reference image's tokens beside the noisy ones."""

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call on noisy + reference tokens; the prediction keeps the noisy ones.

        AI Toolkit's get_noise_prediction packs the noisy latents and the control latents (the
        control image at the bucket's size, through the VAE) each 2x2, concatenates them along the
        sequence with the reference's positions at index 1, and slices the prediction back to the
        noisy tokens; FluxKontextPipeline does the same in a preview (the control image resized to
        the preview's size, `_auto_resize=False`). The reference's latents are drawn here: the
        VAE's output has their shape.
        """
        import torch

        from fitfinder.models._common import batched

        batch = latents.shape[0]
        with torch.no_grad():
            reference = self.inputs.randn(latents.shape)
            tokens = torch.cat([flux.pack(latents), flux.pack(reference)], dim=1)
            ids = torch.cat([flux.image_ids(latents, self.inputs), flux.image_ids(reference, self.inputs, index=1.0)])
            del reference
        noisy_tokens = tokens.shape[1] // 2
        cond = batched(cond, batch)
        text_ids = torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=self.inputs.device,
                               dtype=self.inputs.dtype)
        out = denoiser(hidden_states=tokens, timestep=t, guidance=self.guidance(guidance_scale, batch), img_ids=ids,
                       txt_ids=text_ids, return_dict=False, **cond)[0]
        return flux.unpack(out[:, :noisy_tokens], latents.shape)
