"""Wan 2.2 TI2V 5B: one WanTransformer3DModel on the Wan 2.2 VAE's 48 latent channels (16x smaller
sides, 4x fewer frames: clips of 4k+1 frames), one timestep per token (the first frame's tokens,
clean conditioning, at 0), UMT5; flow matching, the negative prompt as a second call.

AI Toolkit: extensions_built_in/diffusion_models/wan22/wan22_5b_model.py (Wan225bModel:
get_noise_prediction, get_bucket_divisibility, _wan_expand_timesteps) on
toolkit/models/wan21/wan21.py (Wan21.load_model) and toolkit/models/wan21/wan_utils.py
(add_first_frame_conditioning_v22); commit 27a03a91.
"""

from __future__ import annotations

from dataclasses import replace

from fitfinder.models import wan21
from fitfinder.models.wan22 import UNQUANTIZED
from fitfinder.models._family import Family

# Loading, quantization (the transformer and UMT5 with model.qtype) and low_vram placement are
# Wan21.load_model's; the LoRA targets every block's Linear layers. Wan225bModel keeps
# condition_embedder and proj_out unquantized (get_quantization_exclude_modules): about 30 M
# parameters that the probe quantizes with the rest (tens of MiB lighter in 8-bit; not followed).
FAMILY = Family(
    name="wan22_5b",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes=wan21.CLASSES,
    lora_blocks=wan21.FAMILY.lora_blocks,
    arch_values=("wan22_5b",),
    name_hints=("wan225b", "wan22ti2v", "ti2v"),
    video=True,
    # The Wan 2.2 VAE keeps the first frame and folds every 4 more into a latent frame
    # (scale_factor_temporal 4): clips of 4k+1 frames, the ladder 121 -> 61, 29, 13, 5, 1.
    frame_step=4,
    quantized_text_encoders=("text_encoder",),
    unquantized_layers=UNQUANTIZED,  # Wan225bModel.get_quantization_exclude_modules
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    text_seq_len=512,
    tokenizer="tokenizer",
    placement=wan21.FAMILY.placement,  # Wan225bModel.load_model is Wan21.load_model
    # Its previews under low_vram run Wan22Pipeline with aggressive_offload, which also moves the
    # transformer off for the decode; Wan225bModel.generate_single_image tiles it (use_vae_tiling).
    low_vram={**wan21.FAMILY.low_vram,
              "transformer": replace(wan21.FAMILY.low_vram["transformer"], in_previews=frozenset({"denoise"}))},
    tiled_preview_decode=True,
    tiled_preview_decode_key="vae_tiling",
)


class Recipe(wan21.Recipe):
    """Wan 2.1's recipe on the Wan 2.2 VAE's latents, with a timestep per token."""

    def __init__(self, arch: dict, inputs):
        import torch

        vae = dict(arch["parts"]["vae"])
        channels = int(vae.get("z_dim", 48))
        # The shipped arch leaves the VAE's 48 latents_mean/std out (they scale latents and hold no
        # weights): zero and one then, the same memory; a diffusers folder's config lends the real ones.
        vae.setdefault("latents_mean", [0.0] * channels)
        vae.setdefault("latents_std", [1.0] * channels)
        super().__init__({**arch, "parts": {**arch["parts"], "vae": vae}}, inputs)
        # 16x spatial compression and 2x2 patches: buckets are multiples of 32 (get_bucket_divisibility).
        self.divisor = self.scale_factor * 2
        self.latents_mean = torch.tensor(vae["latents_mean"]).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(vae["latents_std"]).view(1, -1, 1, 1, 1)

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call with AI Toolkit's TI2V conditioning (add_first_frame_conditioning_v22).

        AI Toolkit's UI sets `do_i2v` on this model's datasets: a clip's first latent frame is
        replaced by the first frame's latents (made here as random values of their shape; the VAE
        encode of one frame is small) and its tokens get timestep 0; every token gets its own
        timestep (Wan225bModel.get_noise_prediction; previews the same, Wan22Pipeline with
        expand_timesteps), so the transformer's modulation is per token: (B, tokens, 6, width).
        An image (one frame) keeps its latents and gets the per-token timesteps of an all-ones mask.
        """
        import torch

        from fitfinder.models._common import batched

        batch, _, frames, height, width = latents.shape
        if frames > 1:
            mask = torch.ones((batch, 1, frames, height, width), device=latents.device, dtype=latents.dtype)
            first = self.inputs.randn((batch, latents.shape[1], 1, height, width))
            latents = latents.clone()
            latents[:, :, :1] = first
            mask[:, :, :1] = 0.0
            del first
        else:
            mask = torch.ones(latents.shape, device=latents.device, dtype=latents.dtype)
        # One timestep per 2x2 patch of each latent frame, the mask of the first sample for all
        # (AI Toolkit's `noise_mask[0][0][:, ::2, ::2] * t`, chunked per sample).
        per_token = mask[0, 0, :, ::2, ::2].flatten()
        timestep = torch.stack([per_token * level for level in (t * 1000).unbind(0)])
        del mask, per_token
        return denoiser(hidden_states=latents, timestep=timestep, return_dict=False,
                        **batched(cond, batch))[0]
