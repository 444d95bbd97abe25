"""kohya's trainers: the winning AI Toolkit job written as sd-scripts / musubi-tuner settings, and read back.

sd-scripts trains the image families (flux, sdxl); musubi-tuner the video ones (wan). What is
written, in results/NAME/:

- `kohya.toml`: the training arguments, for `--config_file`. Both trainers flatten its
  sections into one namespace, so the sections are only for the reader's eyes.
- `kohya_dataset.toml`: the dataset config, for `--dataset_config`. AI Toolkit trains every
  image at every resolution of its list; the equivalent is one dataset per resolution over the
  same folder, each bucketed by aspect ratio at that resolution.
- `kohya_prompts.txt`: the preview prompts, each with its size, steps, guidance and seed.
- `kohya.sh`: the command line; the model files come from environment variables, since an AI
  Toolkit job names a Hugging Face repository and kohya's trainers want the files.

Every setting is reported as `exact`, `approximate` (written, but not the same thing: the fit
was not proven for it) or `none` (kohya has no equivalent, nothing written). The option names
are those of sd-scripts' train_util/config_util and musubi-tuner's parser_common/config_utils.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitfinder import jobconfig, models
from fitfinder.errors import UserError
from fitfinder.jobconfig import JobFile, one_line, write_atomic

FILES = ("kohya.toml", "kohya_dataset.toml", "kohya_prompts.txt", "kohya.sh")


@dataclass(frozen=True)
class Trainer:
    family: str
    repo: str  # sd-scripts | musubi-tuner
    script: str
    network_module: str
    model_files: tuple[tuple[str, str, str], ...]  # (option, environment variable, what file)
    max_blocks_to_swap: int | None = None
    guidance_flag: str = "--l"  # prompt-file option AI Toolkit's guidance_scale becomes
    cache_scripts: tuple[str, ...] = ()  # musubi-tuner caches latents and text before training

    @property
    def musubi(self) -> bool:
        return self.repo == "musubi-tuner"


_FLUX = Trainer(
    "flux", "sd-scripts", "flux_train_network.py", "networks.lora_flux",
    (("pretrained_model_name_or_path", "FLUX_MODEL", "the FLUX.1 transformer .safetensors (flux1-dev.safetensors)"),
     ("clip_l", "CLIP_L", "clip_l.safetensors"), ("t5xxl", "T5XXL", "t5xxl_fp16.safetensors"),
     ("ae", "AE", "ae.safetensors")),
    max_blocks_to_swap=35, guidance_flag="--g",  # FLUX.1-dev embeds guidance: `--g`, not CFG
)
_SDXL = Trainer(
    "sdxl", "sd-scripts", "sdxl_train_network.py", "networks.lora",
    (("pretrained_model_name_or_path", "SDXL_MODEL", "the SDXL checkpoint .safetensors"),),
)


# musubi-tuner's documented maximum of --blocks_to_swap for each Wan size.
_WAN_MAX_SWAP = {"1.3B": 29, "14B": 39}


def _wan(task: str) -> Trainer:
    swap = _WAN_MAX_SWAP["1.3B" if "1.3B" in task else "14B"]
    files = [("dit", "WAN_DIT", "the Wan DiT .safetensors (low-noise one for Wan 2.2)"),
             ("vae", "WAN_VAE", "Wan2.1_VAE.pth"), ("t5", "WAN_T5", "models_t5_umt5-xxl-enc-bf16.pth")]
    if "A14B" in task:
        files.insert(1, ("dit_high_noise", "WAN_DIT_HIGH_NOISE", "the Wan 2.2 high-noise DiT .safetensors"))
    if task == "i2v-14B":  # Wan 2.1 I2V conditions on a CLIP image encoder
        files.append(("clip", "WAN_CLIP", "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"))
    return Trainer("wan", "musubi-tuner", "src/musubi_tuner/wan_train_network.py", "networks.lora_wan",
                   tuple(files), max_blocks_to_swap=swap,
                   cache_scripts=("src/musubi_tuner/wan_cache_latents.py",
                                  "src/musubi_tuner/wan_cache_text_encoder_outputs.py"))


def trainer_for(job: JobFile) -> tuple[Trainer, dict[str, Any]]:
    """The kohya trainer for the job's model family (models.family_of, the family the search probed),
    and trainer-specific arguments (wan's task: the variant, read from model.arch and the name)."""
    family = models.family_of(job)
    if family == "flux":
        return _FLUX, {}
    if family == "sdxl":
        return _SDXL, {}
    # musubi-tuner's Wan tasks (wan_train_network.py --task); its TI2V-5B training is not one of them.
    tasks = {"wan22": "t2v-A14B", "wan22_i2v": "i2v-A14B", "wan21_i2v": "i2v-14B"}
    if family == "wan21":
        arch = str(job.get("model.arch", "") or "").lower()
        name = str(job.get("model.name_or_path", "") or "").lower()
        tasks["wan21"] = "t2v-1.3B" if "1.3b" in name or "1b" in arch else "t2v-14B"
    if family in tasks:
        return _wan(tasks[family]), {"task": tasks[family]}
    raise UserError(f"kohya export: no kohya trainer known for the {family} family; "
                    "supported: flux and sdxl (sd-scripts), wan21, wan21_i2v, wan22 and wan22_i2v (musubi-tuner)")


@dataclass
class Mapping:
    """One AI Toolkit setting and what became of it."""

    setting: str  # AI Toolkit key under config.process[0]
    value: Any
    kohya: str  # where it went, in kohya's words
    kind: str = "exact"  # exact | approximate | none
    note: str = ""


@dataclass
class Export:
    trainer: Trainer
    files: list[Path]
    rows: list[Mapping] = field(default_factory=list)


# -- writing ------------------------------------------------------------------------------------
_OPTIMIZERS = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "adafactor": "Adafactor", "lion": "Lion",
               "lion8bit": "Lion8bit", "prodigy": "Prodigy"}
