"""Stable Diffusion 1.5: one CLIP (its last hidden state), a UNet with four levels; epsilon
prediction on the DDPM schedule SDXL shares; classifier-free guidance on a doubled batch.

AI Toolkit: toolkit/stable_diffusion_model.py (load_model's last branch, StableDiffusionPipeline;
commit 27a03a91). Its UI writes `model.arch: sd15`; toolkit/config_modules.py ModelConfig maps a
job with no arch and no is_* flag to 'sd1', the same loader.
"""

from __future__ import annotations

from fitfinder.models import sdxl
from fitfinder.models._family import Family

# LoRA targets: toolkit/lora_special.py (LoRASpecialNetwork.create_modules) wraps the whole
# UNet2DConditionModel (UNET_TARGET_REPLACE_MODULE) and, with transformer_only, skips nothing in a
# UNet (it has no transformer_blocks/blocks): every Linear layer trains -- attentions, feed-forwards,
# the resnets' time projections, the time embedding -- and every 1x1 convolution (proj_in/proj_out,
# conv_shortcut) at the LoRA's rank, the 3x3 ones at `network.conv`'s when the job sets it
# (is_conv2d_1x1, conv_lora_dim: Family.lora_convs).
# The loader has no quantize call: neither the UNet nor CLIP is quantized (the UI hides
# model.quantize for SD 1.5).
FAMILY = Family(
    name="sd15",
    denoisers=("unet",),
    text_encoders=("text_encoder",),
    classes={"unet": "diffusers.UNet2DConditionModel", "text_encoder": "transformers.CLIPTextModel",
             "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r".*",
    lora_convs=True,
    arch_values=("sd15", "sd1"),
    name_hints=("sd15", "sdv15", "stablediffusionv15", "stablediffusion15"),
    quantized_denoisers=False,
    text_seq_len=77,  # CLIP only
    tokenizer=None,
)


class Recipe(sdxl.Recipe):
    """What SD 1.5 computes: SDXL's DDPM noising and doubled-batch guidance, its own conditioning."""

    vae_scaling = 0.18215

    def encode_prompts(self, parts, batch) -> dict:
        # toolkit/train_tools.py text_encode: the encoder's output [0], its last hidden state.
        encoder = parts["text_encoder"]
        text = encoder(input_ids=self.inputs.clip_ids(encoder.config, batch))[0]
        return {"encoder_hidden_states": text.to(self.inputs.dtype)}

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        from fitfinder.models._common import batched

        cond = batched(cond, latents.shape[0])
        return denoiser(latents, t * 999, encoder_hidden_states=cond["encoder_hidden_states"], return_dict=False)[0]
