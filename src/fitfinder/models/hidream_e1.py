"""HiDream E1 (E1-1, E1-Full): HiDream-I1's parts, loader and prompts, with the control image's
latents set beside the noisy ones along the width: the transformer sees a (H, 2W) latent image,
padded to its max_seq tokens as every non-square input is; the prediction keeps the left half.
Previews run the editing pipeline's three-way guidance (uncond, image, full) on a tripled batch.

AI Toolkit: extensions_built_in/diffusion_models/hidream/hidream_e1_model.py (HidreamE1Model, a
HidreamModel; commit 27a03a91).
"""

from __future__ import annotations

from fitfinder.models import hidream
from fitfinder.models._family import Family, Placement

# HidreamE1Model inherits HidreamModel.load_model whole: the same load order, quantization and low_vram
# moves as HiDream-I1 (see models/hidream.py), the transformer built from diffusers'
# HiDreamImageTransformer2DModel (its `hidream_transformer_class`) instead of AI Toolkit's own copy.
# condition_noisy_latents moves the VAE to the device and encodes the control image at every training
# step, cached latents or not. The LoRA targets the same blocks (get_transformer_block_names); the UI's
# hidream_e1 defaults leave the image MoE's experts and gate out (ignore_if_contains).
FAMILY = Family(
    name="hidream_e1",
    denoisers=hidream.FAMILY.denoisers,
    text_encoders=hidream.FAMILY.text_encoders,
    classes=dict(hidream.FAMILY.classes),
    lora_blocks=hidream.FAMILY.lora_blocks,
    arch_values=("hidream_e1",),
    name_hints=("hidreame1",),
    quantized_text_encoders=hidream.FAMILY.quantized_text_encoders,
    te_qtype_key=hidream.FAMILY.te_qtype_key,
    text_seq_len=128,  # HidreamE1Model.get_prompt_embeds: max_sequence_length = 128
    tokenizer=hidream.FAMILY.tokenizer,
    load_order=hidream.FAMILY.load_order,
    placement={"vae": Placement(also_in=frozenset({"train"}))},
    low_vram=dict(hidream.FAMILY.low_vram),
)

# HiDreamImageEditingPipeline.__call__'s image_guidance_scale default; HidreamE1Model.generate_single_image
# passes none.
IMAGE_GUIDANCE_SCALE = 2.0


