"""AI Toolkit (ostris/ai-toolkit): its job file's knobs and model, and how a job becomes a probe request.

The job file itself, YAML read with its comments and order kept, validated and written back, is
`aitoolkit_job.JobFile` with AI Toolkit's defaults (`aitoolkit_job.AITK_DEFAULTS`, from
toolkit/config_modules.py). This module holds what AI Toolkit's rules decide above the file:

- its knobs in its own key paths (`knob_specs`: buckets are `datasets[*].resolution`, rank
  `network.linear`, layer offloading `model.layer_offloading` and its percents, ...), each with how
  it writes itself into the job;
- the phases a probe of a point runs (`phases_run`: AI Toolkit's previews, skip_first_sample);
- the job's model from its `model` keys (`family_of`, `model_spec`, `architecture_spec`,
  `full_size`): the family by `model.arch`, an `is_*` flag or the name, the weights from a local
  diffusers folder or the Hugging Face cache, or a shipped architecture with random weights
  (models answers the lookups by name);
- the probe request (`probe_request`): the model's precision and quantization as its loaders do
  them, the LoRA as its network builds it, the previews as its samplers draw them;
- what diagnose's rollback reads of the job (`diagnose_settings`) and its levers as edits of the
  job's keys (`lever_changes`).

kohya's trainers answer the same questions in their own modules (sd_scripts.py, musubi_tuner.py,
through `_kohya.KohyaJob`); the functions of the same names in `trainers` ask whichever trainer the
job is for.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from fitfinder import models
from fitfinder.errors import ConfigError, UserError, brief
from fitfinder.trainers import _safetensors, aitoolkit_job
from fitfinder.trainers.aitoolkit_job import (AITK_DEFAULTS, FRAMES, PIXELS, RANKS, JobFile, int_in, is_full_fine_tune,
                                             network_type, optimizer_name)
from fitfinder.trainers._knob import ALL, DATA, PHASES, PREVIEW, KnobSpec
from fitfinder.units import format_bytes


# -- what the layers above ask -------------------------------------------------------------------
def knob_specs(job: JobFile) -> list[KnobSpec]:
    """The knobs around the job's desired point, with the `fitfinder:` candidate overrides: those with
    more than one candidate. An override that does not apply, or lists a value a knob cannot take, is
    a ConfigError naming each."""
    overrides = job.settings.candidates
    video = is_video(job)
    problems: list[str] = []
    specs = []
    for name, make in _BUILDERS.items():
        try:
            spec = make(job, overrides.get(name), video)
        except ValueError as exc:
            problems.append(f"fitfinder.candidates.{name}: {exc}")
            continue
        if spec is not None and len(spec.candidates) > 1:
            specs.append(spec)
        elif name in overrides and spec is None:
            problems.append(f"fitfinder.candidates.{name}: this knob does not apply to this job")
    if problems:
        raise ConfigError(job.source, problems)
    return specs


def phases_run(job: JobFile, point: dict) -> list[str]:
    """The phases a probe of `point` runs: every one, but the previews it does not sample."""
    sampling = point.get("sampling", not job.get("train.disable_sampling"))
    skipped = {"sample", "last_sample"} if not sampling else set()
    if job.get("train.skip_first_sample"):
        skipped.add("sample")
    return [phase for phase in PHASES if phase not in skipped]


def effective_batch(job: JobFile) -> int:
    return job.batch_size * job.accumulation


def diagnose_settings(job: JobFile) -> dict[str, Any]:
    """Every setting diagnose's rollback looks at (diagnose.Settings' fields), with AI Toolkit's defaults
    for what the file leaves out."""
    return dict(
        batch=int(job.get("train.batch_size")), accumulation=job.accumulation,
        checkpointing=bool(job.get("train.gradient_checkpointing")), buckets=job.buckets,
        frames=max((int(f) for f in job.get("datasets[*].num_frames")), default=1),
        quantize=job.quantize, quantize_text=job.quantize_te,
        low_vram=bool(job.get("model.low_vram")),
        cache_text=job.text_encoder_mode != "keep",
        sampling_off=bool(job.get("train.disable_sampling")),
        sample_size=(int(job.get("sample.width")), int(job.get("sample.height"))),
        sample_frames=int(job.get("sample.num_frames")),
        cache_to_disk=all(bool(v) for v in job.get("datasets[*].cache_latents_to_disk")),
        workers=max((int(w) for w in job.get("datasets[*].num_workers", NUM_WORKERS)), default=None),
    )


def assumptions(job: JobFile) -> list[str]:
    """What an estimate of the job assumes where its files are not on this machine, or does not follow."""
    notes = []
    adapter = recovery_adapter(job, family_for(job))
    if adapter is not None and not adapter["read"]:
        notes.append(f"the accuracy-recovery adapter {adapter['path']} is not on this machine: its rank is assumed "
                     f"to be {adapter['rank']}, on the LoRA's layers (AI Toolkit reads both from the file)")
    backend = str(job.get("train.attention_backend", None) or "native")
    if backend != "native":  # BaseSDTrainProcess.run: set_attention_backend on the unet, VAE and encoders
        notes.append(f"train.attention_backend {backend}: estimated with diffusers' native attention (PyTorch's "
                     "scaled_dot_product_attention); its kernels do not run on the CPU")
    if job.get("model.compile", None):
        notes.append("model.compile: estimated uncompiled; torch.compile's fusions (and block_compile's) change "
                     "what a card holds for activations, which fitfinder does not follow")
    return notes


# -- the job's model: AI Toolkit's `model` keys (toolkit/config_modules.py ModelConfig) -----------
def family_of(job: JobFile) -> str:
    """The family from `model.arch`, AI Toolkit's flags, or the model name; only a family fitfinder probes.

    A model AI Toolkit trains whose family module does not exist yet is refused by name, and an
    unknown one as unsupported: relabelling a model as another family would probe the wrong network.
    """
    arch = str(job.get("model.arch", None) or "").strip().lower()
    name = _model_name(job)
    if arch:
        return _probeable(job, models.family_by_arch(arch), f"model.arch {arch!r}")
    for flag, family in models.FLAGS.items():
        if job.get(f"model.{flag}", None) is True:
            return _probeable(job, family, f"model.{flag}")
    shipped = models.shipped_by_name(name)
    if shipped is not None:
        return _probeable(job, shipped[1]["family"], f"{name} ({shipped[0]})")
    guessed = models.family_from_name(name)
    if guessed is not None:
        return _probeable(job, guessed, name)
    return _probeable(job, None, f"the model {name or '-'} (neither model.arch, an is_* flag nor its name "
                                 "says which it is)")


def _probeable(job: JobFile, family: str | None, model: str) -> str:
    if family in models.FAMILIES:
        return family
    where = f"{job.source}: config.process[0].model"
    if family is None:
        raise UserError(f"{where}: fitfinder does not support {model}; {models.supported()}")
    raise UserError(f"{where}: fitfinder knows {model} but cannot probe the {family} family yet; "
                    f"{models.supported()}")


def _model_name(job: JobFile) -> str:
    return str(job.get("model.name_or_path", None) or "")


def family_for(job: JobFile) -> models.Family:
    """The job's family declaration (see family_of)."""
    return models.FAMILIES[family_of(job)]


