"""What each family computes: prompt encoding, VAE encode/decode, one denoiser call, guidance.

One class per family with the same methods, so the probe's recipe reads the same for all:

    family = for_family("flux", arch, inputs)               # inputs: the seeded random source
    cond = family.encode_prompts(parts, batch)               # text encoders -> conditioning
    latents = family.encode_images(vae, family.pixels(height, width, frames, batch))
    noisy, target = family.noisy_and_target(latents, noise, t)
    prediction = family.predict(denoiser, noisy, t, cond)    # one training forward
    velocity = family.guided(denoiser, latents, t, cond, uncond, scale)  # one sampling step
    images = family.decode(vae, latents)

No tokenizers: prompts are random token ids of the encoder's length (CLIP: 77 or its
max_position_embeddings, with the end-of-text id last so the pooled output reads a real
position; T5/UMT5: the arch's text_seq_len). Timesteps `t` are in (0, 1): the noise level.
"""

from __future__ import annotations

import torch


class Inputs:
    """Random inputs on the meter's device, in the training dtype, from one seeded generator."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int, text_seq_len: int):
        self.device, self.dtype, self.text_seq_len = device, dtype, text_seq_len
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def randn(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, device=self.device, dtype=self.dtype)

    def timesteps(self, batch: int) -> torch.Tensor:
        """Noise levels for a training batch: sigmoid of a normal, AI Toolkit's default sampling."""
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
        return torch.randint(3, int(config.vocab_size) - 2, (batch, seq), generator=self.generator, device=self.device)


def flow_noisy_and_target(latents, noise, t):
    """Flow matching: x_t = (1 - t) x + t noise; the model predicts noise - x."""
    sigma = t.view((-1,) + (1,) * (latents.dim() - 1)).to(latents.dtype)
    return (1 - sigma) * latents + sigma * noise, noise - latents


def image_pixels(inputs: Inputs, height: int, width: int, batch: int) -> torch.Tensor:
    """A batch of images (B, 3, H, W) in [-1, 1]."""
    return inputs.randn((batch, 3, height, width)).clamp_(-1, 1)