_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
_SAVE_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "float"}
_SAMPLE_EVERY = 100  # AI Toolkit's SampleConfig default
_FP8 = re.compile(r"^(q?float8|fp8|qfloat8_e4m3fn|float8_e4m3fn)$")


def write(job: JobFile, out_dir: Path) -> Export:
    """Write the four files for `job` (the winner's job file) into `out_dir`."""
    trainer, extra = trainer_for(job)
    out_dir = Path(out_dir)
    rows: list[Mapping] = []
    args = _training_args(job, trainer, extra, rows)
    datasets = _dataset_config(job, trainer, rows)
    prompts = _prompts(job, trainer, args, rows)
    dtype = jobconfig.DTYPES[str(job.get("train.dtype")).lower()]
    header = [f"kohya {trainer.repo} settings for AI Toolkit job {job.source}, written by fitfinder.",
              f"Run kohya.sh (it passes this file as --config_file to {trainer.script})."]
    header += [f"not the same: {r.setting} = {_show(r.value)} -> {r.kohya} ({r.note})" for r in rows
               if r.kind == "approximate"]
    header += [f"no equivalent: {r.setting} = {_show(r.value)} ({r.note})" for r in rows if r.kind == "none"]
    files = [out_dir / "kohya.toml", out_dir / "kohya_dataset.toml"]
    write_atomic(files[0], _toml(args, header))
    write_atomic(files[1], _toml(datasets, [f"Dataset config for {trainer.script}, written by fitfinder."]))
    prompts_path = out_dir / "kohya_prompts.txt"
    if prompts:
        write_atomic(prompts_path, "\n".join(prompts) + "\n")
        files.append(prompts_path)
    else:
        prompts_path.unlink(missing_ok=True)  # a stale one from an earlier export would be read back
    files.append(out_dir / "kohya.sh")
    write_atomic(files[-1], _command(job, trainer, extra, bool(prompts), dtype), mode=0o777)
    return Export(trainer, files, rows)


