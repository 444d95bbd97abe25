"""Wan 2.1 T2V (1.3B, 14B): UMT5 sequence; video latents (4x fewer frames, 8x smaller sides);
flow matching; the negative prompt as a second call when sampling with guidance.

AI Toolkit: toolkit/models/wan21/wan21.py (Wan21.load_model; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._family import Family, Placement

CLASSES = {"transformer": "diffusers.WanTransformer3DModel", "text_encoder": "transformers.UMT5EncoderModel",
           "vae": "diffusers.AutoencoderKLWan"}
# LoRA targets: attention and feed-forward of every block (toolkit/lora_special.py on the
# transformer). Quantization (Wan21.load_model): the transformer with model.qtype, UMT5 with
# model.qtype too.
# Previews under low_vram (Wan21.get_generation_pipeline picks AggressiveWanUnloadPipeline, whose
# __call__ moves the VAE to the CPU, UMT5 to the CPU once the prompt is encoded, the transformer to the
# device for the denoising loop, and the VAE back for the decode; the transformer stays): UMT5 is off
# for the loop and the decode, the VAE for the loop. Wan 2.2's Wan22Pipeline (aggressive_offload) and
# Wan 2.1 I2V's AggressiveWanI2VUnloadPipeline move these two the same way.
PREVIEW_UNLOADS = {"text_encoder": Placement(in_previews=frozenset()),
                   "vae": Placement(in_previews=frozenset({"decode"}))}

FAMILY = Family(
    name="wan21",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes=CLASSES,
    lora_blocks=r"blocks\.\d+\..*",
    arch_values=("wan21", "wan21_1b", "wan21_14b"),
    name_hints=("wan21",),
    video=True,
    frame_step=4,  # the VAE keeps the first frame and compresses the rest 4x: clips of 4k+1 frames
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    text_seq_len=512,  # WanPipeline's max_sequence_length
    tokenizer="tokenizer",
    # Wan21.load_wan_transformer: quantize_model leaves a quantized transformer's blocks on the CPU
    # while UMT5 comes in bf16 and is quantized on the device; with low_vram the transformer is on the
    # CPU from the start, quantized a block at a time on the device, and moved back after UMT5
    # (load_model: "we can move it back to the gpu now"). Every part stays on the device after.
    placement={"transformer": Placement(after_load="waits if quantized")},
    low_vram={"transformer": Placement(quantized_on="host", after_load="waits"), **PREVIEW_UNLOADS},
    tiled_preview_decode=True,  # Wan21.use_vae_tiling: low_vram, or model_kwargs.vae_tiling
    tiled_preview_decode_key="vae_tiling",
)


class Recipe:
    """What Wan 2.1 (and Wan 2.2's two experts) compute; built by probe children (imports torch)."""

    def __init__(self, arch: dict, inputs):
        import torch

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

    def noisy_and_target(self, latents, noise, t):
        from fitfinder.models._common import flow_noisy_and_target

        return flow_noisy_and_target(latents, noise, t)

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        from fitfinder.models._common import batched

        return denoiser(hidden_states=latents, timestep=t * 1000, return_dict=False,
                        **batched(cond, latents.shape[0]))[0]

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
