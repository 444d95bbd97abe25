"""Anima (circlestone-labs, Cosmos-Predict2 2B fine-tune): Qwen3 0.6B's last hidden states, mapped by
the text conditioner (an LLM adapter that cross-attends from T5 token embeddings to them) into the
Cosmos DiT's cross-attention; the Qwen-Image VAE run on single frames, latents normalized per
channel; flow matching; true CFG (a second transformer call) in previews.

AI Toolkit: extensions_built_in/diffusion_models/anima/anima.py (AnimaModel; commit 27a03a91), which
loads diffusers' modular Anima pipeline (AnimaAutoBlocks().init_pipeline, diffusers.modular_pipelines.anima).
"""

from __future__ import annotations

import contextlib

from fitfinder.errors import UserError
from fitfinder.models._family import Family, Placement
from fitfinder.models.qwen_image import Recipe as QwenImageRecipe


class _AnimaFamily(Family):
    """Anima's declaration, refusing `model_kwargs.train_text_conditioner` (see trained_denoisers)."""

    def trained_denoisers(self, job) -> list[str]:
        """AnimaModel.__init__: `train_text_conditioner` adds the conditioner to the LoRA's targets
        (target_lora_modules, get_transformer_block_names). fitfinder probes the conditioner frozen, so
        a job that trains it is refused rather than estimated short."""
        kwargs = job.get("model.model_kwargs", None) or {}
        if kwargs.get("train_text_conditioner", False):
            raise UserError(f"{job.source}: config.process[0].model.model_kwargs.train_text_conditioner: "
                            "fitfinder does not probe a LoRA on Anima's text conditioner yet; remove it "
                            "to probe the transformer's LoRA")
        return super().trained_denoisers(job)


# LoRA targets: AnimaModel sets target_lora_modules ["CosmosTransformer3DModel"] and
# get_transformer_block_names ["transformer_blocks"]; transformer_only (the default) keeps the Linear
# layers of the 28 blocks (toolkit/lora_special.py, LoRASpecialNetwork.create_modules).
# Quantization (AnimaModel.load_model): with model.quantize, the transformer by quantize_model
# (toolkit/util/quantize.py: a block at a time on the device, back to the CPU) and the text conditioner
# in host memory, both with model.qtype; with model.quantize_te, Qwen3 on the device with model.qtype_te.
# Block swap: MemoryManager.attach on the transformer (after quantize_model), on Qwen3 and on the
# conditioner (after it is quantized), those two with the text encoder's percent, each while it is in
# host memory: before `.to(device)`, and for Qwen3 before `quantize` (offloaded_on_host).
FAMILY = _AnimaFamily(
    name="anima",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={"transformer": "diffusers.CosmosTransformer3DModel", "text_encoder": "transformers.Qwen3Model",
             "vae": "diffusers.AutoencoderKLQwenImage", "text_conditioner": "diffusers.AnimaTextConditioner"},
    lora_blocks=r"transformer_blocks\.\d+\..*",
    arch_values=("anima",),
    name_hints=("animabase",),  # not "anima": SDXL fine-tunes are named Animagine
    quantized_text_encoders=("text_encoder",),
    te_qtype_key="qtype_te",
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    text_seq_len=512,  # AnimaModel.max_sequence_length (model_kwargs.max_sequence_length, 512)
    tokenizer="tokenizer",
    others=("text_conditioner",),
    quantized_with_denoisers=("text_conditioner",),
    # AnimaModel.load_model: every part is loaded in host memory (pipe.load_components); the transformer
    # (quantized there) and the conditioner go to the device before Qwen3 comes in bf16 and is quantized
    # on it. AnimaTrainableModel holds both as the model the device presets move (the 'unet'), so the
    # conditioner is wherever the transformer is. With low_vram both stay on the CPU (BaseSDTrainProcess.run
    # then moves the model), Qwen3 goes back to the CPU once loaded and after every encoding
    # (get_prompt_embeds: _offload_text_encoder), and the VAE after every encoding and every preview
    # (encode_images, generate_single_image).
    placement={"transformer": Placement(quantized_on="host", offloaded_on_host="always"),
               "text_encoder": Placement(offloaded_on_host="always"),
               "text_conditioner": Placement(follows="transformer", offloaded_on_host="always")},
    low_vram={"transformer": Placement(quantized_on="host", after_load="waits", offloaded_on_host="always"),
              "text_encoder": Placement(after_load="leaves", only_in=frozenset({"text_encoder"}),
                                        offloaded_on_host="always"),
              "vae": Placement(only_in=frozenset({"latents", "sample", "last_sample"}))},
    offloaded_with_text_encoders=("text_conditioner",),
)

# AnimaTextConditioner's target_vocab_size default: the T5 tokenizer's ids it embeds.
T5_VOCAB = 32128


