"""kohya musubi-tuner: its scripts, their parsers' defaults, their knobs, their recipes (kohya-ss/musubi-tuner).

What is read here is public source (kohya-ss/musubi-tuner, commit 30c658c4, 2026-06-24), cited by
file and line or function beside each rule; docs/trainers.md gathers the rules in tables.

Scripts, each a `Script` below: `qwen_image_train_network.py` (Qwen-Image and its edit versions by
--model_version), `wan_train_network.py` (Wan 2.1 and 2.2 by --task, t2v and i2v, 2.2's two experts
with --dit_high_noise), `flux_kontext_train_network.py`, `zimage_train_network.py` and
`flux_2_train_network.py`. Each trains in NetworkTrainer.train (training/trainer_base.py) after its
two caching scripts: separate processes run before training, each with one model on the card, so each
is a phase of its own (text_encoder, latents).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from fitfinder.errors import UserError
from fitfinder.trainers import _kohya
from fitfinder.trainers import _musubi_options as parsers
from fitfinder.trainers._knob import KnobSpec
from fitfinder.trainers._kohya import INT, LIST, KohyaJob, Option

REPO = "musubi-tuner"
# training/trainer_base.py get_optimizer: an empty optimizer_type matches no optimizer (getattr(torch.optim, "")).
DEFAULT_OPTIMIZER = None


def PREVIEW_DEFAULT(job) -> tuple[int, int]:  # noqa: N802 - a trainer's constant, by the job's script
    """A preview prompt's size where it gives no --w / --h (trainer_base.py sample_image_inference: 256x256)."""
    previews = job.script.previews(str(job.get("task")))
    return previews.width, previews.height

QWEN_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.QWEN_IMAGE}
WAN_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.WAN}
KONTEXT_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.FLUX_KONTEXT}
ZIMAGE_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.ZIMAGE}
FLUX_2_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.FLUX_2}
# The video dataset's keys fitfinder reads (dataset/config_utils.py VideoDatasetParams).
VIDEO_KEYS = {"target_frames": Option(LIST, [1], "src/musubi_tuner/dataset/config_utils.py:68"),
              "max_frames": Option(INT, 129, "src/musubi_tuner/dataset/config_utils.py:72")}


@dataclass(frozen=True)
class Previews:
    """A preview's defaults where a prompt gives none (trainer_base.py sample_image_inference: 256x256,
    one frame, 20 steps; the guidance's default is the architecture's), and the prompt's key for it."""

    guidance: float
    guidance_key: str = "l"
    width: int = 256
    height: int = 256
    steps: int = 20


@dataclass(frozen=True)
class Script:
    name: str
    options: dict[str, Option]
    model: Callable[[KohyaJob], tuple[str, str]]  # the job -> (family, shipped architecture)
    text_cache: tuple[str, dict[str, Option]]  # the text encoders' caching script and its options
    latent_cache: tuple[str, dict[str, Option]]  # the latents' caching script and its options
    text_fp8: str  # the caching script's (and the training script's) fp8 switch for its text encoder
    scaled: tuple[tuple[str, ...], tuple[str, ...]]  # --fp8_scaled: (targets, excluded) module names
    swap: Callable[[dict, int], dict[str, int]]  # (arch, n) -> block list: how many of its last blocks
    most_swapped: Callable[[dict], int]
    previews: Callable[[str], Previews]  # the --task (Wan's) -> its previews' defaults
    lora_ignore: tuple[str, ...] = ()
    checkpoint: str = "dit"
    vae_dtype: str = "bf16"  # the VAE's dtype where --vae_dtype gives none
    network_module: str = ""  # its LoRA (networks/lora_NAME.py)
    model_files: tuple[tuple[str, str, str], ...] = ()  # (option, environment variable, what file) a new job names

    @property
    def cache_scripts(self) -> dict[str, dict[str, Option]]:
        return dict([self.text_cache, self.latent_cache])


def _cache(name: str, own: dict[str, Option], common: dict[str, Option]) -> tuple[str, dict[str, Option]]:
    return name, {**common, **own}


def _text_cache(stem: str, own: dict[str, Option]) -> tuple[str, dict[str, Option]]:
    return _cache(f"{stem}_cache_text_encoder_outputs.py", own, parsers.CACHE_TEXT)


def _latent_cache(stem: str, own: dict[str, Option] | None = None) -> tuple[str, dict[str, Option]]:
    return _cache(f"{stem}_cache_latents.py", own or {}, parsers.CACHE_LATENTS)