def _training_args(job: JobFile, trainer: Trainer, extra: dict, rows: list[Mapping]) -> dict[str, dict]:
    """kohya.toml's sections: network, training, memory, sampling and saving."""
    def row(setting, value, kohya, kind="exact", note=""):
        rows.append(Mapping(setting, value, kohya, kind, note))

    if jobconfig.is_full_fine_tune(job):
        raise UserError(f"{job.source}: a full fine-tune (no `network`): the kohya export writes LoRA jobs only")
    network_type = str(job.get("network.type", "lora")).lower()
    rank, alpha = job.lora_rank, job.lora_alpha
    network = {"network_module": trainer.network_module, "network_dim": rank, "network_alpha": float(alpha)}
    row("network.type", network_type, f"network_module = {trainer.network_module}",
        "exact" if network_type == "lora" else "approximate",
        "" if network_type == "lora" else "kohya's LyCORIS module is a separate install; a plain LoRA is written")
    row("network.linear", rank, "network_dim")
    row("network.linear_alpha", int(alpha) if alpha.is_integer() else alpha, "network_alpha")

    batch = int(job.get("train.batch_size"))
    dtype = jobconfig.DTYPES[str(job.get("train.dtype")).lower()]
    optimizer = str(job.get("train.optimizer")).lower()
    training = {"max_train_steps": int(job.get("train.steps", 1000)), "learning_rate": float(job.get("train.lr")),
                "optimizer_type": _OPTIMIZERS.get(optimizer, optimizer),
                "gradient_accumulation_steps": job.accumulation,
                "gradient_checkpointing": bool(job.get("train.gradient_checkpointing")),
                "mixed_precision": _PRECISION[dtype], "sdpa": True}
    if not trainer.musubi:  # musubi-tuner takes the batch from the dataset config only
        training = {"train_batch_size": batch, **training}
    row("train.batch_size", batch, "batch_size in kohya_dataset.toml"
        + ("" if trainer.musubi else " (and train_batch_size)"))
    row(job.accumulation_key, job.accumulation, "gradient_accumulation_steps")
    row("train.gradient_checkpointing", training["gradient_checkpointing"], "gradient_checkpointing")
    row("train.dtype", dtype, f"mixed_precision = {_PRECISION[dtype]}")
    row("train.optimizer", optimizer, f"optimizer_type = {training['optimizer_type']}",
        "exact" if optimizer in _OPTIMIZERS else "approximate",
        "" if optimizer in _OPTIMIZERS else "no known kohya name: check optimizer_type")
    row("train.lr", training["learning_rate"], "learning_rate")
    row("train.steps", training["max_train_steps"], "max_train_steps")

    memory = _memory_args(job, trainer, row)
    sampling = _sampling_args(job, row)
    saving = {"output_dir": str(job.get("training_folder", "output")), "output_name": job.name}
    if not trainer.musubi:  # musubi-tuner always saves safetensors and refuses unknown options
        saving["save_model_as"] = "safetensors"
    if job.has("save.save_every"):
        saving["save_every_n_steps"] = int(job.get("save.save_every"))
    save_dtype = jobconfig.DTYPES.get(str(job.get("save.dtype", "") or "").lower())
    if save_dtype and not trainer.musubi:
        saving["save_precision"] = _SAVE_PRECISION[save_dtype]
    return {"model": extra, "network": network, "training": training, "memory": memory, "sampling": sampling,
            "saving": saving}


