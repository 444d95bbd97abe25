"""Qwen-Image: Qwen2.5-VL 7B's last hidden states as the prompt, 16-channel latents of a Wan-like VAE
run on single frames, packed 2x2 into tokens; flow matching; true CFG (a negative prompt, a second
transformer call) in previews.

AI Toolkit: extensions_built_in/diffusion_models/qwen_image/qwen_image.py (QwenImageModel; commit
27a03a91). The edit models (qwen_image_edit.py, qwen_image_edit_plus.py) reuse this Recipe.
"""

from __future__ import annotations

from fitfinder.models._family import Family, Placement

CLASSES = {"transformer": "diffusers.QwenImageTransformer2DModel",
           "text_encoder": "transformers.Qwen2_5_VLForConditionalGeneration",
           "vae": "diffusers.AutoencoderKLQwenImage"}
# LoRA targets: QwenImageModel sets target_lora_modules ["QwenImageTransformer2DModel"] and
# get_transformer_block_names ["transformer_blocks"]; NetworkConfig.transformer_only defaults to true, so
# toolkit/lora_special.py keeps the Linear layers inside transformer_blocks only.
LORA_BLOCKS = r"transformer_blocks\.\d+\..*"
# QwenImageModel.load_model: the transformer is quantized with model.qtype by quantize_model
# (toolkit/util/quantize.py: block by block, each moved back to the CPU), then moved to the device
# unless low_vram; Qwen2.5-VL is moved to the device in bf16 and quantized there with model.qtype_te
# (`quantize(text_encoder, weights=get_qtype(self.model_config.qtype_te))`), low_vram or not, and stays
# (under layer_offloading: attached in host memory first, see PLACEMENT).
PLACEMENT = {"transformer": Placement(quantized_on="host", after_load="waits", offloaded_on_host="always"),
             "text_encoder": Placement(offloaded_on_host="always")}
FAMILY = Family(
    name="qwen_image",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes=CLASSES,
    lora_blocks=LORA_BLOCKS,
    arch_values=("qwen_image",),
    name_hints=("qwenimage",),
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype_te",
    # QwenImageModel.get_prompt_embeds calls encode_prompt with its default max_sequence_length, 1024,
    # and the tokenizer truncates at tokenizer_max_length (1024) past the template: a caption is encoded
    # at its own length up to 1024 tokens, and the probe encodes the longest (previews' 512 is
    # QwenImagePipeline.__call__'s, which AI Toolkit's previews do not take: they pass embeddings)
    text_seq_len=1024,
    tokenizer="tokenizer",
    # load_model: `text_encoder.model.visual = None` unless the model keeps the vision tower (edit models).
    dropped={"text_encoder": ("model.visual",)},
    # QwenImageModel.load_model: the transformer waits in host memory (quantize_model, or not
    # quantized) while Qwen2.5-VL comes in bf16 and is quantized on the device, then comes, low_vram
    # or not (with it, BaseSDTrainProcess.run moves it). Under layer_offloading both are attached in
    # host memory: the transformer after quantize_model, Qwen2.5-VL before `text_encoder.to(device)`
    # and before `quantize`, so its offloaded layers are quantized on the CPU and only its embeddings
    # and norms (and the layers left out of the share) come to the device.
    placement=PLACEMENT,
    # QwenImageModel.generate_single_image tiles the preview's decode under low_vram (and flushes the
    # cache between steps, which frees nothing live); its pipeline moves no part.
    tiled_preview_decode=True,
)

# QwenImagePipeline.prompt_template_encode_start_idx: the template's system turn, encoded and dropped.
TEMPLATE_TOKENS = 34


