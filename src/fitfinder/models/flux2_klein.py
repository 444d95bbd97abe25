"""FLUX.2 klein base 4B and 9B: FLUX.2's computation with Qwen3 4B / 8B as the text encoder (the
hidden states after layers 9, 18 and 27), no guidance embedder, and real classifier-free guidance
with a negative prompt in previews.

AI Toolkit: extensions_built_in/diffusion_models/flux2/flux2_klein_model.py (Flux2KleinModel,
Flux2Klein4BModel, Flux2Klein9BModel; flux2_is_guidance_distilled False; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models import flux2
from fitfinder.models._family import Family, Placement

# Flux2KleinModel.load_te: Qwen3 quantized with model.qtype_te when quantize_te, in host memory,
# then on the device unless low_vram; the transformer as FLUX.2 dev's (quantized in host memory).
FAMILY = Family(
    name="flux2_klein",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={**flux2.FAMILY.classes, "text_encoder": "transformers.Qwen3ForCausalLM"},
    lora_blocks=flux2.FAMILY.lora_blocks,
    arch_values=("flux2_klein_4b", "flux2_klein_9b"),
    name_hints=("flux2klein",),
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype_te",
    text_seq_len=512,
    tokenizer="tokenizer",  # a diffusers FLUX.2 folder's; its model_max_length may only shorten 512
    # Flux2KleinModel.load_te quantizes Qwen3 in host memory, then it comes to the device (or, not
    # quantized, comes at once), unless low_vram, where it stays on the CPU (Flux2Model.load_model).
    placement={**flux2.FAMILY.placement, "text_encoder": Placement(quantized_on="host")},
    low_vram={**flux2.FAMILY.low_vram, "text_encoder": Placement(quantized_on="host", after_load="leaves")},
)


class Recipe(flux2.Recipe):
    """FLUX.2's computation with Qwen3's layers and true guidance."""

    layers = flux2.QWEN3_LAYERS
    guidance_distilled = False
