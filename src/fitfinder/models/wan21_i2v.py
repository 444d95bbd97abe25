"""Wan 2.1 I2V 14B (480P, 720P): Wan 2.1's computation on a transformer that takes the clip's first
frame as conditioning: its VAE latents and a 4-channel frame mask concatenated to the noisy latents
in channels (16 + 4 + 16 = 36 inputs), and the first frame's CLIP vision features through the
transformer's image cross-attention (`encoder_hidden_states_image`).

AI Toolkit: toolkit/models/wan21/wan21_i2v.py (Wan21I2V: load_model, get_noise_prediction,
generate_images, set_device_state_preset) and toolkit/models/wan21/wan_utils.py
(add_first_frame_conditioning); commit 27a03a91.
"""

from __future__ import annotations

from fitfinder.models import wan21
from fitfinder.models._family import EVERY_PHASE, Family, Placement

# The image encoder is the diffusers folder's image_encoder, loaded as a CLIPVisionModel (no
# projection: Wan21I2V.load_model) in the training dtype, on the device, frozen, never quantized.
# Quantization otherwise as Wan 2.1 (Wan21.load_model: the transformer and UMT5 with model.qtype);
# the LoRA targets every block's Linear layers, the image cross-attention's add_k/add_v included
# (target_lora_modules ['WanTransformer3DModel']).
FAMILY = Family(
    name="wan21_i2v",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={**wan21.CLASSES, "image_encoder": "transformers.CLIPVisionModel"},
    lora_blocks=wan21.FAMILY.lora_blocks,
    arch_values=("wan21_i2v",),
    name_hints=("wan21i2v",),
    video=True,
    frame_step=4,  # the Wan 2.1 VAE: clips of 4k+1 frames
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    text_seq_len=512,
    tokenizer="tokenizer",
    others=("image_encoder",),
    # Wan21I2V.load_model: the image encoder is loaded onto the device after the rest and no preset
    # knows it, so it stays throughout. With low_vram it goes back to the CPU once loaded, UMT5 too,
    # and get_noise_prediction brings the encoder back at the first training step (its
    # set_device_state_preset does nothing under low_vram, so nothing moves it off again); the
    # transformer is loaded as Wan 2.1's (Wan21.load_model). Its previews under low_vram
    # (AggressiveWanI2VUnloadPipeline.__call__) keep UMT5 off and the VAE off while the transformer
    # denoises, as Wan 2.1's do (wan21.PREVIEW_UNLOADS); Wan21I2V.generate_single_image never tiles.
    placement={**wan21.FAMILY.placement, "image_encoder": EVERY_PHASE},
    low_vram={**wan21.FAMILY.low_vram,
              "text_encoder": Placement(after_load="leaves", in_previews=frozenset()),
              "image_encoder": Placement(after_load="leaves", also_in=frozenset({"train"}),
                                         only_in=frozenset({"train"}))},
)


class Recipe(wan21.Recipe):
    """Wan 2.1's recipe with the first frame's conditioning added to every denoiser call."""

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        transformer = arch["parts"]["transformer"]
        # Channels beyond the noisy latents: the mask (one per frame the VAE folds into a latent
        # frame) and the first frame's latents (add_first_frame_conditioning).
        self.condition_channels = int(transformer["in_channels"]) - self.latent_channels
        encoder = arch["parts"].get("image_encoder")
        # CLIP's penultimate hidden state (hidden_states[-2]): every patch and the class token.
        self.image_tokens = (encoder["image_size"] // encoder["patch_size"]) ** 2 + 1 if encoder else 0
        self.image_width = encoder["hidden_size"] if encoder else 0

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        from fitfinder.models._common import batched

        conditioned = first_frame_conditioned(self, latents)
        extra = {}
        if self.image_tokens:
            # The first frame's CLIP vision features, as Wan21I2V.get_noise_prediction makes them
            # each step under no_grad (the encoder's weights are resident, see FAMILY.placement;
            # its run on one 224 px image per sample is a few MiB beside the transformer's).
            extra["encoder_hidden_states_image"] = self.inputs.randn(
                (latents.shape[0], self.image_tokens, self.image_width))
        return denoiser(hidden_states=conditioned, timestep=t * 1000, return_dict=False,
                        **batched(cond, latents.shape[0]), **extra)[0]


def first_frame_conditioned(recipe, latents):
    """The noisy latents with the first frame's conditioning concatenated in channels (B, 36, F, h, w).

    AI Toolkit encodes the first frame followed by zero frames through the VAE at every step
    (wan_utils.add_first_frame_conditioning, under no_grad, before the transformer runs) and
    concatenates [mask, latents] to the noisy latents. The probe makes those channels as random
    values of the same shape and dtype: the denoiser meets the same input, and the encode's
    transient is the one the train phase already meets at its heaviest steps (the batch's own
    encode, same clip shape) when latents are not cached; with cached latents AI Toolkit moves the
    VAE off the device (SDTrainer.hook_before_train_loop), where this encode could not run.
    """
    import torch

    batch, _, frames, height, width = latents.shape
    condition = recipe.inputs.randn((batch, recipe.condition_channels, frames, height, width))
    return torch.cat([latents, condition], dim=1)
