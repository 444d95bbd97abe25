"""kohya sd-scripts: its scripts, their parsers' defaults, their knobs, their recipes (kohya-ss/sd-scripts).

What is read here is public source (kohya-ss/sd-scripts, commit 48d368fa, 2026-02-16), cited by
file and line or function beside each rule; docs/trainers.md gathers the rules in tables.

Scripts, each a `Script` below: `flux_train_network.py` (FLUX.1 dev and schnell; Chroma with
`--model_type chroma`), `sdxl_train_network.py`, `sd3_train_network.py`, `train_network.py`
(SD 1.5) and `lumina_train_network.py` (Lumina Image 2.0). Every one runs NetworkTrainer.train
(train_network.py), so one recipe holds them all, its script-specific parts named by the Script:
which parts are "always not fp8" in the text encoders' caching pass, which follow the fp8 file,
whether the encoders' outputs can be cached, the block lists that swap, the preview's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fitfinder.errors import UserError
from fitfinder.trainers import _kohya
from fitfinder.trainers import _sd_scripts_options as parsers
from fitfinder.trainers._knob import KnobSpec
from fitfinder.trainers._kohya import KohyaJob, Option

REPO = "sd-scripts"
# train_util.get_optimizer: an empty optimizer_type is AdamW.
DEFAULT_OPTIMIZER = "adamw"


def PREVIEW_DEFAULT(job) -> tuple[int, int]:  # noqa: N802 - a trainer's constant, by the job's script
    """A preview prompt's size where it gives no --w / --h (each script's sample_image_inference)."""
    return job.script.previews.width, job.script.previews.height

# Each script's parser, as its setup_parser builds it (library/config_util.py add_config_arguments
# is in COMMON: --dataset_config).
FLUX_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.DIT, **parsers.FLUX}
SDXL_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.SDXL}
SD3_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.DIT, **parsers.SD3}
SD15_OPTIONS: dict[str, Option] = dict(parsers.COMMON)
LUMINA_OPTIONS: dict[str, Option] = {**parsers.COMMON, **parsers.DIT, **parsers.LUMINA}


@dataclass(frozen=True)
class Previews:
    """A preview prompt's defaults where the prompt file gives none (its --w --h --s), and the key of
    its guidance: the scale whose default doubles the denoiser's batch (classifier-free guidance), or
    FLUX.1's embedded guidance (one call)."""

    width: int
    height: int
    steps: int
    guidance_key: str
    guidance: float
    source: str
    vae_throughout: bool = False  # the VAE on the card for the whole preview, not only its decode


@dataclass(frozen=True)
class Script:
    name: str
    family: str
    options: dict[str, Option]
    checkpoint: str  # the option naming the denoiser's .safetensors file
    default_arch: str
    decide: Callable | None  # the checkpoint's header -> a shipped architecture
    clips: tuple[str, ...]  # encoders cast to the weight dtype in the caching pass ("always not fp8")
    t5: tuple[str, ...]  # encoders that keep their file's dtype with --fp8_base (T5XXL, an fp8 file)
    caches_text: bool  # --cache_text_encoder_outputs exists for the script
    previews: Previews
    swap: Callable[[dict, int], dict[str, int]] | None = None  # (arch, n) -> block list: count, or no swap
    most_swapped: Callable[[dict], int] | None = None
    lora_blocks: str | None = None  # kohya's LoRA targets, where they differ from the family's
    lora_convs: bool | None = None
    cache_scripts: dict = field(default_factory=dict)  # sd-scripts caches inside the training script
    model_type: str = "flux"  # flux_train_network.py's --model_type this Script answers
    network_module: str = "networks.lora"  # its LoRA (networks/lora_NAME.py)
    model_files: tuple[tuple[str, str, str], ...] = ()  # (option, environment variable, what file) a new job names


# -- the architectures a checkpoint names ---------------------------------------------------------------
def _flux_arch(header) -> str:
    """flux_utils.analyze_checkpoint_state: schnell has no guidance embedder (`guidance_in`)."""
    return "flux-dev" if header.has("guidance_in") else "flux-schnell"


