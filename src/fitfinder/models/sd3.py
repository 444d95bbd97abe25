"""Stable Diffusion 3.5 (Large): CLIP-L and CLIP-G (penultimate hidden states, pooled projections)
beside a T5 sequence; 16-channel latents with a shift; an MMDiT on 2x2 patches; flow matching; true
classifier-free guidance on a doubled batch in previews.

AI Toolkit: toolkit/stable_diffusion_model.py (load_model's is_v3 branch; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._common import FlowImageLatents
from fitfinder.models._family import Family, Placement

# LoRA targets (toolkit/lora_special.py, LoRANetwork.create_modules): target_modules is
# ["SD3Transformer2DModel"] for is_v3 and, with transformer_only (NetworkConfig's default), a Linear
# layer is skipped unless its name holds "transformer_blocks": the joint blocks' attention, MLPs and
# norms' modulation, not the embedders nor proj_out.
# Quantization (load_model, is_v3): the transformer with model.qtype; T5 (text_encoder_3) is moved to
# the device in bf16 and quantized there with model.qtype too, and only when model.quantize says so
# (quantize_te is not read); both CLIPs stay in full precision.
FAMILY = Family(
    name="sd3",
    denoisers=("transformer",),
    text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
    classes={"transformer": "diffusers.SD3Transformer2DModel",
             "text_encoder": "transformers.CLIPTextModelWithProjection",
             "text_encoder_2": "transformers.CLIPTextModelWithProjection",
             "text_encoder_3": "transformers.T5EncoderModel", "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r"transformer_blocks\.\d+\..*",
    arch_values=("sd3",),
    # AI Toolkit's ModelConfig turns is_v3 into arch sd3 (toolkit/config_modules.py).
    flags=("is_v3",),
    name_hints=("stablediffusion3", "sd35", "sd3"),
    quantized_text_encoders=("text_encoder_3",),
    te_qtype_key="qtype",
    # StableDiffusion3Pipeline._get_t5_prompt_embeds' max_sequence_length, which AI Toolkit's
    # encode_prompts_sd3 (toolkit/train_tools.py) leaves at its default.
    text_seq_len=256,
    tokenizer="tokenizer_3",
    te_quantized_with_denoiser=True,
    # load_model (is_v3): as FLUX.1's branch, low_vram keeps the transformer in host memory while it is
    # quantized, then moves it to the device; T5 comes in bf16 and is quantized there; all stay.
    low_vram={"transformer": Placement(quantized_on="host")},
)


class Recipe(FlowImageLatents):
    """What SD 3.5 computes; built by probe children (its methods import torch)."""

    def __init__(self, arch: dict, inputs):
        self.inputs = inputs
        self.read_autoencoder_kl(arch["parts"]["vae"], scaling=1.5305, shift=0.0609)
        self.divisor = self.scale_factor * int(arch["parts"]["transformer"].get("patch_size", 2))

    def encode_prompts(self, parts, batch) -> dict:
        """encode_prompts_sd3 (toolkit/train_tools.py) through the pipeline's helpers: each CLIP's
        penultimate hidden states side by side, zero-padded to T5's width and put before T5's
        sequence; the two CLIPs' projections side by side as the pooled embedding."""
        import torch

        clip_l, clip_g, t5 = parts["text_encoder"], parts["text_encoder_2"], parts["text_encoder_3"]
        out_l = clip_l(input_ids=self.inputs.clip_ids(clip_l.config, batch), output_hidden_states=True)
        out_g = clip_g(input_ids=self.inputs.clip_ids(clip_g.config, batch), output_hidden_states=True)
        clip_text = torch.cat([out_l.hidden_states[-2], out_g.hidden_states[-2]], dim=-1)
        pooled = torch.cat([out_l.text_embeds, out_g.text_embeds], dim=-1)
        del out_l, out_g
        t5_text = t5(input_ids=self.inputs.t5_ids(t5.config, batch)).last_hidden_state
        clip_text = torch.nn.functional.pad(clip_text, (0, t5_text.shape[-1] - clip_text.shape[-1]))
        text = torch.cat([clip_text, t5_text], dim=-2)
        dtype = self.inputs.dtype
        return {"encoder_hidden_states": text.to(dtype), "pooled_projections": pooled.to(dtype)}

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call as AI Toolkit's predict_noise makes it (is_v3): latents as they are
        (the model patches them), the timestep on the 1000 scale, text and pooled embeddings."""
        from fitfinder.models._common import batched

        return denoiser(hidden_states=latents, timestep=t * 1000, return_dict=False,
                        **batched(cond, latents.shape[0]))[0]

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        import torch

        if guidance_scale <= 1:
            return self.predict(denoiser, latents, t, cond)
        # StableDiffusion3Pipeline (AI Toolkit's sample() passes the negative embeddings): one call
        # on a doubled batch, unconditional first.
        both = {key: torch.cat([uncond[key], cond[key]]) for key in cond}
        uncond_pred, cond_pred = self.predict(denoiser, torch.cat([latents, latents]), torch.cat([t, t]), both).chunk(2)
        return uncond_pred + guidance_scale * (cond_pred - uncond_pred)
