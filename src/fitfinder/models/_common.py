"""What every family's Recipe shares. Importing it costs no torch (the family modules name the mixins
below in their class statements, and the CLI reads those modules); what runs imports torch inside.

A family's `Recipe` (in its module, `models/NAME.py`) has the same methods for all families, so
the probe's recipe reads the same for all:

    recipe = family.recipe(arch, inputs)                     # inputs: the seeded random source
    recipe.divisor                                           # a bucket side is a multiple of it
    cond = recipe.encode_prompts(parts, batch)               # text encoders -> conditioning
    latents = recipe.encode_images(vae, recipe.pixels(height, width, frames, batch))
    recipe.latent_shape(height, width, frames, batch)        # what encode_images gives, without a VAE
    noisy, target = recipe.noisy_and_target(latents, noise, t)
    prediction = recipe.predict(denoiser, noisy, t, cond)    # one training forward
    velocity = recipe.guided(denoiser, latents, t, cond, uncond, scale)  # one sampling step
    images = recipe.decode(vae, latents)
    recipe.inputs                                            # the Inputs it was built with

A family whose latents come from an AutoencoderKL and train by flow matching (FLUX.1, SD 3.5, Lumina 2,
Z-Image, HiDream) takes `latent_shape`, `pixels`, `encode_images`, `decode` and `noisy_and_target` from
`FlowImageLatents`, its `__init__` calling `self.read_autoencoder_kl(vae_config, scaling=..., shift=...)`;
SDXL takes the latents (`KLImageLatents`, no shift) and keeps its DDPM noising.

No tokenizers: prompts are random token ids of the encoder's length (CLIP: 77 or its
max_position_embeddings, with the end-of-text id last so the pooled output reads a real
position; T5/UMT5: the arch's text_seq_len). Timesteps `t` are in (0, 1): the noise level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Inputs:
    """Random inputs on the meter's device, in the training dtype, from one seeded generator."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int, text_seq_len: int):
        import torch

        self.device, self.dtype, self.text_seq_len = device, dtype, text_seq_len
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def randn(self, shape) -> torch.Tensor:
        import torch

        return torch.randn(shape, generator=self.generator, device=self.device, dtype=self.dtype)

    def timesteps(self, batch: int) -> torch.Tensor:
        """Noise levels for a training batch: sigmoid of a normal, AI Toolkit's default sampling."""
        import torch

        return torch.sigmoid(torch.randn(batch, generator=self.generator, device=self.device)).to(self.dtype)

    def clip_ids(self, config, batch: int) -> torch.Tensor:
        """CLIP ids with the end-of-text token last, where the pooled output reads."""
        ids = self._ids(config, batch, min(77, int(config.max_position_embeddings)))
        # CLIP configs with eos_token_id 2 pool at the largest id (transformers' legacy path).
        ids[:, -1] = config.eos_token_id if config.eos_token_id != 2 else config.vocab_size - 1
        return ids

    def t5_ids(self, config, batch: int) -> torch.Tensor:
        ids = self._ids(config, batch, self.text_seq_len)
        ids[:, -1] = 1  # </s>
        return ids

    def _ids(self, config, batch: int, seq: int) -> torch.Tensor:
        import torch

        return torch.randint(3, int(config.vocab_size) - 2, (batch, seq), generator=self.generator, device=self.device)


def flow_noisy_and_target(latents, noise, t):
    """Flow matching: x_t = (1 - t) x + t noise; the model predicts noise - x."""
    sigma = t.view((-1,) + (1,) * (latents.dim() - 1)).to(latents.dtype)
    return (1 - sigma) * latents + sigma * noise, noise - latents


def image_pixels(inputs: Inputs, height: int, width: int, batch: int) -> torch.Tensor:
    """A batch of images (B, 3, H, W) in [-1, 1]."""
    return inputs.randn((batch, 3, height, width)).clamp_(-1, 1)


def batched(cond: dict, batch: int) -> dict:
    """Conditioning for `batch` samples; one cached prompt is repeated, as cached embeddings are loaded."""
    return {key: value if value.shape[0] == batch else value[:1].repeat(batch, *([1] * (value.dim() - 1)))
            for key, value in cond.items()}


class KLImageLatents:
    """Image latents of an AutoencoderKL: (B, C, H/f, W/f), the VAE's sample shifted then scaled.

    The Recipe's `__init__` calls `read_autoencoder_kl` (or sets `inputs`, `scale_factor`,
    `latent_channels`, `scaling` and `shift` itself); `shift` None means none (SDXL's VAE has no
    shift_factor). What AI Toolkit does for each family is written in the family's module.
    """

    def read_autoencoder_kl(self, vae: dict, scaling: float, shift: float | None) -> None:
        """The VAE config's factors; `scaling` and `shift` are the family's defaults where it names none."""
        self.scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = vae["latent_channels"]
        self.scaling = vae.get("scaling_factor", scaling)
        self.shift = vae.get("shift_factor", shift)

    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, height // self.scale_factor, width // self.scale_factor)

    def pixels(self, height, width, frames, batch):
        return image_pixels(self.inputs, height, width, batch)

    def encode_images(self, vae, pixels):
        # One expression per case: the VAE's sample is freed as soon as the shift has read it.
        if self.shift is None:
            return vae.encode(pixels).latent_dist.sample() * self.scaling
        return (vae.encode(pixels).latent_dist.sample() - self.shift) * self.scaling

    def decode(self, vae, latents):
        if self.shift is None:
            return vae.decode(latents / self.scaling).sample
        return vae.decode(latents / self.scaling + self.shift).sample


class FlowImageLatents(KLImageLatents):
    """AutoencoderKL image latents trained by flow matching (FLUX.1, SD 3.5, Lumina 2, Z-Image, HiDream)."""

    def noisy_and_target(self, latents, noise, t):
        return flow_noisy_and_target(latents, noise, t)
