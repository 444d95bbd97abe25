"""Chroma (lodestones/Chroma, Chroma1-Base, Chroma1-HD): FLUX.1-schnell's blocks whose modulation
comes from a distilled approximator (no guidance input, no pooled CLIP); T5 only, with an attention
mask over the joint text + image sequence; real classifier-free guidance in previews.

AI Toolkit: extensions_built_in/diffusion_models/chroma/chroma_model.py (ChromaModel), its
pipeline.py (ChromaPipeline) and src/model.py (Chroma, AI Toolkit's own transformer class with the
same weights as diffusers' ChromaTransformer2DModel); commit 27a03a91.
"""

from __future__ import annotations

from fitfinder.models import flux
from fitfinder.models._family import Family

# ChromaModel.load_model: the transformer quantized with model.qtype (quantize, freeze) and moved to
# the device; T5 (Flex.1-alpha's) on the device in bf16, then quantized with model.qtype when
# quantize_te; a placeholder CLIP that holds nothing; the VAE (Flex.1-alpha's) on the device.
# LoRA: target_lora_modules ['Chroma'] with transformer_only (toolkit/lora_special.py): the
# double_blocks and single_blocks, not the approximator (distilled_guidance_layer); diffusers names
# them transformer_blocks and single_transformer_blocks.
FAMILY = Family(
    name="chroma",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={"transformer": "diffusers.ChromaTransformer2DModel", "text_encoder": "transformers.T5EncoderModel",
             "vae": "diffusers.AutoencoderKL"},
    lora_blocks=flux.FAMILY.lora_blocks,
    arch_values=("chroma",),
    name_hints=("chroma",),
    quantized_text_encoders=("text_encoder",),
    text_seq_len=512,  # get_prompt_embeds: max_length 512, padded
    tokenizer="tokenizer",
)


class Recipe(flux.Recipe):
    """FLUX.1's latents and packing; T5 alone; AI Toolkit's attention mask; negative prompts in previews."""

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        self.heads = int(arch["parts"]["transformer"]["num_attention_heads"])
        self.divisor = 32  # ChromaModel.get_bucket_divisibility

    def encode_prompts(self, parts, batch) -> dict:
        """T5's last hidden state (get_prompt_embeds: padded to 512 tokens, no CLIP)."""
        t5 = parts["text_encoder"]
        text = t5(input_ids=self.inputs.t5_ids(t5.config, batch)).last_hidden_state
        return {"encoder_hidden_states": text.to(self.inputs.dtype)}

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call with AI Toolkit's attention mask (Chroma.forward, src/model.py).

        Chroma.forward turns the (batch, sequence) mask of text and image tokens into a boolean mask
        for every head, (batch, heads, sequence, sequence), by way of an fp32 outer product repeated
        over batch and heads, then int32, then bool: at 1024 px (4,608 tokens) a 4 GiB transient
        before the first block and 0.5 GiB that every checkpointed block keeps until the backward.
        SDPA gets it per head. Here the same mask is made the same way; the transformer gets a view
        of it (so it lives as long), and `_MaskPerHead` hands SDPA the per-head mask.
        """
        import torch

        from fitfinder.models._common import batched

        batch = latents.shape[0]
        tokens, ids = flux.pack(latents), flux.image_ids(latents, self.inputs)
        text = batched(cond, batch)["encoder_hidden_states"]
        text_ids = torch.zeros(text.shape[1], 3, device=self.inputs.device, dtype=self.inputs.dtype)
        with torch.no_grad():
            mask = self._mask(batch, text.shape[1] + tokens.shape[1])
        _mask_per_head(denoiser)
        out = denoiser(hidden_states=tokens, encoder_hidden_states=text, timestep=t, img_ids=ids, txt_ids=text_ids,
                       attention_mask=mask[:, 0, 0, :], return_dict=False)[0]
        del mask
        return flux.unpack(out, latents.shape)

    def _mask(self, batch: int, sequence: int):
        """AI Toolkit's per-head mask, made as Chroma.forward makes it (the prompt's padding is
        unmasked, all of it here: the values cost nothing)."""
        import torch

        joint = torch.ones(batch, sequence, device=self.inputs.device, dtype=torch.float32)
        square = joint.T @ joint
        return square[None, None].repeat(batch, self.heads, 1, 1).int().bool()

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        prediction = self.predict(denoiser, latents, t, cond)
        if guidance_scale <= 1.00001:
            return prediction
        # ChromaPipeline: the negative prompt as a second transformer call (guidance_scale > 1.00001).
        unconditional = self.predict(denoiser, latents, t, uncond)
        return unconditional + guidance_scale * (prediction - unconditional)


class _MaskPerHead:
    """An attention processor that gives SDPA the mask for every head.

    ChromaTransformer2DModel's blocks make a (batch, 1, sequence, sequence) mask from the one they
    get, which SDPA would broadcast; AI Toolkit's Chroma hands SDPA a mask per head, which SDPA
    turns into an additive mask of that size (and keeps for the backward). Expanding it to the
    heads gives SDPA the same input without another copy here.
    """

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            attention_mask = attention_mask.expand(-1, attn.heads, -1, -1)
        return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _mask_per_head(denoiser) -> None:
    """Every attention of the transformer through `_MaskPerHead` (once)."""
    for module in denoiser.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(module, "set_processor") and not isinstance(processor, _MaskPerHead):
            module.set_processor(_MaskPerHead(processor))
