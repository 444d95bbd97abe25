"""HiDream-I1 (Full, Dev, Fast): four text encoders (CLIP-L and CLIP-G pooled, T5-XXL, and every
hidden layer of Llama 3.1 8B Instruct), the FLUX.1 VAE's 16-channel latents patched 2x2 into a
transformer with a mixture-of-experts feed-forward; flow matching; true classifier-free guidance
on a doubled batch when sampling.

AI Toolkit: extensions_built_in/diffusion_models/hidream/hidream_model.py (HidreamModel; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models._common import FlowImageLatents
from fitfinder.models._family import Family, Placement

# Load order and quantization (HidreamModel.load_model): Llama 3.1 8B first, onto the device in
# bf16 and quantized there with model.qtype_te; then the transformer, onto the device whole in
# bf16 and quantized there with model.qtype; then the VAE and both CLIPs (never quantized); then
# T5, quantized with model.qtype_te. The LoRA (target_lora_modules 'HiDreamImageTransformer2DModel',
# toolkit/lora_special.py with transformer_only on by default) takes every Linear layer inside
# get_transformer_block_names(): double_stream_blocks and single_stream_blocks, the MoE experts
# included unless the job's network_kwargs.ignore_if_contains leaves them out (its example does).
FAMILY = Family(
    name="hidream",
    denoisers=("transformer",),
    text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"),
    classes={"transformer": "diffusers.HiDreamImageTransformer2DModel",
             "text_encoder": "transformers.CLIPTextModelWithProjection",
             "text_encoder_2": "transformers.CLIPTextModelWithProjection",
             "text_encoder_3": "transformers.T5EncoderModel",
             "text_encoder_4": "transformers.LlamaForCausalLM",
             "vae": "diffusers.AutoencoderKL"},
    lora_blocks=r"(double|single)_stream_blocks\.\d+\..*",
    arch_values=("hidream",),
    name_hints=("hidream",),
    quantized_text_encoders=("text_encoder_3", "text_encoder_4"),
    te_qtype_key="qtype_te",
    text_seq_len=128,  # HidreamModel.get_prompt_embeds: max_sequence_length = 128, for every encoder
    tokenizer="tokenizer_3",
    load_order=("text_encoder_4", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"),
    # HidreamModel.load_model with low_vram: Llama is quantized on the device, then waits on the CPU;
    # the transformer stays on the CPU and is quantized a block at a time on the device; both come
    # back once T5 is loaded and quantized ("move everything to the device").
    low_vram={"text_encoder_4": Placement(after_load="waits"),
              "transformer": Placement(quantized_on="host", after_load="waits")},
)


class Recipe(FlowImageLatents):
    """What HiDream-I1 computes; built by probe children (its methods import torch)."""

    def __init__(self, arch: dict, inputs):
        vae, transformer = arch["parts"]["vae"], arch["parts"]["transformer"]
        self.inputs = inputs
        self.read_autoencoder_kl(vae, scaling=0.3611, shift=0.1159)
        self.patch = int(transformer.get("patch_size") or 2)
        self.divisor = 16  # HidreamModel.get_bucket_divisibility

    def encode_prompts(self, parts, batch) -> dict:
        """HiDreamImagePipeline._encode_prompt as AI Toolkit's copy runs it (src/pipelines/hidream_image/
        pipeline_hidream_image.py): both CLIPs' projected pooled outputs side by side, T5's last hidden
        state, and Llama's hidden states after every layer stacked (hidden_states[1:])."""
        import torch

        dtype = self.inputs.dtype
        pooled = [parts[name](input_ids=self._clip_ids(parts[name].config, batch), output_hidden_states=True)[0]
                  for name in ("text_encoder", "text_encoder_2")]
        t5 = parts["text_encoder_3"]
        text_t5 = t5(input_ids=self.inputs.t5_ids(t5.config, batch)).last_hidden_state
        llama = parts["text_encoder_4"]
        # AI Toolkit also asks for output_attentions, which Llama's sdpa path (transformers 5) ignores
        # with a warning; eager attention would return 32 maps of 32x128x128 (about 34 MB in bf16).
        outputs = llama(input_ids=self.inputs.t5_ids(llama.config, batch), output_hidden_states=True)
        # Stacked batch first (the pipeline stacks layers first; predict hands the model that view),
        # so a cached prompt repeats over the batch like every other conditioning.
        text_llama = torch.stack(outputs.hidden_states[1:], dim=1)
        del outputs
        return {"pooled_embeds": torch.cat(pooled, dim=-1).to(dtype), "encoder_hidden_states_t5": text_t5.to(dtype),
                "encoder_hidden_states_llama3": text_llama.to(dtype)}

    def _clip_ids(self, config, batch):
        """CLIP ids padded to min(128, 218) as the pipeline's tokenizer call pads them, within the positions."""
        length = min(self.inputs.text_seq_len, 218, int(config.max_position_embeddings))
        ids = self.inputs._ids(config, batch, length)
        ids[:, -1] = config.eos_token_id if config.eos_token_id != 2 else config.vocab_size - 1
        return ids

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One transformer call (HidreamModel.get_noise_prediction): the latents as they are (the model
        patches them, and pads a non-square image to max_seq tokens as AI Toolkit does), timesteps on
        the 0-1000 scale, the prediction negated."""
        from fitfinder.models._common import batched

        _route_evenly(denoiser)
        batch, channels, height, width = latents.shape
        denoiser._fitfinder_grid = (height // self.patch, width // self.patch)  # read by _unpatchify
        cond = batched(cond, batch)
        llama = cond["encoder_hidden_states_llama3"].transpose(0, 1)  # (layers, batch, tokens, width)
        out = denoiser(hidden_states=latents, timesteps=t * 1000, pooled_embeds=cond["pooled_embeds"],
                       encoder_hidden_states_t5=cond["encoder_hidden_states_t5"],
                       encoder_hidden_states_llama3=llama, return_dict=False)[0]
        if out.shape[-2:] != (height, width):  # training mode: (B, C, tokens, patch*patch)
            rows, cols, p = height // self.patch, width // self.patch, self.patch
            out = out[:, :, :rows * cols].reshape(batch, channels, rows, cols, p, p).permute(0, 1, 2, 4, 3, 5)
            out = out.reshape(batch, channels, height, width)
        return -out

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        import torch

        if guidance_scale <= 1:
            return self.predict(denoiser, latents, t, cond)
        # HiDreamImagePipeline.__call__ (AI Toolkit's copy): negative and positive on one doubled batch.
        both = {key: torch.cat([uncond[key], cond[key]]) for key in cond}
        uncond_pred, cond_pred = self.predict(denoiser, torch.cat([latents, latents]), torch.cat([t, t]),
                                              both).chunk(2)
        return uncond_pred + guidance_scale * (cond_pred - uncond_pred)


def _route_evenly(denoiser) -> None:
    """Each MoE feed-forward runs AI Toolkit's routing with its token counts made even.

    AI Toolkit's MoE (extensions_built_in/diffusion_models/hidream/src/models/moe.py,
    MOEFeedForwardSwiGLU.forward) trains and samples through `moe_infer`: gate scores, top-k,
    a zero buffer, then each expert gathers its tokens, runs, is scaled in place and scattered back
    with an index repeated across the width (the scaling and the scatter below say what differs).
    How many tokens each expert gets depends on the values (bincount), which fake tensors do not
    have; the total (tokens x top-k) does not. Here each expert gets an even share of the sorted
    assignments, the balance the gate is trained towards: the same ops and the same total bytes,
    and one shape for the probe and the estimate alike (the largest expert's transient is what an
    uneven routing would add). The transformer's unpatchify, which reads the grid from a tensor's
    values in eval mode, is swapped for one that takes it from Python ints.
    """
    import types

    if getattr(denoiser, "_fitfinder_even", False):
        return
    for module in denoiser.modules():
        if type(module).__name__ == "MOEFeedForwardSwiGLU":
            module.forward = types.MethodType(_even_moe_forward, module)
    denoiser.unpatchify = types.MethodType(_unpatchify, denoiser)
    denoiser._fitfinder_even = True


def _unpatchify(self, x, img_sizes, is_training):
    """The transformer's own unpatchify, with the patch grid from Python ints: in eval mode (previews)
    diffusers reads each image's grid from the `img_sizes` tensor's values, which fake tensors lack.
    The same slices, reshapes and concatenation follow."""
    import torch

    if is_training and not self.config.force_inference_output:
        return type(self).unpatchify(self, x, img_sizes, is_training)
    rows, cols = self._fitfinder_grid
    p = self.config.patch_size
    images = []
    for i in range(x.shape[0]):
        image = x[i, : rows * cols].reshape(1, rows, cols, -1)
        image = image.reshape(1, rows, cols, p, p, image.shape[-1] // (p * p)).permute(0, 5, 1, 3, 2, 4)
        images.append(image.reshape(1, -1, rows * p, cols * p))
    return torch.cat(images, dim=0)


def _even_moe_forward(self, x):
    import torch
    import torch.nn.functional as F

    identity, shape = x, x.shape
    flat = x.view(-1, shape[-1])
    scores = F.linear(flat, self.gate.weight, None).softmax(dim=-1)
    top_weight, top_index = torch.topk(scores, k=self.gate.top_k, dim=-1, sorted=False)
    k, experts = self.num_activated_experts, len(self.experts)
    order = top_index.view(-1).argsort()
    token_index = order // k
    weights = top_weight.view(-1, 1)
    combined = torch.zeros_like(flat)
    assignments = token_index.shape[0]
    start = 0
    for i, expert in enumerate(self.experts):
        end = start + assignments // experts + (1 if i < assignments % experts else 0)
        if end == start:
            continue
        tokens = token_index[start:end]
        out = expert(flat[tokens])
        if torch.is_grad_enabled():
            # AI Toolkit scales in place (mul_), for which autograd keeps a copy of the unscaled output:
            # the bytes of this product. In place, quanto's 8-bit layers refuse it (their output is a
            # view made inside a custom Function).
            out = out * weights[order[start:end]]
        else:
            out.mul_(weights[order[start:end]])
        combined = combined.to(out.dtype)
        # Out of place: AI Toolkit's in-place scatter_reduce_ keeps a clone of the buffer for each
        # expert's backward (autograd's original self), the same bytes as the new buffer here; but a
        # second in-place scatter breaks the first one's saved result, which only checkpointing's
        # recomputation hides (without it AI Toolkit's backward raises "modified by an inplace operation").
        combined = combined.scatter_reduce(0, tokens.view(-1, 1).repeat(1, flat.shape[-1]), out, reduce="sum")
        start = end
    return combined.view(*shape) + self.shared_experts(identity)
