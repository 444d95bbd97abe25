"""AI Toolkit to kohya: the winning AI Toolkit job written as sd-scripts / musubi-tuner settings, and read back.

The script a family trains with, its options and their limits are the trainers' own
(fitfinder.trainers: sd_scripts.py and musubi_tuner.py, each Script with its parser, its model's files,
its block swap); this module maps AI Toolkit's settings onto them, and the trainers' writer writes the
job (`_kohya.new_job_texts`), which fitfinder reads back as any kohya job (`trainers.load`: the export
is a job `fitfinder estimate results/NAME/kohya.sh` takes). What is written, in results/NAME/:

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
are those of the scripts' parsers (trainers/_sd_scripts_options.py, _musubi_options.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitfinder import models, trainers
from fitfinder.errors import UserError
from fitfinder.errors import one_line
from fitfinder.files import write_atomic
from fitfinder.trainers import aitoolkit, aitoolkit_job
from fitfinder.trainers.aitoolkit_job import JobFile
from fitfinder.trainers import _kohya, musubi_tuner, sd_scripts

FILES = ("kohya.toml", "kohya_dataset.toml", "kohya_prompts.txt", "kohya.sh")


@dataclass(frozen=True)
class Trainer:
    """The kohya script that trains a job's family, as the trainers' modules declare it."""

    module: Any  # fitfinder.trainers.sd_scripts or musubi_tuner
    spec: Any  # its Script
    own: dict  # the script's options that name the model (--task, --model_version, --model_type)
    family: str
    arch: dict  # the family's architecture (the job's shipped one, else the script's default)

    @property
    def repo(self) -> str:
        return self.module.REPO

    @property
    def musubi(self) -> bool:
        return self.repo == "musubi-tuner"

    @property
    def script(self) -> str:
        """The script as kohya.sh runs it (musubi-tuner's under src/musubi_tuner/)."""
        return f"src/musubi_tuner/{self.spec.name}" if self.musubi else self.spec.name

    @property
    def network_module(self) -> str:
        return self.spec.network_module

    @property
    def model_files(self) -> tuple[tuple[str, str, str], ...]:
        return self.module.model_files(self.spec, self.own)

    @property
    def max_blocks_to_swap(self) -> int | None:
        most = self.spec.most_swapped
        return most(self.arch) if most else None

    @property
    def guidance_flag(self) -> str:
        """The prompt-file option AI Toolkit's guidance_scale becomes: `--g` for an embedded guidance
        (FLUX.1, Kontext, FLUX.2), else `--l`, the CFG scale."""
        previews = self.spec.previews(str(self.own.get("task", ""))) if self.musubi else self.spec.previews
        return f"--{previews.guidance_key}"

    def takes(self, option: str) -> bool:
        return option in self.spec.options


def trainer_for(job: JobFile) -> tuple[Trainer, dict[str, Any]]:
    """The kohya trainer for the job's model family (aitoolkit.family_of, the family the search probed),
    and the script's own arguments for the model (Wan's task, read from model.arch and the name)."""
    family = aitoolkit.family_of(job)
    found = next(((module, *pair) for module in (sd_scripts, musubi_tuner)
                  for pair in [module.for_family(family)] if pair), None)
    if found is None:
        followed = sorted({*sd_scripts.FAMILIES, *musubi_tuner.FAMILIES})
        raise UserError(f"kohya export: no kohya trainer known for the {family} family; supported: "
                        f"{', '.join(followed)} (sd-scripts and musubi-tuner)")
    module, spec, own = found
    name = str(job.get("model.name_or_path", "") or "").lower()
    arch_value = str(job.get("model.arch", "") or "").lower()
    if family == "wan21" and ("1.3b" in name or "1b" in arch_value):
        own["task"] = "t2v-1.3B"
    if family == "flux2_klein" and "4b" in name:
        own["model_version"] = "klein-4b"
    try:
        arch = aitoolkit.shipped_arch(job, family)[1]
    except UserError:  # no shipped architecture by that name: the script's own default
        arch = models.known_archs()[_default_arch(spec, own)]
    return Trainer(module, spec, own, family, arch), dict(own)


def _default_arch(spec: Any, own: dict) -> str:
    if hasattr(spec, "default_arch"):
        return spec.default_arch
    probe = _kohya.KohyaJob(trainer=musubi_tuner, script=spec, source="export", form="toml", config=dict(own))
    return spec.model(probe)[1]


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
    dtype = aitoolkit_job.DTYPES[str(job.get("train.dtype")).lower()]
    header = [f"kohya {trainer.repo} settings for AI Toolkit job {job.source}, written by fitfinder.",
              f"Run kohya.sh (it passes this file as --config_file to {trainer.script})."]
    header += [f"not the same: {r.setting} = {_show(r.value)} -> {r.kohya} ({r.note})" for r in rows
               if r.kind == "approximate"]
    header += [f"no equivalent: {r.setting} = {_show(r.value)} ({r.note})" for r in rows if r.kind == "none"]
    source, name = one_line(job.source), one_line(job.name)
    comments = [f"{trainer.repo}: train the LoRA fitfinder found for {source} (config {name}).",
                f"Run from your {trainer.repo} checkout; set these to the model files first:"]
    comments += [f"  {env}: {what}" for _, env, what in trainer.model_files]
    comments.append(f"(the AI Toolkit job used {one_line(job.get('model.name_or_path', '') or '-')})")
    new = _kohya.NewJob(trainer.module, trainer.spec, trainer.own, args, datasets, prompts, header, comments,
                        _PRECISION[dtype], text_fp8=bool(job.quantize_te) and trainer.musubi)
    texts = _kohya.new_job_texts(new, stem="kohya")
    files = []
    for file_name in FILES:
        path = out_dir / file_name
        if file_name in texts:
            write_atomic(path, texts[file_name], mode=0o777 if file_name.endswith(".sh") else 0o666)
            files.append(path)
        else:
            path.unlink(missing_ok=True)  # a stale prompt file from an earlier export would be read back
    return Export(trainer, files, rows)


def _training_args(job: JobFile, trainer: Trainer, extra: dict, rows: list[Mapping]) -> dict[str, dict]:
    """kohya.toml's sections: network, training, memory, sampling and saving."""
    def row(setting, value, kohya, kind="exact", note=""):
        rows.append(Mapping(setting, value, kohya, kind, note))

    if aitoolkit_job.is_full_fine_tune(job):
        raise UserError(f"{job.source}: a full fine-tune (no `network`): the kohya export writes LoRA jobs only")
    network_type = str(job.get("network.type", "lora")).lower()
    rank, alpha = job.lora_rank, job.lora_alpha
    network = {"network_module": trainer.network_module, "network_dim": rank, "network_alpha": float(alpha)}
    row("network.type", network_type, f"network_module = {trainer.network_module}",
        "exact" if network_type == "lora" else "approximate",
        "" if network_type == "lora" else "kohya's LyCORIS module is a separate install; a plain LoRA is written")
    row("network.linear", rank, "network_dim")
    row("network.linear_alpha", int(alpha) if alpha.is_integer() else alpha, "network_alpha")
    if trainer.takes("network_train_unet_only"):  # sd-scripts trains the text encoders' LoRA unless told not to
        text_too = bool(job.get("train.train_text_encoder", False))
        network["network_train_unet_only"] = not text_too
        row("train.train_text_encoder", text_too, f"network_train_unet_only = {str(not text_too).lower()}")

    batch = int(job.get("train.batch_size"))
    dtype = aitoolkit_job.DTYPES[str(job.get("train.dtype")).lower()]
    optimizer = str(job.get("train.optimizer")).lower()
    training = {"max_train_steps": int(job.get("train.steps", 1000)), "learning_rate": float(job.get("train.lr")),
                "optimizer_type": _OPTIMIZERS.get(optimizer, optimizer),
                "gradient_accumulation_steps": job.accumulation,
                "gradient_checkpointing": bool(job.get("train.gradient_checkpointing")),
                "mixed_precision": _PRECISION[dtype], "sdpa": True}
    if trainer.takes("train_batch_size"):  # musubi-tuner takes the batch from the dataset config only
        training = {"train_batch_size": batch, **training}
    row("train.batch_size", batch, "batch_size in kohya_dataset.toml"
        + (" (and train_batch_size)" if trainer.takes("train_batch_size") else ""))
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
    if trainer.takes("save_model_as"):  # musubi-tuner always saves safetensors and refuses unknown options
        saving["save_model_as"] = "safetensors"
    if job.has("save.save_every"):
        saving["save_every_n_steps"] = int(job.get("save.save_every"))
    save_dtype = aitoolkit_job.DTYPES.get(str(job.get("save.dtype", "") or "").lower())
    if save_dtype and trainer.takes("save_precision"):
        saving["save_precision"] = _SAVE_PRECISION[save_dtype]
    return {"model": extra, "network": network, "training": training, "memory": memory, "sampling": sampling,
            "saving": saving}


def _memory_args(job: JobFile, trainer: Trainer, row) -> dict[str, Any]:
    """Base quantization, block swapping and caching."""
    memory: dict[str, Any] = {}
    quantize, quantize_te, qtype = job.quantize, job.quantize_te, job.qtype
    if quantize:
        exact = bool(_FP8.match(qtype))
        if not trainer.musubi and not quantize_te:  # sd-scripts: fp8_base also casts the text encoders
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
        if not trainer.musubi and quantize:
            row("model.quantize_te", True, "fp8_base (covers the text encoders)")
        elif trainer.musubi:
            row("model.quantize_te", True, f"--{trainer.spec.text_fp8} when caching text encoder outputs")
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
    elif not trainer.takes("cache_text_encoder_outputs"):  # train_network.py (SD 1.x) encodes every step
        row("train.cache_text_embeddings", cache_te, "-", "exact" if not cache_te else "none",
            "" if not cache_te else f"{trainer.script} has no text encoder caching")
    if not trainer.musubi:
        if trainer.takes("cache_text_encoder_outputs"):
            memory["cache_text_encoder_outputs"] = cache_te
            row("train.cache_text_embeddings", bool(job.get("train.cache_text_embeddings")),
                "cache_text_encoder_outputs")
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


# -- reading back ---------------------------------------------------------------------------------
def read(out_dir: Path) -> dict[str, Any]:
    """The AI Toolkit settings a kohya export in `out_dir` stands for, by AI Toolkit key: kohya.sh read
    as any kohya job (trainers.load: its --config_file and --dataset_config beside it, each option the
    command line's, else the config's, else the parser's default)."""
    out_dir = Path(out_dir)
    for name in ("kohya.sh", "kohya.toml", "kohya_dataset.toml"):
        if not (out_dir / name).is_file():
            raise UserError(f"{out_dir / name}: missing; run `fitfinder export NAME --format kohya` first")
    job = trainers.load(out_dir / "kohya.sh")
    batch = job.get("datasets[0].batch_size")
    settings: dict[str, Any] = {
        "network.linear": job.get("network_dim"),
        "network.linear_alpha": job.get("network_alpha"),
        "train.batch_size": batch,
        "train.gradient_accumulation_steps": job.accumulation,
        "train.gradient_checkpointing": bool(job.get("gradient_checkpointing")),
        "train.dtype": {v: k for k, v in _PRECISION.items()}[str(job.get("mixed_precision") or "no")],
        "train.optimizer": {v: k for k, v in _OPTIMIZERS.items()}.get(job.get("optimizer_type"),
                                                                       str(job.get("optimizer_type")).lower()),
        "train.lr": job.get("learning_rate"),
        "train.steps": job.get("max_train_steps"),
        "model.quantize": bool(job.get("fp8_base") or job.get("fp8_base_unet")),
    }
    if job.has("train_batch_size") and job.get("train_batch_size") != batch:
        raise UserError(f"{out_dir}: train_batch_size {job.get('train_batch_size')} disagrees with the "
                        f"dataset's batch_size {batch}")
    if job.trainer is sd_scripts:  # sd-scripts' fp8_base covers the text encoders, fp8_base_unet does not
        settings["model.quantize_te"] = bool(job.get("fp8_base")) and not job.get("fp8_base_unet")
    if job.get("blocks_to_swap"):
        most = job.trainer.max_blocks_to_swap(job, job.architecture_spec()["arch"])
        settings["model.layer_offloading"] = True
        settings["model.layer_offloading_transformer_percent"] = round(job.get("blocks_to_swap") / most, 2)
    if job.has("cache_text_encoder_outputs"):
        settings["train.cache_text_embeddings"] = bool(job.get("cache_text_encoder_outputs"))
    if job.has("cache_latents_to_disk"):
        settings["datasets[*].cache_latents_to_disk"] = bool(job.get("cache_latents_to_disk"))
    settings.update(_read_datasets(job.datasets))
    settings.update(_read_sampling(job))
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


def _read_sampling(job: _kohya.KohyaJob) -> dict[str, Any]:
    prompts_path = _kohya.resolve(job, job.get("sample_prompts"))
    if not job.get("sample_every_n_steps") or prompts_path is None or not prompts_path.exists():
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
    return {"train.disable_sampling": False, "sample.sample_every": job.get("sample_every_n_steps"),
            "train.skip_first_sample": not job.get("sample_at_first"), "sample.prompts": prompts,
            "sample.width": int(opts["w"]), "sample.height": int(opts["h"]),
            "sample.sample_steps": int(opts["s"]), "sample.seed": seeds[0],
            "sample.walk_seed": len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds))),
            "sample.guidance_scale": float(guidance) if guidance is not None else None,
            **({"sample.num_frames": int(opts["f"])} if "f" in opts else {})}


def _round_to(value: int, step: int) -> int:
    return max(step, round(value / step) * step)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else one_line(value, 200)
