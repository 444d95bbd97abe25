"""kohya musubi-tuner: its argument parser's defaults, its scripts, its knobs, its recipe (kohya-ss/musubi-tuner).

What is read here is public source (kohya-ss/musubi-tuner, commit 30c658c4, 2026-06-24), cited by
file and line or function beside each rule; docs/trainers.md gathers the rules in tables.

Scripts: `qwen_image_train_network.py` (Qwen-Image; its edit versions are to come), with its two
caching scripts, qwen_image_cache_latents.py and qwen_image_cache_text_encoder_outputs.py: separate
processes run before training, each with one model on the card, so each is a phase of its own. The
others (wan_train_network.py, flux_kontext_train_network.py, zimage_train_network.py,
flux_2_train_network.py) follow this module's pattern and are refused by name until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fitfinder.errors import UserError
from fitfinder.trainers import _kohya
from fitfinder.trainers._kohya import BOOL, FLOAT, INT, LIST, STR, KnobSpec, KohyaJob, Option

REPO = "musubi-tuner"
# training/trainer_base.py get_optimizer: an empty optimizer_type matches no optimizer (getattr(torch.optim, "")).
DEFAULT_OPTIMIZER = None

# Every option of qwen_image_train_network.py's parser with its default: training/parser_common.py
# (setup_parser_common's groups) and qwen_image_train_network.py qwen_image_setup_parser (file:line of
# each add_argument, at commit 30c658c4), and qwen_image/qwen_image_utils.py add_model_version_args.
QWEN_OPTIONS: dict[str, Option] = {
    "config_file": Option(STR, None, "src/musubi_tuner/training/parser_common.py:36"),
    "dataset_config": Option(STR, None, "src/musubi_tuner/training/parser_common.py:42"),
    "sdpa": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:51"),
    "flash_attn": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:56"),
    "sage_attn": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:61"),
    "xformers": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:66"),
    "flash3": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:71"),
    "split_attn": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:77"),
    "compile": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:86"),
    "compile_backend": Option(STR, 'inductor', "src/musubi_tuner/training/parser_common.py:91"),
    "compile_mode": Option(STR, 'default', "src/musubi_tuner/training/parser_common.py:97"),
    "compile_dynamic": Option(STR, None, "src/musubi_tuner/training/parser_common.py:104"),
    "compile_fullgraph": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:112"),
    "compile_cache_size_limit": Option(INT, None, "src/musubi_tuner/training/parser_common.py:117"),
    "cuda_allow_tf32": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:123"),
    "cuda_cudnn_benchmark": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:128"),
    "dynamo_backend": Option(STR, 'NO', "src/musubi_tuner/training/parser_common.py:134"),
    "dynamo_mode": Option(STR, None, "src/musubi_tuner/training/parser_common.py:142"),
    "dynamo_fullgraph": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:150"),
    "dynamo_dynamic": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:156"),
    "max_train_steps": Option(INT, 1600, "src/musubi_tuner/training/parser_common.py:164"),
    "max_train_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:165"),
    "max_data_loader_n_workers": Option(INT, 8, "src/musubi_tuner/training/parser_common.py:171"),
    "persistent_data_loader_workers": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:177"),
    "seed": Option(INT, None, "src/musubi_tuner/training/parser_common.py:182"),
    "gradient_checkpointing": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:183"),
    "gradient_checkpointing_cpu_offload": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:186"),
    "gradient_accumulation_steps": Option(INT, 1, "src/musubi_tuner/training/parser_common.py:191"),
    "mixed_precision": Option(STR, None, "src/musubi_tuner/training/parser_common.py:197"),
    "save_precision": Option(STR, None, "src/musubi_tuner/training/parser_common.py:204"),
    "logging_dir": Option(STR, None, "src/musubi_tuner/training/parser_common.py:215"),
    "log_with": Option(STR, None, "src/musubi_tuner/training/parser_common.py:221"),
    "log_prefix": Option(STR, None, "src/musubi_tuner/training/parser_common.py:228"),
    "log_tracker_name": Option(STR, None, "src/musubi_tuner/training/parser_common.py:231"),
    "wandb_run_name": Option(STR, None, "src/musubi_tuner/training/parser_common.py:237"),
    "log_tracker_config": Option(STR, None, "src/musubi_tuner/training/parser_common.py:243"),
    "wandb_api_key": Option(STR, None, "src/musubi_tuner/training/parser_common.py:249"),
    "log_config": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:255"),
    "ddp_timeout": Option(INT, None, "src/musubi_tuner/training/parser_common.py:259"),
    "ddp_gradient_as_bucket_view": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:265"),
    "ddp_static_graph": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:270"),
    "sample_every_n_steps": Option(INT, None, "src/musubi_tuner/training/parser_common.py:278"),
    "sample_at_first": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:284"),
    "sample_every_n_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:287"),
    "sample_prompts": Option(STR, None, "src/musubi_tuner/training/parser_common.py:293"),
    "optimizer_type": Option(STR, '', "src/musubi_tuner/training/parser_common.py:302"),
    "optimizer_args": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:309"),
    "learning_rate": Option(FLOAT, 2e-06, "src/musubi_tuner/training/parser_common.py:316"),
    "max_grad_norm": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:317"),
    "lr_scheduler": Option(STR, 'constant', "src/musubi_tuner/training/parser_common.py:326"),
    "lr_warmup_steps": Option(STR, 0, "src/musubi_tuner/training/parser_common.py:332"),
    "lr_decay_steps": Option(STR, 0, "src/musubi_tuner/training/parser_common.py:339"),
    "lr_scheduler_num_cycles": Option(INT, 1, "src/musubi_tuner/training/parser_common.py:346"),
    "lr_scheduler_power": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:352"),
    "lr_scheduler_timescale": Option(INT, None, "src/musubi_tuner/training/parser_common.py:358"),
    "lr_scheduler_min_lr_ratio": Option(FLOAT, None, "src/musubi_tuner/training/parser_common.py:365"),
    "lr_scheduler_type": Option(STR, '', "src/musubi_tuner/training/parser_common.py:372"),
    "lr_scheduler_args": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:373"),
    "fp8_base": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:383"),
    "full_fp16": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:388"),
    "full_bf16": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:389"),
    "blocks_to_swap": Option(INT, None, "src/musubi_tuner/training/parser_common.py:391"),
    "use_pinned_memory_for_block_swap": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:397"),
    "block_swap_h2d_only": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:403"),
    "block_swap_ring_size": Option(INT, 2, "src/musubi_tuner/training/parser_common.py:410"),
    "img_in_txt_in_offloading": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:418"),
    "disable_numpy_memmap": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:423"),
    "flow_shift": Option(FLOAT, 7.0, "src/musubi_tuner/training/parser_common.py:432"),
    "guidance_scale": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:433"),
    "timestep_sampling": Option(STR, 'sigma', "src/musubi_tuner/training/parser_common.py:436"),
    "discrete_flow_shift": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:456"),
    "sigmoid_scale": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:462"),
    "weighting_scheme": Option(STR, 'none', "src/musubi_tuner/training/parser_common.py:468"),
    "logit_mean": Option(FLOAT, 0.0, "src/musubi_tuner/training/parser_common.py:475"),
    "logit_std": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:481"),
    "mode_scale": Option(FLOAT, 1.29, "src/musubi_tuner/training/parser_common.py:487"),
    "min_timestep": Option(INT, None, "src/musubi_tuner/training/parser_common.py:493"),
    "max_timestep": Option(INT, None, "src/musubi_tuner/training/parser_common.py:499"),
    "preserve_distribution_shape": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:505"),
    "num_timestep_buckets": Option(INT, None, "src/musubi_tuner/training/parser_common.py:514"),
    "show_timesteps": Option(STR, None, "src/musubi_tuner/training/parser_common.py:528"),
    "no_metadata": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:538"),
    "network_weights": Option(STR, None, "src/musubi_tuner/training/parser_common.py:541"),
    "network_module": Option(STR, None, "src/musubi_tuner/training/parser_common.py:544"),
    "network_dim": Option(INT, None, "src/musubi_tuner/training/parser_common.py:547"),
    "network_alpha": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:553"),
    "network_dropout": Option(FLOAT, None, "src/musubi_tuner/training/parser_common.py:559"),
    "network_args": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:565"),
    "training_comment": Option(STR, None, "src/musubi_tuner/training/parser_common.py:572"),
    "dim_from_weights": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:578"),
    "scale_weight_norms": Option(FLOAT, None, "src/musubi_tuner/training/parser_common.py:583"),
    "base_weights": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:589"),
    "base_weights_multiplier": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:596"),
    "output_dir": Option(STR, None, "src/musubi_tuner/training/parser_common.py:606"),
    "output_name": Option(STR, None, "src/musubi_tuner/training/parser_common.py:609"),
    "resume": Option(STR, None, "src/musubi_tuner/training/parser_common.py:615"),
    "save_every_n_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:617"),
    "save_every_n_steps": Option(INT, None, "src/musubi_tuner/training/parser_common.py:623"),
    "save_last_n_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:629"),
    "save_last_n_epochs_state": Option(INT, None, "src/musubi_tuner/training/parser_common.py:635"),
    "save_last_n_steps": Option(INT, None, "src/musubi_tuner/training/parser_common.py:641"),
    "save_last_n_steps_state": Option(INT, None, "src/musubi_tuner/training/parser_common.py:647"),
    "save_state": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:653"),
    "save_state_on_train_end": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:658"),
    "metadata_title": Option(STR, None, "src/musubi_tuner/training/parser_common.py:668"),
    "metadata_author": Option(STR, None, "src/musubi_tuner/training/parser_common.py:674"),
    "metadata_description": Option(STR, None, "src/musubi_tuner/training/parser_common.py:680"),
    "metadata_license": Option(STR, None, "src/musubi_tuner/training/parser_common.py:686"),
    "metadata_tags": Option(STR, None, "src/musubi_tuner/training/parser_common.py:692"),
    "metadata_reso": Option(STR, None, "src/musubi_tuner/training/parser_common.py:698"),
    "metadata_arch": Option(STR, None, "src/musubi_tuner/training/parser_common.py:704"),
    "huggingface_repo_id": Option(STR, None, "src/musubi_tuner/training/parser_common.py:713"),
    "huggingface_repo_type": Option(STR, None, "src/musubi_tuner/training/parser_common.py:719"),
    "huggingface_path_in_repo": Option(STR, None, "src/musubi_tuner/training/parser_common.py:725"),
    "huggingface_token": Option(STR, None, "src/musubi_tuner/training/parser_common.py:731"),
    "huggingface_repo_visibility": Option(STR, None, "src/musubi_tuner/training/parser_common.py:732"),
    "save_state_to_huggingface": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:738"),
    "resume_from_huggingface": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:741"),
    "async_upload": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:746"),
    "dit": Option(STR, None, "src/musubi_tuner/training/parser_common.py:754"),
    "vae": Option(STR, None, "src/musubi_tuner/training/parser_common.py:755"),
    "vae_dtype": Option(STR, None, "src/musubi_tuner/training/parser_common.py:756"),
    "fp8_scaled": Option(BOOL, False, "src/musubi_tuner/qwen_image_train_network.py:592"),
    "text_encoder": Option(STR, None, "src/musubi_tuner/qwen_image_train_network.py:593"),
    "fp8_vl": Option(BOOL, False, "src/musubi_tuner/qwen_image_train_network.py:594"),
    "num_layers": Option(INT, None, "src/musubi_tuner/qwen_image_train_network.py:595"),
    "remove_first_image_from_target": Option(BOOL, False, "src/musubi_tuner/qwen_image_train_network.py:596"),
    "edit": Option(BOOL, False, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1551"),
    "edit_plus": Option(BOOL, False, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1554"),
    "model_version": Option(STR, None, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1557"),
}
# The caching scripts' own options fitfinder reads (qwen_image_cache_text_encoder_outputs.py main and
# cache_text_encoder_outputs.py setup_parser; qwen_image_cache_latents.py, cache_latents.py).
CACHE_OPTIONS: dict[str, Option] = {
    "dataset_config": Option(STR, None, "src/musubi_tuner/cache_latents.py:381"),
    "batch_size": Option(INT, None, "src/musubi_tuner/cache_latents.py:386"),
    "fp8_vl": Option(BOOL, False, "src/musubi_tuner/qwen_image_cache_text_encoder_outputs.py:178"),
    "skip_existing": Option(BOOL, False, "src/musubi_tuner/cache_latents.py:389"),
    "keep_cache": Option(BOOL, False, "src/musubi_tuner/cache_latents.py:390"),
}


@dataclass(frozen=True)
class Script:
    name: str
    family: str
    options: dict[str, Option]
    checkpoint: str
    default_arch: str
    decide: Callable | None
    cache_scripts: tuple[str, str]  # the text encoder's and the latents' caching scripts


def _qwen_arch(header) -> str:
    """load_qwen_image_model reads 60 blocks unless --num_layers; the shipped architecture is the
    published transformer's (a checkpoint with another block count keeps it: see the notes)."""
    return "qwen-image"


