"""kohya sd-scripts: its argument parser's defaults, its scripts, its knobs, its recipe (kohya-ss/sd-scripts).

What is read here is public source (kohya-ss/sd-scripts, commit 48d368fa, 2026-02-16), cited by
file and line or function beside each rule; docs/trainers.md gathers the rules in tables.

Scripts: `flux_train_network.py` (FLUX.1 dev and schnell). The others (sdxl_train_network.py,
sd3_train_network.py, train_network.py, lumina_train_network.py, Chroma by --model_type) follow
this module's pattern and are refused by name until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fitfinder.errors import UserError
from fitfinder.trainers import _kohya
from fitfinder.trainers._kohya import BOOL, FLOAT, INT, LIST, STR, KnobSpec, KohyaJob, Option

REPO = "sd-scripts"
# train_util.get_optimizer: an empty optimizer_type is AdamW.
DEFAULT_OPTIMIZER = "adamw"

# Every option of flux_train_network.py's parser with its default: library/train_util.py (the shared
# argument groups), train_network.py setup_parser, library/flux_train_utils.py add_flux_train_arguments,
# flux_train_network.py setup_parser (file:line of each add_argument, at commit 48d368fa).
FLUX_OPTIONS: dict[str, Option] = {
    "v2": Option(BOOL, False, "library/train_util.py:3643"),
    "v_parameterization": Option(BOOL, False, "library/train_util.py:3646"),
    "pretrained_model_name_or_path": Option(STR, None, "library/train_util.py:3649"),
    "tokenizer_cache_dir": Option(STR, None, "library/train_util.py:3655"),
    "optimizer_type": Option(STR, '', "library/train_util.py:3678"),
    "use_8bit_adam": Option(BOOL, False, "library/train_util.py:3690"),
    "use_lion_optimizer": Option(BOOL, False, "library/train_util.py:3695"),
    "learning_rate": Option(FLOAT, 2e-06, "library/train_util.py:3701"),
    "max_grad_norm": Option(FLOAT, 1.0, "library/train_util.py:3702"),
    "optimizer_args": Option(LIST, None, "library/train_util.py:3709"),
    "lr_scheduler_type": Option(STR, '', "library/train_util.py:3731"),
    "lr_scheduler_args": Option(LIST, None, "library/train_util.py:3732"),
    "lr_scheduler": Option(STR, 'constant', "library/train_util.py:3740"),
    "lr_warmup_steps": Option(STR, 0, "library/train_util.py:3746"),
    "lr_decay_steps": Option(STR, 0, "library/train_util.py:3753"),
    "lr_scheduler_num_cycles": Option(INT, 1, "library/train_util.py:3760"),
    "lr_scheduler_power": Option(FLOAT, 1.0, "library/train_util.py:3766"),
    "fused_backward_pass": Option(BOOL, False, "library/train_util.py:3772"),
    "lr_scheduler_timescale": Option(INT, None, "library/train_util.py:3778"),
    "lr_scheduler_min_lr_ratio": Option(FLOAT, None, "library/train_util.py:3785"),
    "output_dir": Option(STR, None, "library/train_util.py:3795"),
    "output_name": Option(STR, None, "library/train_util.py:3798"),
    "huggingface_repo_id": Option(STR, None, "library/train_util.py:3801"),
    "huggingface_repo_type": Option(STR, None, "library/train_util.py:3807"),
    "huggingface_path_in_repo": Option(STR, None, "library/train_util.py:3813"),
    "huggingface_token": Option(STR, None, "library/train_util.py:3819"),
    "huggingface_repo_visibility": Option(STR, None, "library/train_util.py:3820"),
    "save_state_to_huggingface": Option(BOOL, False, "library/train_util.py:3826"),
    "resume_from_huggingface": Option(BOOL, False, "library/train_util.py:3829"),
    "async_upload": Option(BOOL, False, "library/train_util.py:3834"),
    "save_precision": Option(STR, None, "library/train_util.py:3839"),
    "save_every_n_epochs": Option(INT, None, "library/train_util.py:3846"),
    "save_every_n_steps": Option(INT, None, "library/train_util.py:3852"),
    "save_n_epoch_ratio": Option(INT, None, "library/train_util.py:3858"),
    "save_last_n_epochs": Option(INT, None, "library/train_util.py:3864"),
    "save_last_n_epochs_state": Option(INT, None, "library/train_util.py:3870"),
    "save_last_n_steps": Option(INT, None, "library/train_util.py:3876"),
    "save_last_n_steps_state": Option(INT, None, "library/train_util.py:3882"),
    "save_state": Option(BOOL, False, "library/train_util.py:3888"),
    "save_state_on_train_end": Option(BOOL, False, "library/train_util.py:3893"),
    "resume": Option(STR, None, "library/train_util.py:3898"),
    "train_batch_size": Option(INT, 1, "library/train_util.py:3900"),
    "max_token_length": Option(INT, None, "library/train_util.py:3901"),
    "mem_eff_attn": Option(BOOL, False, "library/train_util.py:3908"),
    "torch_compile": Option(BOOL, False, "library/train_util.py:3913"),
    "dynamo_backend": Option(STR, 'inductor', "library/train_util.py:3916"),
    "xformers": Option(BOOL, False, "library/train_util.py:3939"),
    "sdpa": Option(BOOL, False, "library/train_util.py:3940"),
    "vae": Option(STR, None, "library/train_util.py:3945"),
    "max_train_steps": Option(INT, 1600, "library/train_util.py:3952"),
    "max_train_epochs": Option(INT, None, "library/train_util.py:3953"),
    "max_data_loader_n_workers": Option(INT, 8, "library/train_util.py:3959"),
    "persistent_data_loader_workers": Option(BOOL, False, "library/train_util.py:3965"),
    "seed": Option(INT, None, "library/train_util.py:3970"),
    "gradient_checkpointing": Option(BOOL, False, "library/train_util.py:3971"),
    "gradient_accumulation_steps": Option(INT, 1, "library/train_util.py:3974"),
    "mixed_precision": Option(STR, 'no', "library/train_util.py:3980"),
    "full_fp16": Option(BOOL, False, "library/train_util.py:3987"),
    "full_bf16": Option(BOOL, False, "library/train_util.py:3992"),
    "fp8_base": Option(BOOL, False, "library/train_util.py:3997"),
    "ddp_timeout": Option(INT, None, "library/train_util.py:4003"),
    "ddp_gradient_as_bucket_view": Option(BOOL, False, "library/train_util.py:4009"),
    "ddp_static_graph": Option(BOOL, False, "library/train_util.py:4014"),
    "clip_skip": Option(INT, None, "library/train_util.py:4019"),
    "logging_dir": Option(STR, None, "library/train_util.py:4025"),
    "log_with": Option(STR, None, "library/train_util.py:4031"),
    "log_prefix": Option(STR, None, "library/train_util.py:4038"),
    "log_tracker_name": Option(STR, None, "library/train_util.py:4041"),
    "wandb_run_name": Option(STR, None, "library/train_util.py:4047"),
    "log_tracker_config": Option(STR, None, "library/train_util.py:4053"),
    "wandb_api_key": Option(STR, None, "library/train_util.py:4059"),
    "log_config": Option(BOOL, False, "library/train_util.py:4065"),
    "noise_offset": Option(FLOAT, None, "library/train_util.py:4067"),
    "noise_offset_random_strength": Option(BOOL, False, "library/train_util.py:4073"),
    "multires_noise_iterations": Option(INT, None, "library/train_util.py:4078"),
    "ip_noise_gamma": Option(FLOAT, None, "library/train_util.py:4084"),
    "ip_noise_gamma_random_strength": Option(BOOL, False, "library/train_util.py:4091"),
    "multires_noise_discount": Option(FLOAT, 0.3, "library/train_util.py:4103"),
    "adaptive_noise_scale": Option(FLOAT, None, "library/train_util.py:4109"),
    "zero_terminal_snr": Option(BOOL, False, "library/train_util.py:4115"),
    "min_timestep": Option(INT, None, "library/train_util.py:4120"),
    "max_timestep": Option(INT, None, "library/train_util.py:4126"),
    "loss_type": Option(STR, 'l2', "library/train_util.py:4132"),
    "huber_schedule": Option(STR, 'snr', "library/train_util.py:4139"),
    "huber_c": Option(FLOAT, 0.1, "library/train_util.py:4147"),
    "huber_scale": Option(FLOAT, 1.0, "library/train_util.py:4155"),
    "lowram": Option(BOOL, False, "library/train_util.py:4163"),
    "highvram": Option(BOOL, False, "library/train_util.py:4168"),
    "sample_every_n_steps": Option(INT, None, "library/train_util.py:4175"),
    "sample_at_first": Option(BOOL, False, "library/train_util.py:4181"),
    "sample_every_n_epochs": Option(INT, None, "library/train_util.py:4184"),
    "sample_prompts": Option(STR, None, "library/train_util.py:4190"),
    "sample_sampler": Option(STR, 'ddim', "library/train_util.py:4196"),
    "config_file": Option(STR, None, "library/train_util.py:4221"),
    "output_config": Option(BOOL, False, "library/train_util.py:4227"),
    "prior_loss_weight": Option(FLOAT, 1.0, "library/train_util.py:4232"),
    "conditioning_data_dir": Option(STR, None, "library/train_util.py:4238"),
    "masked_loss": Option(BOOL, False, "library/train_util.py:4244"),
    "cache_text_encoder_outputs": Option(BOOL, False, "library/train_util.py:4253"),
    "cache_text_encoder_outputs_to_disk": Option(BOOL, False, "library/train_util.py:4256"),
    "text_encoder_batch_size": Option(INT, None, "library/train_util.py:4261"),
    "disable_mmap_load_safetensors": Option(BOOL, False, "library/train_util.py:4270"),
    "weighting_scheme": Option(STR, 'uniform', "library/train_util.py:4277"),
    "logit_mean": Option(FLOAT, 0.0, "library/train_util.py:4285"),
    "logit_std": Option(FLOAT, 1.0, "library/train_util.py:4291"),
    "mode_scale": Option(FLOAT, 1.29, "library/train_util.py:4297"),
    "blocks_to_swap": Option(INT, None, "library/train_util.py:4305"),
    "train_data_dir": Option(STR, None, "library/train_util.py:4479"),
    "cache_info": Option(BOOL, False, "library/train_util.py:4482"),
    "shuffle_caption": Option(BOOL, False, "library/train_util.py:4488"),
    "caption_separator": Option(STR, ',', "library/train_util.py:4491"),
    "caption_extension": Option(STR, '.caption', "library/train_util.py:4492"),
    "caption_extention": Option(STR, None, "library/train_util.py:4495"),
    "keep_tokens": Option(INT, 0, "library/train_util.py:4501"),
    "keep_tokens_separator": Option(STR, '', "library/train_util.py:4507"),
    "secondary_separator": Option(STR, None, "library/train_util.py:4514"),
    "enable_wildcard": Option(BOOL, False, "library/train_util.py:4521"),
    "caption_prefix": Option(STR, None, "library/train_util.py:4526"),
    "caption_suffix": Option(STR, None, "library/train_util.py:4532"),
    "color_aug": Option(BOOL, False, "library/train_util.py:4538"),
    "flip_aug": Option(BOOL, False, "library/train_util.py:4541"),
    "face_crop_aug_range": Option(STR, None, "library/train_util.py:4544"),
    "random_crop": Option(BOOL, False, "library/train_util.py:4550"),
    "debug_dataset": Option(BOOL, False, "library/train_util.py:4555"),
    "resolution": Option(STR, None, "library/train_util.py:4560"),
    "cache_latents": Option(BOOL, False, "library/train_util.py:4566"),
    "vae_batch_size": Option(INT, 1, "library/train_util.py:4571"),
    "cache_latents_to_disk": Option(BOOL, False, "library/train_util.py:4574"),
    "skip_cache_check": Option(BOOL, False, "library/train_util.py:4579"),
    "enable_bucket": Option(BOOL, False, "library/train_util.py:4585"),
    "min_bucket_reso": Option(INT, 256, "library/train_util.py:4590"),
    "max_bucket_reso": Option(INT, 1024, "library/train_util.py:4597"),
    "bucket_reso_steps": Option(INT, 64, "library/train_util.py:4604"),
    "bucket_no_upscale": Option(BOOL, False, "library/train_util.py:4610"),
    "resize_interpolation": Option(STR, None, "library/train_util.py:4615"),
    "token_warmup_min": Option(INT, 1, "library/train_util.py:4622"),
    "token_warmup_step": Option(FLOAT, 0.0, "library/train_util.py:4628"),
    "alpha_mask": Option(BOOL, False, "library/train_util.py:4634"),
    "dataset_class": Option(STR, None, "library/train_util.py:4640"),
    "caption_dropout_rate": Option(FLOAT, 0.0, "library/train_util.py:4650"),
    "caption_dropout_every_n_epochs": Option(INT, 0, "library/train_util.py:4653"),
    "caption_tag_dropout_rate": Option(FLOAT, 0.0, "library/train_util.py:4659"),
    "reg_data_dir": Option(STR, None, "library/train_util.py:4668"),
    "in_json": Option(STR, None, "library/train_util.py:4674"),
    "dataset_repeats": Option(INT, 1, "library/train_util.py:4677"),
    "use_safetensors": Option(BOOL, False, "library/train_util.py:4693"),
    "cpu_offload_checkpointing": Option(BOOL, False, "train_network.py:1746"),
    "no_metadata": Option(BOOL, False, "train_network.py:1752"),
    "save_model_as": Option(STR, 'safetensors', "train_network.py:1755"),
    "unet_lr": Option(FLOAT, None, "train_network.py:1763"),
    "text_encoder_lr": Option(LIST, None, "train_network.py:1764"),
    "fp8_base_unet": Option(BOOL, False, "train_network.py:1771"),
    "network_weights": Option(STR, None, "train_network.py:1778"),
    "network_module": Option(STR, None, "train_network.py:1781"),
    "network_dim": Option(INT, None, "train_network.py:1784"),
    "network_alpha": Option(FLOAT, 1.0, "train_network.py:1790"),
    "network_dropout": Option(FLOAT, None, "train_network.py:1796"),
    "network_args": Option(LIST, None, "train_network.py:1802"),
    "network_train_unet_only": Option(BOOL, False, "train_network.py:1809"),
    "network_train_text_encoder_only": Option(BOOL, False, "train_network.py:1812"),
    "training_comment": Option(STR, None, "train_network.py:1817"),
    "dim_from_weights": Option(BOOL, False, "train_network.py:1823"),
    "scale_weight_norms": Option(FLOAT, None, "train_network.py:1828"),
    "base_weights": Option(LIST, None, "train_network.py:1834"),
    "base_weights_multiplier": Option(LIST, None, "train_network.py:1841"),
    "no_half_vae": Option(BOOL, False, "train_network.py:1848"),
    "skip_until_initial_step": Option(BOOL, False, "train_network.py:1853"),
    "initial_epoch": Option(INT, None, "train_network.py:1858"),
    "initial_step": Option(INT, None, "train_network.py:1865"),
    "validation_seed": Option(INT, None, "train_network.py:1872"),
    "validation_split": Option(FLOAT, 0.0, "train_network.py:1878"),
    "validate_every_n_steps": Option(INT, None, "train_network.py:1884"),
    "validate_every_n_epochs": Option(INT, None, "train_network.py:1890"),
    "max_validation_steps": Option(INT, None, "train_network.py:1896"),
    "clip_l": Option(STR, None, "library/flux_train_utils.py:618"),
    "t5xxl": Option(STR, None, "library/flux_train_utils.py:623"),
    "ae": Option(STR, None, "library/flux_train_utils.py:628"),
    "controlnet_model_name_or_path": Option(STR, None, "library/flux_train_utils.py:629"),
    "t5xxl_max_token_length": Option(INT, None, "library/flux_train_utils.py:635"),
    "apply_t5_attn_mask": Option(BOOL, False, "library/flux_train_utils.py:642"),
    "guidance_scale": Option(FLOAT, 3.5, "library/flux_train_utils.py:648"),
    "timestep_sampling": Option(STR, 'sigma', "library/flux_train_utils.py:655"),
    "sigmoid_scale": Option(FLOAT, 1.0, "library/flux_train_utils.py:662"),
    "model_prediction_type": Option(STR, 'sigma_scaled', "library/flux_train_utils.py:668"),
    "discrete_flow_shift": Option(FLOAT, 3.0, "library/flux_train_utils.py:677"),
    "model_type": Option(STR, 'flux', "library/flux_train_utils.py:684"),
    "split_mode": Option(BOOL, False, "flux_train_network.py:528"),
}
FLUX_OPTIONS["dataset_config"] = Option(STR, None, "library/config_util.py:46")


@dataclass(frozen=True)
class Script:
    name: str
    family: str
    options: dict[str, Option]
    checkpoint: str  # the option naming the denoiser's .safetensors file
    default_arch: str
    decide: Callable | None  # the checkpoint's header -> a shipped architecture


def _flux_arch(header) -> str:
    """flux_utils.analyze_checkpoint_state: schnell has no guidance embedder (`guidance_in`)."""
    return "flux-dev" if header.has("guidance_in") else "flux-schnell"


SCRIPTS = {"flux_train_network.py": Script("flux_train_network.py", "flux", FLUX_OPTIONS,
                                           "pretrained_model_name_or_path", "flux-dev", _flux_arch)}
# Scripts of sd-scripts that fitfinder knows and does not follow yet, named so a job of one is told so.
TO_COME = ("sdxl_train_network.py", "sd3_train_network.py", "train_network.py", "lumina_train_network.py",
           "anima_train_network.py", "hunyuan_image_train_network.py")


def infer_script(flat: dict[str, Any]) -> str | None:
    """The script a config TOML is for, where its keys decide it (t5xxl with ae: FLUX.1's, as
    flux_train_utils.add_flux_train_arguments declares them)."""
    if {"t5xxl", "ae"} <= set(flat) or flat.get("network_module") == "networks.lora_flux":
        return "flux_train_network.py"
    return None


def options(script: Script) -> dict[str, Option]:
    return script.options


def check(job: KohyaJob) -> None:
    """What fitfinder reads, checked at once; what it does not follow, named."""
    if str(job.get("model_type") or "flux") != "flux":
        raise UserError(f"{job.source}: --model_type {job.get('model_type')}: fitfinder follows FLUX.1 (dev, "
                        "schnell) in flux_train_network.py; Chroma is to come")
    if not job.get("network_dim"):
        raise UserError(f"{job.source}: network_dim: missing; train_network.py creates the LoRA with it")
    if str(job.get("network_module") or "") not in ("networks.lora_flux", ""):
        job.notes.append(f"--network_module {job.get('network_module')} is probed as networks.lora_flux's LoRA")
    if job.get("blocks_to_swap") and job.get("cpu_offload_checkpointing"):
        raise UserError(f"{job.source}: blocks_to_swap with cpu_offload_checkpointing: flux_train_network.py "
                        "refuses the two together (FluxNetworkTrainer.assert_extra_args)")
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
    if not job.get("network_train_unet_only"):
        job.notes.append("--network_train_unet_only is not set: CLIP-L's LoRA is not modelled (the estimate may be "
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
def max_blocks_to_swap(arch: dict) -> int:
    """Flux.enable_block_swap (library/flux_models.py): n blocks swap n//2 double blocks and
    (n - n//2) * 2 single ones, at most two fewer than each kind has; the largest n that allows."""
    transformer = arch["parts"]["transformer"]
    double, single = int(transformer.get("num_layers", 19)), int(transformer.get("num_single_layers", 38))
    most = 0
    for n in range(1, double + single + 1):
        if n // 2 <= double - 2 and (n - n // 2) * 2 <= single - 2:
            most = n
    return most


def swapped_blocks(arch: dict, n: int) -> dict[str, int]:
    """The blocks whose weights stay in host memory (diffusers' names for BFL's double and single blocks)."""
    return {"transformer_blocks": n // 2, "single_transformer_blocks": (n - n // 2) * 2} if n else {}


def quantize_knob(job: KohyaJob) -> KnobSpec:
    """fp8_base: the DiT in float8_e4m3fn (and the text encoders, unless fp8_base_unet)."""
    desired = "8bit" if job.get("fp8_base") or job.get("fp8_base_unet") else "none"
    values = ("8bit", "none") if desired == "none" else ("8bit",)

    def write(target: KohyaJob, level: str, space) -> None:
        target.set("fp8_base", level == "8bit")
        if level == "none":
            target.set("fp8_base_unet", False)

    return KnobSpec("quantize", "quality", values, desired, ("fp8_base", "fp8_base_unet"), _kohya.ALL, "fp8_base",
                    lambda v: "on" if v == "8bit" else "off", write)


def text_encoder_knob(job: KohyaJob) -> KnobSpec | None:
    if job.get("cache_text_encoder_outputs") or job.get("cache_text_encoder_outputs_to_disk"):
        return None  # already off the device while training

    def write(target: KohyaJob, mode: str, space) -> None:
        target.set("cache_text_encoder_outputs", mode == "cache")

    return KnobSpec("text_encoder", "quality", ("cache", "keep"), "keep", ("cache_text_encoder_outputs",),
                    _kohya.ALL, "cache_text_encoder_outputs", lambda v: "on" if v == "cache" else "off", write)


def knob_specs(job: KohyaJob) -> list[KnobSpec]:
    arch = job.architecture_spec()["arch"]
    found = [_kohya.buckets_knob(job), _kohya.rank_knob(job), quantize_knob(job),
             _kohya.optimizer_knob(job, DEFAULT_OPTIMIZER),
             _kohya.sampling_knob(job), text_encoder_knob(job), _kohya.batch_knob(job),
             _kohya.switch_knob("gradient_checkpointing", "gradient_checkpointing", job, frozenset({"train"}), True),
             _kohya.swap_knob(job, max_blocks_to_swap(arch), frozenset({"sample", "train", "last_sample"}))]
    return [knob for knob in found if knob is not None and len(knob.candidates) > 1]


# -- the recipe: what flux_train_network.py holds on the card in each phase -----------------------------
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


def recipe(job: KohyaJob, arch: dict) -> dict[str, Any]:
    """flux_train_network.py's recipe as the probe's `trainer` field (probe/protocol.py TrainerRecipe).

    - Load: every part in host memory (FluxNetworkTrainer.load_target_model loads to "cpu"); the
      DiT in float8_e4m3fn with --fp8_base (cast there, or read as is from an fp8 file).
    - Latents: with --cache_latents the AE alone on the card (NetworkTrainer.train: vae.to(device),
      new_cache_latents, vae.to("cpu")), vae_batch_size images at a time (default 1).
    - Text: with --cache_text_encoder_outputs CLIP-L and T5XXL alone on the card
      (cache_text_encoder_outputs_if_needed moves the DiT and AE to the CPU first, unless --lowram),
      text_encoder_batch_size captions at a time (else the dataset's batch_size), then back to the CPU
      and deleted before training (is_text_encoder_not_needed_for_training). T5XXL as its file is with
      --fp8_base (fp8 file: float8 weights, norms and embeddings in the weight dtype,
      prepare_text_encoder_fp8), else cast to the weight dtype. Without caching both stay on the card.
    - Train: the DiT on the card (prepare_unet_with_accelerator; with --blocks_to_swap every block but
      the swapped ones' Linear weights, move_to_device_except_swap_blocks), the LoRA in fp32 (its
      modules are made in fp32; --full_bf16 is not followed), every DiT call under
      accelerator.autocast(), so an fp8 weight is upcast per layer (one layer's bf16 copy at a time,
      held for the backward only inside a checkpointed block).
    - Previews: the DiT denoises; the AE comes to the card for the decode only and goes back
      (flux_train_utils.sample_image_inference: ae.to(device) ... ae.to(org_vae_device)).
    """
    dtype = _kohya.dtype_of_precision(job.get("mixed_precision"))
    fp8 = bool(job.get("fp8_base") or job.get("fp8_base_unet"))  # assert_extra_args: fp8_base_unet sets fp8_base
    te_fp8 = fp8 and not job.get("fp8_base_unet")
    cached_te = bool(job.get("cache_text_encoder_outputs") or job.get("cache_text_encoder_outputs_to_disk"))
    cached_latents = bool(job.get("cache_latents") or job.get("cache_latents_to_disk"))
    t5_file = _kohya.part_dtype(job, "t5xxl", dtype)
    if te_fp8 and (t5_file == "fp8" or not cached_te):
        t5 = "fp8"  # read as is from an fp8 file; or, kept for training, cast in train() (te_weight_dtype)
    else:
        t5 = dtype  # cast to the weight dtype on the card (cache_text_encoder_outputs_if_needed)
    clip = "fp8" if te_fp8 and not cached_te else dtype  # caching: "always not fp8"
    encoders = ["text_encoder", "text_encoder_2"]
    train = ["transformer"] + ([] if cached_te else encoders) + ([] if cached_latents else ["vae"])
    swap = int(job.get("blocks_to_swap") or 0)
    return {
        "name": REPO, "script": job.script.name,
        "weights": {"transformer": "fp8" if fp8 else dtype, "text_encoder": clip, "text_encoder_2": t5,
                    "vae": "fp32" if job.get("no_half_vae") else dtype},
        "residency": {"load": [], "text_encoder": encoders, "latents": ["vae"] if cached_latents else train,
                      "sample": train, "train": train, "last_sample": train},
        "decode": ["vae"],
        "autocast": dtype if dtype != "fp32" else None,
        "swapped": swapped_blocks(arch, min(swap, max_blocks_to_swap(arch))),
        "lora_input_cast": False,
        "text_batch": int(job.get("text_encoder_batch_size") or job.get("datasets[0].batch_size")),
        "latent_batch": int(job.get("vae_batch_size") or 1),
    }


def probe_request(job: KohyaJob, **run) -> dict:
    spec = run.pop("spec", None) or job.model_spec()
    arch = spec["arch"]
    prompts = _kohya.prompt_lines(job)
    sample = _kohya.sample_settings(job, prompts, width=512, height=512, steps=20, guidance_key="g",
                                    guidance=3.5, first=phases_run(job, {}), sample_steps=run.pop("sample_steps"))
    if prompts and any(float(p.get("l", 1.0) or 1.0) != 1.0 for p in prompts):
        _kohya._note(job, "--l (CFG) previews run the DiT twice: not modelled, the previews' estimate may be low")
    return _kohya.request(job, spec, recipe(job, arch), sample, rank_ignore=[], **run)
