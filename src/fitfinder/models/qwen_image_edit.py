"""Qwen-Image-Edit: Qwen-Image with a control image, encoded twice: by Qwen2.5-VL's vision tower into
the prompt (about 1,370 more prompt tokens at 1 MP), and by the VAE into latents packed after the
noisy image tokens (twice the image tokens of a bucket in training).

AI Toolkit: extensions_built_in/diffusion_models/qwen_image/qwen_image_edit.py (QwenImageEditModel,
a QwenImageModel that keeps the vision tower; commit 27a03a91). Its loader, quantization, LoRA
targets and true CFG are Qwen-Image's (models/qwen_image.py).
"""

from __future__ import annotations

from fitfinder.models import qwen_image
from fitfinder.models._family import Family

# _qwen_image_keep_visual = True: the vision tower stays in the text encoder (nothing dropped).
FAMILY = Family(
    name="qwen_image_edit",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes=qwen_image.CLASSES,
    lora_blocks=qwen_image.LORA_BLOCKS,
    arch_values=("qwen_image_edit",),
    name_hints=("qwenimageedit",),
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype_te",
    text_seq_len=512,
    tokenizer="tokenizer",
    placement=qwen_image.FAMILY.placement,  # QwenImageModel.load_model's
    tiled_preview_decode=True,  # QwenImageEditModel.generate_single_image, under low_vram
)