SCRIPTS = {"qwen_image_train_network.py": Script(
    "qwen_image_train_network.py", "qwen_image", QWEN_OPTIONS, "dit", "qwen-image", _qwen_arch,
    ("qwen_image_cache_text_encoder_outputs.py", "qwen_image_cache_latents.py"))}
TO_COME = ("wan_train_network.py", "flux_kontext_train_network.py", "zimage_train_network.py",
           "flux_2_train_network.py", "hv_train_network.py", "fpack_train_network.py", "qwen_image_train.py")


def infer_script(flat: dict[str, Any]) -> str | None:
    """The script a config TOML is for, where its keys decide it: Qwen-Image's LoRA module, or its
    text encoder beside `dit` with a model_version; `dit` with `task` is Wan's (to come)."""
    keys = set(flat)
    module = str(flat.get("network_module") or "")
    if module == "networks.lora_qwen_image" or ({"dit", "text_encoder"} <= keys and "model_version" in keys):
        return "qwen_image_train_network.py"
    if module == "networks.lora_wan" or {"dit", "task"} <= keys:
        return "wan_train_network.py"
    return None


def options(script: Script) -> dict[str, Option]:
    return script.options


def check(job: KohyaJob) -> None:
    version = str(job.get("model_version") or ("edit-2509" if job.get("edit_plus") else "edit" if job.get("edit")
                                               else "original")).lower()
    if version != "original":
        raise UserError(f"{job.source}: --model_version {version}: fitfinder follows Qwen-Image's text-to-image "
                        "training (original); the edit and layered versions are to come")
    if job.get("fp8_scaled") and not job.get("fp8_base"):
        raise UserError(f"{job.source}: fp8_scaled without fp8_base: musubi-tuner refuses it "
                        "(trainer_base.py _validate_args_and_init: 'fp8_scaled requires fp8_base')")
    if not job.get("network_dim"):
        raise UserError(f"{job.source}: network_dim: missing; musubi-tuner creates the LoRA with it")
    if job.get("num_layers") not in (None, 60):
        job.notes.append(f"--num_layers {job.get('num_layers')} is not modelled: the architecture keeps its blocks")
    _kohya.not_modelled(job, {
        "gradient_checkpointing_cpu_offload": "activations kept in host memory: the estimate may be high",
        "fused_backward_pass": "the estimate may be high",
        "block_swap_h2d_only": "its ring buffers are not modelled",
        "img_in_txt_in_offloading": "the input layers' offloading is not modelled",
        "network_weights": "a LoRA read from a file is probed as a new one",
        "compile": "compiled graphs may hold other buffers",
    })


