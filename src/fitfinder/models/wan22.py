"""Wan 2.2 T2V A14B: Wan 2.1's computation on two experts, the high-noise transformer above the
boundary ratio and the low-noise transformer_2 below it, trained in turns.

AI Toolkit: extensions_built_in/diffusion_models/wan22/wan22_14b_model.py (Wan2214bModel:
train_high_noise / train_low_noise in model_kwargs, boundary_ratio_t2v 0.875; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models import wan21
from fitfinder.models._family import Family, Placement
from fitfinder.models.wan21 import Recipe  # noqa: F401  the same computation, per expert

# Wan2214bModel and Wan225bModel.get_quantization_exclude_modules (wan22_14b_model.py, wan22_5b_model.py;
# AI Toolkit 27a03a91): "the timestep/text conditioning embedders and the final projection feed every
# downstream modulation; keep them in full precision when quantizing".
UNQUANTIZED = ("condition_embedder*", "proj_out*")

FAMILY = Family(
    name="wan22",
    denoisers=("transformer", "transformer_2"),
    text_encoders=("text_encoder",),
    classes={**wan21.CLASSES, "transformer_2": "diffusers.WanTransformer3DModel"},
    lora_blocks=wan21.FAMILY.lora_blocks,
    arch_values=("wan22_14b",),
    name_hints=("wan22",),
    video=True,
    frame_step=4,
    quantized_text_encoders=("text_encoder",),
    unquantized_layers=UNQUANTIZED,
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    text_seq_len=512,
    tokenizer="tokenizer",
    index_defaults={"boundary_ratio": 0.875},  # Wan 2.2 A14B's published value
    expert_switches={"transformer": "train_high_noise", "transformer_2": "train_low_noise"},
    # Wan2214bModel.load_wan_transformer with low_vram: each expert is quantized a block at a time on
    # the device and left on the CPU, where DualWanTransformer3DModel (whose `to` does nothing) keeps
    # it until its first prediction; its forward then swaps the experts, so only the active one is on
    # the device, in previews and training alone. Without low_vram both come and stay. Previews under
    # low_vram (Wan22Pipeline.__call__ with aggressive_offload) move the experts off for the decode too,
    # UMT5 and the VAE as Wan 2.1's do (wan21.PREVIEW_UNLOADS), and Wan2214bModel.generate_single_image
    # tiles the decode (Wan21.use_vae_tiling).
    low_vram={**{expert: Placement(quantized_on="host", after_load="leaves", only_when_active=True,
                                   only_in=frozenset({"sample", "train", "last_sample"}),
                                   in_previews=frozenset({"denoise"}))
                 for expert in ("transformer", "transformer_2")}, **wan21.PREVIEW_UNLOADS},
    tiled_preview_decode=True,
    tiled_preview_decode_key="vae_tiling",
)