class Recipe(qwen_image.Recipe):
    """Qwen-Image's computation with control images in the prompt and on the image sequence."""

    template_tokens = 64  # QwenImageEditPipeline.prompt_template_encode_start_idx
    control_images = 1
    # QwenImageEditModel.get_prompt_embeds resizes each control image to 1 MP for the vision tower.
    vision_area = 1024 * 1024
    picture_tokens = 0  # edit plus writes "Picture N: " before each image
    # Control latents: in training at the training image's size (condition_noisy_latents); in previews
    # QwenImageEditPipeline resizes the control image to 1 MP (calculate_dimensions(1024 * 1024, ratio)).
    train_latent_area: int | None = None
    sample_latent_area = 1024 * 1024
    _control_area: int | None = None  # of the call in progress (see _predict)

    # -- prompts ----------------------------------------------------------------------------------
    def encode_prompts(self, parts, batch) -> dict:
        """QwenImageEditPipeline._get_qwen_prompt_embeds: the template with the control image(s)
        through Qwen2.5-VL (vision tower, then the language model with every hidden state and the
        logits, as its forward computes them); the last hidden state less the template's tokens.

        The image features go into the prompt's embedding where the image tokens are, and the
        3-D rotary positions are laid out from the image grid, as the model's forward does, from
        shapes alone. The vision tower splits its attention by lengths it reads from a tensor
        (`cu_seqlens.tolist()`), so it runs under `inputs.concrete()` for the estimate."""
        import contextlib

        import torch

        encoder, inputs = parts["text_encoder"], self.inputs
        vision = encoder.config.vision_config
        merge, patches = vision.spatial_merge_size, self._patches_per_side(vision)
        images = self.control_images * batch
        with getattr(inputs, "concrete", contextlib.nullcontext)():
            grid = torch.tensor([[1, patches, patches]] * images, device=inputs.device)
            patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
            pixels = inputs.randn((images * patches * patches, patch_values))
            features = encoder.model.visual(pixels, grid_thw=grid).pooler_output
        del grid, pixels
        image_tokens = (patches // merge) ** 2
        segments = self._segments(image_tokens)
        ids = self._prompt_ids(encoder.config, batch, sum(length for _, length in segments))
        embeds = encoder.get_input_embeddings()(ids).clone()  # masked_scatter's new tensor
        features = features.view(batch, self.control_images, image_tokens, -1).to(embeds.dtype)
        start, image = 0, 0
        for kind, length in segments:
            if kind == "image":
                embeds[:, start:start + length] = features[:, image]
                image += 1
            start += length
        del features
        positions = self._positions(segments, patches // merge, batch, embeds.device)
        out = encoder.model.language_model(inputs_embeds=embeds, position_ids=positions,
                                           attention_mask=torch.ones_like(ids), output_hidden_states=True)
        logits = encoder.lm_head(out.last_hidden_state)
        del logits, embeds, positions
        return self._embeds(out.hidden_states[-1][:, self.template_tokens:])

    def _patches_per_side(self, vision) -> int:
        """Patches per side of a square control image: AI Toolkit rounds its side to 32, the Qwen2-VL
        processor's smart_resize to patch_size * spatial_merge_size (28), within its max_pixels
        (12.8 MP for Qwen-Image-Edit: no limit at 1 MP; read from the vision config when it has one,
        as the tiny archs do)."""
        area = min(self.vision_area, getattr(vision, "max_pixels", None) or self.vision_area)
        side = round(area ** 0.5 / 32) * 32
        factor = vision.patch_size * vision.spatial_merge_size
        return max(1, round(side / factor)) * vision.spatial_merge_size

    def _segments(self, image_tokens: int) -> list[tuple[str, int]]:
        """The prompt's token layout: the template, each image between its vision start and end
        tokens (after "Picture N: " for edit plus), then the prompt."""
        segments = [("text", self.template_tokens)]
        for _ in range(self.control_images):
            segments += [("text", self.picture_tokens + 1), ("image", image_tokens), ("text", 1)]
        return segments + [("text", self.inputs.text_seq_len)]

    @staticmethod
    def _positions(segments, grid_side: int, batch: int, device):
        """Qwen2.5-VL's 3-D rotary positions (Qwen2_5_VLModel.get_rope_index, from shapes): text
        counts on in all three axes; an image's tokens take its grid rows and columns, offset by the
        text before it; the text after it starts past the image's largest position."""
        import torch

        parts, next_position = [], 0
        for kind, length in segments:
            if kind == "text":
                parts.append(torch.arange(length, device=device).view(1, -1).expand(3, -1) + next_position)
                next_position += length
                continue
            rows = torch.arange(grid_side, device=device).view(-1, 1).expand(-1, grid_side).reshape(-1)
            cols = torch.arange(grid_side, device=device).view(1, -1).expand(grid_side, -1).reshape(-1)
            parts.append(torch.stack([torch.zeros_like(rows), rows, cols]) + next_position)
            next_position += grid_side
        return torch.cat(parts, dim=1).unsqueeze(1).expand(-1, batch, -1)

    # -- the transformer --------------------------------------------------------------------------
    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        return self._predict(denoiser, latents, t, cond, self.train_latent_area)

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """Qwen-Image's true CFG, each call with the control latents of a preview."""
        import torch

        prediction = self._predict(denoiser, latents, t, cond, self.sample_latent_area)
        if guidance_scale <= 1:
            return prediction
        unconditional = self._predict(denoiser, latents, t, uncond, self.sample_latent_area)
        combined = unconditional + guidance_scale * (prediction - unconditional)
        conditional_norm = torch.norm(prediction, dim=1, keepdim=True)
        return combined * (conditional_norm / torch.norm(combined, dim=1, keepdim=True))

    def _predict(self, denoiser, latents, t, cond, control_area: int | None):
        self._control_area = control_area
        return qwen_image.Recipe.predict(self, denoiser, latents, t, cond)

    def conditioned(self, tokens, shapes, cond):
        """The control images' latents packed after the image tokens, each with its shape
        (QwenImageEditModel.get_noise_prediction). They come from the VAE, outside autograd; here
        they are drawn at their shape (the VAE's encode of them is not run in the probe)."""
        import torch

        batch, _, width_tokens = tokens.shape
        _, rows, cols = shapes[0]
        if self._control_area:
            rows = cols = round(self._control_area ** 0.5 / 32) * 32 // self.scale_factor // 2
        controls = self.inputs.randn((batch, self.control_images * rows * cols, width_tokens))
        tokens = torch.cat([tokens, controls], dim=1)
        return tokens, shapes + [(1, rows, cols)] * self.control_images
