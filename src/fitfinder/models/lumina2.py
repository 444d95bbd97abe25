"""Lumina-Image 2.0: Gemma 2's second-to-last hidden states (256 tokens, with their attention mask);
FLUX.1's 16-channel VAE; a single-stream DiT with caption and noise refiners; flow matching with the
time reversed; classifier-free guidance as a second call with the negative prompt in previews.

AI Toolkit: toolkit/stable_diffusion_model.py (load_model's is_lumina2 branch, encode_prompt,
predict_noise, generate_images; commit 27a03a91).
"""

from __future__ import annotations

import contextlib

from fitfinder.models._common import FlowImageLatents
from fitfinder.models._family import Family

# LoRA targets (toolkit/lora_special.py, LoRANetwork.create_modules): target_modules is
# ["Lumina2Transformer2DModel"] for is_lumina2 and, with transformer_only (NetworkConfig's default), a
# Linear layer is kept only when its name holds "layers.", "noise_refiner." or "context_refiner."
# (peft-format names): every block, not the embedders nor norm_out.
# Quantization (load_model, is_lumina2): the transformer with model.qtype (moved to the device in
# bf16 first, quantized there); Gemma 2 moved to the device and quantized with model.qtype when
# model.quantize_te says so.
FAMILY = Family(
    name="lumina2",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={"transformer": "diffusers.Lumina2Transformer2DModel", "text_encoder": "transformers.Gemma2Model",
             "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r"(layers|noise_refiner|context_refiner)\.\d+\..*",
    arch_values=("lumina2",),
    # AI Toolkit's ModelConfig turns is_lumina2 into arch lumina2 (toolkit/config_modules.py).
    flags=("is_lumina2",),
    name_hints=("lumina",),
    quantized_text_encoders=("text_encoder",),
    te_qtype_key="qtype",
    # encode_prompt (is_lumina2) calls Lumina2Pipeline.encode_prompt with max_sequence_length=256,
    # which pads every prompt to that length.
    text_seq_len=256,
    tokenizer="tokenizer",
)


class Recipe(FlowImageLatents):
    """What Lumina 2 computes; built by probe children (its methods import torch)."""

    def __init__(self, arch: dict, inputs):
        self.inputs = inputs
        self.read_autoencoder_kl(arch["parts"]["vae"], scaling=0.3611, shift=0.1159)
        self.divisor = self.scale_factor * int(arch["parts"]["transformer"].get("patch_size", 2))

    def encode_prompts(self, parts, batch) -> dict:
        """Lumina2Pipeline._get_gemma_prompt_embeds: the prompt (after the pipeline's system prompt)
        padded to 256 tokens through Gemma 2, the second-to-last hidden states and the mask kept."""
        import torch

        gemma = parts["text_encoder"]
        ids = self.inputs.t5_ids(gemma.config, batch)
        mask = torch.ones(ids.shape, dtype=torch.int64, device=ids.device)
        out = gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        text = out.hidden_states[-2]
        del out
        return {"encoder_hidden_states": text.to(self.inputs.dtype), "encoder_attention_mask": mask}

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """predict_noise (is_lumina2): the time reversed (1 - timestep / 1000), the caption's mask
        passed along, the output negated."""
        from fitfinder.models._common import batched

        cond = batched(cond, latents.shape[0])
        with _captions_of_known_length(denoiser):
            out = denoiser(hidden_states=latents, timestep=1 - t, return_dict=False, **cond)[0]
        return -out

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        prediction = self.predict(denoiser, latents, t, cond)
        if guidance_scale <= 1:
            return prediction
        # Lumina2Pipeline (AI Toolkit's generate_images passes the negative embeddings): the negative
        # prompt as a second call, compute doubles, the batch does not.
        unconditional = self.predict(denoiser, latents, t, uncond)
        return unconditional + guidance_scale * (prediction - unconditional)


@contextlib.contextmanager
def _captions_of_known_length(denoiser):
    """The transformer's rotary embedding without reading the caption mask's values.

    Lumina2RotaryPosEmbed.forward counts each caption's tokens with `mask.sum(dim=1).tolist()`, a
    value no fake tensor has (the estimate). The probe's captions are always whole (all 256 tokens
    real, the longest a prompt can be), so the same positions and tensors are made from the mask's
    shape: `_rope_of_whole_captions` for the call, the module's own forward after.
    """
    rope = denoiser.rope_embedder
    rope.forward = lambda hidden_states, attention_mask: _rope_of_whole_captions(rope, hidden_states, attention_mask)
    try:
        yield
    finally:
        del rope.forward


def _rope_of_whole_captions(rope, hidden_states, attention_mask):
    """What Lumina2RotaryPosEmbed.forward returns when every caption fills its mask: caption
    positions 0..L-1 on the first axis, the image's rows and columns after them, the frequency
    tables made on the device for the call (the module keeps them in host memory and copies them)."""
    import torch

    batch, channels, height, width = hidden_states.shape
    p = rope.patch_size
    rows, cols = height // p, width // p
    caption_len = attention_mask.shape[1]
    seq_len = caption_len + rows * cols
    device = hidden_states.device
    ids = torch.zeros(batch, seq_len, 3, dtype=torch.int32, device=device)
    ids[:, :caption_len, 0] = torch.arange(caption_len, dtype=torch.int32, device=device)
    ids[:, caption_len:, 0] = caption_len
    ids[:, caption_len:, 1] = torch.arange(rows, dtype=torch.int32, device=device).view(-1, 1).repeat(1, cols).flatten()
    ids[:, caption_len:, 2] = torch.arange(cols, dtype=torch.int32, device=device).view(1, -1).repeat(rows, 1).flatten()
    tables = _frequency_tables(rope, device)
    parts = []
    for axis, table in enumerate(tables):
        index = ids[:, :, axis:axis + 1].repeat(1, 1, table.shape[-1]).to(torch.int64)
        parts.append(torch.gather(table.unsqueeze(0).repeat(batch, 1, 1), dim=1, index=index))
    del tables
    freqs = torch.cat(parts, dim=-1)
    del parts
    caption_freqs = torch.zeros(batch, caption_len, freqs.shape[-1], device=device, dtype=freqs.dtype)
    image_freqs = torch.zeros(batch, rows * cols, freqs.shape[-1], device=device, dtype=freqs.dtype)
    caption_freqs.copy_(freqs[:, :caption_len])
    image_freqs.copy_(freqs[:, caption_len:])
    tokens = hidden_states.view(batch, channels, rows, p, cols, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)
    return tokens, caption_freqs, image_freqs, freqs, [caption_len] * batch, [seq_len] * batch


def _frequency_tables(rope, device):
    """The module's complex frequency tables (one per axis, float64 as it makes them off Apple's
    GPUs) made on `device`: the copy `_get_freqs_cis` makes of its host tables on every call."""
    import torch
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    with torch.device(device):
        return [get_1d_rotary_pos_embed(dim, length, theta=rope.theta, freqs_dtype=torch.float64)
                for dim, length in zip(rope.axes_dim, rope.axes_lens)]