def _memory_args(job: JobFile, trainer: Trainer, row) -> dict[str, Any]:
    """Base quantization, block swapping and caching."""
    memory: dict[str, Any] = {}
    quantize, quantize_te, qtype = job.quantize, job.quantize_te, job.qtype
    if quantize:
        exact = bool(_FP8.match(qtype))
        if trainer.family == "flux" and not quantize_te:
            memory["fp8_base_unet"] = True
            where = "fp8_base_unet (transformer only)"
        else:
            memory["fp8_base"] = True
            where = "fp8_base"
        row("model.quantize", True, where)
        row("model.qtype", qtype, where, "exact" if exact else "approximate",
            "" if exact else "kohya has no 4-bit base: 8-bit uses more memory than the job searched")
    else:
        row("model.quantize", False, "fp8_base not set")
    if quantize_te:
        if trainer.family == "flux" and quantize:
            row("model.quantize_te", True, "fp8_base (covers CLIP-L and T5-XXL)")
        elif trainer.musubi:
            row("model.quantize_te", True, "--fp8_t5 when caching text encoder outputs")
        else:
            row("model.quantize_te", True, "-", "none", "no fp8 text encoder alone; its outputs are cached instead")
    if job.get("model.layer_offloading", False):
        percent = float(job.get("model.layer_offloading_transformer_percent", 1.0))
        if trainer.max_blocks_to_swap:
            memory["blocks_to_swap"] = round(percent * trainer.max_blocks_to_swap)
            row("model.layer_offloading_transformer_percent", percent,
                f"blocks_to_swap = {memory['blocks_to_swap']} of {trainer.max_blocks_to_swap}", "approximate",
                "swaps whole blocks through the CPU instead of offloading a share of the layers")
        else:
            row("model.layer_offloading", True, "-", "none", f"{trainer.script} has no block swap")
    if job.get("model.low_vram"):
        row("model.low_vram", True, "-", "none",
            "AI Toolkit's low-VRAM loading has no kohya switch; blocks_to_swap is the nearest, not written")
    cache_te = job.text_encoder_mode != "keep"
    if trainer.musubi:
        row("train.cache_text_embeddings", cache_te, "always cached before training (kohya.sh)",
            "exact" if cache_te else "approximate", "" if cache_te else "musubi-tuner always caches them")
        row("datasets[*].cache_latents", True, "always cached before training (kohya.sh)")
    else:
        memory["cache_text_encoder_outputs"] = cache_te
        row("train.cache_text_embeddings", bool(job.get("train.cache_text_embeddings")), "cache_text_encoder_outputs")
        if job.get("train.unload_text_encoder"):
            row("train.unload_text_encoder", True, "cache_text_encoder_outputs", "approximate",
                "kohya frees the text encoders after caching every caption, not one trigger embedding")
        latents = any(job.get("datasets[*].cache_latents")) or any(job.get("datasets[*].cache_latents_to_disk"))
        memory["cache_latents"] = latents
        memory["cache_latents_to_disk"] = any(job.get("datasets[*].cache_latents_to_disk"))
        row("datasets[*].cache_latents_to_disk", memory["cache_latents_to_disk"], "cache_latents_to_disk")
    return memory


def _sampling_args(job: JobFile, row) -> dict[str, Any]:
    prompts = list(job.get("sample.prompts", None) or [])
    if job.get("train.disable_sampling") or not prompts:
        row("train.disable_sampling", True if job.get("train.disable_sampling") else "(no prompts)",
            "no sample_prompts: no previews")
        return {}
    every = int(job.get("sample.sample_every", None) or _SAMPLE_EVERY)
    first = not job.get("train.skip_first_sample")
    row("sample.sample_every", every, "sample_every_n_steps")
    row("train.skip_first_sample", not first, f"sample_at_first = {str(first).lower()}")
    return {"sample_every_n_steps": every, "sample_at_first": first}


