"""SDXL: two CLIPs (penultimate hidden states, pooled projection), time ids, a UNet; epsilon
prediction on SDXL's DDPM schedule; classifier-free guidance on a doubled batch.

AI Toolkit: toolkit/stable_diffusion_model.py (load_model's is_xl branch; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._common import KLImageLatents
from fitfinder.models._family import Family

# LoRA targets: every Linear and 1x1 convolution of the UNet, and its larger convolutions at
# `network.conv`'s rank, as SD 1.5's (models/sd15.py says why: toolkit/lora_special.py wraps the whole
# UNet2DConditionModel and skips nothing in it). load_model's SDXL branch has no quantize call: the
# UNet is never quantized, nor either CLIP.
FAMILY = Family(
    name="sdxl",
    denoisers=("unet",),
    text_encoders=("text_encoder", "text_encoder_2"),
    classes={"unet": "diffusers.UNet2DConditionModel", "text_encoder": "transformers.CLIPTextModel",
             "text_encoder_2": "transformers.CLIPTextModelWithProjection", "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r".*",
    lora_convs=True,
    arch_values=("sdxl",),
    flags=("is_xl",),
    name_hints=("xl",),
    quantized_denoisers=False,
    text_seq_len=77,  # CLIP only
    tokenizer=None,
)


class Recipe(KLImageLatents):
    """What SDXL computes; built by probe children (its methods import torch)."""

    vae_scaling = 0.13025  # the VAE's scaling_factor where its config names none

    def __init__(self, arch: dict, inputs):
        import torch

        self.inputs = inputs
        self.read_autoencoder_kl(arch["parts"]["vae"], scaling=self.vae_scaling, shift=None)
        self.divisor = self.scale_factor * 2 ** (len(arch["parts"]["unet"]["block_out_channels"]) - 1)
        # The DDPM schedule SDXL was trained with: scaled-linear betas 0.00085..0.012 over 1000 steps.
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0).to(torch.float32)

    def encode_prompts(self, parts, batch) -> dict:
        import torch

        first, second = parts["text_encoder"], parts["text_encoder_2"]
        out_1 = first(input_ids=self.inputs.clip_ids(first.config, batch), output_hidden_states=True)
        out_2 = second(input_ids=self.inputs.clip_ids(second.config, batch), output_hidden_states=True)
        text = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2]], dim=-1)
        dtype = self.inputs.dtype
        return {"encoder_hidden_states": text.to(dtype), "text_embeds": out_2.text_embeds.to(dtype)}

    def noisy_and_target(self, latents, noise, t):
        """DDPM: x_t = sqrt(a) x + sqrt(1 - a) noise at step t * 999; the model predicts the noise."""
        steps = (t.float() * 999).long().clamp(0, 999).cpu()
        alpha = self.alphas_cumprod[steps].to(device=latents.device, dtype=latents.dtype).view(-1, 1, 1, 1)
        return alpha.sqrt() * latents + (1 - alpha).sqrt() * noise, noise

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        import torch

        from fitfinder.models._common import batched

        device, dtype = self.inputs.device, self.inputs.dtype
        batch, _, height, width = latents.shape
        pixels_high, pixels_wide = float(height * self.scale_factor), float(width * self.scale_factor)
        # original size, crop top-left, target size: SDXL's micro-conditioning
        time_ids = torch.tensor([pixels_high, pixels_wide, 0.0, 0.0, pixels_high, pixels_wide], device=device,
                                dtype=dtype)
        cond = batched(cond, batch)
        added = {"text_embeds": cond["text_embeds"], "time_ids": time_ids.expand(batch, 6)}
        return denoiser(latents, t * 999, encoder_hidden_states=cond["encoder_hidden_states"],
                        added_cond_kwargs=added, return_dict=False)[0]

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        import torch

        if guidance_scale <= 1:
            return self.predict(denoiser, latents, t, cond)
        # Classifier-free guidance as StableDiffusionXLPipeline does it: one call on a doubled batch.
        both = {key: torch.cat([uncond[key], cond[key]]) for key in cond}
        eps_uncond, eps_cond = self.predict(denoiser, torch.cat([latents, latents]), torch.cat([t, t]), both).chunk(2)
        return eps_uncond + guidance_scale * (eps_cond - eps_uncond)