class Recipe(QwenImageRecipe):
    """What Anima computes; built by probe children (its methods import torch). The latents are
    Qwen-Image's (AnimaModel.encode_images and decode_latents do what QwenImageModel's do, unpacked).

    `pipeline` (set by the Pipeline that builds it) lends the text conditioner.
    """

    def __init__(self, arch: dict, inputs):
        super().__init__(arch, inputs)
        self.pipeline = None
        self.divisor = 32  # AnimaModel.get_bucket_divisibility: 16 * 2
        self.t5_vocab = int(arch["parts"].get("text_conditioner", {}).get("target_vocab_size", T5_VOCAB))
        _resize_without_torchvision()

    # -- prompts ----------------------------------------------------------------------------------
    def encode_prompts(self, parts, batch) -> dict:
        """AnimaModel.get_prompt_embeds: the prompt (no template) through Qwen3Model, its last hidden
        state masked, and the same prompt's T5 token ids, both padded to the longest prompt and cut at
        512: the probe takes 512 of each, the longest caption a job can have."""
        import torch

        qwen = parts["text_encoder"]
        ids = self._prompt_ids(qwen.config, batch, self.inputs.text_seq_len)
        mask = torch.ones_like(ids)
        # All ones, as the longest prompt's mask is: transformers then lets SDPA's is_causal stand for the
        # causal mask. Without a mask that holds under FakeTensorMode too (see _unpacked_positions).
        with _unpacked_positions():
            hidden = qwen(input_ids=ids, output_hidden_states=False).last_hidden_state
        embeds = hidden.to(self.inputs.dtype) * mask.to(self.inputs.dtype).unsqueeze(-1)
        del hidden
        t5_ids = torch.randint(2, self.t5_vocab, (batch, self.inputs.text_seq_len), generator=self.inputs.generator,
                               device=self.inputs.device)
        t5_ids[:, -1] = 1  # </s>
        return {"qwen_embeds": embeds, "qwen_mask": mask, "t5_ids": t5_ids, "t5_mask": torch.ones_like(t5_ids)}

    def _conditioned(self, cond: dict, batch: int):
        """AnimaModel._condition_prompt_embeds: the text conditioner maps Qwen3's states onto the T5
        tokens (and pads them to its min_sequence_length, 512), in every prediction."""
        from fitfinder.models._common import batched

        cond = batched(cond, batch)
        return self.pipeline.parts["text_conditioner"](
            source_hidden_states=cond["qwen_embeds"].to(self.inputs.dtype), target_input_ids=cond["t5_ids"],
            target_attention_mask=cond["t5_mask"], source_attention_mask=cond["qwen_mask"])

    # -- the transformer --------------------------------------------------------------------------
    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """AnimaModel.get_noise_prediction: one frame of latents, the noise level as the timestep, the
        conditioned prompt, and a zero padding mask of 16x the latent size (the transformer resizes it to
        the latents and concatenates it as a channel); no guidance embedding."""
        return self._call(denoiser, latents, t, cond, mask_scale=16)

    def _preview_call(self, denoiser, latents, t, cond):
        """AnimaLoopDenoiser: the padding mask at the image's pixel size (AnimaPrepareLatentsStep)."""
        return self._call(denoiser, latents, t, cond, mask_scale=self.scale_factor)

    def _call(self, denoiser, latents, t, cond, mask_scale: int):
        """One transformer call on one frame, with a zero padding mask `mask_scale` times the latents' size."""
        embeds = self._conditioned(cond, latents.shape[0])
        height, width = latents.shape[-2:]
        padding_mask = latents.new_zeros(1, 1, height * mask_scale, width * mask_scale, dtype=self.inputs.dtype)
        out = denoiser(hidden_states=latents.unsqueeze(2).to(self.inputs.dtype), timestep=t.to(self.inputs.dtype),
                       encoder_hidden_states=embeds, padding_mask=padding_mask, return_dict=False)[0]
        del embeds
        return out.squeeze(2)

    @staticmethod
    def without_gradient(denoiser) -> list:
        """Every LoRA layer of the Cosmos blocks feeds the output (Qwen-Image's dead text stream is not here)."""
        return []

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """AnimaModel.generate_single_image sets the pipeline's ClassifierFreeGuidance to the job's
        guidance_scale and passes the negative prompt: the guider runs the negative as a second call
        (not a doubled batch) unless the scale is 1, then uncond + scale * (cond - uncond)."""
        import math

        prediction = self._preview_call(denoiser, latents, t, cond)
        if math.isclose(guidance_scale, 1.0):
            return prediction
        unconditional = self._preview_call(denoiser, latents, t, uncond)
        return unconditional + guidance_scale * (prediction - unconditional)


@contextlib.contextmanager
def _unpacked_positions():
    """Qwen3Model's positions 0..L-1 are one sequence, which transformers finds by reading them
    (masking_utils.find_packed_sequence_indices) before it skips the causal mask. Under FakeTensorMode
    it cannot read them, assumes packed sequences and builds a [B, 1, L, L] mask that the GPU never
    holds: measured on the tiny arch, the estimate's text_encoder peak was that mask (1,024 bytes)
    above the sim meter's. The probe's positions are never packed, so the answer real tensors give is
    given for them: no packing. transformers 5.24."""
    from transformers import masking_utils

    found = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def _resize_without_torchvision() -> None:
    """CosmosTransformer3DModel.forward resizes the padding mask with torchvision
    (`transforms.functional.resize`, NEAREST), which diffusers imports only when torchvision is
    installed; AI Toolkit's environment has it, fitfinder's need not. The stand-in does what
    torchvision's tensor resize does for a bf16 mask: a float32 copy, torch's nearest interpolation,
    the result cast back (torchvision.transforms._functional_tensor.resize, _cast_squeeze_in/_out)."""
    from types import SimpleNamespace

    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return

    def resize(image, size, interpolation="nearest"):
        import torch

        wide = image if image.dtype in (torch.float32, torch.float64) else image.to(torch.float32)
        resized = torch.nn.functional.interpolate(wide, size=list(size), mode="nearest")
        del wide
        return resized.to(image.dtype)

    transformer_cosmos.transforms = SimpleNamespace(
        functional=SimpleNamespace(resize=resize), InterpolationMode=SimpleNamespace(NEAREST="nearest"))