# -- the dataset TOML (dataset/config_utils.py) ---------------------------------------------------
# BaseDatasetParams: resolution (960, 544), batch_size 1 (config_utils.py:33); a dataset's table wins
# over [general] (BlueprintGenerator: dataset, general, defaults), no command-line fallback.
_DATASET_DEFAULTS = {"resolution": [960, 544], "batch_size": 1}


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


# -- knobs, in musubi-tuner's names ---------------------------------------------------------------------
def max_blocks_to_swap(arch: dict) -> int:
    """QwenImageTransformer2DModel.enable_block_swap (qwen_image/qwen_image_model.py): at most one
    block fewer than the model has."""
    return int(arch["parts"]["transformer"].get("num_layers", 60)) - 1


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


def knob_specs(job: KohyaJob) -> list[KnobSpec]:
    arch = job.architecture_spec()["arch"]
    found = [_kohya.buckets_knob(job), _kohya.rank_knob(job), quantize_knob(job),
             _kohya.optimizer_knob(job, DEFAULT_OPTIMIZER), _kohya.sampling_knob(job), _kohya.batch_knob(job),
             _kohya.switch_knob("gradient_checkpointing", "gradient_checkpointing", job, frozenset({"train"}), True),
             _kohya.swap_knob(job, max_blocks_to_swap(arch), frozenset({"load", "sample", "train", "last_sample"}))]
    return [knob for knob in found if knob is not None and len(knob.candidates) > 1]