def _prompts(job: JobFile, trainer: Trainer, args: dict, rows: list[Mapping]) -> list[str]:
    """kohya's prompt file: one line per prompt with `--w --h --s --d` and the guidance flag."""
    if not args["sampling"]:
        return []
    trigger = str(job.get("trigger_word", "") or "")
    seed, walk = int(job.get("sample.seed", 42)), bool(job.get("sample.walk_seed", False))
    width, height = int(job.get("sample.width")), int(job.get("sample.height"))
    steps, guidance = int(job.get("sample.sample_steps")), float(job.get("sample.guidance_scale"))
    frames, negative = int(job.get("sample.num_frames")), str(job.get("sample.neg", "") or "")
    lines = []
    negative, dashes = _prompt_text(negative)
    for i, prompt in enumerate(job.get("sample.prompts")):
        text, cut = _prompt_text(prompt.replace("[trigger]", trigger))
        dashes = dashes or cut
        line = f"{text} --w {width} --h {height} --s {steps} --d {seed + i if walk else seed} "
        line += f"{trainer.guidance_flag} {_number(guidance)}"
        line += f" --f {frames}" if trainer.musubi else ""
        line += f" --n {negative}" if negative else ""
        lines.append(line)
    for setting, value, option in (("sample.width", width, "--w"), ("sample.height", height, "--h"),
                                   ("sample.sample_steps", steps, "--s"), ("sample.seed", seed, "--d"),
                                   ("sample.walk_seed", walk, "--d counting up" if walk else "--d the same"),
                                   ("sample.guidance_scale", guidance, trainer.guidance_flag)):
        rows.append(Mapping(setting, value, f"{option} in kohya_prompts.txt", "exact"))
    if dashes:
        rows.append(Mapping("sample.prompts", len(lines), "kohya_prompts.txt", "approximate",
                            "' --' inside a prompt or sample.neg is written ' -': kohya would read it as an option"))
    if trainer.musubi:
        rows.append(Mapping("sample.num_frames", frames, "--f in kohya_prompts.txt", "exact"))
    elif frames > 1:
        rows.append(Mapping("sample.num_frames", frames, "-", "none", "image trainer: no frames"))
    return lines


def _prompt_text(text: str) -> tuple[str, bool]:
    """A prompt as one line of kohya's prompt file: every line break (the ones Python and kohya
    split on, \\r and U+2028 included) and control character becomes a space, and ` --` becomes
    ` -` (kohya splits a line at ` --` into options). Also says whether a ` --` was there."""
    flat = "".join(ch if ch.isprintable() else " " for ch in str(text)).strip()
    return flat.replace(" --", " -"), " --" in flat