class Recipe:
    """What Qwen-Image computes; built by probe children (its methods import torch)."""

    template_tokens = TEMPLATE_TOKENS

    def __init__(self, arch: dict, inputs):
        import torch

        vae = arch["parts"]["vae"]
        self.inputs = inputs
        self.scale_factor = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
        self.latent_channels = int(vae.get("z_dim", 16))
        self.divisor = 32  # QwenImageModel.get_bucket_divisibility: 16 * 2
        from fitfinder.models.wan21 import _WAN21_LATENTS_MEAN, _WAN21_LATENTS_STD

        mean, std = vae.get("latents_mean"), vae.get("latents_std")
        self.latents_mean = torch.tensor(mean or _WAN21_LATENTS_MEAN).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(std or _WAN21_LATENTS_STD).view(1, -1, 1, 1, 1)

    # -- prompts ----------------------------------------------------------------------------------
    def encode_prompts(self, parts, batch) -> dict:
        """QwenImagePipeline._get_qwen_prompt_embeds: the template and prompt through the whole
        Qwen2.5-VL (logits included) with every hidden state returned; the last one, less the
        template's tokens, is the prompt (AI Toolkit: QwenImageModel.get_prompt_embeds)."""
        import torch

        encoder = parts["text_encoder"]
        ids = self._prompt_ids(encoder.config, batch, self.template_tokens + self.inputs.text_seq_len)
        out = encoder(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        return self._embeds(out.hidden_states[-1][:, self.template_tokens:])

    def _prompt_ids(self, config, batch: int, length: int):
        import torch

        vocab = int(config.get_text_config().vocab_size)
        return torch.randint(3, vocab - 2, (batch, length), generator=self.inputs.generator, device=self.inputs.device)

    def _embeds(self, hidden) -> dict:
        import torch

        mask = torch.ones(hidden.shape[:2], dtype=torch.int64, device=hidden.device)
        return {"encoder_hidden_states": hidden.to(self.inputs.dtype), "encoder_hidden_states_mask": mask}

    # -- images -----------------------------------------------------------------------------------
    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, height // self.scale_factor, width // self.scale_factor)

    def pixels(self, height, width, frames, batch):
        from fitfinder.models._common import image_pixels

        return image_pixels(self.inputs, height, width, batch)

    def _statistics(self, latents):
        mean = self.latents_mean.to(device=latents.device, dtype=latents.dtype)
        return mean, self.latents_std.to(device=latents.device, dtype=latents.dtype)

    def encode_images(self, vae, pixels):
        """QwenImageModel.encode_images: one frame through the video VAE, normalized per channel."""
        latents = vae.encode(pixels.unsqueeze(2)).latent_dist.sample()
        mean, std = self._statistics(latents)
        return ((latents - mean) * (1.0 / std)).squeeze(2)

    def decode(self, vae, latents):
        """QwenImageModel.decode_latents."""
        mean, std = self._statistics(latents)
        return vae.decode(latents.unsqueeze(2) * std + mean).sample.squeeze(2)

    def noisy_and_target(self, latents, noise, t):
        from fitfinder.models._common import flow_noisy_and_target

        return flow_noisy_and_target(latents, noise, t)

    # -- the transformer --------------------------------------------------------------------------
    @staticmethod
    def pack(latents):
        """(B, C, H, W) -> (B, H/2 * W/2, 4C): QwenImageModel.get_noise_prediction's packing."""
        batch, channels, height, width = latents.shape
        tokens = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return tokens.reshape(batch, (height // 2) * (width // 2), channels * 4)

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call (QwenImageModel.get_noise_prediction): no guidance embedding."""
        from fitfinder.models._common import batched

        batch, channels, height, width = latents.shape
        tokens, shapes = self.pack(latents), [(1, height // 2, width // 2)]
        tokens, shapes = self.conditioned(tokens, shapes, cond)
        out = denoiser(hidden_states=tokens, timestep=t, guidance=None, img_shapes=[shapes] * batch,
                       return_dict=False, **batched(self.text_conditioning(cond), batch))[0]
        _forget_rope_frequencies()
        out = out[:, :(height // 2) * (width // 2)]  # the control tokens' outputs are dropped
        out = out.reshape(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(batch, channels, height, width)

    @staticmethod
    def without_gradient(denoiser) -> list:
        """The LoRA parameters no loss reaches: the last block's text stream after the attention
        (`attn.to_add_out`, `txt_mlp`) feeds only the text output, which the transformer drops."""
        last = len(denoiser.transformer_blocks) - 1
        dead = (f"transformer_blocks.{last}.attn.to_add_out.", f"transformer_blocks.{last}.txt_mlp.")
        return [param for name, param in denoiser.named_parameters()
                if param.requires_grad and name.startswith(dead)]

    def conditioned(self, tokens, shapes, cond):
        """The image tokens the transformer sees, and their shapes: the edit models add their control images'."""
        return tokens, shapes

    @staticmethod
    def text_conditioning(cond: dict) -> dict:
        return {key: cond[key] for key in ("encoder_hidden_states", "encoder_hidden_states_mask")}

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """QwenImagePipeline's true CFG: the negative prompt as a second call, then the combined
        prediction rescaled to the conditional one's norm (AI Toolkit passes the negative embeds and
        true_cfg_scale=guidance_scale: QwenImageModel.generate_single_image)."""
        import torch

        prediction = self.predict(denoiser, latents, t, cond)
        if guidance_scale <= 1:
            return prediction
        unconditional = self.predict(denoiser, latents, t, uncond)
        combined = unconditional + guidance_scale * (prediction - unconditional)
        conditional_norm = torch.norm(prediction, dim=1, keepdim=True)
        return combined * (conditional_norm / torch.norm(combined, dim=1, keepdim=True))


def _forget_rope_frequencies() -> None:
    """Empty diffusers' per-shape cache of QwenEmbedRope frequencies (`_compute_video_freqs`, an
    lru_cache of up to 128 device tensors). It keeps each bucket's table alive for the rest of the
    run (2 MiB per 1024 bucket at full size), so the buckets trained would move the previews' peak
    by that much and a one-step estimate would pay a cache miss the probe's later steps do not:
    the probe drops it after each call and leaves those few MiB out (docs/models.md)."""
    from diffusers.models.transformers import transformer_qwenimage

    for cell in transformer_qwenimage.QwenEmbedRope._compute_video_freqs.__closure__ or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