def is_video(job: JobFile) -> bool:
    """Video jobs have a frames knob: a video family, or any dataset with more than one frame."""
    frames = [int(f) for f in job.get("datasets[*].num_frames")]
    return family_for(job).video or any(f > 1 for f in frames)


def model_spec(job: JobFile) -> dict[str, Any]:
    """What a probe needs to build the job's model: family, architecture, where the weights are."""
    family = family_of(job)
    if job.settings.weights == "random":
        arch_name, arch = shipped_arch(job, family)
        return {"family": family, "weights": "random", "arch_name": arch_name, "arch": arch, "path": None}
    path = _local_weights(job)
    arch = models.arch_from_folder(path, family)
    return {"family": family, "weights": "pretrained", "arch_name": _model_name(job), "arch": arch,
            "path": str(path)}


def architecture_spec(job: JobFile) -> dict[str, Any]:
    """The job's model as an estimate needs it: the architecture, never the weights.

    A local diffusers folder lends its config files; otherwise the shipped architecture of that
    name (or of any name with `fitfinder: {weights: random}`); otherwise the Hugging Face cache's
    snapshot, read offline. Nothing is downloaded and no weight file is opened.
    """
    family = family_of(job)
    name = _model_name(job)
    local = Path(name).expanduser() if name else None
    if job.settings.weights != "random" and local is not None and local.is_dir():
        return {"family": family, "weights": "none", "arch_name": name,
                "arch": models.arch_from_folder(local, family), "path": None}
    found = models.shipped_by_name(name)
    if job.settings.weights == "random" or (found is not None and found[1]["family"] == family):
        arch_name, arch = shipped_arch(job, family)
        return {"family": family, "weights": "none", "arch_name": arch_name, "arch": arch, "path": None}
    try:
        folder = _local_weights(job)
    except UserError:
        raise UserError(f"{job.source}: model.name_or_path {name!r} is neither a shipped {family} architecture "
                        f"({', '.join(models.shipped_of(family))}) nor a local diffusers folder; set it to one "
                        "of those") from None
    return {"family": family, "weights": "none", "arch_name": name, "arch": models.arch_from_folder(folder, family),
            "path": None}


def shipped_arch(job: JobFile, family: str | None = None) -> tuple[str, dict]:
    """The shipped architecture config named by `model.name_or_path` (stem or one of its names)."""
    family = family or family_of(job)
    name = _model_name(job)
    found = models.shipped_by_name(name)
    if found is not None and found[1]["family"] == family:
        return found
    raise UserError(
        f"{job.source}: model.name_or_path {name!r} has no shipped {family} architecture for random "
        f"weights; use one of: {', '.join(models.shipped_of(family))}"
    )


def _local_weights(job: JobFile) -> Path:
    name = _model_name(job)
    if not name:
        raise UserError(f"{job.source}: config.process[0].model.name_or_path: missing")
    return models.local_weights(name, job.source)


def full_size(job: JobFile) -> str | None:
    """The job's model, named, when it is full-size (a shipped architecture that is not a `-tiny`
    one, or a local folder with more than models.SIM_WEIGHTS_LIMIT of weight files); None otherwise."""
    name = _model_name(job)
    found = models.shipped_by_name(name)
    if found is not None:
        return None if found[0].endswith("-tiny") else f"{name} ({found[0]}, {found[1]['family']})"
    path = Path(name).expanduser() if name else None
    if job.settings.weights == "random" or path is None or not path.is_dir():
        return None
    held = models.weights_held(path)
    return f"{name} ({format_bytes(held)} of weights)" if held > models.SIM_WEIGHTS_LIMIT else None


# AI Toolkit's DatasetConfig default for `num_workers` (toolkit/config_modules.py), which the job
# defaults this project keeps do not carry.
NUM_WORKERS = 2