class Recipe(hidream.Recipe):
    """HiDream-I1's prompts and latents; E1's transformer calls with the control latents beside."""

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """One training call (HidreamE1Model.condition_noisy_latents, then get_noise_prediction).

        The control image's latents (drawn here: the VAE's output has the noisy latents' shape, as
        AI Toolkit resizes the control image to the training image's size) are concatenated on the
        channels; get_noise_prediction chunks them back off and concatenates the two along the width,
        without gradients; the prediction is sliced to the noisy half and negated.
        """
        import torch

        with torch.no_grad():
            conditioned = torch.cat([latents, self.inputs.randn(latents.shape)], dim=1)
            model_input = torch.cat(torch.chunk(conditioned, 2, dim=1), dim=-1)
        out = self._transformer(denoiser, model_input, t, cond)
        del model_input, conditioned
        return -1.0 * out[..., :latents.shape[-1]]

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """One preview step of HiDreamImageEditingPipeline.__call__ (AI Toolkit's copy, editing stage):
        the control image's latents along the width of every call; with guidance (> 1) one call on a
        tripled batch, [negative, negative, positive] prompts beside [zeros, image, image] latents, and
        uncond + image_guidance * (image - uncond) + guidance * (full - image)."""
        import torch

        image_latents = self.inputs.randn(latents.shape)  # prepare_image_latents: the control image's
        if guidance_scale <= 1:
            out = self._transformer(denoiser, torch.cat([latents, image_latents], dim=-1), t, cond)
            return -1.0 * out[..., :latents.shape[-1]]
        image_latents = torch.cat([torch.zeros_like(image_latents), image_latents, image_latents])
        model_input = torch.cat([torch.cat([latents] * 3), image_latents], dim=-1)
        del image_latents
        prompts = {key: torch.cat([uncond[key], uncond[key], cond[key]]) for key in cond}
        out = self._transformer(denoiser, model_input, torch.cat([t, t, t]), prompts)
        del model_input
        prediction = -1.0 * out[..., :latents.shape[-1]]
        del out
        uncond_pred, image_pred, full_pred = prediction.chunk(3)
        return uncond_pred + IMAGE_GUIDANCE_SCALE * (image_pred - uncond_pred) + \
            guidance_scale * (full_pred - image_pred)

    def _transformer(self, denoiser, model_input, t, cond):
        """The transformer on a (B, C, H, 2W) input, timesteps on the 0-1000 scale. get_noise_prediction
        sets the config's force_inference_output, so the output comes unpatchified in training too; the
        MoE blocks read their own flag, set when the model was built (false), and train by diffusers'
        training path."""
        from fitfinder.models._common import batched

        _route_evenly(denoiser)
        denoiser.config.force_inference_output = True
        batch, _, height, width = model_input.shape
        tokens = (height // self.patch) * (width // self.patch)
        if height != width and tokens > denoiser.max_seq:
            # HiDreamImageTransformer2DModel.patchify pads a non-square input into max_seq tokens and
            # fails ("expanded size of the tensor") on a longer one; AI Toolkit's HidreamE1Model passes it as is.
            side = self.scale_factor
            raise ValueError(f"HiDream E1: a {height * side}x{width // 2 * side} px image beside its control image "
                             f"is {tokens} tokens, over the transformer's max_seq of {denoiser.max_seq} "
                             "(config max_resolution); AI Toolkit fails there too: use smaller buckets and previews")
        denoiser._fitfinder_grid = (height // self.patch, width // self.patch)  # read by hidream._unpatchify
        cond = batched(cond, batch)
        llama = cond["encoder_hidden_states_llama3"].transpose(0, 1)  # (layers, batch, tokens, width)
        return denoiser(hidden_states=model_input, timesteps=t * 1000, pooled_embeds=cond["pooled_embeds"],
                        encoder_hidden_states_t5=cond["encoder_hidden_states_t5"],
                        encoder_hidden_states_llama3=llama, return_dict=False)[0]


def _route_evenly(denoiser) -> None:
    """Each MoE feed-forward routes its tokens evenly (see hidream._route_evenly for why), by
    diffusers' MOEFeedForwardSwiGLU: its training path while the model trains, moe_infer otherwise;
    the unpatchify takes the grid from Python ints."""
    import types

    if getattr(denoiser, "_fitfinder_even_e1", False):
        return
    for module in denoiser.modules():
        if type(module).__name__ == "MOEFeedForwardSwiGLU":
            module.forward = types.MethodType(_even_moe_forward, module)
    denoiser.unpatchify = types.MethodType(hidream._unpatchify, denoiser)
    denoiser._fitfinder_even_e1 = True


def _even_moe_forward(self, x):
    """diffusers' MOEFeedForwardSwiGLU.forward (models/transformers/transformer_hidream_image.py) with
    each expert given an even share of the token assignments.

    In training (and not `_force_inference_output`) diffusers repeats every token once per active
    expert, fills an empty buffer expert by expert through boolean masks, weights and sums the copies;
    its gate also computes an auxiliary loss that forward drops. Here the masks' rows are taken from
    the sorted assignments as int64 indices (the masks, a byte per assignment, are not made: kilobytes).
    Outside training diffusers runs moe_infer, which hidream._even_moe_forward follows.
    """
    import torch
    import torch.nn.functional as F

    if not self.training or self._force_inference_output:
        return hidream._even_moe_forward(self, x)
    identity, shape, dtype = x, x.shape, x.dtype
    flat = x.view(-1, shape[-1])
    scores = F.linear(flat, self.gate.weight, None).softmax(dim=-1)
    top_weight, top_index = torch.topk(scores, k=self.gate.top_k, dim=-1, sorted=False)
    _auxiliary_loss(self.gate, scores, top_index)
    k, experts = self.num_activated_experts, len(self.experts)
    repeated = flat.repeat_interleave(k, dim=0)
    combined = torch.empty_like(repeated, dtype=dtype)
    order = top_index.view(-1).argsort()
    assignments, start = order.shape[0], 0
    for i, expert in enumerate(self.experts):
        end = start + assignments // experts + (1 if i < assignments % experts else 0)
        rows = order[start:end]
        combined[rows] = expert(repeated[rows]).to(dtype=dtype)
        start = end
    combined = (combined.view(*top_weight.shape, -1) * top_weight.unsqueeze(-1)).sum(dim=1)
    return combined.view(*shape).to(dtype=dtype) + self.shared_experts(identity)


def _auxiliary_loss(gate, scores, top_index) -> None:
    """MoEGate.forward's auxiliary loss in training (alpha > 0, seq_aux off), made and dropped as
    diffusers does: a one-hot of every assignment (int64, here zeros of its shape), its mean, the
    scores' mean."""
    import torch

    if gate.alpha <= 0.0:
        return
    one_hot = torch.zeros(top_index.numel(), gate.n_routed_experts, dtype=torch.int64, device=scores.device)
    fraction = one_hot.float().mean(0) * gate.n_routed_experts
    del one_hot
    loss = (scores.mean(0) * fraction).sum() * gate.alpha
    del loss