class Flux:
    """FLUX.1: pooled CLIP + T5 sequence; 16-channel latents packed 2x2 into tokens; guidance embedded."""

    noisy_and_target = staticmethod(flow_noisy_and_target)

    def __init__(self, arch: dict, inputs: Inputs):
        vae = arch["parts"]["vae"]
        self.inputs = inputs
        self.scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = vae["latent_channels"]
        self.scaling, self.shift = vae.get("scaling_factor", 0.3611), vae.get("shift_factor", 0.1159)
        self.guidance_embeds = bool(arch["parts"]["transformer"].get("guidance_embeds"))
        self.divisor = self.scale_factor * 2  # latents are packed 2x2

    def encode_prompts(self, parts, batch) -> dict:
        clip, t5 = parts["text_encoder"], parts["text_encoder_2"]
        pooled = clip(input_ids=self.inputs.clip_ids(clip.config, batch)).pooler_output
        text = t5(input_ids=self.inputs.t5_ids(t5.config, batch)).last_hidden_state
        dtype = self.inputs.dtype
        return {"pooled_projections": pooled.to(dtype), "encoder_hidden_states": text.to(dtype)}

    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, height // self.scale_factor, width // self.scale_factor)

    def pixels(self, height, width, frames, batch):
        return image_pixels(self.inputs, height, width, batch)

    def encode_images(self, vae, pixels):
        return (vae.encode(pixels).latent_dist.sample() - self.shift) * self.scaling

    def decode(self, vae, latents):
        return vae.decode(latents / self.scaling + self.shift).sample

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call: latents packed 2x2 into tokens as FluxPipeline packs them."""
        device, dtype = self.inputs.device, self.inputs.dtype
        batch, channels, height, width = latents.shape
        rows, cols = height // 2, width // 2
        tokens = latents.view(batch, channels, rows, 2, cols, 2).permute(0, 2, 4, 1, 3, 5)
        tokens = tokens.reshape(batch, rows * cols, channels * 4)
        image_ids = torch.zeros(rows, cols, 3, device=device, dtype=dtype)
        image_ids[..., 1] = torch.arange(rows, device=device)[:, None]
        image_ids[..., 2] = torch.arange(cols, device=device)[None, :]
        cond = _batched(cond, batch)
        text_ids = torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=device, dtype=dtype)
        guidance = torch.full((batch,), guidance_scale, device=device, dtype=dtype) if self.guidance_embeds else None
        out = denoiser(hidden_states=tokens, timestep=t, guidance=guidance, img_ids=image_ids.view(-1, 3),
                       txt_ids=text_ids, return_dict=False, **cond)[0]
        out = out.view(batch, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(batch, channels, height, width)

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        # FLUX.1-dev is guidance-distilled: the scale is an input, one call per step, no negative.
        return self.predict(denoiser, latents, t, cond, guidance_scale)


class SDXL:
    """SDXL: two CLIPs (penultimate hidden states, pooled projection), time ids; epsilon prediction."""

    def __init__(self, arch: dict, inputs: Inputs):
        vae = arch["parts"]["vae"]
        self.inputs = inputs
        self.scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = vae["latent_channels"]
        self.scaling = vae.get("scaling_factor", 0.13025)
        self.divisor = self.scale_factor * 2 ** (len(arch["parts"]["unet"]["block_out_channels"]) - 1)
        # The DDPM schedule SDXL was trained with: scaled-linear betas 0.00085..0.012 over 1000 steps.
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0).to(torch.float32)

    def encode_prompts(self, parts, batch) -> dict:
        first, second = parts["text_encoder"], parts["text_encoder_2"]
        out_1 = first(input_ids=self.inputs.clip_ids(first.config, batch), output_hidden_states=True)
        out_2 = second(input_ids=self.inputs.clip_ids(second.config, batch), output_hidden_states=True)
        text = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2]], dim=-1)
        dtype = self.inputs.dtype
        return {"encoder_hidden_states": text.to(dtype), "text_embeds": out_2.text_embeds.to(dtype)}

    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, height // self.scale_factor, width // self.scale_factor)

    def pixels(self, height, width, frames, batch):
        return image_pixels(self.inputs, height, width, batch)

    def encode_images(self, vae, pixels):
        return vae.encode(pixels).latent_dist.sample() * self.scaling

    def decode(self, vae, latents):
        return vae.decode(latents / self.scaling).sample

    def noisy_and_target(self, latents, noise, t):
        """DDPM: x_t = sqrt(a) x + sqrt(1 - a) noise at step t * 999; the model predicts the noise."""
        steps = (t.float() * 999).long().clamp(0, 999).cpu()
        alpha = self.alphas_cumprod[steps].to(device=latents.device, dtype=latents.dtype).view(-1, 1, 1, 1)
        return alpha.sqrt() * latents + (1 - alpha).sqrt() * noise, noise

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        device, dtype = self.inputs.device, self.inputs.dtype
        batch, _, height, width = latents.shape
        pixels_high, pixels_wide = float(height * self.scale_factor), float(width * self.scale_factor)
        # original size, crop top-left, target size: SDXL's micro-conditioning
        time_ids = torch.tensor([pixels_high, pixels_wide, 0.0, 0.0, pixels_high, pixels_wide], device=device,
                                dtype=dtype)
        cond = _batched(cond, batch)
        added = {"text_embeds": cond["text_embeds"], "time_ids": time_ids.expand(batch, 6)}
        return denoiser(latents, t * 999, encoder_hidden_states=cond["encoder_hidden_states"],
                        added_cond_kwargs=added, return_dict=False)[0]

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        if guidance_scale <= 1:
            return self.predict(denoiser, latents, t, cond)
        # Classifier-free guidance as StableDiffusionXLPipeline does it: one call on a doubled batch.
        both = {key: torch.cat([uncond[key], cond[key]]) for key in cond}
        eps_uncond, eps_cond = self.predict(denoiser, torch.cat([latents, latents]), torch.cat([t, t]), both).chunk(2)
        return eps_uncond + guidance_scale * (eps_cond - eps_uncond)


class Wan:
    """Wan 2.1/2.2: UMT5 sequence; video latents (4x fewer frames, 8x smaller sides); flow matching."""

    noisy_and_target = staticmethod(flow_noisy_and_target)

    def __init__(self, arch: dict, inputs: Inputs):
        vae = arch["parts"]["vae"]
        self.inputs = inputs
        self.scale_factor = int(vae.get("scale_factor_spatial") or 8)
        self.temporal_factor = int(vae.get("scale_factor_temporal") or 4)
        self.latent_channels = int(vae.get("z_dim", 16))
        self.divisor = self.scale_factor * 2  # patches of 2x2 latents
        # AutoencoderKLWan's defaults are Wan 2.1's published statistics.
        mean, std = vae.get("latents_mean"), vae.get("latents_std")
        self.latents_mean = torch.tensor(mean or _WAN21_LATENTS_MEAN).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(std or _WAN21_LATENTS_STD).view(1, -1, 1, 1, 1)

    def encode_prompts(self, parts, batch) -> dict:
        umt5 = parts["text_encoder"]
        text = umt5(input_ids=self.inputs.t5_ids(umt5.config, batch)).last_hidden_state
        return {"encoder_hidden_states": text.to(self.inputs.dtype)}

    def latent_frames(self, frames: int) -> int:
        """Wan's VAE keeps the first frame and compresses the rest 4x: 81 frames -> 21."""
        return (max(frames, 1) - 1) // self.temporal_factor + 1

    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, self.latent_frames(frames), height // self.scale_factor,
                width // self.scale_factor)

    def pixels(self, height, width, frames, batch):
        return self.inputs.randn((batch, 3, max(frames, 1), height, width)).clamp_(-1, 1)

    def _statistics(self, latents):
        mean = self.latents_mean.to(device=latents.device, dtype=latents.dtype)
        return mean, self.latents_std.to(device=latents.device, dtype=latents.dtype)

    def encode_images(self, vae, pixels):
        latents = vae.encode(pixels).latent_dist.sample()
        mean, std = self._statistics(latents)
        return (latents - mean) / std

    def decode(self, vae, latents):
        mean, std = self._statistics(latents)
        return vae.decode(latents * std + mean).sample

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        return denoiser(hidden_states=latents, timestep=t * 1000, return_dict=False,
                        **_batched(cond, latents.shape[0]))[0]

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        prediction = self.predict(denoiser, latents, t, cond)
        if guidance_scale <= 1:
            return prediction
        # WanPipeline runs the negative prompt as a second call: compute doubles, the batch does not.
        unconditional = self.predict(denoiser, latents, t, uncond)
        return unconditional + guidance_scale * (prediction - unconditional)


_WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                       0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
_WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                      3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916]


def _batched(cond: dict, batch: int) -> dict:
    """Conditioning for `batch` samples; one cached prompt is repeated, as cached embeddings are loaded."""
    return {key: value if value.shape[0] == batch else value[:1].repeat(batch, *([1] * (value.dim() - 1)))
            for key, value in cond.items()}


RECIPES = {"flux": Flux, "sdxl": SDXL, "wan21": Wan, "wan22": Wan}


def for_family(family: str, arch: dict, inputs: Inputs):
    return RECIPES[family](arch, inputs)
