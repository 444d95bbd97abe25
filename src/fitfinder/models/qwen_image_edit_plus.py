"""Qwen-Image-Edit-2509 (AI Toolkit's qwen_image_edit_plus): Qwen-Image-Edit with up to three
control images, each through the vision tower at 384x384 ("Picture N: " before it in the prompt)
and each as 1 MP latents packed after the image tokens, whatever the training bucket.

AI Toolkit: extensions_built_in/diffusion_models/qwen_image/qwen_image_edit_plus.py
(QwenImageEditPlusModel: get_prompt_embeds, get_noise_prediction; commit 27a03a91), with diffusers'
CONDITION_IMAGE_SIZE (384 * 384) and VAE_IMAGE_SIZE (1024 * 1024) from pipeline_qwenimage_edit_plus.
"""

from __future__ import annotations

from fitfinder.models import qwen_image, qwen_image_edit
from fitfinder.models._family import Family

FAMILY = Family(
    name="qwen_image_edit_plus",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes=qwen_image.CLASSES,
    lora_blocks=qwen_image.LORA_BLOCKS,
    arch_values=("qwen_image_edit_plus",),
    name_hints=("qwenimageedit2509", "qwenimageeditplus"),
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype_te",
    text_seq_len=512,
    tokenizer="tokenizer",
    placement=qwen_image.FAMILY.placement,  # QwenImageModel.load_model's
    tiled_preview_decode=True,  # QwenImageEditPlusModel.generate_single_image, under low_vram
)


class Recipe(qwen_image_edit.Recipe):
    """Edit's computation with `control_images` images (the arch's, 3 by default: AI Toolkit's
    datasets take up to three control folders, as its 2509 example trains)."""

    vision_area = 384 * 384  # CONDITION_IMAGE_SIZE
    picture_tokens = 4  # "Picture N: "
    # VAE_IMAGE_SIZE in training (unless model_kwargs.match_target_res) and in previews.
    train_latent_area = 1024 * 1024
    sample_latent_area = 1024 * 1024

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        self.control_images = int(arch.get("control_images", 3))