def probe_request(job: JobFile, steps: int, meter: str, budget_bytes: int | None, gpu: int, spec: dict | None,
                  fault: str | None, sample_steps: int) -> dict:
    """Everything a probe needs, read from the job file with AI Toolkit's defaults (probe/protocol.py
    names every field; probe/request.py adds how the probe is run)."""
    spec = spec or model_spec(job)
    family = models.FAMILIES[spec["family"]]
    qtype, qtype_te = quant_types(job, family)
    bits = aitoolkit_job.qtype_bits(qtype)[0] if job.quantize else None  # a blank qtype is unused (aitoolkit_job)
    bits_te = aitoolkit_job.qtype_bits(qtype_te)[0] if job.quantize_te else None
    return {
        "model": spec,
        "dtype": aitoolkit_job.DTYPES[str(job.get("train.dtype")).lower()],
        "quantize": bits, "quant_type": qtype,
        "recovery_adapter": recovery_adapter(job, family),
        "quantize_te": bits_te, "quant_type_te": qtype_te,
        "low_vram": bool(job.get("model.low_vram")),
        "tiled_preview_decode": family.tiles_preview_decode(job),
        "layer_offloading": layer_offloading(job, family),
        "text_encoder": job.text_encoder_mode,
        "cache_latents": job.latents_cached,
        "shapes": _shapes(job, family.video),
        "batch_size": job.batch_size,
        "accumulation": job.accumulation,
        "gradient_checkpointing": bool(job.get("train.gradient_checkpointing")),
        **_trained_weights(job, family),
        "optimizer": aitoolkit_job.optimizer_name(job.get("train.optimizer")),
        "optimizer_params": json.loads(json.dumps(job.get("train.optimizer_params", None) or {})),
        "ema_decay": _ema_decay(job),
        "preservation": _preservation(job),
        **_validation(job),
        "lr": float(job.get("train.lr")),
        "trained": family.trained_denoisers(job),
        "switch_every": int(job.get("train.switch_boundary_every")),
        "sample": _sample_settings(job, family.video, sample_steps),
        **_first_sample(job, family.video, sample_steps),
        # AI Toolkit counts a step per micro-batch with gradient_accumulation_steps and samples on
        # that count (BaseSDTrainProcess.run), so a preview can land while gradients accumulate.
        "preview_holds_gradients": int(job.get("train.gradient_accumulation_steps")) > 1,
        "steps": int(steps),
        "meter": meter,
        "budget_bytes": budget_bytes,
        "gpu": gpu,
        "seed": 0,
        **({"fault": fault} if fault else {}),
    }


# -- the knobs ---------------------------------------------------------------------------------
def _knob(name: str, role: str, candidates: tuple, desired: Any, paths: tuple[str, ...], phases: frozenset,
          unordered: frozenset = frozenset()) -> KnobSpec:
    """A knob by AI Toolkit's rules: its short name in trial lines, its labels and its writer below."""
    return KnobSpec(name, role, candidates, desired, paths, phases, _SHORT.get(name, name), _LABELS.get(name, str),
                    _WRITERS[name], unordered)


def _with_desired(values: list, desired: Any, allowed: Callable[[Any], bool], what: str) -> list:
    bad = [v for v in values if not allowed(v)]
    if bad:
        raise ValueError(f"expected {what}, got {brief(bad)}")
    return list(dict.fromkeys([*values, desired]))


def _set(job: JobFile, path: str, value: Any) -> None:
    """Write `value`, unless the file leaves the key out and the default already says it."""
    if job.has(path) or AITK_DEFAULTS.get(path, object()) != value:
        job.set(path, value)


# -- buckets: datasets[*].resolution ------------------------------------------------------------
def bucket_label(resolutions: list[int]) -> str:
    return ",".join(str(r) for r in sorted(set(resolutions)))


def bucket_list(label: str) -> list[int]:
    return [int(r) for r in str(label).split(",")]


def resolutions(job: JobFile) -> list[int]:
    values = []
    for res in job.get("datasets[*].resolution"):
        values += list(res) if isinstance(res, list) else [res]
    return sorted(set(int(v) for v in values))


def _buckets(job: JobFile, override: list | None, video: bool) -> KnobSpec:
    desired = resolutions(job)
    if override is None:
        # Drop the largest bucket first, as the seeds' rollback does: [a, b, c] -> [a, b] -> [a].
        sets = [desired[:n] for n in range(1, len(desired) + 1)]
    else:
        sets = [desired]
        for entry in override:
            entry = entry if isinstance(entry, list) else [entry]
            if not entry or not all(int_in(v, *PIXELS) for v in entry):
                raise ValueError(f"expected bucket lists of positive integers (at most {PIXELS[1]}), "
                                 f"got {brief(entry)}")
            sets.append(sorted(set(entry)))
    # Memory follows the largest bucket; more buckets at the same size cost no memory, only coverage.
    labels = sorted({bucket_label(s) for s in sets},
                    key=lambda label: (max(bucket_list(label)), len(bucket_list(label))))
    return _knob("buckets", "quality", tuple(labels), bucket_label(desired), ("datasets[*].resolution",), DATA)


def _apply_buckets(job: JobFile, label: str, space) -> None:
    allowed = bucket_list(label)
    for i, res in enumerate(job.get("datasets[*].resolution")):
        mine = list(res) if isinstance(res, list) else [res]
        kept = [r for r in mine if r in allowed] or [max(allowed)]
        if kept != mine:
            job.set(f"datasets[{i}].resolution", kept if isinstance(res, list) or len(kept) > 1 else kept[0])


# -- frames: datasets[*].num_frames (video) -------------------------------------------------------
def frame_ladder(job: JobFile, desired: int) -> list[int]:
    """Clip lengths the family's VAE wants, down from `desired` (Wan: 4k+1, halving k: 81 -> 41, 21, 9, 5, 1)."""
    return family_for(job).frame_ladder(desired)