# -- the recipe ------------------------------------------------------------------------------------------
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


def _cache_flag(job: KohyaJob, script: str, name: str) -> Any:
    for command in job.caching:
        if command["script"] == script and name in command["flags"]:
            return command["flags"][name]
    return None


def recipe(job: KohyaJob, arch: dict) -> dict[str, Any]:
    """qwen_image_train_network.py's recipe, with its two caching scripts (probe/protocol.py TrainerRecipe).

    - Text: qwen_image_cache_text_encoder_outputs.py, its own process: Qwen2.5-VL alone on the card,
      in bf16 or with --fp8_vl in float8_e4m3fn (load_qwen2_5_vl(dtype=vl_dtype, device=device)), its
      --batch_size captions at a time (else the dataset's batch_size), under autocast.
    - Latents: qwen_image_cache_latents.py, its own process: the VAE alone on the card.
    - Load: the DiT to the card (trainer_base.py _load_dit_and_swap: loading_device is the card unless
      --blocks_to_swap, then the CPU and move_to_device_except_swap_blocks); with --fp8_base and
      --fp8_scaled the blocks' Linear weights in float8_e4m3fn with a bf16 scale per 64 weights
      (fp8_optimization_utils.py quantize_weight, block mode; FP8_OPTIMIZATION_TARGET_KEYS
      "transformer_blocks", EXCLUDE "norm", "time_text_embed"), dequantized per layer in the forward
      (fp8_linear_forward_patch); with --fp8_base alone every weight in float8_e4m3fn (dit_weight_dtype),
      upcast per layer by autocast.
    - Train: the LoRA in fp32 (network_dtype: full_bf16 and full_fp16 are switched off in
      _prepare_with_accelerator), modulation layers left out (lora_qwen_image.py: exclude `_mod_`),
      every DiT call under accelerator.autocast().
    - Previews: their prompts are encoded before the DiT loads (process_sample_prompts: Qwen2.5-VL on
      the card, then deleted); the VAE waits in host memory and comes for the decode only.
    """
    dtype = _kohya.dtype_of_precision(job.get("mixed_precision") or job.launcher.get("mixed_precision"))
    text_script, latent_script = job.script.cache_scripts
    fp8_vl = bool(_cache_flag(job, text_script, "fp8_vl") or job.get("fp8_vl"))
    level = quantize_level(job)
    swap = int(job.get("blocks_to_swap") or 0)
    batch = int(job.get("datasets[0].batch_size"))
    return {
        "name": REPO, "script": job.script.name,
        "weights": {"transformer": {"none": "bf16", "fp8": "fp8", "fp8_scaled": "fp8_scaled"}[level],
                    "text_encoder": "fp8" if fp8_vl else "bf16", "vae": "bf16"},
        "residency": {"load": ["transformer"], "text_encoder": ["text_encoder"], "latents": ["vae"],
                      "sample": ["transformer"], "train": ["transformer"], "last_sample": ["transformer"]},
        "decode": ["vae"],
        "autocast": dtype if dtype != "fp32" else None,
        "swapped": {"transformer_blocks": min(swap, max_blocks_to_swap(arch))} if swap else {},
        "lora_input_cast": False,
        "text_batch": int(_cache_flag(job, text_script, "batch_size") or batch),
        "latent_batch": int(_cache_flag(job, latent_script, "batch_size") or batch),
    }


def probe_request(job: KohyaJob, **run) -> dict:
    spec = run.pop("spec", None) or job.model_spec()
    prompts = _kohya.prompt_lines(job)
    # process_sample_prompts: 256x256 unless --w/--h; do_inference: cfg_scale 4.0 unless --l
    sample = _kohya.sample_settings(job, prompts, width=256, height=256, steps=20, guidance_key="l",
                                    guidance=4.0, first=phases_run(job, {}), sample_steps=run.pop("sample_steps"))
    # lora_qwen_image.create_arch_network: modulation layers (`_mod_`) are left out of the LoRA
    return _kohya.request(job, spec, recipe(job, spec["arch"]), sample, rank_ignore=["img_mod", "txt_mod"], **run)
