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


PHASES_AFTER_LOAD = frozenset({"text_encoder", "latents", "sample", "train", "last_sample"})
PREVIEWS = frozenset({"sample", "last_sample"})


@dataclass(frozen=True)
class Placement:
    """Where AI Toolkit keeps one part: while the model loads, and in each phase after.

    The default (`SHARED`) is what AI Toolkit's shared code does with a part whose loader says
    nothing: it comes onto the device in full precision and is quantized there
    (toolkit/util/quantize.py `quantize` on a part already moved), it stays there, and after the
    load the device presets place it by its kind (toolkit/stable_diffusion_model.py
    `set_device_state_preset`; SDTrainer `hook_before_train_loop`, see Family.resident_in).
    AI Toolkit commit 27a03a91.
    """

    # While loading. `quantized_on`: "device" (arrives whole in full precision, quantized there) or
    # "host" (quantized in host memory, or a block at a time on the device and back, as
    # toolkit/util/quantize.py quantize_model does: it reaches the device quantized). `after_load`:
    # "stays" on the device once loaded; "waits" in host memory until every later part is loaded,
    # then comes; "waits if quantized" (quantize_model leaves the blocks on the CPU); "leaves" for
    # host memory, to come back only when a phase wants it.
    quantized_on: str = "device"
    after_load: str = "stays"
    # Under `model.layer_offloading`: whether the loader attaches its MemoryManager while the part is
    # still in host memory, before anything moves it onto the device (toolkit/memory_management/
    # manager.py MemoryManager.attach pins each managed layer's weight in host memory there, and the
    # `to` it installs moves the unmanaged modules only): "never" (it comes, then its layers leave),
    # "always", or "if quantized". Such a part's offloaded weights never reach the device; one quantized
    # on the device has its offloaded layers quantized where they are, in host memory.
    offloaded_on_host: str = "never"
    # After load. `also_in`: phases it is on the device in beyond what the presets say (a part the
    # presets do not know is in none of them by the presets). `only_in`: phases outside which it is
    # never on the device (None: no limit). `only_when_active`: of several denoisers, on the device
    # only while it predicts. `follows`: on the device exactly when that part is, while loading too.
    also_in: frozenset = frozenset()
    only_in: frozenset | None = None
    only_when_active: bool = False
    follows: str | None = None
    # Inside a preview, once the preview pipeline has moved the parts: the steps of the preview it is on
    # the device for, of "denoise" (the loop) and "decode" (the VAE), after the prompts are encoded
    # (None: it stays wherever the phase put it). A preview phase still brings it with the others
    # first, as the 'generate' preset does before the pipeline runs.
    in_previews: frozenset | None = None

    def waits(self, quantized: bool) -> bool:
        return self.after_load == "waits" or (self.after_load == "waits if quantized" and quantized)

    def loading(self, part: str, quantized: bool) -> Loading:
        """How the part is loaded: built where it is quantized (a follower in host memory, to come with
        the part it follows), brought onto the device unless it is built in host memory only to stay
        there, then kept, sent back, or sent back to come again once the later parts are loaded (the
        loaders the family's Placement cites: toolkit/stable_diffusion_model.py `load_model`, each
        model's own `load_model`, toolkit/util/quantize.py `quantize_model`)."""
        waits = self.waits(quantized)
        leaves = waits or self.after_load == "leaves"
        built_on_host = self.quantized_on == "host" or self.follows is not None
        comes_on = self.follows is None and not (built_on_host and leaves)
        offloaded_on_host = self.offloaded_on_host == "always" or (self.offloaded_on_host == "if quantized"
                                                                    and quantized)
        return Loading(part, built_on_host, comes_on, leaves, waits, offloaded_on_host)

    def on_device_in(self, phase: str, by_the_presets: bool, active: bool, preview_step: str | None) -> bool:
        """Whether the part is on the device in `phase` by its own rules (a part that follows another
        is where that one is: Family.with_followers): where the presets put it (`by_the_presets`) or
        `also_in` says, unless outside `only_in`, not the `active` denoiser when `only_when_active`,
        or, inside a preview at `preview_step`, not in `in_previews`."""
        if self.follows is not None or (self.only_in is not None and phase not in self.only_in):
            return False
        if self.only_when_active and not active:
            return False
        if preview_step is not None and self.in_previews is not None and preview_step not in self.in_previews:
            return False
        return by_the_presets or phase in self.also_in


@dataclass(frozen=True)
class Loading:
    """How one part is loaded, as its Placement says (Family.load_plan)."""

    part: str
    built_on_host: bool  # built in host memory: quantized there, or waiting for the part it follows
    comes_on: bool  # onto the device once built: whole, to be quantized there, or quantized already
    leaves: bool  # back to host memory once loaded (its layers offloaded first)
    waits: bool  # onto the device again once every later part is loaded
    offloaded_on_host: bool = False  # layer offloading attached before it comes (Placement.offloaded_on_host)