def _same(stem: str) -> Callable:
    return lambda header: stem


# -- block swap, per model: which blocks of which list keep their weights in host memory ---------------
def _flux_swap(arch: dict, n: int) -> dict[str, int]:
    """Flux.enable_block_swap (library/flux_models.py): n blocks swap n//2 double blocks and
    (n - n//2) * 2 single ones (diffusers' names for BFL's double and single blocks); Chroma is a
    Flux subclass (library/chroma_models.py) and swaps the same way."""
    return {"transformer_blocks": n // 2, "single_transformer_blocks": (n - n // 2) * 2} if n else {}


def _flux_most(arch: dict) -> int:
    """At most two fewer than each kind has: the largest n Flux.enable_block_swap's assert allows."""
    transformer = arch["parts"]["transformer"]
    double, single = int(transformer.get("num_layers", 19)), int(transformer.get("num_single_layers", 38))
    return max((n for n in range(1, double + single + 1) if n // 2 <= double - 2 and (n - n // 2) * 2 <= single - 2),
               default=0)


def _list_swap(attribute: str) -> Callable[[dict, int], dict[str, int]]:
    return lambda arch, n: {attribute: n} if n else {}


def _list_most(key: str, default: int) -> Callable[[dict], int]:
    """MMDiT.enable_block_swap (library/sd3_models.py) and NextDiT.enable_block_swap
    (library/lumina_models.py): at most two fewer than the model's blocks."""
    return lambda arch: int(arch["parts"]["transformer"].get(key, default)) - 2


# kohya's LoRA for the U-Nets (networks/lora.py create_network): the Linear and 1x1 Conv2d layers of
# every Transformer2DModel (UNET_TARGET_REPLACE_MODULE), which diffusers' UNet2DConditionModel holds
# as the blocks' `attentions`; the 3x3 convolutions only with conv_dim in --network_args.
UNET_LORA_BLOCKS = r"(down_blocks\.\d+|mid_block|up_blocks\.\d+)\.attentions\.\d+\..+"

# Previews' defaults: train_util.sample_image_inference (SD 1.5 and SDXL: 512x512, 30 steps, scale 7.5,
# the VAE moved to the card for the whole of sample_images_common), flux_train_utils.sample_image_inference
# (512x512, 20 steps, --g 3.5 embedded, the AE for the decode only), sd3_train_utils.sample_image_inference
# (512x512, 30 steps, scale 7.5 on a doubled batch, do_sample; the VAE for the decode only) and
# lumina_train_util.sample_image_inference (1024x1024, 36 steps, scale 3.5; the VAE for the decode only).
_SD_PREVIEWS = Previews(512, 512, 30, "l", 7.5, "library/train_util.py sample_image_inference", vae_throughout=True)
_FLUX_PREVIEWS = Previews(512, 512, 20, "g", 3.5, "library/flux_train_utils.py sample_image_inference")
_SD3_PREVIEWS = Previews(512, 512, 30, "l", 7.5, "library/sd3_train_utils.py sample_image_inference")
_LUMINA_PREVIEWS = Previews(1024, 1024, 36, "l", 3.5, "library/lumina_train_util.py sample_image_inference")

SCRIPTS = {
    "flux_train_network.py": Script(
        "flux_train_network.py", "flux", FLUX_OPTIONS, "pretrained_model_name_or_path", "flux-dev", _flux_arch,
        clips=("text_encoder",), t5=("text_encoder_2",), caches_text=True, previews=_FLUX_PREVIEWS,
        swap=_flux_swap, most_swapped=_flux_most, network_module="networks.lora_flux",
        model_files=(("pretrained_model_name_or_path", "FLUX_MODEL", "the FLUX.1 transformer .safetensors "
                      "(flux1-dev.safetensors)"), ("clip_l", "CLIP_L", "clip_l.safetensors"),
                     ("t5xxl", "T5XXL", "t5xxl_fp16.safetensors"), ("ae", "AE", "ae.safetensors"))),
    "sdxl_train_network.py": Script(
        "sdxl_train_network.py", "sdxl", SDXL_OPTIONS, "pretrained_model_name_or_path", "sdxl-base",
        _same("sdxl-base"), clips=("text_encoder", "text_encoder_2"), t5=(), caches_text=True,
        previews=_SD_PREVIEWS, lora_blocks=UNET_LORA_BLOCKS, lora_convs=True,
        model_files=(("pretrained_model_name_or_path", "SDXL_MODEL", "the SDXL checkpoint .safetensors"),)),
    "sd3_train_network.py": Script(
        "sd3_train_network.py", "sd3", SD3_OPTIONS, "pretrained_model_name_or_path", "sd35-large",
        _same("sd35-large"), clips=("text_encoder", "text_encoder_2"), t5=("text_encoder_3",), caches_text=True,
        previews=_SD3_PREVIEWS, swap=_list_swap("transformer_blocks"), most_swapped=_list_most("num_layers", 38),
        network_module="networks.lora_sd3",
        model_files=(("pretrained_model_name_or_path", "SD3_MODEL", "the SD3 checkpoint .safetensors"),
                     ("clip_l", "CLIP_L", "clip_l.safetensors"), ("clip_g", "CLIP_G", "clip_g.safetensors"),
                     ("t5xxl", "T5XXL", "t5xxl_fp16.safetensors"))),
    "train_network.py": Script(
        "train_network.py", "sd15", SD15_OPTIONS, "pretrained_model_name_or_path", "sd15", _same("sd15"),
        clips=("text_encoder",), t5=(), caches_text=False, previews=_SD_PREVIEWS, lora_blocks=UNET_LORA_BLOCKS,
        lora_convs=True,
        model_files=(("pretrained_model_name_or_path", "SD15_MODEL", "the SD 1.5 checkpoint .safetensors"),)),
    "lumina_train_network.py": Script(
        "lumina_train_network.py", "lumina2", LUMINA_OPTIONS, "pretrained_model_name_or_path", "lumina2",
        _same("lumina2"), clips=("text_encoder",), t5=(), caches_text=True, previews=_LUMINA_PREVIEWS,
        swap=_list_swap("layers"), most_swapped=_list_most("num_layers", 26), network_module="networks.lora_lumina",
        model_files=(("pretrained_model_name_or_path", "LUMINA_MODEL", "the Lumina Image 2.0 .safetensors"),
                     ("gemma2", "GEMMA2", "gemma_2_2b_fp16.safetensors"), ("ae", "AE", "ae.safetensors"))),
}
# flux_train_network.py --model_type chroma (library/flux_train_utils.py :684): Chroma, a Flux without
# CLIP-L (FluxNetworkTrainer.assert_extra_args: use_clip_l False, apply_t5_attn_mask required).
CHROMA = Script("flux_train_network.py", "chroma", FLUX_OPTIONS, "pretrained_model_name_or_path", "chroma",
                _same("chroma"), clips=(), t5=("text_encoder",), caches_text=True, previews=_FLUX_PREVIEWS,
                swap=_flux_swap, most_swapped=_flux_most, model_type="chroma", network_module="networks.lora_flux",
                model_files=(("pretrained_model_name_or_path", "CHROMA_MODEL", "the Chroma .safetensors"),
                             ("t5xxl", "T5XXL", "t5xxl_fp16.safetensors"), ("ae", "AE", "ae.safetensors")))
# The script each model family trains with, and the options that name the model to it.
FAMILIES = {"flux": ("flux_train_network.py", {}), "sdxl": ("sdxl_train_network.py", {}),
            "sd3": ("sd3_train_network.py", {}), "sd15": ("train_network.py", {}),
            "lumina2": ("lumina_train_network.py", {}),
            "chroma": ("flux_train_network.py", {"model_type": "chroma", "apply_t5_attn_mask": True})}
# Scripts of sd-scripts that fitfinder knows and does not follow yet, named so a job of one is told so.
TO_COME = ("anima_train_network.py", "hunyuan_image_train_network.py")


def infer_script(flat: dict[str, Any]) -> str | None:
    """The script a config TOML is for, where its keys decide it: each script's own model options
    (flux_train_utils.add_flux_train_arguments: t5xxl with ae; sd3_train_utils: clip_g with t5xxl;
    lumina_train_util: gemma2) or its LoRA module (networks.lora_flux, lora_sd3, lora_lumina; SDXL's
    and SD 1.5's networks.lora is both's, so it does not decide)."""
    keys, module = set(flat), str(flat.get("network_module") or "")
    if {"clip_g", "t5xxl"} <= keys or module == "networks.lora_sd3":
        return "sd3_train_network.py"
    if {"t5xxl", "ae"} <= keys or module == "networks.lora_flux":
        return "flux_train_network.py"
    if "gemma2" in keys or module == "networks.lora_lumina":
        return "lumina_train_network.py"
    return None


def options(script: Script) -> dict[str, Option]:
    return script.options


def for_family(family: str) -> tuple[Script, dict[str, Any]] | None:
    """The Script that trains `family`, and its own options for the model (Chroma's --model_type)."""
    if family not in FAMILIES:
        return None
    name, own = FAMILIES[family]
    return (CHROMA if own.get("model_type") == "chroma" else SCRIPTS[name]), dict(own)


def model_files(script: Script, own: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    return script.model_files


def for_model_type(job: KohyaJob) -> None:
    """flux_train_network.py trains Chroma with --model_type chroma: the job takes Chroma's Script."""
    if job.script.name == "flux_train_network.py":
        model_type = str(job.get("model_type") or "flux")
        if model_type not in ("flux", "chroma"):
            raise UserError(f"{job.source}: --model_type {model_type}: flux_train_network.py trains flux or chroma "
                            "(library/flux_train_utils.py :684)")
        job.script = CHROMA if model_type == "chroma" else SCRIPTS["flux_train_network.py"]


def check(job: KohyaJob) -> None:
    """What fitfinder reads, checked at once; what it does not follow, named."""
    for_model_type(job)
    script = job.script
    if not job.get("network_dim"):
        raise UserError(f"{job.source}: network_dim: missing; train_network.py creates the LoRA with it")
    if script.family == "sd15" and job.get("v2"):
        raise UserError(f"{job.source}: --v2: Stable Diffusion 2 is not followed; fitfinder follows train_network.py "
                        "with SD 1.x checkpoints")
    if script.model_type == "chroma" and not job.get("apply_t5_attn_mask"):
        raise UserError(f"{job.source}: --model_type chroma without --apply_t5_attn_mask: flux_train_network.py "
                        "refuses it (FluxNetworkTrainer.assert_extra_args)")
    if (job.get("fp8_base") or job.get("fp8_base_unet")) and _kohya.dtype_of_precision(job.get("mixed_precision")) \
            == "fp32":
        raise UserError(f"{job.source}: fp8_base needs --mixed_precision fp16 or bf16 (train_network.py train: "
                        "'fp8_base requires mixed precision')")
    if job.get("blocks_to_swap") and job.get("cpu_offload_checkpointing"):
        raise UserError(f"{job.source}: blocks_to_swap with cpu_offload_checkpointing: {script.name} refuses the "
                        "two together (assert_extra_args)")
    _kohya.check_swap(job, max_blocks_to_swap(job, job.architecture_spec()["arch"]) if script.swap else None)
    network_args = [str(arg) for arg in job.get("network_args") or []]
    if script.family in ("sdxl", "sd15") and any(arg.startswith("conv_dim") for arg in network_args):
        job.notes.append("--network_args conv_dim (LoRA on the 3x3 convolutions) is not modelled: the estimate may "
                         "be low")
    _kohya.not_modelled(job, {
        "cpu_offload_checkpointing": "checkpoints kept in host memory: the estimate may be high",
        "fused_backward_pass": "the estimate may be high",
        "full_bf16": "a bf16 LoRA: the estimate may be high",
        "full_fp16": "an fp16 LoRA: the estimate may be high",
        "network_weights": "a LoRA read from a file is probed as a new one",
        "lowram": "the models' load order with --lowram is not followed",
        "deepspeed": "DeepSpeed's placement is not followed",
        "torch_compile": "compiled graphs may hold other buffers",
    })
    if not job.get("network_train_unet_only") and (script.clips or script.family == "lumina2"):
        names = {"flux": "CLIP-L's", "sd3": "CLIP-L's and CLIP-G's", "sdxl": "both CLIPs'", "sd15": "CLIP's",
                 "lumina2": "Gemma2's"}.get(script.family, "the text encoders'")
        job.notes.append(f"--network_train_unet_only is not set: {names} LoRA is not modelled (the estimate may be "
                         "low)")


# -- the dataset TOML (library/config_util.py) ---------------------------------------------------
# Options the dataset takes from the command line when neither its table nor [general] has them
# (BlueprintGenerator.generate: dataset, general, argparse; ARGPARSE_OPTNAME_TO_CONFIG_OPTNAME maps
# train_batch_size to batch_size).
_FROM_ARGS = {"batch_size": "train_batch_size", "resolution": "resolution"}


def dataset_value(job: KohyaJob, index: int, name: str) -> Any:
    key = f"datasets[{index}].{name}"
    if key in job.changes:
        return job.changes[key]
    dataset = job.datasets[index]
    general = job.dataset.get("general") or {}
    for source in (dataset, general):
        if source.get(name) is not None:
            return source[name]
    flag = _FROM_ARGS.get(name)
    value = job.get(flag) if flag else None
    if name == "resolution" and isinstance(value, str):  # --resolution "512,512" (train_util.prepare_dataset_args)
        parts = [int(p) for p in value.split(",")]
        value = parts if len(parts) == 2 else parts[0]
    if value is None and name == "resolution":
        raise UserError(f"{job.dataset_path}: datasets[{index}].resolution: missing (nor in [general], nor "
                        "--resolution); config_util.py needs one")
    return value


def dataset_edits(job: KohyaJob, changes: dict[str, Any]) -> tuple[dict, dict]:
    """Dataset changes as (table, occurrence, key) edits of the dataset TOML, and the options the
    command line holds instead (a value that came from --train_batch_size stays there)."""
    return _kohya.dataset_edits(job, changes, _FROM_ARGS)


# -- knobs, in sd-scripts' names ----------------------------------------------------------------------
def max_blocks_to_swap(job: KohyaJob, arch: dict) -> int:
    most = job.script.most_swapped
    return most(arch) if most else 0


def quantize_knob(job: KohyaJob) -> KnobSpec:
    """fp8_base: the denoiser in float8_e4m3fn (and the text encoders, unless fp8_base_unet)."""
    desired = "8bit" if job.get("fp8_base") or job.get("fp8_base_unet") else "none"
    values = ("8bit", "none") if desired == "none" else ("8bit",)
    if _kohya.dtype_of_precision(job.get("mixed_precision")) == "fp32":
        values = ("none",)  # train_network.py refuses fp8_base without mixed precision

    def write(target: KohyaJob, level: str, space) -> None:
        target.set("fp8_base", level == "8bit")
        if level == "none":
            target.set("fp8_base_unet", False)

    return KnobSpec("quantize", "quality", values, desired, ("fp8_base", "fp8_base_unet"), _kohya.ALL, "fp8_base",
                    lambda v: "on" if v == "8bit" else "off", write)


def text_encoder_knob(job: KohyaJob) -> KnobSpec | None:
    if not job.script.caches_text or job.get("cache_text_encoder_outputs") \
            or job.get("cache_text_encoder_outputs_to_disk"):
        return None  # no caching in the script (train_network.py), or already off the device while training

    def write(target: KohyaJob, mode: str, space) -> None:
        target.set("cache_text_encoder_outputs", mode == "cache")

    return KnobSpec("text_encoder", "quality", ("cache", "keep"), "keep", ("cache_text_encoder_outputs",),
                    _kohya.ALL, "cache_text_encoder_outputs", lambda v: "on" if v == "cache" else "off", write)


def knob_specs(job: KohyaJob) -> list[KnobSpec]:
    arch = job.architecture_spec()["arch"]
    found = [_kohya.buckets_knob(job), _kohya.rank_knob(job), quantize_knob(job),
             _kohya.optimizer_knob(job, DEFAULT_OPTIMIZER),
             _kohya.sampling_knob(job), _kohya.sample_size_knob(job), text_encoder_knob(job), _kohya.batch_knob(job),
             _kohya.switch_knob("gradient_checkpointing", "gradient_checkpointing", job, frozenset({"train"}), True),
             _kohya.swap_knob(job, max_blocks_to_swap(job, arch), frozenset({"sample", "train", "last_sample"}))]
    return [knob for knob in found if knob is not None and len(knob.candidates) > 1]


# -- the recipe: what NetworkTrainer.train holds on the card in each phase ------------------------------
def architecture_spec(job: KohyaJob) -> dict:
    script = job.script
    return _kohya.architecture(job, script.family, script.default_arch, script.checkpoint, script.decide)


def phases_run(job: KohyaJob, point: dict) -> list[str]:
    sampling = point.get("sampling", bool(job.get("sample_prompts")))
    first = sampling and bool(job.get("sample_at_first"))
    last = sampling and bool(job.get("sample_every_n_steps") or job.get("sample_every_n_epochs"))
    skipped = ({"sample"} if not first else set()) | ({"last_sample"} if not last else set())
    return [phase for phase in ("load", "text_encoder", "latents", "sample", "train", "last_sample")
            if phase not in skipped]


def _encoder_forms(job: KohyaJob, dtype: str, cached_te: bool) -> dict[str, str]:
    """Each text encoder's weights on the card. train_network.py train: with --fp8_base (not
    fp8_base_unet) an encoder on the card when training starts is cast to float8_e4m3fn
    (te_weight_dtype; prepare_text_encoder_fp8 keeps its embeddings, and T5XXL's norms, in the weight
    dtype). In the caching pass (cache_text_encoder_outputs_if_needed) the CLIPs are cast to the weight
    dtype ("always not fp8"), T5XXL is kept as its file is with --fp8_base (an fp8 file stays fp8, an
    fp16 one is cast to the weight dtype), and they leave the card before training."""
    te_fp8 = bool(job.get("fp8_base")) and not job.get("fp8_base_unet")
    forms = {name: "fp8" if te_fp8 and not cached_te else dtype for name in job.script.clips}
    for name in job.script.t5:
        key = "t5xxl" if job.script.family in ("flux", "chroma", "sd3") else ""
        t5_file = _kohya.part_dtype(job, key, dtype) if key else dtype
        forms[name] = "fp8" if te_fp8 and (t5_file == "fp8" or not cached_te) else dtype
    if job.script.family == "lumina2":  # Gemma2 is loaded in the weight dtype (lumina_util.load_gemma2)
        forms = {"text_encoder": "fp8" if te_fp8 and not cached_te else dtype}
    return forms


def recipe(job: KohyaJob, arch: dict) -> dict[str, Any]:
    """The script's recipe as the probe's `trainer` field (probe/protocol.py TrainerRecipe).

    - Load: every part in host memory (each load_target_model loads to "cpu"); the denoiser in
      float8_e4m3fn with --fp8_base or --fp8_base_unet (FLUX.1, SD3, Lumina: cast there or read as is
      from an fp8 file; SD 1.5 and SDXL: `unet.to(dtype=unet_weight_dtype)` in train()).
    - Latents: with --cache_latents the VAE alone on the card (NetworkTrainer.train: vae.to(device,
      dtype=vae_dtype), new_cache_latents, vae.to("cpu")), vae_batch_size images at a time (default 1);
      vae_dtype is fp32 with --no_half_vae, else the weight dtype.
    - Text: with --cache_text_encoder_outputs the encoders alone on the card (the denoiser and VAE moved
      to the CPU first, unless --lowram), text_encoder_batch_size captions at a time (else the dataset's
      batch_size), then back to the CPU before training; an encoder whose LoRA trains (no
      --network_train_unet_only: the CLIPs, Gemma2) stays on the card (`if not
      self.is_train_text_encoder(args)`). Without caching (and always in train_network.py and SDXL without
      the flag) every encoder stays on the card for training.
    - Train: the denoiser on the card (prepare_unet_with_accelerator; with --blocks_to_swap every block
      but the swapped ones' Linear weights, move_to_device_except_swap_blocks), the LoRA in fp32 (its
      modules are made in fp32; --full_bf16 is not followed), every denoiser call under
      accelerator.autocast(), so an fp8 weight is upcast per layer.
    - Previews: the denoiser denoises; the VAE comes to the card for the decode only (FLUX.1, SD3,
      Lumina), or for the whole preview (SD 1.5 and SDXL: sample_images_common moves it first and back
      after); the encoders that left the card stay off (their sample prompts were cached with the captions).
    """
    script = job.script
    family = _kohya.family(script.family)
    dtype = _kohya.dtype_of_precision(job.get("mixed_precision"))
    fp8 = bool(job.get("fp8_base") or job.get("fp8_base_unet"))  # assert_extra_args: fp8_base_unet sets fp8_base
    cached_te = script.caches_text and bool(job.get("cache_text_encoder_outputs")
                                            or job.get("cache_text_encoder_outputs_to_disk"))
    cached_latents = bool(job.get("cache_latents") or job.get("cache_latents_to_disk"))
    encoders = list(family.text_encoders)
    trained_encoders = [] if job.get("network_train_unet_only") else [e for e in encoders if e not in script.t5]
    kept = encoders if not cached_te else trained_encoders
    denoiser = family.denoisers[0]
    train = [denoiser] + kept + ([] if cached_latents else ["vae"])
    sample = train + (["vae"] if script.previews.vae_throughout and cached_latents else [])
    swap = min(int(job.get("blocks_to_swap") or 0), max_blocks_to_swap(job, arch))
    return {
        "name": REPO, "script": script.name,
        "weights": {denoiser: "fp8" if fp8 else dtype, **_encoder_forms(job, dtype, cached_te),
                    "vae": "fp32" if job.get("no_half_vae") else dtype},
        "residency": {"load": [], "text_encoder": encoders, "latents": ["vae"] if cached_latents else train,
                      "sample": sample, "train": train, "last_sample": sample},
        "decode": ["vae"],
        "autocast": dtype if dtype != "fp32" else None,
        "swapped": script.swap(arch, swap) if script.swap and swap else {},
        "lora_input_cast": False,
        **({"lora_blocks": script.lora_blocks} if script.lora_blocks else {}),
        **({"lora_convs": script.lora_convs} if script.lora_convs is not None else {}),
        "text_batch": int(job.get("text_encoder_batch_size") or job.get("datasets[0].batch_size")),
        "latent_batch": int(job.get("vae_batch_size") or 1),
    }


def probe_request(job: KohyaJob, **run) -> dict:
    spec = run.pop("spec", None) or job.model_spec()
    previews = job.script.previews
    prompts = _kohya.prompt_lines(job)
    sample = _kohya.sample_settings(job, prompts, width=previews.width, height=previews.height, steps=previews.steps,
                                    guidance_key=previews.guidance_key, guidance=previews.guidance,
                                    first=phases_run(job, {}), sample_steps=run.pop("sample_steps"))
    if previews.guidance_key == "g" and prompts and any(float(p.get("l", 1.0) or 1.0) != 1.0 for p in prompts):
        _kohya._note(job, "--l (CFG) previews run the DiT twice: not modelled, the previews' estimate may be low")
    return _kohya.request(job, spec, recipe(job, spec["arch"]), sample, rank_ignore=[], **run)