def _dataset_config(job: JobFile, trainer: Trainer, rows: list[Mapping]) -> dict[str, Any]:
    """One kohya dataset per AI Toolkit dataset and resolution, bucketed at that resolution."""
    batch = int(job.get("train.batch_size"))
    general: dict[str, Any] = {"batch_size": batch, "enable_bucket": True}
    datasets = []
    for i, dataset in enumerate(job.datasets):
        sizes = dataset.get("resolution", 512)
        sizes = sorted(set(int(r) for r in (sizes if isinstance(sizes, list) else [sizes])))
        folder = str(dataset.get("folder_path", ""))
        caption = "." + str(dataset.get("caption_ext", "txt")).lstrip(".")
        repeats = int(dataset.get("num_repeats", 1) or 1)
        frames = int(job.get(f"datasets[{i}].num_frames"))
        step = int(job.get(f"datasets[{i}].bucket_tolerance"))
        for size in sizes:
            if trainer.musubi:
                entry = {"resolution": [size, size], "caption_extension": caption, "num_repeats": repeats,
                         "cache_directory": f"{folder.rstrip('/')}_cache/{size}"}
                if frames > 1:
                    entry.update(video_directory=folder, target_frames=[frames], frame_extraction="head")
                else:
                    entry["image_directory"] = folder
            else:
                entry = {"resolution": size, "min_bucket_reso": _round_to(size // 2, step),
                         "max_bucket_reso": _round_to(size * 2, step), "bucket_reso_steps": step,
                         "subsets": [{"image_dir": folder, "caption_extension": caption, "num_repeats": repeats}]}
            datasets.append(entry)
        prefix = f"datasets[{i}]"
        rows.append(Mapping(f"{prefix}.resolution", sizes, f"{len(sizes)} kohya datasets, one per resolution"
                            + ("" if trainer.musubi else ", aspect buckets from half to twice it")))
        rows.append(Mapping(f"{prefix}.folder_path", folder, "video_directory" if trainer.musubi and frames > 1
                            else "image_directory" if trainer.musubi else "image_dir"))
        rows.append(Mapping(f"{prefix}.caption_ext", caption.lstrip("."), "caption_extension"))
        if trainer.musubi:
            rows.append(Mapping(f"{prefix}.num_frames", frames, "target_frames" if frames > 1 else "images: no frames"))
        else:
            rows.append(Mapping(f"{prefix}.bucket_tolerance", step, "bucket_reso_steps"))
            if frames > 1:
                rows.append(Mapping(f"{prefix}.num_frames", frames, "-", "none", "image trainer: no frames"))
    return {"general": general, "datasets": datasets}


def _command(job: JobFile, trainer: Trainer, extra: dict, prompts: bool, dtype: str) -> str:
    """kohya.sh. Every value in a command is shlex-quoted and every text from the job in a comment
    is one line (a newline in config.name would otherwise start a command of its own)."""
    q = shlex.quote
    source, name = one_line(job.source), one_line(job.name)
    lines = ["#!/usr/bin/env bash",
             f"# {trainer.repo}: train the LoRA fitfinder found for {source} (config {name}).",
             f"# Run from your {trainer.repo} checkout; set these to the model files first:"]
    lines += [f"#   {env}: {what}" for _, env, what in trainer.model_files]
    lines += [f"# (the AI Toolkit job used {one_line(job.get('model.name_or_path', '') or '-')})",
              "set -euo pipefail", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
    lines += [f': "${{{env}:?set {env} to {what}}}"' for _, env, what in trainer.model_files]
    dataset = '--dataset_config "$here/kohya_dataset.toml"'
    files = {option: f'"${env}"' for option, env, _ in trainer.model_files}
    for script in trainer.cache_scripts:  # musubi-tuner: latents and text outputs are cached first
        if "latents" in script:
            lines.append(f'python {q(script)} {dataset} --vae {files["vae"]}')
        else:
            fp8 = " --fp8_t5" if job.quantize_te else ""
            lines.append(f'python {q(script)} {dataset} --t5 {files["t5"]}{fp8}')
    launch = [f"accelerate launch --num_cpu_threads_per_process 1 --mixed_precision {q(_PRECISION[dtype])} "
              f"{q(trainer.script)}", '--config_file "$here/kohya.toml"', dataset]
    launch += [f"--{option} {value}" for option, value in files.items()]
    if prompts:
        launch.append('--sample_prompts "$here/kohya_prompts.txt"')
    lines.append(" \\\n  ".join(launch))
    return "\n".join(lines) + "\n"


# -- reading back ---------------------------------------------------------------------------------
def read(out_dir: Path) -> dict[str, Any]:
    """The AI Toolkit settings a kohya export in `out_dir` stands for, by AI Toolkit key."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    out_dir = Path(out_dir)
    try:
        args_file = tomllib.loads((out_dir / "kohya.toml").read_text(encoding="utf-8"))
        data = tomllib.loads((out_dir / "kohya_dataset.toml").read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise UserError(f"{exc.filename}: missing; run `fitfinder export NAME --format kohya` first") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{out_dir}: not valid TOML: {exc}") from None
    args: dict[str, Any] = {}
    for value in args_file.values():  # sections flattened, as the trainers read them
        args.update(value if isinstance(value, dict) else {})
    settings: dict[str, Any] = {
        "network.linear": args["network_dim"],
        "network.linear_alpha": args["network_alpha"],
        "train.batch_size": data["general"]["batch_size"],
        "train.gradient_accumulation_steps": args.get("gradient_accumulation_steps", 1),
        "train.gradient_checkpointing": bool(args.get("gradient_checkpointing", False)),
        "train.dtype": {v: k for k, v in _PRECISION.items()}[args.get("mixed_precision", "no")],
        "train.optimizer": {v: k for k, v in _OPTIMIZERS.items()}.get(args.get("optimizer_type"),
                                                                       str(args.get("optimizer_type")).lower()),
        "train.lr": args["learning_rate"],
        "train.steps": args["max_train_steps"],
        "model.quantize": bool(args.get("fp8_base") or args.get("fp8_base_unet")),
    }
    if "train_batch_size" in args and args["train_batch_size"] != settings["train.batch_size"]:
        raise UserError(f"{out_dir}: train_batch_size {args['train_batch_size']} disagrees with the "
                        f"dataset's batch_size {settings['train.batch_size']}")
    if args.get("network_module") == _FLUX.network_module:  # sd-scripts' fp8 for FLUX covers the text encoders
        settings["model.quantize_te"] = bool(args.get("fp8_base"))
    if args.get("blocks_to_swap"):
        most = (_FLUX.max_blocks_to_swap if args.get("network_module") == _FLUX.network_module
                else _WAN_MAX_SWAP["1.3B" if "1.3B" in str(args.get("task")) else "14B"])
        settings["model.layer_offloading"] = True
        settings["model.layer_offloading_transformer_percent"] = round(args["blocks_to_swap"] / most, 2)
    if "cache_text_encoder_outputs" in args:
        settings["train.cache_text_embeddings"] = bool(args["cache_text_encoder_outputs"])
    if "cache_latents_to_disk" in args:
        settings["datasets[*].cache_latents_to_disk"] = bool(args["cache_latents_to_disk"])
    settings.update(_read_datasets(data["datasets"]))
    settings.update(_read_sampling(args, out_dir / "kohya_prompts.txt"))
    return settings


def _read_datasets(datasets: list[dict]) -> dict[str, Any]:
    """Group kohya datasets by folder back into AI Toolkit datasets with resolution lists."""
    folders: dict[str, dict[str, Any]] = {}
    for entry in datasets:
        subset = (entry.get("subsets") or [{}])[0]
        folder = subset.get("image_dir") or entry.get("image_directory") or entry.get("video_directory")
        size = entry["resolution"][0] if isinstance(entry["resolution"], list) else entry["resolution"]
        caption = subset.get("caption_extension") or entry.get("caption_extension") or ".txt"
        into = folders.setdefault(folder, {"resolution": [], "caption_ext": caption.lstrip("."),
                                           "num_frames": (entry.get("target_frames") or [1])[0]})
        if "bucket_reso_steps" in entry:
            into["bucket_tolerance"] = entry["bucket_reso_steps"]
        into["resolution"].append(int(size))
    settings = {}
    for i, (folder, values) in enumerate(folders.items()):
        settings[f"datasets[{i}].folder_path"] = folder
        for key, value in values.items():
            settings[f"datasets[{i}].{key}"] = sorted(value) if key == "resolution" else value
    return settings


_OPTION = re.compile(r"\s--(\w+)\s+((?:(?!\s--\w+\s).)*)")


def _read_sampling(args: dict[str, Any], prompts_path: Path) -> dict[str, Any]:
    if "sample_every_n_steps" not in args or not prompts_path.exists():
        return {"train.disable_sampling": True}
    prompts, options = [], []
    for line in prompts_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            first = re.search(r"\s--\w+\s", line)
            prompts.append(line[:first.start()].strip() if first else line.strip())
            options.append(dict(_OPTION.findall(line + " ")))
    opts = options[0]
    guidance = opts.get("g", opts.get("l"))
    seeds = [int(o["d"]) for o in options]
    return {"train.disable_sampling": False, "sample.sample_every": args["sample_every_n_steps"],
            "train.skip_first_sample": not args.get("sample_at_first", False), "sample.prompts": prompts,
            "sample.width": int(opts["w"]), "sample.height": int(opts["h"]),
            "sample.sample_steps": int(opts["s"]), "sample.seed": seeds[0],
            "sample.walk_seed": len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds))),
            "sample.guidance_scale": float(guidance) if guidance is not None else None,
            **({"sample.num_frames": int(opts["f"])} if "f" in opts else {})}


# -- TOML, written by a TOML library: a newline or quote in a value stays inside its string ---------
def _toml(sections: dict[str, Any], header: list[str]) -> str:
    import tomli_w

    body = {name: content for name, content in sections.items() if content}  # no empty [model] table
    return "".join(f"# {one_line(line, 1000)}\n" for line in header) + "\n" + tomli_w.dumps(body)


def _round_to(value: int, step: int) -> int:
    return max(step, round(value / step) * step)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else one_line(value, 200)