# -- the models each script trains ------------------------------------------------------------------------
def qwen_version(job: KohyaJob) -> str:
    """qwen_image_utils.resolve_model_version_args: --model_version, else --edit_plus, --edit, original."""
    value = job.get("model_version")
    return str(value).lower() if value else "edit-2509" if job.get("edit_plus") else "edit" if job.get("edit") \
        else "original"


# --model_version -> fitfinder's family and architecture (edit-2511 is 2509's architecture, trained alike)
_QWEN_MODELS = {"original": ("qwen_image", "qwen-image"), "edit": ("qwen_image_edit", "qwen-image-edit"),
                "edit-2509": ("qwen_image_edit_plus", "qwen-image-edit-2509"),
                "edit-2511": ("qwen_image_edit_plus", "qwen-image-edit-2509")}


def _qwen_model(job: KohyaJob) -> tuple[str, str]:
    version = qwen_version(job)
    if version not in _QWEN_MODELS:
        raise UserError(f"{job.source}: --model_version {version}: fitfinder follows Qwen-Image's original, edit, "
                        "edit-2509 and edit-2511 training; layered is to come")
    return _QWEN_MODELS[version]


# --task (wan/configs/__init__.py WAN_CONFIGS) -> family and architecture; t2i trains Wan 2.1's T2V model on
# images, flf2v its I2V model with a last frame (its second CLIP image is not modelled: see check).
_WAN_MODELS = {"t2v-1.3B": ("wan21", "wan21-1.3b"), "t2v-14B": ("wan21", "wan21-14b"),
               "t2i-14B": ("wan21", "wan21-14b"), "i2v-14B": ("wan21_i2v", "wan21-i2v-14b"),
               "flf2v-14B": ("wan21_i2v", "wan21-i2v-14b"), "t2v-A14B": ("wan22", "wan22-14b"),
               "i2v-A14B": ("wan22_i2v", "wan22-i2v-14b")}


def _wan_model(job: KohyaJob) -> tuple[str, str]:
    task = str(job.get("task"))
    if task not in _WAN_MODELS:
        known = ", ".join(_WAN_MODELS)
        raise UserError(f"{job.source}: --task {task}: fitfinder follows Wan's tasks {known} (the Fun-Control ones "
                        "are to come)")
    return _WAN_MODELS[task]


def _fixed(family: str, arch: str) -> Callable[[KohyaJob], tuple[str, str]]:
    return lambda job: (family, arch)


def _flux_2_model(job: KohyaJob) -> tuple[str, str]:
    """flux2_utils.FLUX2_MODEL_INFO: dev, or a Klein (4B, 9B), by --model_version."""
    version = str(job.get("model_version") or "dev")
    found = {"dev": ("flux2", "flux2-dev"), "klein-4b": ("flux2_klein", "flux2-klein-4b"),
             "klein-9b": ("flux2_klein", "flux2-klein-9b")}.get(version)
    if found is None:
        raise UserError(f"{job.source}: --model_version {version}: fitfinder follows FLUX.2 dev, klein-4b and klein-9b")
    return found


# -- block swap: the last n blocks of a list keep their Linear weights in host memory ----------------------
def _one_list(attribute: str) -> Callable[[dict, int], dict[str, int]]:
    return lambda arch, n: {attribute: n} if n else {}


def _blocks_less(key: str, default: int, fewer: int) -> Callable[[dict], int]:
    return lambda arch: int(arch["parts"]["transformer"].get(key, default)) - fewer


