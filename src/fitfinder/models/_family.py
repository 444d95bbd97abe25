"""What a family module declares (no torch): its parts, names, placement, and where its recipe is.

A family module (`models/NAME.py`, public name, no leading underscore) holds two things:

    FAMILY = Family(name="NAME", ...)   # this declaration: data, importable without torch
    class Recipe:                        # what it computes, built by probe children only;
        ...                              # its methods import torch (see models/flux.py)

The registry in `models/__init__.py` finds every such module; nothing else names a family.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from fitfinder.errors import UserError


@dataclass(frozen=True)
class Family:
    """The parts of one kind of pipeline, by diffusers folder name, and how AI Toolkit treats them."""

    name: str  # the family's key: its module's name and the `family` of its archs/*.json
    denoisers: tuple[str, ...]  # the parts that train, in AI Toolkit's load order
    text_encoders: tuple[str, ...]
    classes: dict[str, str]  # part -> "library.ClassName" (diffusers or transformers), the VAE included
    lora_blocks: str  # regex of the module names whose Linear layers the LoRA trains
    # How a job names this family, as AI Toolkit resolves it: `model.arch` values (the part
    # before a ':' as in 'wan21:14b'; the first is what tests write), `model.is_*` flags, and
    # substrings of a compacted lowercase model name (the longest match among all families wins).
    arch_values: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    name_hints: tuple[str, ...] = ()
    # Video: the datasets' num_frames and sample.num_frames are knobs; clips are frame_step*k+1 long.
    video: bool = False
    frame_step: int = 4
    # What AI Toolkit's loader quantizes: `model.quantize` the denoiser(s) unless it never does;
    # `model.quantize_te` these encoders, with the qtype read from `model.<te_qtype_key>`.
    quantized_denoisers: bool = True
    quantized_text_encoders: tuple[str, ...] = ()
    te_qtype_key: str = "qtype"
    # Prompt length of the long-prompt encoder when a diffusers folder's tokenizer does not say,
    # and that tokenizer's folder (None: CLIP only, 77).
    text_seq_len: int = 512
    tokenizer: str | None = None
    # Keys a diffusers folder's model_index.json lends the arch, with their defaults (Wan 2.2's boundary).
    index_defaults: dict = field(default_factory=dict)
    # Denoiser -> `model.model_kwargs` key that turns its training off (Wan 2.2's two experts).
    expert_switches: dict = field(default_factory=dict)
    # The VAE stays on the device through training although latents are cached: the family encodes
    # a conditioning image at every step (Kontext's reference, Flex.2's control).
    vae_in_train: bool = False
    # The text encoders of `quantized_text_encoders` follow `model.quantize` instead of `model.quantize_te`
    # (SD3: AI Toolkit's is_v3 loader quantizes T5 whenever it quantizes the transformer).
    te_quantized_with_denoiser: bool = False
    # Parts that encode each training sample's conditioning for the denoiser (Wan 2.1 I2V's CLIP
    # vision tower), loaded after the VAE, never quantized, never unloaded: AI Toolkit's device
    # presets leave them where they are (see probe.resident).
    conditioners: tuple[str, ...] = ()
    # Parts beside denoisers, encoders and VAE, each -> the part whose device placement it follows
    # (LTX-2's text connectors, audio VAE and vocoder go where its transformer goes).
    companions: dict = field(default_factory=dict)
    # Part -> attribute paths AI Toolkit sets to None right after loading it (LTX-2's Gemma 3 vision tower).
    dropped: dict = field(default_factory=dict)
    # The order AI Toolkit's loader brings the parts onto the device when it is not `parts`
    # (denoisers, encoders, VAE): HiDream loads and quantizes Llama before the transformer, so the
    # bf16 transformer lands next to an already quantized Llama. Empty: `parts`.
    load_order: tuple[str, ...] = ()
    # Where AI Toolkit's loader quantizes a part, "host" or "device", when that does not follow
    # low_vram (host with it, device without): FLUX.2 and Z-Image quantize their transformer in host
    # memory always (quantize_model, OstrisModelMixin.quantize_: a block at a time on the device, back
    # to the CPU) and FLUX.2 its Mistral on the device always, in bf16 there first, then parks it on
    # the CPU under low_vram.
    quantized_on: dict = field(default_factory=dict)
    # Parts that stay on the device once loaded, low_vram or not (Qwen-Image's Qwen2.5-VL: loaded and
    # quantized on the device, where AI Toolkit leaves it).
    kept_on_device: tuple[str, ...] = ()
    # AI Toolkit's loader attaches its MemoryManager under `model.layer_offloading` (the block swap,
    # see models/_offload.py) to the denoiser(s), with layer_offloading_transformer_percent, and the
    # text encoder, with layer_offloading_text_encoder_percent. The loaders of FLUX.1, SDXL, SD3,
    # Chroma, Lumina2 and HiDream I1 (toolkit/stable_diffusion_model.py and theirs) never read it.
    layer_offloading: bool = False

    @property
    def parts(self) -> tuple[str, ...]:
        return (*self.denoisers, *self.text_encoders, "vae", *self.conditioners, *self.companions)

    def frame_ladder(self, desired: int) -> list[int]:
        """Clip lengths of the frame_step*k+1 form, halving k: 81 -> 41, 21, 9(k=2), 5, 1 for step 4."""
        values, k = [desired], (desired - 1) // self.frame_step
        while k > 0:
            k //= 2
            values.append(self.frame_step * k + 1)
        return sorted(set(values))

    def trained_denoisers(self, job) -> list[str]:
        """The denoisers that get a LoRA: all, but those whose `expert_switches` key is false."""
        kwargs = job.get("model.model_kwargs", None) or {}
        trained = [name for name in self.denoisers if kwargs.get(self.expert_switches.get(name, ""), True) is not False]
        if not trained:
            keys = " and ".join(self.expert_switches.values())
            raise UserError(f"{job.source}: config.process[0].model.model_kwargs: {keys} are both false; "
                            "nothing would be trained")
        return trained

    def recipe(self, arch: dict, inputs):
        """The family's computation (imports torch): its module's `Recipe(arch, inputs)`."""
        return importlib.import_module(f"fitfinder.models.{self.name}").Recipe(arch, inputs)
