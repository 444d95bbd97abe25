"""FLUX.2 dev: Mistral Small 3.1 24B's hidden states of three layers side by side as the prompt, the
FLUX.2 VAE's 32-channel latents patched 2x2 into 128 channels and normalized by its batch norm, one
token per latent position with 4-axis ids, guidance embedded (one call per preview step).

AI Toolkit: extensions_built_in/diffusion_models/flux2/flux2_model.py (Flux2Model) and its
src/pipeline.py (Flux2Pipeline); commit 27a03a91. AI Toolkit builds its own transformer and VAE
(src/model.py Flux2, src/autoencoder.py AutoEncoder) from the same checkpoints; fitfinder builds
diffusers' Flux2Transformer2DModel and AutoencoderKLFlux2 of the same sizes.
"""

from __future__ import annotations

from fitfinder.models._family import Family, Placement

# Loading (Flux2Model.load_model, load_te): the transformer is quantized with model.qtype while it
# stays in host memory (toolkit/util/quantize.py quantize_model: one block at a time on the device,
# back to the CPU), then goes to the device; Mistral is moved to the device in bf16 and quantized
# there with model.qtype (not qtype_te) when quantize_te. LoRA (target_lora_modules ['Flux2'],
# get_transformer_block_names double_blocks and single_blocks: diffusers names them
# transformer_blocks and single_transformer_blocks): every Linear layer of both block kinds.
FAMILY = Family(
    name="flux2",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={"transformer": "diffusers.Flux2Transformer2DModel",
             "text_encoder": "transformers.Mistral3ForConditionalGeneration",
             "vae": "diffusers.AutoencoderKLFlux2"},
    lora_blocks=r"(single_)?transformer_blocks\.\d+\..*",
    arch_values=("flux2",),
    name_hints=("flux2", "flux2dev"),
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype",
    text_seq_len=512,  # src/pipeline.py MAX_LENGTH
    tokenizer="tokenizer",  # a diffusers FLUX.2 folder's; its model_max_length may only shorten 512
    # Flux2Model.load_model: a quantized transformer waits in host memory (quantize_model) while
    # Mistral comes in bf16 and is quantized on the device, then comes; an unquantized one comes first.
    # With low_vram it waits either way, and Mistral goes back to the CPU once loaded: get_prompt_embeds
    # brings it back when it encodes.
    placement={"transformer": Placement(quantized_on="host", after_load="waits if quantized")},
    low_vram={"transformer": Placement(quantized_on="host", after_load="waits"),
              "text_encoder": Placement(after_load="leaves")},
)

# src/pipeline.py: OUTPUT_LAYERS_MISTRAL and OUTPUT_LAYERS_QWEN3 (hidden_states indices).
MISTRAL_LAYERS = (10, 20, 30)
QWEN3_LAYERS = (9, 18, 27)


class Recipe:
    """What FLUX.2 computes (dev; klein through flux2_klein); built by probe children (imports torch)."""

    layers = MISTRAL_LAYERS
    guidance_distilled = True  # Flux2Model.flux2_is_guidance_distilled

    def __init__(self, arch: dict, inputs):
        vae = arch["parts"]["vae"]
        self.inputs = inputs
        self.scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = vae.get("latent_channels", 32) * 4  # patched 2x2
        self.bn_eps = vae.get("batch_norm_eps", 1e-4)
        self.guidance_embeds = bool(arch["parts"]["transformer"].get("guidance_embeds"))
        self.divisor = 16  # Flux2Model.get_bucket_divisibility

    def encode_prompts(self, parts, batch) -> dict:
        """The encoder's hidden states after three layers, concatenated per token (src/pipeline.py,
        _get_mistral_prompt_embeds / _get_qwen_prompt_embeds): 3 x 5120 = 15360 wide for Mistral."""
        import torch

        encoder = parts["text_encoder"]
        config = getattr(encoder.config, "text_config", encoder.config)
        output = encoder(input_ids=self.inputs.t5_ids(config, batch), output_hidden_states=True, use_cache=False)
        stacked = torch.stack([output.hidden_states[k] for k in self.layers], dim=1)
        del output
        batch_size, layers, tokens, width = stacked.shape
        text = stacked.permute(0, 2, 1, 3).reshape(batch_size, tokens, layers * width)
        return {"encoder_hidden_states": text.to(self.inputs.dtype)}

    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, height // (self.scale_factor * 2), width // (self.scale_factor * 2))

    def pixels(self, height, width, frames, batch):
        from fitfinder.models._common import image_pixels

        return image_pixels(self.inputs, height, width, batch)

    def _statistics(self, vae, latents):
        import torch

        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + self.bn_eps).to(latents.device, latents.dtype)
        return mean, std

    def encode_images(self, vae, pixels):
        """Flux2Model.encode_images: the VAE's latents patched 2x2 and normalized by its batch norm."""
        latents = vae.encode(pixels).latent_dist.mode()
        batch, channels, height, width = latents.shape
        latents = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
        latents = latents.reshape(batch, channels * 4, height // 2, width // 2)
        mean, std = self._statistics(vae, latents)
        return (latents - mean) / std

    def decode(self, vae, latents):
        mean, std = self._statistics(vae, latents)
        latents = latents * std + mean
        batch, channels, height, width = latents.shape
        latents = latents.reshape(batch, channels // 4, 2, 2, height, width).permute(0, 1, 4, 2, 5, 3)
        return vae.decode(latents.reshape(batch, channels // 4, height * 2, width * 2)).sample

    def noisy_and_target(self, latents, noise, t):
        from fitfinder.models._common import flow_noisy_and_target

        return flow_noisy_and_target(latents, noise, t)

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call (Flux2Model.get_noise_prediction): a token per latent position with
        (t, h, w, l) ids, the text's ids along l, timesteps on the 0-1 scale, guidance embedded."""
        import torch

        from fitfinder.models._common import batched

        device, dtype = self.inputs.device, self.inputs.dtype
        batch, channels, height, width = latents.shape
        tokens = latents.reshape(batch, channels, height * width).permute(0, 2, 1)
        image_ids = torch.zeros(height, width, 4, device=device, dtype=torch.long)
        image_ids[..., 1] = torch.arange(height, device=device)[:, None]
        image_ids[..., 2] = torch.arange(width, device=device)[None, :]
        cond = batched(cond, batch)
        text_length = cond["encoder_hidden_states"].shape[1]
        text_ids = torch.zeros(text_length, 4, device=device, dtype=torch.long)
        text_ids[:, 3] = torch.arange(text_length, device=device)
        guidance = torch.full((batch,), guidance_scale, device=device, dtype=dtype) if self.guidance_embeds else None
        out = denoiser(hidden_states=tokens, timestep=t, guidance=guidance,
                       img_ids=image_ids.view(1, -1, 4).expand(batch, -1, -1),
                       txt_ids=text_ids.view(1, -1, 4).expand(batch, -1, -1), return_dict=False,
                       encoder_hidden_states=cond["encoder_hidden_states"])[0]
        return out.permute(0, 2, 1).reshape(batch, channels, height, width)

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        prediction = self.predict(denoiser, latents, t, cond, guidance_scale)
        if self.guidance_distilled or guidance_scale <= 1:
            return prediction
        # Flux2Pipeline.__call__ for a model without distilled guidance (klein): the negative prompt
        # as a second call; compute doubles, the batch does not.
        unconditional = self.predict(denoiser, latents, t, uncond, guidance_scale)
        return unconditional + guidance_scale * (prediction - unconditional)
