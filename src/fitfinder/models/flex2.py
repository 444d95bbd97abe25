"""Flex.2 (ostris/Flex.2-preview): Flex.1's FLUX.1 transformer (8 double blocks) with 49 latent
channels in, packed 2x2 (196): the noisy latents (16), the inpainting image's latents (16) and its
mask (1), and a control image's latents (16: depth, line, pose); 16 come out. Guidance embedded.

AI Toolkit: extensions_built_in/flex2/flex2.py (Flex2) and pipeline.py (Flex2Pipeline); commit 27a03a91.
"""

from __future__ import annotations

from fitfinder.models import flux
from fitfinder.models._family import Family, Placement

# Flex2.load_model: FluxTransformer2DModel quantized with model.qtype and moved to the device; T5 on
# the device in bf16, then quantized with model.qtype when quantize_te; CLIP on the device, never
# quantized; the VAE. LoRA: target_lora_modules ['FluxTransformer2DModel'], the blocks only
# (toolkit/lora_special.py, transformer_only), as for FLUX.1.
FAMILY = Family(
    name="flex2",
    denoisers=("transformer",),
    text_encoders=("text_encoder", "text_encoder_2"),
    classes=dict(flux.FAMILY.classes),
    lora_blocks=flux.FAMILY.lora_blocks,
    arch_values=("flex2",),
    name_hints=("flex2",),
    quantized_text_encoders=("text_encoder_2",),
    text_seq_len=512,  # get_prompt_embeds: encode_prompts_flux(max_length=512)
    tokenizer="tokenizer_2",
    # condition_noisy_latents encodes the control image through the VAE at every training step
    # (unless control_dropout drops it), cached latents or not.
    # (Flex2's loader never reads low_vram.)
    placement={"vae": Placement(also_in=frozenset({"train"}))},
)


class Recipe(flux.Recipe):
    """FLUX.1's computation on the noisy latents with the inpainting and control channels beside them."""

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        transformer = arch["parts"]["transformer"]
        # Latent channels the transformer takes beyond the noisy ones: 16 + 1 + 16 for Flex.2.
        self.conditioning_channels = transformer["in_channels"] // 4 - self.latent_channels

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call on the noisy latents concatenated in channels with the conditioning.

        AI Toolkit's condition_noisy_latents concatenates, without gradients, the inpainting
        latents (the batch's latents masked), the mask (1 channel, at the latents' size) and the
        control image's latents (through the VAE, or zeros on dropout) to the noisy latents, and
        get_noise_prediction packs all 49 channels 2x2; Flex2Pipeline feeds a preview zeros and a
        mask of ones for them. Their values cost nothing; their shape is drawn here.
        """
        import torch

        from fitfinder.models._common import batched

        batch, _, height, width = latents.shape
        with torch.no_grad():
            conditioning = self.inputs.randn((batch, self.conditioning_channels, height, width))
            tokens = flux.pack(torch.cat([latents, conditioning], dim=1))
            del conditioning
        ids = flux.image_ids(latents, self.inputs)
        cond = batched(cond, batch)
        text_ids = torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=self.inputs.device,
                               dtype=self.inputs.dtype)
        out = denoiser(hidden_states=tokens, timestep=t, guidance=self.guidance(guidance_scale, batch), img_ids=ids,
                       txt_ids=text_ids, return_dict=False, **cond)[0]
        return flux.unpack(out, latents.shape)
