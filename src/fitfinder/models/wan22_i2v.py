"""Wan 2.2 I2V A14B: Wan 2.2's two experts (high noise above the boundary, low noise below it),
each a transformer that takes the first frame's VAE latents and a frame mask concatenated to the
noisy latents in channels (36 inputs), as Wan 2.1 I2V, without a CLIP vision encoder.

AI Toolkit: extensions_built_in/diffusion_models/wan22/wan22_14b_i2v_model.py (Wan2214bI2VModel:
get_noise_prediction, generate_single_image) on wan22_14b_model.py (Wan2214bModel: load_model,
train_high_noise / train_low_noise); commit 27a03a91.
"""

from __future__ import annotations

from fitfinder.models import wan21, wan22
from fitfinder.models._family import Family
from fitfinder.models.wan21_i2v import first_frame_conditioned

# Loading, quantization (each expert with model.qtype, UMT5 too), low_vram placement and the LoRA
# targets are Wan2214bModel's, as for the T2V experts (models/wan22.py). Wan2214bModel builds its
# expert switch with boundary_ratio_t2v (0.875) for I2V too ("todo detect if it is i2v or t2v"), so
# a diffusers folder's boundary_ratio (0.9 in Wan2.2-I2V-A14B's model_index.json) is not read.
FAMILY = Family(
    name="wan22_i2v",
    denoisers=wan22.FAMILY.denoisers,
    text_encoders=("text_encoder",),
    classes=wan22.FAMILY.classes,
    lora_blocks=wan22.FAMILY.lora_blocks,
    arch_values=("wan22_14b_i2v",),
    name_hints=("wan22i2v",),
    video=True,
    frame_step=4,  # the Wan 2.1 VAE: clips of 4k+1 frames
    quantized_text_encoders=("text_encoder",),
    unquantized_layers=wan22.UNQUANTIZED,  # Wan2214bI2VModel (a Wan2214bModel).get_quantization_exclude_modules
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    text_seq_len=512,
    tokenizer="tokenizer",
    expert_switches=wan22.FAMILY.expert_switches,
    # Wan2214bModel's experts and its Wan22Pipeline; Wan2214bI2VModel.generate_single_image never tiles.
    low_vram=wan22.FAMILY.low_vram,
)


class Recipe(wan21.Recipe):
    """Wan 2.1's recipe, per expert, with the first frame's conditioning in channels."""

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        self.condition_channels = int(arch["parts"]["transformer"]["in_channels"]) - self.latent_channels

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        # Wan2214bI2VModel.get_noise_prediction: add_first_frame_conditioning at every step, the
        # same for both experts; previews condition the initial latents the same way
        # (generate_single_image), so both calls of a guided step see 36 channels.
        return super().predict(denoiser, first_frame_conditioned(self, latents), t, cond)