SHARED = Placement()
EVERY_PHASE = Placement(also_in=PHASES_AFTER_LOAD)  # a part no preset moves: where it was loaded


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
    # The LoRA also wraps the Conv2d layers of `lora_blocks`: 1x1 at the LoRA's rank, the others only
    # at `network.conv`'s rank when the job sets one (UNets: toolkit/lora_special.py create_modules,
    # is_conv2d_1x1 and conv_lora_dim).
    lora_convs: bool = False
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
    # Parts beyond the denoisers that `model.quantize` quantizes with `model.qtype` (Anima's text conditioner).
    quantized_with_denoisers: tuple[str, ...] = ()
    # The text encoders of `quantized_text_encoders` follow `model.quantize` instead of `model.quantize_te`
    # (SD3: AI Toolkit's is_v3 loader quantizes T5 whenever it quantizes the transformer).
    te_quantized_with_denoiser: bool = False
    # Parts beside denoisers, encoders and VAE, loaded after the VAE (Wan 2.1 I2V's CLIP vision tower,
    # LTX-2's text connectors, audio VAE and vocoder); where they are is their `placement`.
    others: tuple[str, ...] = ()
    # Part -> attribute paths AI Toolkit sets to None right after loading it (LTX-2's Gemma 3 vision tower).
    dropped: dict = field(default_factory=dict)
    # The order AI Toolkit's loader brings the parts onto the device when it is not `parts`
    # (denoisers, encoders, VAE): HiDream loads and quantizes Llama before the transformer, so the
    # bf16 transformer lands next to an already quantized Llama. Empty: `parts`.
    load_order: tuple[str, ...] = ()
    # Where each part is, while loading and in each phase: part -> Placement, for the parts whose
    # loader or model class departs from AI Toolkit's shared code (`SHARED`), without low_vram (`placement`)
    # and with it (`low_vram`; a part it leaves out is placed as without). Read through `placed`, and
    # interpreted only by `load_plan` / `after_load` (models._pipeline.load) and `resident_in`
    # (probe.recipe.resident), so a rule means the same while loading and in every phase.
    placement: dict = field(default_factory=dict)
    low_vram: dict = field(default_factory=dict)
    # Phases whose computation the family's Recipe changes with low_vram (LTX-2's frame-wise VAE tiles).
    low_vram_in_recipe: frozenset = frozenset()
    # AI Toolkit's loader attaches its MemoryManager under `model.layer_offloading` (the block swap,
    # see models/_offload.py) to the denoiser(s), with layer_offloading_transformer_percent, and the
    # text encoder, with layer_offloading_text_encoder_percent. The loaders of FLUX.1, SDXL, SD3,
    # Chroma, Lumina2 and HiDream I1 (toolkit/stable_diffusion_model.py and theirs) never read it.
    layer_offloading: bool = False
    # A `model.` key that makes the loader turn model.qtype `qfloat8` into torchao's `float8` when set
    # (Z-Image's assistant_lora_path, the training adapter: ZImageModel.load_model).
    float8_with: str | None = None
    # fnmatch patterns of the denoisers' layers the loader keeps in full precision when it quantizes them
    # (the model's get_quantization_exclude_modules, which quantize_model and OstrisModelMixin.quantize_
    # pass to `quantize` as `exclude`; names relative to each denoiser).
    unquantized_layers: tuple[str, ...] = ()
    # The loader quantizes the denoiser(s) through toolkit/util/quantize.py quantize_model, which reads
    # the accuracy-recovery adapter of `qtype: QTYPE|PATH` (FLUX.1's, SDXL's, SD3's loaders quantize
    # otherwise and drop it).
    recovery_adapter: bool = False
    # Parts beyond the text encoders that the loader offloads with the text encoder's percent
    # (Anima's text conditioner: AnimaModel.load_model attaches it with layer_offloading_text_encoder_percent).
    offloaded_with_text_encoders: tuple[str, ...] = ()
    # generate_single_image tiles the preview's VAE decode (diffusers' `vae.enable_tiling()`) under
    # low_vram, or when `model.model_kwargs` sets this key (Wan21.use_vae_tiling: "vae_tiling").
    tiled_preview_decode: bool = False
    tiled_preview_decode_key: str | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        return (*self.denoisers, *self.text_encoders, "vae", *self.others)

    def placed(self, part: str, low_vram: bool) -> Placement:
        """Where `part` is, as this family declares it or AI Toolkit's shared code puts it."""
        declared = self.low_vram if low_vram and part in self.low_vram else self.placement
        return declared.get(part, SHARED)

    def qtype_of(self, part: str, settings: dict) -> str | None:
        """The qtype AI Toolkit's loader gives `part` under a probe request's `settings`, or None
        (see `quantized_denoisers`, `quantized_with_denoisers`, `quantized_text_encoders`)."""
        if part in self.denoisers and self.quantized_denoisers and settings["quantize"]:
            return settings["quant_type"]
        if part in self.quantized_with_denoisers and settings["quantize"]:
            return settings["quant_type"]
        te_switch = settings["quantize"] if self.te_quantized_with_denoiser else settings["quantize_te"]
        if part in self.quantized_text_encoders and te_switch:
            return settings["quant_type_te"]
        return None

    def quantized_on_device(self, settings: dict) -> list[str]:
        """The parts the load brings onto the device whole, in the job's dtype, to quantize them
        there (load_plan): what makes a load peak higher than the quantized model it leaves."""
        quantized = {part for part in self.parts if self.qtype_of(part, settings)}
        return [step.part for step in self.load_plan(settings["low_vram"], quantized)
                if step.part in quantized and step.comes_on and not step.built_on_host]

    def load_plan(self, low_vram: bool, quantized: set[str]) -> list[Loading]:
        """How each part is loaded, in AI Toolkit's load order (`load_order`, else `parts`), by its
        Placement with or without low_vram; `quantized`: the parts the job quantizes."""
        return [self.placed(part, low_vram).loading(part, part in quantized) for part in self.load_order or self.parts]

    def after_load(self, low_vram: bool, quantized: set[str]) -> set[str]:
        """The parts on the device once every part is loaded: those that came and stayed, those that
        waited for the later parts, and the parts that follow them."""
        arrived = {step.part for step in self.load_plan(low_vram, quantized)
                   if (step.comes_on and not step.leaves) or step.waits}
        return self.with_followers(arrived, low_vram)

    def resident_in(self, phase: str, by_the_presets: set[str], low_vram: bool, active: str,
                    preview_step: str | None = None) -> set[str]:
        """The parts on the device during `phase`, from those AI Toolkit's device presets put there
        (`by_the_presets`; probe.recipe._by_the_presets): each part's Placement adds phases
        (`also_in`), bounds them (`only_in`), keeps one of several denoisers (`only_when_active`:
        `active`), ties a part to another (`follows`), or, inside a preview at `preview_step`
        ("denoise" or "decode"), keeps it to the steps its preview pipeline has it on the device
        for (`in_previews`), with low_vram or without as the family declares."""
        wanted = {part for part in self.parts if self.placed(part, low_vram).on_device_in(
            phase, part in by_the_presets, part == active, preview_step)}
        return self.with_followers(wanted, low_vram)

    def with_followers(self, parts: set[str], low_vram: bool) -> set[str]:
        """`parts` and every part that follows one of them (Placement.follows)."""
        return set(parts) | {part for part in self.parts if self.placed(part, low_vram).follows in parts}

    @property
    def low_vram_moves(self) -> frozenset:
        """The phases whose peak `model.low_vram` can change for this family: the load where a part
        is loaded or quantized elsewhere with it, the phases where a part is placed otherwise, the
        previews where a preview pipeline moves a part otherwise or tiles the decode, and the recipe's
        own (space.py's low_vram knob claims exactly these)."""
        moved = set(self.low_vram_in_recipe) | (PREVIEWS if self.tiled_preview_decode else set())
        for part in self.parts:
            plain, low = self.placed(part, False), self.placed(part, True)
            if (plain.quantized_on, plain.after_load, plain.offloaded_on_host) != \
                    (low.quantized_on, low.after_load, low.offloaded_on_host):
                moved.add("load")
            moved |= plain.also_in ^ low.also_in
            if plain.only_in != low.only_in:
                moved |= (PHASES_AFTER_LOAD - (plain.only_in or PHASES_AFTER_LOAD)) | \
                         (PHASES_AFTER_LOAD - (low.only_in or PHASES_AFTER_LOAD))
            if (plain.only_when_active, plain.follows) != (low.only_when_active, low.follows):
                moved |= PHASES_AFTER_LOAD
            if plain.in_previews != low.in_previews:
                moved |= PREVIEWS
        return frozenset(moved)

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

    def tiles_preview_decode(self, job) -> bool:
        """Whether the job's previews decode with the VAE tiled (`tiled_preview_decode`)."""
        if not self.tiled_preview_decode:
            return False
        kwargs = job.get("model.model_kwargs", None) or {}
        return bool(job.get("model.low_vram")) or bool(self.tiled_preview_decode_key
                                                        and kwargs.get(self.tiled_preview_decode_key))

    def recipe(self, arch: dict, inputs):
        """The family's computation (imports torch): its module's `Recipe(arch, inputs)`."""
        return importlib.import_module(f"fitfinder.models.{self.name}").Recipe(arch, inputs)
