"""Z-Image (Turbo, base, De-Turbo): Qwen3's second-to-last hidden states as the caption; FLUX.1's
16-channel VAE; a single-stream transformer that takes lists (one latent and one caption per
sample); flow matching with the time reversed; classifier-free guidance on a doubled list.

AI Toolkit: extensions_built_in/diffusion_models/z_image/z_image.py (ZImageModel; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._common import FlowImageLatents
from fitfinder.models._family import Family, Placement

# LoRA targets: ZImageModel.get_transformer_block_names is ["layers"], and LoRANetwork.create_modules
# (toolkit/lora_special.py, transformer_only) keeps a Linear layer only when its name holds it: the
# 30 main blocks, not the noise and context refiners nor the embedders.
# Quantization (ZImageModel.load_transformer -> toolkit/models/v2/_mixin.py, quantize_): the
# transformer with model.qtype, loaded in host memory and quantized a block at a time on the device,
# so it reaches the device already quantized; Qwen3 is moved to the device in bf16 and quantized
# there with model.qtype_te (load_model).
FAMILY = Family(
    name="zimage",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={"transformer": "diffusers.ZImageTransformer2DModel", "text_encoder": "transformers.Qwen3ForCausalLM",
             "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r"layers\.\d+\..*",
    arch_values=("zimage",),
    name_hints=("zimage",),
    quantized_text_encoders=("text_encoder",),
    # toolkit/models/v2/z_image.py ZImageTransformer2DModel.get_quantization_exclude_modules: "sensitive
    # modules kept in full precision" (the timestep, caption and latent embedders, the final layers),
    # excluded from OstrisModelMixin.quantize_'s pass over what the "layers" blocks leave
    # ZImageModel.load_model: with a training adapter (merged into the weights), qfloat8 is torchao's float8
    float8_with="model.assistant_lora_path",
    unquantized_layers=("t_embedder*", "cap_embedder*", "all_x_embedder*", "all_final_layer*", "siglip_embedder*"),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype_te",
    text_seq_len=512,  # ZImagePipeline.encode_prompt's max_sequence_length
    tokenizer="tokenizer",
    # ZImageModel.load_model: the transformer is loaded in host memory (quantized there a block at a
    # time, OstrisModelMixin.quantize_) and waits there while Qwen3 comes in bf16 and is quantized on
    # the device, then comes, low_vram or not (with it, BaseSDTrainProcess.run moves it). Under
    # layer_offloading both are attached in host memory, Qwen3 before `text_encoder.to(device)` and
    # before `quantize`, as Qwen-Image's loader does (qwen_image.PLACEMENT).
    placement={"transformer": Placement(quantized_on="host", after_load="waits", offloaded_on_host="always"),
               "text_encoder": Placement(offloaded_on_host="always")},
)


class Recipe(FlowImageLatents):
    """What Z-Image computes; built by probe children (its methods import torch)."""

    def __init__(self, arch: dict, inputs):
        self.inputs = inputs
        self.read_autoencoder_kl(arch["parts"]["vae"], scaling=0.3611, shift=0.1159)
        # ZImageModel.get_bucket_divisibility: 8 for the VAE, 2 for the patch.
        self.divisor = self.scale_factor * int(arch["parts"]["transformer"].get("all_patch_size", [2])[0])

    def encode_prompts(self, parts, batch) -> dict:
        """ZImagePipeline.encode_prompt (ZImageModel.get_prompt_embeds): the chat-templated prompt
        padded to 512 tokens through Qwen3ForCausalLM (its logits are computed too), the
        second-to-last hidden states kept. The pipeline then keeps a prompt's real tokens only; the
        probe keeps all of them, the longest caption a job can have."""
        qwen = parts["text_encoder"]
        ids = self.inputs.t5_ids(qwen.config, batch)
        out = qwen(input_ids=ids, attention_mask=ids.new_ones(ids.shape, dtype=bool), output_hidden_states=True)
        text = out.hidden_states[-2]
        del out
        return {"cap_feats": text.to(self.inputs.dtype)}

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """ZImageModel.get_noise_prediction: one single-frame latent and one caption per sample as
        lists, the time reversed ((1000 - timestep) / 1000), the outputs stacked in fp32 and negated."""
        import torch

        from fitfinder.models._common import batched

        captions = batched(cond, latents.shape[0])["cap_feats"]
        outputs = denoiser(list(latents.unsqueeze(2).unbind(dim=0)), 1 - t, list(captions.unbind(dim=0)),
                           return_dict=False)[0]
        prediction = torch.stack([out.float() for out in outputs], dim=0)
        del outputs
        return -prediction.squeeze(2)

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """ZImageModel.generate_single_image: the guidance is zero-based (scale - 1), and
        ZImagePipeline runs a positive one as one call on a doubled list of latents and captions."""
        import torch

        guidance = max(0.0, guidance_scale - 1.0)
        if guidance <= 0:
            return self.predict(denoiser, latents, t, cond).to(latents.dtype)
        both = {"cap_feats": torch.cat([cond["cap_feats"], uncond["cap_feats"]])}
        positive, negative = self.predict(denoiser, torch.cat([latents, latents]), torch.cat([t, t]), both).chunk(2)
        # The pipeline guides in fp32 and casts the latents back to the models' dtype for the next step.
        return (positive + guidance * (positive - negative)).to(latents.dtype)