def _frames(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    desired = max(int(f) for f in job.get("datasets[*].num_frames"))
    if not video and desired == 1:
        return None
    values = frame_ladder(job, desired) if override is None else _with_desired(
        override, desired, lambda v: int_in(v, *FRAMES), f"frame counts from 1 to {FRAMES[1]}")
    return _knob("frames", "quality", tuple(sorted(values)), desired, ("datasets[*].num_frames",), DATA)


def _apply_frames(job: JobFile, frames: int, space) -> None:
    for i, own in enumerate(job.get("datasets[*].num_frames")):
        job.set(f"datasets[{i}].num_frames", min(int(own), frames) if int(own) > 1 else own)


# -- rank: network.linear (+ linear_alpha keeping its ratio) -------------------------------------
MIN_RANK = 4  # below this a LoRA learns little; an override may still ask for less


def _rank(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    if is_full_fine_tune(job):
        return None  # no LoRA: the whole denoiser trains
    if network_type(job) == "lokr" and job.get("network.lokr_full_rank", True):
        return None  # NetworkConfig: a full-rank LoKr ignores network.linear (its factors are whole)
    desired = job.lora_rank
    if override is None:
        values = [2**i for i in range(0, 16) if MIN_RANK <= 2**i < desired] + [desired]
    else:
        values = _with_desired(override, desired, lambda v: int_in(v, *RANKS),
                               f"ranks from 1 to {RANKS[1]}")
    return _knob("rank", "quality", tuple(sorted(set(values))), desired,
                ("network.linear", "network.linear_alpha"), ALL)


def _apply_rank(job: JobFile, rank: int, space) -> None:
    alpha = rank * space.job.lora_alpha / space.job.lora_rank
    job.set("network.linear", rank)
    if job.has("network.rank"):
        job.set("network.rank", rank)
    job.set("network.linear_alpha", int(alpha) if float(alpha).is_integer() else alpha)


# -- quantize: model.quantize + model.qtype (base precision) ---------------------------------------
FOUR_BIT = ("uint4", "qint4", "int4", "nf4", "fp4", "uint3", "uint2")


def quantize_level(job: JobFile) -> str:
    if not job.quantize:
        return "none"
    return "4bit" if job.qtype in FOUR_BIT else "8bit"


def _quantize(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    ladder = ("4bit", "8bit", "none")
    desired = quantize_level(job)
    if is_full_fine_tune(job) and desired == "none" and override is None:
        # The trained weights are the base's own: quantizing them is another training, not a
        # memory trade (AI Toolkit's full fine-tune examples: "a crapshoot").
        return None
    values = ladder[:ladder.index(desired) + 1] if override is None else _with_desired(
        override, desired, lambda v: v in ladder, "none, 8bit or 4bit")
    # While loading, the weights arrive in full precision and are quantized on the device (AI
    # Toolkit without low_vram): the load peak of a quantized base is no lower than an unquantized one.
    return _knob("quantize", "quality", tuple(v for v in ladder if v in values), desired,
                ("model.quantize", "model.qtype"), ALL, unordered=frozenset({"load"}))


def _apply_quantize(job: JobFile, level: str, space) -> None:
    if level == "none":
        job.set("model.quantize", False)
        return
    job.set("model.quantize", True)
    job.set("model.qtype", "uint4" if level == "4bit" else "qfloat8")


# -- optimizer: train.optimizer ------------------------------------------------------------------
# Every optimizer fitfinder probes, lightest state first (bytes per trained
# element: adafactor's factored fp32 moments, lion8bit 1, the 8-bit Adams 2, lion 1 and Adam(W) 2
# in the weights' dtype, prodigy 4).
OPTIMIZERS = ("adafactor", "lion8bit", "adam8bit", "adamw8bit", "lion", "adam", "adamw", "prodigy")
# Where AI Toolkit offers the same algorithm with 8-bit states, the two are a precision choice;
# any other change of optimizer is a different training and happens only when the user lists it.
PRECISION_TWINS = {"adamw": "adamw8bit", "adam": "adam8bit", "lion": "lion8bit"}


def _optimizer(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    desired = optimizer_name(job.get("train.optimizer"))
    if override is None:
        values = [PRECISION_TWINS[desired], desired] if desired in PRECISION_TWINS else [desired]
    else:
        values = _with_desired([optimizer_name(v) or str(v) for v in override], desired,
                               lambda v: v in OPTIMIZERS, ", ".join(OPTIMIZERS))
        # Never past the desired point: a heavier state than the user's is no better for fitting.
        values = [v for v in values if OPTIMIZERS.index(v) <= OPTIMIZERS.index(desired)]
    return _knob("optimizer", "quality", tuple(v for v in OPTIMIZERS if v in values), desired,
                ("train.optimizer",), frozenset({"train", "last_sample"}))


def _apply_optimizer(job: JobFile, name: str, space) -> None:
    job.set("train.optimizer", name)


# -- EMA: train.ema_config.use_ema ------------------------------------------------------------------
def _ema(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    desired = bool(job.get("train.ema_config.use_ema"))
    if not desired:
        return None  # never past the desired point: no EMA asked, none added
    values = [False, True] if override is None else _with_desired(
        override, desired, lambda v: isinstance(v, bool), "true or false")
    # A shadow of the trained weights from the end of the load on (BaseSDTrainProcess.setup_ema, before
    # any caching), and a stored copy of them from the first preview on (AI Toolkit's toolkit/ema.py):
    # for a full fine-tune, two more copies of the model.
    return _knob("ema", "quality", tuple(v for v in (False, True) if v in values), desired,
                ("train.ema_config.use_ema",), ALL)


def _apply_ema(job: JobFile, on: bool, space) -> None:
    job.set("train.ema_config.use_ema", bool(on))


# -- preview sampling: on/off, size, frames --------------------------------------------------------
def _sampling(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    desired = not job.get("train.disable_sampling")
    values = [False, True] if override is None else _with_desired(
        override, desired, lambda v: isinstance(v, bool), "true or false")
    values = [v for v in (False, True) if v in values and (v <= desired)]
    # The sample prompts are encoded with the captions and kept for the last preview: sampling
    # at all weighs on every phase from the text encoder on, however large the previews are.
    return _knob("sampling", "quality", tuple(values), desired, ("train.disable_sampling",),
                ALL - {"load"})


def _apply_sampling(job: JobFile, on: bool, space) -> None:
    job.set("train.disable_sampling", not on)


def sample_size_label(width: int, height: int) -> str:
    return f"{width}x{height}"


def _sample_size(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    if job.get("train.disable_sampling"):
        return None  # no previews: their size costs nothing
    width, height = int(job.get("sample.width")), int(job.get("sample.height"))
    desired = sample_size_label(width, height)
    if override is None:
        # Half and three quarters of the desired size, keeping the aspect, on a 64-pixel grid.
        sizes = {desired}
        for scale in (0.5, 0.75):
            sizes.add(sample_size_label(max(64, round(width * scale / 64) * 64),
                                        max(64, round(height * scale / 64) * 64)))
    else:
        sizes = set(_with_desired([str(v) for v in override], desired, _sample_size_ok,
                                  f"sizes such as 512x512 (each side from 1 to {PIXELS[1]})"))
    ordered = sorted(sizes, key=lambda s: math.prod(int(p) for p in s.split("x")))
    return _knob("sample_size", "quality", tuple(ordered), desired, ("sample.width", "sample.height"), PREVIEW)


def _sample_size_ok(label: str) -> bool:
    match = re.fullmatch(r"([0-9]{1,6})x([0-9]{1,6})", label)  # ASCII digits: int("²") fails
    return bool(match) and all(PIXELS[0] <= int(side) <= PIXELS[1] for side in match.groups())


def _apply_sample_size(job: JobFile, label: str, space) -> None:
    width, height = (int(p) for p in label.split("x"))
    job.set("sample.width", width)
    job.set("sample.height", height)


def _sample_frames(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    desired = int(job.get("sample.num_frames"))
    if desired == 1 or job.get("train.disable_sampling"):
        return None
    values = frame_ladder(job, desired) if override is None else _with_desired(
        override, desired, lambda v: int_in(v, *FRAMES), f"frame counts from 1 to {FRAMES[1]}")
    return _knob("sample_frames", "quality", tuple(sorted(values)), desired, ("sample.num_frames",), PREVIEW)


def _apply_sample_frames(job: JobFile, frames: int, space) -> None:
    job.set("sample.num_frames", frames)


# -- text encoder: cached embeddings, or kept on the device --------------------------------------
def _text_encoder(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    desired = job.text_encoder_mode
    if desired != "keep":
        return None  # already off the device during training
    values = ["cache", "keep"] if override is None else _with_desired(
        override, desired, lambda v: v in ("cache", "keep"), "cache or keep")
    return _knob("text_encoder", "quality", tuple(v for v in ("cache", "keep") if v in values), desired,
                ("train.cache_text_embeddings",), ALL)


def _apply_text_encoder(job: JobFile, mode: str, space) -> None:
    _set(job, "train.cache_text_embeddings", mode == "cache")


# -- speed: batch, gradient checkpointing, low_vram, layer offloading ----------------------------
def _batch(job: JobFile, override: list | None, video: bool) -> KnobSpec:
    desired = job.batch_size
    effective = desired * job.accumulation
    divisors = divisors_of(effective)
    if override is not None:
        divisors = _with_desired(override, desired, lambda v: int_in(v, 1, effective) and v in divisors,
                                 f"batch sizes that divide the effective batch {effective} (batch_size x accumulation)")
    return _knob("batch", "speed", tuple(sorted(set(divisors))), desired,
                ("train.batch_size", "train.gradient_accumulation", "train.gradient_accumulation_steps"),
                frozenset({"text_encoder", "latents", "train"}))


def divisors_of(n: int) -> list[int]:
    """Every divisor of n, ascending, in sqrt(n) steps (an effective batch of 10^8 takes 10^4)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _apply_batch(job: JobFile, batch: int, space) -> None:
    job.set("train.batch_size", batch)
    for i, own in enumerate(job.get("datasets[*].batch_size")):  # a dataset's own overrides train's
        if own is not None:
            job.set(f"datasets[{i}].batch_size", batch)
    _set(job, space.job.accumulation_key, space.effective_batch // batch)


def _switch(name: str, path: str, phases: frozenset, light: bool):
    """A boolean speed knob whose `light` setting saves memory (checkpointing on, low_vram on)."""

    def make(job: JobFile, override: list | None, video: bool) -> KnobSpec:
        desired = bool(job.get(path))
        values = [True, False] if override is None else _with_desired(
            override, desired, lambda v: isinstance(v, bool), "true or false")
        order = (light, not light)
        return _knob(name, "speed", tuple(v for v in order if v in values), desired, (path,), phases)

    def apply(job: JobFile, value: bool, space) -> None:
        _set(job, path, bool(value))

    return make, apply


_checkpointing, _apply_checkpointing = _switch("gradient_checkpointing", "train.gradient_checkpointing",
                                               frozenset({"train"}), light=True)
_low_vram_switch, _apply_low_vram = _switch("low_vram", "model.low_vram", ALL, light=True)


def _low_vram(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    """model.low_vram moves only what the family's AI Toolkit loader and model class do with it
    (Family.low_vram_moves): for FLUX.1 the load alone, for SDXL nothing, so no knob there."""
    phases = family_for(job).low_vram_moves
    if not phases and override is None:
        return None
    return replace(_low_vram_switch(job, override, video), phases=phases)


# -- layer offloading: model.layer_offloading + its percents ---------------------------------------
# Shares of the layers offloaded, lightest first. AI Toolkit reads each percent as a fraction
# ("0 is off and 1.0 is 100% of the layers", toolkit/config_modules.py ModelConfig) and its UI sets
# it as a slider; quarters give the search five levels, each step a quarter of the denoiser's and
# text encoder's weights, which is as fine as a probe is worth on a card where 100% is the default.
OFFLOAD_SHARES = (1.0, 0.75, 0.5, 0.25, 0.0)


def _layer_offloading(job: JobFile, override: list | None, video: bool) -> KnobSpec | None:
    if is_full_fine_tune(job) or not family_for(job).layer_offloading:
        return None  # the family's AI Toolkit loader never offloads (Family.layer_offloading)
    on = job.get("model.layer_offloading", None)
    on = bool(job.get("model.auto_memory", False) if on is None else on)
    desired = float(job.get("model.layer_offloading_transformer_percent", 1.0)) if on else 0.0
    values = list(OFFLOAD_SHARES) if override is None else _with_desired(
        override, desired, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
        "shares of layers from 0 to 1")
    values = [float(v) for v in values]
    return _knob("layer_offloading", "speed", tuple(sorted(set(values), reverse=True)), desired,
                ("model.layer_offloading", "model.layer_offloading_transformer_percent",
                 "model.layer_offloading_text_encoder_percent"), ALL,
                # Only the load is lighter for sure: after it, the device's rings hold copies of the
                # last offloaded layers (dequantized: twice an 8-bit weight), through the VAE-only
                # latents pass too, and the layers' autograd function saves every input, which
                # without checkpointing can outweigh the weights that went to the host (a Wan clip
                # of 81 frames: 335 MB of input against 141 MB of weight per FFN layer).
                unordered=ALL - {"load"})


def _apply_layer_offloading(job: JobFile, share: float, space) -> None:
    """Off at 0; else on, with the same share of the denoiser's and the text encoder's layers."""
    job.set("model.layer_offloading", share > 0)
    if share > 0:
        job.set("model.layer_offloading_transformer_percent", share)
        job.set("model.layer_offloading_text_encoder_percent", share)


_BUILDERS: dict[str, Callable[[JobFile, list | None, bool], KnobSpec | None]] = {
    "buckets": _buckets, "frames": _frames, "rank": _rank, "quantize": _quantize, "optimizer": _optimizer, "ema": _ema,
    "sampling": _sampling, "sample_size": _sample_size, "sample_frames": _sample_frames,
    "text_encoder": _text_encoder, "batch": _batch, "gradient_checkpointing": _checkpointing,
    "low_vram": _low_vram, "layer_offloading": _layer_offloading,
}
_WRITERS: dict[str, Callable[[JobFile, Any, Any], None]] = {
    "buckets": _apply_buckets, "frames": _apply_frames, "rank": _apply_rank, "quantize": _apply_quantize,
    "optimizer": _apply_optimizer, "ema": _apply_ema, "sampling": _apply_sampling, "sample_size": _apply_sample_size,
    "sample_frames": _apply_sample_frames, "text_encoder": _apply_text_encoder, "batch": _apply_batch,
    "gradient_checkpointing": _apply_checkpointing, "low_vram": _apply_low_vram,
    "layer_offloading": _apply_layer_offloading,
}
_LABELS: dict[str, Callable[[Any], str]] = {
    "buckets": lambda v: f"[{v}]",
    "gradient_checkpointing": lambda v: "on" if v else "off",
    "low_vram": lambda v: "on" if v else "off",
    "ema": lambda v: "on" if v else "off",
    "sampling": lambda v: "on" if v else "off",
    "layer_offloading": lambda v: f"{round(v * 100)}%",
}
_SHORT = {"gradient_checkpointing": "gc", "sample_size": "sample", "text_encoder": "te", "layer_offloading": "offload"}


# -- diagnose's levers, as edits of the job's keys ------------------------------------------------
def lever_changes(job: JobFile, lever: str) -> list[tuple[str, Any, Any]]:
    """diagnose's lever (diagnose.LEVERS) as this job's edits, (key under config.process[0], old, new);
    none where no key of the job makes it (more swap space)."""
    edit = _LEVER_EDITS.get(lever)
    return edit(job) if edit is not None else []


def _lever_switch(path: str, value: bool = True) -> Callable[[Any], list[tuple[str, Any, Any]]]:
    return lambda job: [(path, bool(job.get(path)), value)]


def _lever_batch(job) -> list[tuple[str, Any, Any]]:
    batch, accumulation = int(job.get("train.batch_size")), job.accumulation
    return [("train.batch_size", batch, 1), (job.accumulation_key, accumulation, accumulation * batch)]


def _lever_bucket(job) -> list[tuple[str, Any, Any]]:
    """Drop the largest bucket from every dataset that has it; a dataset left with none steps down."""
    largest = max(job.buckets)
    changes = []
    for i, value in enumerate(job.get("datasets[*].resolution")):
        sizes = [int(r) for r in _as_list(value)]
        if largest not in sizes:
            continue
        kept = [r for r in sizes if r != largest] or [_step_down(largest)]
        changes.append((f"datasets[{i}].resolution", sizes if isinstance(value, list) else value,
                        kept if isinstance(value, list) or len(kept) > 1 else kept[0]))
    return changes


def _lever_frames(job) -> list[tuple[str, Any, Any]]:
    frames = [int(f) for f in job.get("datasets[*].num_frames")]
    fewer = _fewer_frames(max(frames))
    return [(f"datasets[{i}].num_frames", f, fewer) for i, f in enumerate(frames) if f > fewer]


def _lever_smaller_sample(job) -> list[tuple[str, Any, Any]]:
    frames = int(job.get("sample.num_frames"))
    if frames > 1:
        return [("sample.num_frames", frames, _fewer_frames(frames))]
    return [(key, int(job.get(key)), max(256, int(job.get(key)) // 2 // 64 * 64))
            for key in ("sample.width", "sample.height") if int(job.get(key)) > 512]


def _lever_cache_to_disk(job) -> list[tuple[str, Any, Any]]:
    return [(f"datasets[{i}].cache_latents_to_disk", bool(v), True)
            for i, v in enumerate(job.get("datasets[*].cache_latents_to_disk")) if not v]


def _lever_fewer_workers(job) -> list[tuple[str, Any, Any]]:
    return [(f"datasets[{i}].num_workers", int(w), 0)
            for i, w in enumerate(job.get("datasets[*].num_workers", NUM_WORKERS)) if int(w) > 0]


_LEVER_EDITS: dict[str, Callable[[JobFile], list[tuple[str, Any, Any]]]] = {
    "checkpointing": _lever_switch("train.gradient_checkpointing"), "batch": _lever_batch, "bucket": _lever_bucket,
    "frames": _lever_frames, "quantize": _lever_switch("model.quantize"), "low_vram": _lever_switch("model.low_vram"),
    "cache_text": _lever_switch("train.cache_text_embeddings"), "quantize_text": _lever_switch("model.quantize_te"),
    "sampling_off": _lever_switch("train.disable_sampling"), "smaller_sample": _lever_smaller_sample,
    "cache_to_disk": _lever_cache_to_disk, "fewer_workers": _lever_fewer_workers,
}


# The buckets the rollback steps down through when it drops a dataset's only bucket.
LADDER = (512, 768, 1024, 1280, 1536, 2048)


def _step_down(size: int) -> int:
    lower = [r for r in LADDER if r < size]
    return lower[-1] if lower else size


def _fewer_frames(frames: int) -> int:
    """About half, kept at 4k+1 as Wan's VAE wants (81 -> 41, 33 -> 17)."""
    return max(1, (frames - 1) // 2 // 4 * 4 + 1)


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# -- the probe request ----------------------------------------------------------------------------
def quant_types(job, family) -> tuple[str, str]:
    """The base model's and the text encoders' qtype names as AI Toolkit's loaders quantize with them.

    Which key gives the text encoders' is the family's (models.Family.te_qtype_key): Flux and Wan
    quantize T5/UMT5 with model.qtype, Qwen-Image and Z-Image read qtype_te. ModelConfig turns a qtype
    of exactly `qfloat8` into torchao's `float8` under model.layer_offloading, whatever the family
    (toolkit/config_modules.py, before it splits an adapter off at '|'), and Z-Image's loader turns
    model.qtype's with a training adapter (Family.float8_with; AI Toolkit commit 27a03a91)."""
    offloading = job.get("model.layer_offloading", None)
    offloading = bool(job.get("model.auto_memory", False) if offloading is None else offloading)

    with_adapter = bool(family.float8_with and job.get(family.float8_with, None))
    qtype = "float8" if (offloading or with_adapter) and str(job.get("model.qtype")) == "qfloat8" else job.qtype
    if family.te_qtype_key != "qtype_te":
        return qtype, qtype
    return qtype, "float8" if offloading and str(job.get("model.qtype_te")) == "qfloat8" else job.qtype_te


# The rank fitfinder assumes for an accuracy-recovery adapter whose file is not on this machine (the
# adapters' own README calls 16 the sweet spot for Qwen-Image at 3 bits; AI Toolkit reads it from the file).
RECOVERY_RANK_ASSUMED = 16


def recovery_adapter(job, family) -> dict | None:
    """The accuracy-recovery adapter of `model.qtype: QTYPE|PATH` (or model.accuracy_recovery_adapter),
    as toolkit/util/quantize.py `quantize_model` loads it (AI Toolkit commit 27a03a91): None without one,
    or for a family whose loader quantizes otherwise (Family.recovery_adapter).

    quantize_model builds a LoRA from the file: its rank is the first `lora_A` weight's rows, alpha the
    rank, its layers the keys' prefixes (`key.split(".lora_")[0]`). The file is read here when it is on
    this machine (a local path, or the Hugging Face cache; its safetensors header only, no weights);
    otherwise the rank is RECOVERY_RANK_ASSUMED on the LoRA's own layers, and "read" says so."""
    path = str(job.get("model.qtype", "")).partition("|")[2].strip() or job.get("model.accuracy_recovery_adapter", None)
    if not (path and job.quantize and family.recovery_adapter):
        return None
    tensors = (_adapter_header(path) or _safetensors.Header(path, {})).tensors
    rank = next((int(shape[0]) for key, (_, shape) in tensors.items() if "lora_A" in key and shape), None)
    if rank is None:
        return {"rank": RECOVERY_RANK_ASSUMED, "layers": None, "read": False, "path": path}
    layers = sorted({re.sub(r"^(transformer|diffusion_model|unet)\.", "", key.split(".lora_")[0])
                     for key in tensors if ".lora_" in key})
    return {"rank": rank, "layers": layers, "read": True, "path": path}


def _adapter_header(path: str) -> _safetensors.Header | None:
    """The adapter file's header, found as AI Toolkit finds the file (a local file, or
    'user/repo/file.safetensors' on the hub, here from the local cache only); None when it is not on
    this machine or not readable."""
    local = Path(path)
    if not local.is_file():
        parts = path.split("/")
        if len(parts) != 3:
            return None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(f"{parts[0]}/{parts[1]}", parts[2])
        if not isinstance(cached, str):
            return None
        local = Path(cached)
    return _safetensors.read(local)


def layer_offloading(job, family) -> dict[str, float]:
    """The share of layers offloaded per kind of part, {"denoiser": p, "text_encoder": p} (0: none).

    AI Toolkit's ModelConfig (toolkit/config_modules.py) reads `model.layer_offloading` (default:
    the deprecated `auto_memory`, false) and the two percents as fractions, each 1.0 by default,
    "0 is off"; only the loaders of `Family.layer_offloading` families act on them. A full
    fine-tune is probed without it (models/_offload.py says why).
    """
    on = job.get("model.layer_offloading", None)
    on = bool(job.get("model.auto_memory", False) if on is None else on)
    if not (on and family.layer_offloading) or aitoolkit_job.is_full_fine_tune(job):
        return {"denoiser": 0.0, "text_encoder": 0.0}
    return {"denoiser": float(job.get("model.layer_offloading_transformer_percent", 1.0)),
            "text_encoder": float(job.get("model.layer_offloading_text_encoder_percent", 1.0))}


# NetworkConfig (toolkit/config_modules.py): lokr_full_rank, true by default, sets linear,
# linear_alpha, conv and conv_alpha to this for a LoKr.
LOKR_FULL_RANK = 9999999999


def _trained_weights(job, family) -> dict[str, Any]:
    """A LoRA's rank and alpha, and its kind (`network_type`: lora, lokr, or locon, which AI Toolkit
    also calls lycoris); or, without `network` (a full fine-tune), rank None and the parameter name
    filters AI Toolkit applies to the denoiser (model.only_if_contains and ignore_if_contains,
    matched as substrings of "transformer.NAME" / "unet.NAME")."""
    if aitoolkit_job.is_full_fine_tune(job):
        return {"rank": None, "alpha": None,
                "only_if_contains": list(job.get("model.only_if_contains", None) or []),
                "ignore_if_contains": list(job.get("model.ignore_if_contains", None) or [])}
    kind = aitoolkit_job.network_type(job)
    kind = "locon" if kind == "lycoris" else kind
    if kind == "locon" and not family.lora_convs:
        raise UserError(f"{job.source}: config.process[0].network.type: {job.get('network.type')}: AI Toolkit's "
                        "LyCORIS network (toolkit/lycoris_special.py) wraps UNet blocks only and finds no layer "
                        f"to train in {family.name}; use type: lora or lokr")
    conv = job.get("network.conv", None)
    rank, alpha = job.lora_rank, job.lora_alpha
    conv_alpha = float(job.get("network.conv_alpha", None) or conv) if conv else None
    if kind == "lokr" and job.get("network.lokr_full_rank", True):
        rank = alpha = conv = conv_alpha = LOKR_FULL_RANK
    return {"rank": rank, "alpha": alpha, "network_type": kind,
            # AI Toolkit's LoRA leaves out the layers whose names hold one of these (lora_special.py)
            "lora_ignore": [str(word) for word in job.get("network.network_kwargs.ignore_if_contains", None) or []],
            # NetworkConfig: `conv` (None: no LoRA on the larger convolutions), `conv_alpha` defaulting to it
            "conv_rank": int(conv) if conv else None,
            "conv_alpha": conv_alpha,
            **({"lokr_factor": int(job.get("network.lokr_factor", -1))} if kind == "lokr" else {})}


def _preservation(job) -> bool:
    """train.diff_output_preservation or blank_prompt_preservation: each training step adds a prior
    prediction and a preservation prediction (SDTrainer.train_single_accumulation). AI Toolkit refuses
    both at once (toolkit/config_modules.py validate_configs), either without a network, and the first
    without a trigger word (SDTrainer.__init__); so does fitfinder, in one line each."""
    where = f"{job.source}: config.process[0].train"
    dop, blank = bool(job.get("train.diff_output_preservation", False)), bool(
        job.get("train.blank_prompt_preservation", False))
    if dop and blank:
        raise UserError(f"{where}: AI Toolkit refuses diff_output_preservation and blank_prompt_preservation "
                        "together; keep one of them")
    if (dop or blank) and aitoolkit_job.is_full_fine_tune(job):
        raise UserError(f"{where}: AI Toolkit's output preservation needs a network (a LoRA); add `network`")
    triggers = [job.get("trigger_word", None), *(dataset.get("trigger_word") for dataset in job.process["datasets"])]
    if dop and not any(trigger is not None for trigger in triggers):
        raise UserError(f"{where}.diff_output_preservation: AI Toolkit requires a trigger_word with it; set "
                        "config.process[0].trigger_word")
    return dop or blank


def _validation(job) -> dict:
    """train.validation_config (toolkit/config_modules.py ValidationConfig; BaseSDTrainProcess
    setup_validation, validate): every validate_every_n_steps, each validation image's cached latents
    at `resolution` (512) with every one of validation_sigmas (four) as one batch, predicted without
    gradients, the network on. AI Toolkit skips items without an image_path; the probe validates a
    square image at the resolution. {} without validation."""
    config = job.get("train.validation_config", None)
    if not isinstance(config, dict):
        return {}
    items = [item for item in config.get("validation_items") or [] if isinstance(item, dict) and item.get("image_path")]
    if not items:
        return {}
    sigmas = config.get("validation_sigmas") or [1.0, 0.75, 0.5, 0.25]
    return {"validation": {"resolution": int(config.get("resolution", 512)), "batch": len(sigmas)}}


def _ema_decay(job) -> float | None:
    """train.ema_config: None without EMA; AI Toolkit's decay defaults to 0.999."""
    if not job.get("train.ema_config.use_ema"):
        return None
    return float(job.get("train.ema_config.ema_decay", None) or 0.999)


def _shapes(job, video: bool) -> list[list[int]]:
    """Every [resolution, frames] the datasets train on; frames are 1 for image families."""
    shapes = set()
    for resolutions, frames in zip(job.get("datasets[*].resolution"), job.get("datasets[*].num_frames")):
        for resolution in resolutions if isinstance(resolutions, list) else [resolutions]:
            shapes.add((int(resolution), int(frames) if video else 1))
    return [list(shape) for shape in sorted(shapes)]


def _sample_settings(job, video: bool, sample_steps: int) -> dict:
    enabled = not job.get("train.disable_sampling")
    width, height = _preview_size(job)
    return {"first": enabled and not job.get("train.skip_first_sample"), "last": enabled,
            "width": width, "height": height,
            "frames": int(job.get("sample.num_frames")) if video else 1,
            "steps": min(sample_steps, int(job.get("sample.sample_steps"))),
            "guidance_scale": float(job.get("sample.guidance_scale"))}


# toolkit/config_modules.py SampleConfig's defaults, for a `first_sample:` section that leaves a key out.
SAMPLE_CONFIG_DEFAULTS = {"width": 512, "height": 512, "num_frames": 1, "sample_steps": 20, "guidance_scale": 7}


def _first_sample(job, video: bool, sample_steps: int) -> dict:
    """`first_sample:` (BaseSDTrainProcess: its own SampleConfig, made from that section alone): a
    preview before training from it, skip_first_sample or not (only disable_sampling stops it), then
    the baseline preview unless skipped; both are the probe's first preview phase. {} without it."""
    section = job.get("first_sample", None)
    if not isinstance(section, dict) or job.get("train.disable_sampling"):
        return {}
    read = {key: section.get(key, default) for key, default in SAMPLE_CONFIG_DEFAULTS.items()}
    width, height = _preview_size(job, "first_sample", (int(read["width"]), int(read["height"])))
    return {"first_sample": {"first": True, "last": False, "width": width, "height": height,
                             "frames": int(read["num_frames"]) if video else 1,
                             "steps": min(sample_steps, int(read["sample_steps"])),
                             "guidance_scale": float(read["guidance_scale"])}}


def _preview_size(job, section: str = "sample", default: tuple[int, int] | None = None) -> tuple[int, int]:
    """The largest preview (by pixels): sample.width x height (or `default`), each of the section's
    samples' own width/height, and a prompt's `--w`/`--h` flags (AI Toolkit's SampleConfig and
    GenerateImageConfig read them per prompt, commit 27a03a91)."""
    default = default or (int(job.get("sample.width")), int(job.get("sample.height")))
    sizes = [default]
    for item in (job.get(f"{section}.samples", None) or []) + (job.get(f"{section}.prompts", None) or []):
        if isinstance(item, dict):
            sizes.append((int(item.get("width", default[0])), int(item.get("height", default[1]))))
            item = item.get("prompt", "")
        if isinstance(item, str):
            found = {flag: int(value) for flag, value in re.findall(r"--([wh])\s+(\d+)", item)}
            sizes.append((found.get("w", default[0]), found.get("h", default[1])))
    return max(sizes, key=lambda size: (size[0] * size[1], size))