def _kontext_swap(arch: dict, n: int) -> dict[str, int]:
    """flux/flux_models.py Flux.enable_block_swap: n//2 double blocks and (n - n//2)*2 + 1 single ones."""
    return {"transformer_blocks": n // 2, "single_transformer_blocks": (n - n // 2) * 2 + 1} if n else {}


def _kontext_most(arch: dict) -> int:
    transformer = arch["parts"]["transformer"]
    double, single = int(transformer.get("num_layers", 19)), int(transformer.get("num_single_layers", 38))
    return max((n for n in range(1, double + single) if n // 2 <= double - 2 and (n - n // 2) * 2 + 1 <= single - 2),
               default=0)


def _flux_2_split(arch: dict, n: int) -> tuple[int, int]:
    """flux_2/flux2_models.py Flux2.enable_block_swap: n split by the single/double ratio, a double
    block counting two, within two fewer than each list has."""
    transformer = arch["parts"]["transformer"]
    double, single = int(transformer.get("num_layers", 8)), int(transformer.get("num_single_layers", 48))
    if n <= 0:
        return 0, 0
    if double == 0:
        return 0, n
    if single == 0:
        return n, 0
    ratio = single / double
    doubles = int(round(n / (1.0 + ratio / 2.0)))
    singles = int(round(doubles * ratio))
    if double * 2 < single:
        while doubles >= 1 and doubles > double - 2:
            doubles, singles = doubles - 1, singles + 2
    else:
        while singles >= 2 and singles > single - 2:
            doubles, singles = doubles + 1, singles - 2
    return doubles, singles


def _flux_2_swap(arch: dict, n: int) -> dict[str, int]:
    doubles, singles = _flux_2_split(arch, n)
    return {"transformer_blocks": doubles, "single_transformer_blocks": singles} if n else {}


def _flux_2_most(arch: dict) -> int:
    transformer = arch["parts"]["transformer"]
    double, single = int(transformer.get("num_layers", 8)), int(transformer.get("num_single_layers", 48))
    fits = [n for n in range(1, double + single + 1)
            if (lambda d, s: d <= double - 2 and s <= single - 2)(*_flux_2_split(arch, n))]
    return max(fits, default=0)


# -- the scripts ------------------------------------------------------------------------------------------
def _wan_previews(task: str) -> Previews:
    """wan_train_network.py do_inference: cfg_scale the task's sample_guide_scale[0] (wan/configs:
    5.0 for Wan 2.1, 3.0 and 3.5 for 2.2's low-noise model), two DiT calls a step."""
    return Previews({"t2v-A14B": 3.0, "i2v-A14B": 3.5}.get(task, 5.0))




SCRIPTS = {
    "qwen_image_train_network.py": Script(
        "qwen_image_train_network.py", QWEN_OPTIONS, _qwen_model,
        _text_cache("qwen_image", {**parsers.QWEN_IMAGE_CACHE_TEXT, **parsers.QWEN_IMAGE_VERSION}),
        _latent_cache("qwen_image", {**parsers.HV_CACHE_LATENTS, **parsers.QWEN_IMAGE_VERSION}), "fp8_vl",
        # qwen_image_model.py FP8_OPTIMIZATION_TARGET_KEYS / EXCLUDE_KEYS
        scaled=(("transformer_blocks",), ("norm", "time_text_embed")),
        # QwenImageTransformer2DModel.enable_block_swap: at most one block fewer than the model has
        swap=_one_list("transformer_blocks"), most_swapped=_blocks_less("num_layers", 60, 1),
        # QwenImageNetworkTrainer.do_inference: cfg_scale 4.0 unless --l, a second call
        previews=lambda task: Previews(4.0),
        # lora_qwen_image.create_arch_network: modulation layers (`_mod_`) are left out of the LoRA
        lora_ignore=("img_mod", "txt_mod"), network_module="networks.lora_qwen_image",
        model_files=(("dit", "QWEN_DIT", "qwen_image_bf16.safetensors"), ("vae", "QWEN_VAE", "the Qwen-Image VAE"),
                     ("text_encoder", "QWEN_VL", "qwen_2.5_vl_7b.safetensors"))),
    "wan_train_network.py": Script(
        "wan_train_network.py", WAN_OPTIONS, _wan_model,
        _text_cache("wan", parsers.WAN_CACHE_TEXT), _latent_cache("wan", parsers.WAN_CACHE_LATENTS), "fp8_t5",
        # wan/modules/model.py FP8_OPTIMIZATION_TARGET_KEYS ["blocks"], EXCLUDE_KEYS (norm, embeddings, head)
        scaled=(("blocks",), ("norm",)),
        # WanModel.enable_block_swap: at most one block fewer than the model has
        swap=_one_list("blocks"), most_swapped=_blocks_less("num_layers", 40, 1), previews=_wan_previews,
        vae_dtype="fp16",  # trainer_base.py _prepare_accelerator_and_dtypes: float16 unless --vae_dtype
        network_module="networks.lora_wan",
        model_files=(("dit", "WAN_DIT", "the Wan DiT .safetensors (low-noise one for Wan 2.2)"),
                     ("dit_high_noise", "WAN_DIT_HIGH_NOISE", "the Wan 2.2 high-noise DiT .safetensors"),
                     ("vae", "WAN_VAE", "Wan2.1_VAE.pth"), ("t5", "WAN_T5", "models_t5_umt5-xxl-enc-bf16.pth"),
                     ("clip", "WAN_CLIP", "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"))),
    "flux_kontext_train_network.py": Script(
        "flux_kontext_train_network.py", KONTEXT_OPTIONS, _fixed("flux_kontext", "flux-kontext-dev"),
        _text_cache("flux_kontext", parsers.FLUX_KONTEXT_CACHE_TEXT),
        _latent_cache("flux_kontext", parsers.HV_CACHE_LATENTS), "fp8_t5",
        # flux/flux_models.py: the double and single blocks, norms excepted
        scaled=(("transformer_blocks",), ("norm",)), swap=_kontext_swap, most_swapped=_kontext_most,
        previews=lambda task: Previews(2.5, guidance_key="g"),  # FLUX.1 Kontext's embedded guidance
        network_module="networks.lora_flux",
        model_files=(("dit", "KONTEXT_DIT", "flux1-kontext-dev.safetensors"), ("vae", "AE", "ae.safetensors"),
                     ("text_encoder1", "T5XXL", "t5xxl_fp16.safetensors"),
                     ("text_encoder2", "CLIP_L", "clip_l.safetensors"))),
    "zimage_train_network.py": Script(
        "zimage_train_network.py", ZIMAGE_OPTIONS, _fixed("zimage", "zimage-turbo"),
        _text_cache("zimage", parsers.ZIMAGE_CACHE_TEXT), _latent_cache("zimage"), "fp8_llm",
        # zimage/zimage_model.py FP8_OPTIMIZATION_TARGET_KEYS / EXCLUDE_KEYS
        scaled=(("layers.", "noise_refiner.", "context_refiner."), ("_modulation", ".norm_", "_norm")),
        # ZImageTransformer.enable_block_swap: at most two fewer than its layers
        swap=_one_list("layers"), most_swapped=_blocks_less("n_layers", 30, 2), previews=lambda task: Previews(1.0),
        network_module="networks.lora_zimage",
        model_files=(("dit", "ZIMAGE_DIT", "the Z-Image DiT .safetensors"), ("vae", "AE", "ae.safetensors"),
                     ("text_encoder", "QWEN3", "the Qwen3 text encoder .safetensors"))),
    "flux_2_train_network.py": Script(
        "flux_2_train_network.py", FLUX_2_OPTIONS, _flux_2_model,
        _text_cache("flux_2", {**parsers.FLUX_2_CACHE_TEXT, **parsers.FLUX_2_VERSION}),
        _latent_cache("flux_2", parsers.FLUX_2_VERSION), "fp8_text_encoder",
        # flux_2/flux2_models.py FP8_OPTIMIZATION_TARGET_KEYS / EXCLUDE_KEYS
        scaled=(("transformer_blocks",), ("norm", "_modulation")), swap=_flux_2_swap, most_swapped=_flux_2_most,
        previews=lambda task: Previews(4.0, guidance_key="g"), network_module="networks.lora_flux_2",
        model_files=(("dit", "FLUX2_DIT", "the FLUX.2 DiT .safetensors"), ("vae", "FLUX2_VAE", "the FLUX.2 VAE"),
                     ("text_encoder", "FLUX2_TEXT_ENCODER", "the FLUX.2 text encoder .safetensors"))),
}
# The script each model family trains with, and the options that name the model to it.
FAMILIES = {"qwen_image": ("qwen_image_train_network.py", {}),
            "qwen_image_edit": ("qwen_image_train_network.py", {"model_version": "edit"}),
            "qwen_image_edit_plus": ("qwen_image_train_network.py", {"model_version": "edit-2509"}),
            "wan21": ("wan_train_network.py", {"task": "t2v-14B"}),
            "wan21_i2v": ("wan_train_network.py", {"task": "i2v-14B"}),
            "wan22": ("wan_train_network.py", {"task": "t2v-A14B"}),
            "wan22_i2v": ("wan_train_network.py", {"task": "i2v-A14B"}),
            "flux_kontext": ("flux_kontext_train_network.py", {}), "zimage": ("zimage_train_network.py", {}),
            "flux2": ("flux_2_train_network.py", {"model_version": "dev"}),
            "flux2_klein": ("flux_2_train_network.py", {"model_version": "klein-9b"})}
TO_COME = ("hv_train_network.py", "hv_1_5_train_network.py", "fpack_train_network.py", "qwen_image_train.py",
           "hidream_o1_train_network.py")


def infer_script(flat: dict[str, Any]) -> str | None:
    """The script a config TOML is for, where its keys decide it: its LoRA module (networks.lora_NAME),
    or its own options (`dit` with `task`: Wan's; `dit` with `text_encoder` and `model_version`:
    Qwen-Image's; `dit` with `text_encoder1`: FLUX.1 Kontext's)."""
    keys = set(flat)
    module = str(flat.get("network_module") or "")
    by_module = {"networks.lora_qwen_image": "qwen_image_train_network.py",
                 "networks.lora_wan": "wan_train_network.py", "networks.lora_flux": "flux_kontext_train_network.py",
                 "networks.lora_zimage": "zimage_train_network.py", "networks.lora_flux_2": "flux_2_train_network.py"}
    if module in by_module:
        return by_module[module]
    if {"dit", "task"} <= keys:
        return "wan_train_network.py"
    if {"dit", "text_encoder1"} <= keys:
        return "flux_kontext_train_network.py"
    if {"dit", "text_encoder"} <= keys and "model_version" in keys:
        return "qwen_image_train_network.py"
    return None


def options(script: Script) -> dict[str, Option]:
    return script.options


def for_family(family: str) -> tuple[Script, dict[str, Any]] | None:
    """The Script that trains `family`, and its own options for the model (--task, --model_version)."""
    if family not in FAMILIES:
        return None
    name, own = FAMILIES[family]
    return SCRIPTS[name], dict(own)


def model_files(script: Script, own: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """The model files a new job names: Wan's high-noise DiT only for 2.2's A14B tasks (both experts
    trained) and its CLIP only for Wan 2.1's I2V tasks (wan_cache_latents.py: "required" there)."""
    task = str(own.get("task") or "")
    return tuple(entry for entry in script.model_files
                 if (entry[0] != "dit_high_noise" or "A14B" in task) and (entry[0] != "clip" or task == "i2v-14B"))


def model_of(job: KohyaJob) -> tuple[str, str]:
    return job.script.model(job)


def check(job: KohyaJob) -> None:
    family, _ = model_of(job)  # an unknown --task or --model_version is one line
    if job.get("fp8_scaled") and not job.get("fp8_base"):
        raise UserError(f"{job.source}: fp8_scaled without fp8_base: musubi-tuner refuses it "
                        "(trainer_base.py _validate_args_and_init: 'fp8_scaled requires fp8_base')")
    if not job.get("network_dim"):
        raise UserError(f"{job.source}: network_dim: missing; musubi-tuner creates the LoRA with it")
    if job.get("dit_high_noise") and job.get("offload_inactive_dit") and job.get("blocks_to_swap"):
        raise UserError(f"{job.source}: --blocks_to_swap with --offload_inactive_dit: wan_train_network.py refuses the "
                        "two together (handle_model_specific_args)")
    if job.get("dit_high_noise") and family not in ("wan22", "wan22_i2v"):
        raise UserError(f"{job.source}: --dit_high_noise with --task {job.get('task')}: only Wan 2.2's A14B tasks have "
                        "a high-noise model")
    _kohya.check_swap(job, max_blocks_to_swap(job, job.architecture_spec()["arch"]))
    if job.get("num_layers") not in (None, 60):
        job.notes.append(f"--num_layers {job.get('num_layers')} is not modelled: the architecture keeps its blocks")
    if str(job.get("task")) == "flf2v-14B" and job.script.name == "wan_train_network.py":
        job.notes.append("--task flf2v-14B's last frame (a second CLIP image) is not modelled: the estimate may be low")
    _kohya.not_modelled(job, {
        "gradient_checkpointing_cpu_offload": "activations kept in host memory: the estimate may be high",
        "fused_backward_pass": "the estimate may be high",
        "block_swap_h2d_only": "its ring buffers are not modelled",
        "img_in_txt_in_offloading": "the input layers' offloading is not modelled",
        "network_weights": "a LoRA read from a file is probed as a new one",
        "compile": "compiled graphs may hold other buffers",
    })


# -- the dataset TOML (dataset/config_utils.py) ---------------------------------------------------
# BaseDatasetParams: resolution (960, 544), batch_size 1 (config_utils.py:33); VideoDatasetParams:
# target_frames (1,), frame_extraction "head", max_frames 129 (:62); a dataset's table wins over
# [general] (BlueprintGenerator: dataset, general, defaults), no command-line fallback.
_DATASET_DEFAULTS = {"resolution": [960, 544], "batch_size": 1, "target_frames": [1], "frame_extraction": "head",
                     "max_frames": 129}


def dataset_value(job: KohyaJob, index: int, name: str) -> Any:
    key = f"datasets[{index}].{name}"
    if key in job.changes:
        return job.changes[key]
    for source in (job.datasets[index], job.dataset.get("general") or {}):
        if source.get(name) is not None:
            return source[name]
    return _DATASET_DEFAULTS.get(name)


def dataset_edits(job: KohyaJob, changes: dict[str, Any]) -> tuple[dict, dict]:
    return _kohya.dataset_edits(job, changes, {})


def is_video(job: KohyaJob, index: int) -> bool:
    """A video dataset is one with video_directory or video_jsonl_file (config_utils.py
    BlueprintGenerator: `is_image_dataset` otherwise)."""
    dataset = job.datasets[index]
    return "video_directory" in dataset or "video_jsonl_file" in dataset


def clip_frames(job: KohyaJob, index: int) -> int:
    """The longest clip a dataset trains on: its largest target_frames, each rounded down to 4k+1
    (image_video_dataset.py VideoDataset: `(f - 1) // 4 * 4 + 1`); "full" extraction takes every frame up
    to max_frames, rounded the same way. An image dataset's are 1."""
    if not is_video(job, index):
        return 1
    if str(job.get(f"datasets[{index}].frame_extraction")) == "full":
        frames = [int(job.get(f"datasets[{index}].max_frames"))]
    else:
        frames = [int(f) for f in job.get(f"datasets[{index}].target_frames") or [1]]
    return max((f - 1) // 4 * 4 + 1 for f in frames)


# -- knobs, in musubi-tuner's names ---------------------------------------------------------------------
def max_blocks_to_swap(job: KohyaJob, arch: dict) -> int:
    return job.script.most_swapped(arch)


_QUANTIZE = ("fp8", "fp8_scaled", "none")


def quantize_level(job: KohyaJob) -> str:
    return "none" if not job.get("fp8_base") else "fp8_scaled" if job.get("fp8_scaled") else "fp8"


def quantize_knob(job: KohyaJob) -> KnobSpec:
    """fp8_base (every Linear weight in float8_e4m3fn), fp8_scaled (the blocks' Linear weights in fp8
    with a scale per 64 weights), or neither; never past the job's own precision."""
    desired = quantize_level(job)
    values = _QUANTIZE[:_QUANTIZE.index(desired) + 1]

    def write(target: KohyaJob, level: str, space) -> None:
        target.set("fp8_base", level != "none")
        target.set("fp8_scaled", level == "fp8_scaled")

    labels = {"fp8": "fp8_base", "fp8_scaled": "fp8_base+fp8_scaled", "none": "off"}
    return KnobSpec("quantize", "quality", values, desired, ("fp8_base", "fp8_scaled"), _kohya.ALL, "fp8_base",
                    labels.__getitem__, write)


def frames_knob(job: KohyaJob) -> KnobSpec | None:
    """The video datasets' clip length (target_frames, or max_frames with "full" extraction): the
    longest first, down the family's ladder of 4k+1 frames (models/_family.py frame_ladder)."""
    video = [i for i in range(len(job.datasets)) if is_video(job, i)]
    if not video:
        return None
    desired = max(clip_frames(job, i) for i in video)
    ladder = tuple(_kohya.family(model_of(job)[0]).frame_ladder(desired))

    def write(target: KohyaJob, frames: int, space) -> None:
        for i in video:
            if str(job.get(f"datasets[{i}].frame_extraction")) == "full":
                target.set(f"datasets[{i}].max_frames", min(int(job.get(f"datasets[{i}].max_frames")), frames))
                continue
            own = [int(f) for f in job.get(f"datasets[{i}].target_frames") or [1]]
            kept = [f for f in own if (f - 1) // 4 * 4 + 1 <= frames]
            target.set(f"datasets[{i}].target_frames", kept if kept else [frames])

    return KnobSpec("frames", "quality", ladder, desired, ("datasets[*].target_frames", "datasets[*].max_frames"),
                    _kohya.DATA, "target_frames", str, write)


def swap_knob(job: KohyaJob, arch: dict) -> KnobSpec | None:
    if job.get("dit_high_noise") and job.get("offload_inactive_dit"):
        return None  # wan_train_network.py refuses block swap with the inactive expert offloaded
    knob = _kohya.swap_knob(job, max_blocks_to_swap(job, arch), frozenset({"load", "sample", "train", "last_sample"}))
    if knob is None or not job.get("dit_high_noise"):
        return knob
    plain = knob.writer

    def write(target: KohyaJob, count: int, space) -> None:
        # Block swap and an offloaded inactive expert are refused together (handle_model_specific_args):
        # a point with both is written as block swap alone (the swap knob writes after low_vram's).
        plain(target, count, space)
        if count:
            target.set("offload_inactive_dit", False)

    return replace(knob, writer=write)


def offload_knob(job: KohyaJob) -> KnobSpec | None:
    """Wan 2.2 with both experts: --offload_inactive_dit keeps the expert not training in host memory
    (swap_high_low_weights: model.to("cpu") before loading the other's weights), a speed knob."""
    if not job.get("dit_high_noise"):
        return None
    # the planner's low_vram: a speed knob that moves a part to the host (space.SPEED_ORDER)
    # On, lighter on the card and heavier on the host: the inactive expert waits there (host order reversed).
    return _kohya.switch_knob("low_vram", "offload_inactive_dit", job, frozenset({"load", "sample", "train",
                                                                                 "last_sample"}), True,
                              host="reversed")


def text_fp8_knob(job: KohyaJob) -> KnobSpec | None:
    """The text caching script's fp8 switch (--fp8_vl, --fp8_t5, --fp8_llm, --fp8_text_encoder): the
    text encoder in float8_e4m3fn in its own process (the training script's switch of the same name
    encodes the sample prompts the same way, and is set with it). Offered where the shell file runs
    that caching script; fp8 < bf16, never past the job's own."""
    script, flag = job.script.text_cache[0], job.script.text_fp8
    if not any(command["script"] == script for command in job.caching):
        return None
    desired = "fp8" if cache_flag(job, script, flag) or job.get(flag) else "bf16"  # as recipe() reads it
    values = ("fp8",) if desired == "fp8" else ("fp8", "bf16")

    def write(target: KohyaJob, form: str, space) -> None:
        target.set(_kohya.cache_key(script, flag), form == "fp8")
        if flag in target.options:
            target.set(flag, form == "fp8")

    return KnobSpec("text_encoder", "quality", values, desired, (flag,), frozenset({"text_encoder"}), flag,
                    lambda v: "on" if v == "fp8" else "off", write)


def knob_specs(job: KohyaJob) -> list[KnobSpec]:
    arch = job.architecture_spec()["arch"]
    found = [_kohya.buckets_knob(job), frames_knob(job), _kohya.rank_knob(job), quantize_knob(job),
             _kohya.optimizer_knob(job, DEFAULT_OPTIMIZER), _kohya.sampling_knob(job), _kohya.sample_size_knob(job),
             text_fp8_knob(job),
             _kohya.batch_knob(job),
             _kohya.switch_knob("gradient_checkpointing", "gradient_checkpointing", job, frozenset({"train"}), True),
             offload_knob(job), swap_knob(job, arch)]
    return [knob for knob in found if knob is not None and len(knob.candidates) > 1]


# -- the recipe ------------------------------------------------------------------------------------------
def architecture_spec(job: KohyaJob) -> dict:
    family, arch = model_of(job)
    return _kohya.architecture(job, family, arch, job.script.checkpoint, lambda header: arch)


def phases_run(job: KohyaJob, point: dict) -> list[str]:
    sampling = point.get("sampling", bool(job.get("sample_prompts")))
    first = sampling and bool(job.get("sample_at_first"))
    last = sampling and bool(job.get("sample_every_n_steps") or job.get("sample_every_n_epochs"))
    skipped = ({"sample"} if not first else set()) | ({"last_sample"} if not last else set())
    return [phase for phase in ("load", "text_encoder", "latents", "sample", "train", "last_sample")
            if phase not in skipped]


def cache_flag(job: KohyaJob, script: str, name: str) -> Any:
    """A caching command's flag: fitfinder's change to it, else the command line's."""
    changed = _kohya.cache_key(script, name)
    if changed in job.changes:
        return job.changes[changed]
    for command in job.caching:
        if command["script"] == script and name in command["flags"]:
            return command["flags"][name]
    return None


def _dtype_name(value: Any, fallback: str) -> str:
    """--vae_dtype's names (utils/model_utils.py str_to_dtype: float16, fp16, bfloat16, bf16, float32, ...)."""
    text = str(value or "").lower()
    for names, dtype in ((("float16", "fp16", "half"), "fp16"), (("bfloat16", "bf16"), "bf16"),
                         (("float32", "fp32", "float"), "fp32")):
        if text in names:
            return dtype
    return fallback


def recipe(job: KohyaJob, arch: dict) -> dict[str, Any]:
    """The script's recipe, with its two caching scripts (probe/protocol.py TrainerRecipe).

    - Text: the text caching script, its own process: the text encoder(s) alone on the card, in
      bf16 or with the script's fp8 switch in float8_e4m3fn (--fp8_vl, --fp8_t5, --fp8_llm,
      --fp8_text_encoder: Linear weights, the norms and embeddings kept), its --batch_size captions at
      a time (else the dataset's batch_size), under autocast. The training script encodes its sample
      prompts the same way before the DiT loads (process_sample_prompts), then deletes the encoders.
    - Latents: the latents caching script, its own process: the VAE alone on the card (--vae_dtype,
      else the script's default); for Wan 2.1's I2V tasks with CLIP vision beside it (wan_cache_latents.py
      encode_and_save_batch: `clip.visual(images)`).
    - Load: the DiT to the card (trainer_base.py _load_dit_and_swap: loading_device is the card unless
      --blocks_to_swap, then the CPU and move_to_device_except_swap_blocks); with --fp8_base and
      --fp8_scaled the blocks' Linear weights in float8_e4m3fn with a scale per 64 weights
      (fp8_optimization_utils.py quantize_weight; each model's FP8_OPTIMIZATION_TARGET_KEYS and
      EXCLUDE_KEYS), dequantized per layer in the forward (fp8_linear_forward_patch); with --fp8_base
      alone every weight in float8_e4m3fn (dit_weight_dtype), upcast per layer by autocast. Wan 2.2
      with --dit_high_noise: the high-noise model is loaded the same way (load_transformer), to the card
      unless --offload_inactive_dit (then to the CPU), its swapped blocks in host memory too.
    - Train: one LoRA in fp32 (network_dtype: full_bf16 and full_fp16 are switched off in
      _prepare_with_accelerator) on the one DiT object: Wan 2.2's two experts take turns by loading
      each other's weights into it (swap_high_low_weights), so one expert's LoRA trains with both
      experts' weights held; every DiT call under accelerator.autocast().
    - Previews: the DiT denoises (Wan 2.2: the low-noise model only, do_inference); the VAE waits in
      host memory and comes for the decode only.
    """
    script = job.script
    family_name, _ = model_of(job)
    family = _kohya.family(family_name)
    dtype = _kohya.dtype_of_precision(job.get("mixed_precision") or job.launcher.get("mixed_precision"))
    text_script, latent_script = script.text_cache[0], script.latent_cache[0]
    text_fp8 = bool(cache_flag(job, text_script, script.text_fp8) or job.get(script.text_fp8))
    level = quantize_level(job)
    swap = min(int(job.get("blocks_to_swap") or 0), max_blocks_to_swap(job, arch))
    batch = int(job.get("datasets[0].batch_size"))
    dit = {"none": "bf16", "fp8": "fp8", "fp8_scaled": "fp8_scaled"}[level]
    dits = list(family.denoisers) if job.get("dit_high_noise") else list(family.denoisers[:1])
    resident = dits if not job.get("offload_inactive_dit") else dits[:1]
    encoders = list(family.text_encoders)
    latents = ["vae"] + (["image_encoder"] if "image_encoder" in family.others else [])
    vae = _dtype_name(job.get("vae_dtype") or cache_flag(job, latent_script, "vae_dtype"), script.vae_dtype)
    return {
        "name": REPO, "script": script.name,
        "weights": {**{name: dit for name in family.denoisers},
                    **{name: "fp8" if text_fp8 else "bf16" for name in encoders},
                    "vae": vae, **({"image_encoder": "fp16"} if "image_encoder" in latents else {})},
        "residency": {"load": resident, "text_encoder": encoders, "latents": latents,
                      "sample": resident, "train": resident, "last_sample": resident},
        "decode": ["vae"],
        "autocast": dtype if dtype != "fp32" else None,
        "swapped": script.swap(arch, swap) if swap else {},
        "scaled": {"targets": list(script.scaled[0]), "excluded": list(script.scaled[1])},
        "previews_by": family.denoisers[0],
        "lora_input_cast": False,
        "text_batch": int(cache_flag(job, text_script, "batch_size") or batch),
        "latent_batch": int(cache_flag(job, latent_script, "batch_size") or batch),
    }


def probe_request(job: KohyaJob, **run) -> dict:
    spec = run.pop("spec", None) or job.model_spec()
    previews = job.script.previews(str(job.get("task")))
    prompts = _kohya.prompt_lines(job)
    sample = _kohya.sample_settings(job, prompts, width=previews.width, height=previews.height, steps=previews.steps,
                                    guidance_key=previews.guidance_key, guidance=previews.guidance,
                                    first=phases_run(job, {}), sample_steps=run.pop("sample_steps"),
                                    frames_key="f" if _kohya.family(spec["family"]).video else None)
    request = _kohya.request(job, spec, recipe(job, spec["arch"]), sample, rank_ignore=list(job.script.lora_ignore),
                             **run)
    request["shapes"] = sorted({(_kohya.resolution_side(job.get(f"datasets[{i}].resolution")), clip_frames(job, i))
                                for i in range(len(job.datasets))})
    request["shapes"] = [list(shape) for shape in request["shapes"]]
    return request
