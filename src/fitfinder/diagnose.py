"""A failed run's log -> which OOM, when, whose fault, and the one change to make first.

The answer is the table of the OOM guides (the seed guides, summarised in docs/diagnose.md): when it crashed
-> most likely cause -> first change. "When" comes from the log (oom.scan_log): before step 1 (and
in which phase), during a sample, in steps 1-10, later, or intermittently. The first change is the
first step of the guides' rollback order for that moment that the job has not taken yet; with
`--job` it is written into a copy of the job file, never into the job file itself.

A log without an OOM is answered with its error (AI Toolkit's "Error running job:" line included) and the
phase its traceback's frames name, or, when the log ends inside a traceback (cut before its exception
line), with what that traceback shows and a request for the rest.

Environment or config: a conservative configuration (batch 1, checkpointing on, buckets up to
768, at most 33 frames) that still finds nothing free, or gets CUBLAS_STATUS_ALLOC_FAILED, before
training really starts is a card or worker that is not clean: relaunching or changing the job
will not help. Host: the machine's RAM ran out, not the card's; its changes are about RAM (cache to
disk, fewer data-loader workers, swap), never a GPU setting.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fitfinder import oom, trainers
from fitfinder.errors import UserError
from fitfinder.trainers.aitoolkit_job import JobFile
from fitfinder.units import format_bytes

# What the guides call a conservative configuration (their "Fix C": keep 512/768 while checking).
CONSERVATIVE_BUCKET = 768
CONSERVATIVE_FRAMES = 33
# The training steps the guides call "the first steps" (their table: "Paso 1-10").
EARLY_STEPS = 10
# Reserved-but-unallocated memory worth a note about fragmentation, as a share of the card.
FRAGMENTATION_SHARE = 0.05

Change = tuple[str, Any, Any]  # (key under config.process[0], old value, new value)


# -- the table ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    key: str
    when: str  # when it crashed, as the guides' table says it
    cause: str  # most likely cause
    levers: tuple[str, ...]  # the rollback order for an image job, first change first
    video_levers: tuple[str, ...] | None = None  # the order for a video job, when it differs
    video_cause: str | None = None


# The guides' orders. The search's rollback (search.planner.ROLLBACK) walks a load OOM the other
# way (low_vram and the text encoder before quantize), on purpose: it proves each move with a probe,
# so it can try the moves that cost only speed first; a diagnosis names one change made blind, and
# quantizing is the one most sure to fit.
ROWS: dict[str, Row] = {row.key: row for row in (
    Row("load", "before step 1, while loading the model",
        "the model does not fit with its current memory savings",
        ("quantize", "low_vram")),
    Row("text_encoder", "before step 1, while encoding the captions",
        "the text encoders sit on the card next to the model",
        ("cache_text", "quantize_text", "low_vram")),
    Row("latents", "before step 1, while caching latents",
        "the VAE encodes the largest bucket at full size",
        ("bucket", "low_vram"), ("frames", "bucket", "low_vram")),
    Row("first_sample", "before step 1, during the first sample",
        "the preview is too heavy on top of the loaded model",
        ("sampling_off", "quantize", "low_vram")),
    Row("before_step_1", "before step 1",
        "a heavy preview, model-load pressure, or a worker that was not clean",
        ("sampling_off", "quantize", "low_vram")),
    Row("steps_1_10", "steps 1-10",
        "gradient checkpointing off, batch too large, or the largest bucket too large",
        ("checkpointing", "batch", "bucket", "quantize", "low_vram"),
        ("frames", "checkpointing", "batch", "bucket", "quantize", "low_vram"),
        "too many frames per clip (a video job's real peak), batch too large, or the largest bucket too large"),
    Row("sample", "only while sampling",
        "the preview settings cost more memory than training does",
        ("smaller_sample", "sampling_off")),
    Row("later", "after step 10, once",
        "a heavier batch came late: the largest bucket or the longest clip (or fragmentation)",
        ("bucket", "checkpointing", "batch", "quantize", "low_vram"),
        ("frames", "bucket", "checkpointing", "batch", "quantize", "low_vram")),
    Row("intermittent", "sometimes yes, sometimes no",
        "a borderline configuration: it fits most batches but not the heaviest",
        ("bucket", "checkpointing", "batch", "quantize", "low_vram"),
        ("frames", "bucket", "checkpointing", "batch", "quantize", "low_vram")),
    Row("environment", "a conservative configuration fails at once, or the card was occupied",
        "the card or the worker is not clean", ()),
    Row("host", "whenever the machine's RAM runs out (OOM killer, MemoryError, a data-loader worker killed)",
        "system RAM, not the card, ran out: cached latents, data-loader workers or offloaded weights held in RAM",
        ("cache_to_disk", "fewer_workers", "more_swap")),
)}
ENVIRONMENT_ADVICE = ("do not relaunch: run nvidia-smi and stop what else holds the card, or start again on "
                      "a clean worker; if this same configuration ran before, report the worker")


# -- the settings a job has, from the job file or as far as the log shows them ----------------------
@dataclass
class Settings:
    source: str  # "job" or "log"
    batch: int | None = None
    accumulation: int | None = None
    checkpointing: bool | None = None
    buckets: list[int] | None = None
    frames: int | None = None
    quantize: bool | None = None
    quantize_text: bool | None = None
    low_vram: bool | None = None
    cache_text: bool | None = None
    sampling_off: bool | None = None
    sample_size: tuple[int, int] | None = None
    sample_frames: int | None = None
    cache_to_disk: bool | None = None  # latents cached to disk, not held in RAM
    workers: int | None = None  # data-loader workers

    @property
    def video(self) -> bool:
        return (self.frames or 1) > 1

    def conservative(self) -> bool | None:
        """False as soon as one known setting is not conservative; None when some are not known."""
        checks = [None if self.batch is None else self.batch == 1, self.checkpointing,
                  None if not self.buckets else max(self.buckets) <= CONSERVATIVE_BUCKET,
                  (self.frames or 1) <= CONSERVATIVE_FRAMES]
        if False in checks:
            return False
        return None if None in checks else True


def settings_of_job(job, source: str = "job") -> Settings:
    """Every setting the rollback looks at, as the job's trainer reads its file (trainers.diagnose_settings:
    AI Toolkit's defaults for what its file leaves out, a kohya job its own)."""
    return Settings(source, **trainers.diagnose_settings(job))


# (pattern, setting, where it comes from). The last match wins, except buckets and frames: the largest.
LOG_SETTINGS: tuple[tuple[str, str, str], ...] = (
    (r"batch size per device / バッチサイズ: (\d{1,9})", "batch",
     "kohya sd-scripts and musubi-tuner at 'running training'"),
    (r"Instantaneous batch size per device = (\d{1,9})", "batch", "diffusers example scripts at 'Running training'"),
    (r"--train_batch_size[= ](\d{1,9})", "batch", "a command line (kohya sd-scripts, diffusers examples)"),
    (r"勾配を合計するステップ数 = (\d{1,9})", "accumulation",
     "kohya sd-scripts and musubi-tuner at 'running training'"),
    (r"Gradient Accumulation steps = (\d{1,9})", "accumulation", "diffusers example scripts at 'Running training'"),
    (r"--gradient_accumulation_steps[= ](\d{1,9})", "accumulation", "a command line"),
    (r"(--gradient_checkpointing)\b", "checkpointing", "a command line (kohya_ss, fluxgym and musubi GUIs print it)"),
    (r"resolution: \((\d{1,9}), (\d{1,9})\)", "buckets", "kohya sd-scripts / musubi-tuner dataset summary"),
    (r"--resolution[= ]\"?(\d{1,9})", "buckets", "a command line (diffusers examples, kohya sd-scripts)"),
    (r"target_frames: \(([\d, ]{1,2000})\)", "frames", "musubi-tuner dataset summary"),
    (r"(--cache_text_encoder_outputs)\b", "cache_text", "a command line (kohya sd-scripts)"),
    (r"(--fp8_base)\b", "quantize", "a command line (kohya sd-scripts, musubi-tuner)"),
    (r"(--blocks_to_swap)\b", "low_vram", "a command line (kohya sd-scripts, musubi-tuner)"),
    (r"(--cache_latents_to_disk)\b", "cache_to_disk", "a command line (kohya sd-scripts)"),
    (r"--(?:max_data_loader_n_workers|dataloader_num_workers)[= ]\"?(\d{1,9})", "workers",
     "a command line (kohya sd-scripts and musubi-tuner; diffusers examples)"),
    (r"width: (\d{1,9})", "sample_width", "kohya sd-scripts, for each sample prompt"),
    (r"height: (\d{1,9})", "sample_height", "kohya sd-scripts, for each sample prompt"),
)
# What may come before a setting on its line: kohya's dataset summary indents "resolution: (W, H)"; its
# sample lines print "width: N" alone, not inside a quoted prompt. Checked per match, so that every
# pattern starts with its literal (a line-start pattern under MULTILINE took 2.4 s for 100,000 lines).
_BEFORE_ON_LINE = {"buckets": re.compile(r"[ \t]*"), "sample_width": re.compile(r'(?:[^"]*\W)?'),
                   "sample_height": re.compile(r'(?:[^"]*\W)?')}
_FLAGS = ("--gradient_checkpointing", "--cache_text_encoder_outputs", "--fp8_base", "--blocks_to_swap",
          "--cache_latents_to_disk")


def settings_of_log(text: str) -> Settings:
    """The few settings kohya sd-scripts, musubi-tuner and diffusers logs show; the rest stay unknown
    (None). AI Toolkit's logs carry the whole config: see `aitk_config_of_log`."""
    found: dict[str, list] = {}
    for pattern, name, _ in LOG_SETTINGS:
        for match in re.finditer(pattern, text):
            if name in _BEFORE_ON_LINE and not _alone_enough(text, match.start(), _BEFORE_ON_LINE[name]):
                continue
            if match.group(1) in _FLAGS:
                found.setdefault(name, []).append(True)
            else:
                found.setdefault(name, []).extend(int(n) for n in re.findall(r"\d{1,9}", " ".join(match.groups())))
    settings = Settings("log")
    for name, values in found.items():
        if name == "buckets":
            settings.buckets = sorted(set(values))
        elif name == "frames":
            settings.frames = max(values)
        elif name == "cache_to_disk":
            settings.cache_to_disk = True
        elif name not in ("sample_width", "sample_height"):
            setattr(settings, name, values[-1])
    if "sample_width" in found and "sample_height" in found:
        settings.sample_size = (max(found["sample_width"]), max(found["sample_height"]))
    return settings


def _alone_enough(text: str, at: int, before: re.Pattern, reach: int = 300) -> bool:
    """Whether what precedes `at` on its line fits `before`, looking back at most `reach` characters
    (so a long line with many matches costs its length, not its length squared)."""
    start = text.rfind("\n", max(0, at - reach), at) + 1
    if start == 0 and at > reach:
        return False  # the line started further back than a trainer's prefix ever does
    return before.fullmatch(text, start, at) is not None


def aitk_config_of_log(text: str):
    """AI Toolkit's process config, echoed as JSON after "Running 1 job", as a job file (read with
    AI Toolkit's defaults, like any job file), or None."""
    import json

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"Running \d+ jobs?\s*$", line.strip())), None)
    if start is None:
        return None
    first = next((i for i in range(start + 1, min(len(lines), start + 20)) if lines[i].rstrip() == "{"), None)
    last = next((i for i in range(first or 0, len(lines)) if lines[i].rstrip() == "}"), None) if first else None
    if first is None or last is None:
        return None
    try:
        process = json.loads("\n".join(lines[first:last + 1]))
    except ValueError:
        return None
    return JobFile({"config": {"name": "log", "process": [process]}}, "the log") if isinstance(process, dict) else None


# -- the levers: one setting each, in the guides' words and each trainer's -------------------------
@dataclass(frozen=True)
class Lever:
    name: str
    text: str
    where: dict[str, str]  # trainer -> the setting to change there
    state: Callable[[Settings], bool | None]  # True: already taken; None: the log does not say


LEVERS: dict[str, Lever] = {lever.name: lever for lever in (
    Lever("checkpointing", "turn gradient checkpointing on",
          {"ai-toolkit": "train.gradient_checkpointing: true", "kohya": "--gradient_checkpointing",
           "musubi": "--gradient_checkpointing", "diffusers": "--gradient_checkpointing"},
          lambda s: s.checkpointing),
    Lever("batch", "batch size 1, with gradient accumulation keeping the effective batch",
          {"ai-toolkit": "train.batch_size: 1 and train.gradient_accumulation: {accumulation}",
           "kohya": "--train_batch_size 1 --gradient_accumulation_steps {accumulation}",
           "musubi": "batch_size = 1 in the dataset config, --gradient_accumulation_steps {accumulation}",
           "diffusers": "--train_batch_size=1 --gradient_accumulation_steps={accumulation}"},
          lambda s: None if s.batch is None else s.batch == 1),
    Lever("bucket", "drop the largest bucket (keep 512/768 until it trains, then add buckets back one at a time)",
          {"ai-toolkit": "datasets[].resolution", "kohya": "--resolution / max_bucket_reso",
           "musubi": "resolution in the dataset config", "diffusers": "--resolution"},
          lambda s: None if not s.buckets else max(s.buckets) <= 512),
    Lever("frames", "fewer frames per clip (the largest memory lever of a video job)",
          {"ai-toolkit": "datasets[].num_frames", "musubi": "target_frames in the dataset config"},
          lambda s: None if s.frames is None else s.frames <= 9),
    Lever("quantize", "quantize the base model to 8 bits",
          {"ai-toolkit": "model.quantize: true", "kohya": "--fp8_base", "musubi": "--fp8_base"},
          lambda s: s.quantize),
    Lever("low_vram", "keep the parts not in use off the card (low VRAM / block swap)",
          {"ai-toolkit": "model.low_vram: true", "kohya": "--blocks_to_swap N", "musubi": "--blocks_to_swap N"},
          lambda s: s.low_vram),
    Lever("cache_text", "cache the text embeddings and unload the text encoders",
          {"ai-toolkit": "train.cache_text_embeddings: true", "kohya": "--cache_text_encoder_outputs"},
          lambda s: s.cache_text),
    Lever("quantize_text", "quantize the text encoders",
          {"ai-toolkit": "model.quantize_te: true", "kohya": "an fp8 T5-XXL file for --t5xxl"},
          lambda s: s.quantize_text),
    Lever("sampling_off", "turn preview sampling off for a first run; bring smaller previews back once it trains",
          {"ai-toolkit": "train.disable_sampling: true", "kohya": "drop --sample_prompts",
           "musubi": "drop --sample_prompts", "diffusers": "drop --validation_prompt"},
          lambda s: s.sampling_off),
    Lever("smaller_sample", "make the preview cheaper: half the sample width and height (video: fewer frames)",
          {"ai-toolkit": "sample.width / sample.height / sample.num_frames", "kohya": "--w / --h in the prompt file",
           "musubi": "--w / --h / --f in the prompt file"},
          lambda s: _sample_small(s)),
    # For host RAM only; none of them is a GPU setting (offloading weights to RAM would make it worse).
    Lever("cache_to_disk", "cache latents to disk instead of holding them in system RAM",
          {"ai-toolkit": "datasets[].cache_latents_to_disk: true", "kohya": "--cache_latents_to_disk",
           "musubi": "cache_latents.py writes its cache to disk: run it before training",
           "onetrainer": "latent caching to disk (the cache directory)", "diffusers": "precompute latents to disk"},
          lambda s: s.cache_to_disk),
    Lever("fewer_workers", "fewer data-loader workers: each holds its own copy of what it loads in RAM",
          {"ai-toolkit": "datasets[].num_workers: 0", "kohya": "--max_data_loader_n_workers 0",
           "musubi": "--max_data_loader_n_workers 0", "diffusers": "--dataloader_num_workers=0",
           "onetrainer": "dataloader threads: 1"},
          lambda s: None if s.workers is None else s.workers == 0),
    Lever("more_swap", "add swap space or system RAM (close what else uses it): the machine ran out, not the card",
          {}, lambda s: None),
)}


def _sample_small(settings: Settings) -> bool | None:
    if settings.sample_size is None:
        return None
    return (settings.sample_frames or 1) <= 1 and max(settings.sample_size) <= 512


# -- the diagnosis -------------------------------------------------------------------------------------
@dataclass
class Diagnosis:
    log: str
    trainer: str
    oom: bool
    kind: str
    phase: str
    step: int | None
    when: str | None
    first_change: str
    row: str | None = None
    lever: str | None = None  # the setting the first change turns (a name in LEVERS)
    cause: str | None = None
    reason: str | None = None
    message: str | None = None
    line: int | None = None
    tried_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    events: int = 0
    error: str | None = None
    error_line: int | None = None
    changes: list[Change] = field(default_factory=list)
    unplaced: str | None = None  # why the phase is "unknown": the line it could not place
    written: str | None = None
    next_step: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "oom": self.oom, "kind": self.kind, "phase": self.phase, "step": self.step,
            "first_change": self.first_change, "when": self.when, "row": self.row, "lever": self.lever,
            "cause": self.cause,
            "reason": self.reason, "trainer": self.trainer, "message": self.message, "line": self.line,
            "tried_bytes": self.tried_bytes, "free_bytes": self.free_bytes, "total_bytes": self.total_bytes,
            "events": self.events, "error": self.error, "error_line": self.error_line,
            "unplaced": self.unplaced,
            "changes": [{"key": key, "old": old, "new": new} for key, old, new in self.changes],
            "written": self.written, "next": self.next_step, "notes": self.notes,
        }

    def lines(self) -> list[str]:
        """The answer for a person: what happened, when, why, and what to change first."""
        head = f"diagnose: {self.log} ({TRAINER_NAMES.get(self.trainer, self.trainer)})"
        if not self.oom:
            return [head, *self._lines_without_oom(), f"  first change: {self.first_change}"] + [
                f"  note: {note}" for note in self.notes]
        out = [head, f"  OOM at line {self.line}: {_shorten(self.message)}",
               f"  kind: {self.kind}    when: {self.when_text()}    phase: {self.phase}"]
        if self.unplaced:
            out.append(f"  phase not placed: {self.unplaced}")
        memory = _memory_text(self)
        if memory:
            out.append(f"  memory: {memory}")
        out.append(f"  most likely cause: {self.cause}" + (f" ({self.reason})" if self.reason else ""))
        out.append(f"  first change: {self.first_change}")
        out += [f"  note: {note}" for note in self.notes]
        if self.written:
            out.append(f"  wrote {self.written}: "
                       + "; ".join(f"{k}: {_yaml(o)} -> {_yaml(n)}" for k, o, n in self.changes))
        if self.next_step:
            out.append(f"  next: {self.next_step}")
        return out

    def _lines_without_oom(self) -> list[str]:
        if self.kind == "cut":
            out = [f"  {self.message} (line {self.line}: the log ends inside this traceback)"]
        else:
            where = f" at line {self.error_line}" if self.error_line else ""
            out = ["  not an out-of-memory failure",
                   f"  error{where}: {self.error}" if self.error else "  no error in the log"]
        if self.phase != "unknown":
            out.append(f"  phase: {self.phase}" + (f"    step: {self.step}" if self.step is not None else ""))
        return out

    def when_text(self) -> str:
        text = WHEN_TEXT.get(self.when, str(self.when))
        if self.when == "intermittent":
            text = f"intermittently ({self.events} OOMs; training went on after some)"
        return text + (f", step {self.step}" if self.step is not None else "")


WHEN_TEXT = {"before_step_1": "before step 1", "sample": "while sampling", "steps_1_10": "in steps 1-10",
             "later": "after step 10", "unknown": "during training (step not in the log)"}
TRAINER_NAMES = {"ai-toolkit": "AI Toolkit", "kohya": "kohya sd-scripts", "musubi": "musubi-tuner",
                 "diffusers": "diffusers example script", "onetrainer": "OneTrainer", "simpletuner": "SimpleTuner",
                 "diffusion-pipe": "diffusion-pipe", "pytorch": "PyTorch"}
# (trainer, strings only its logs carry, where they come from). musubi-tuner before kohya: it
# prints kohya's bilingual lines too.
TRAINER_MARKERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("ai-toolkit", ("# Running job:", "Error running job:", "OOM during training step", "BaseSDTrainProcess",
                    "Generating baseline samples"), "ostris/ai-toolkit run.py and jobs/process"),
    ("musubi", ("musubi_tuner", "musubi-tuner", "hv_train_network", "wan_train_network"),
     "kohya-ss/musubi-tuner module names and its folder"),
    ("onetrainer", ("OneTrainer", "GenericTrainer", "modules/modelSetup", "modules\\modelSetup"),
     "Nerogar/OneTrainer paths and classes"),
    ("simpletuner", ("SimpleTuner", "simpletuner", "helpers/training/trainer.py"), "bghira/SimpleTuner paths"),
    ("diffusion-pipe", ("diffusion-pipe", "deepspeed/runtime/pipe"),
     "tdrussell/diffusion-pipe on DeepSpeed's pipeline"),
    ("kohya", ("train_network.py", "学習開始", "train_util.py", "sd-scripts", "kohya_ss"),
     "kohya-ss/sd-scripts scripts and messages, and the folders of its kohya_ss GUI"),
    ("diffusers", ("***** Running training *****", "Running validation...", "train_dreambooth",
                   "train_text_to_image"), "huggingface/diffusers examples/"),
)


def trainer_of(text: str) -> str:
    for trainer, markers, _ in TRAINER_MARKERS:
        if any(marker in text for marker in markers):
            return trainer
    return "pytorch"


def diagnose(text: str, job=None, log_name: str = "log") -> Diagnosis:
    """Read a training log; with `job`, the rollback is read from the job file instead of the log."""
    scan = oom.scan_log(text)
    trainer = trainer_of(text)
    # AI Toolkit echoes its config: without --job, the first change can still be exact (not written).
    editable = job if job is not None else aitk_config_of_log(text)
    settings = settings_of_job(editable, "job" if job is not None else "log") if editable is not None \
        else settings_of_log(text)
    if not scan.events:
        return _without_oom(scan.failure, trainer, log_name)
    event = scan.events[-1]  # the one that ended the run, or the latest
    intermittent = any(e.recovered for e in scan.events)
    before_training = event.step is None or event.step <= 1
    verdict = oom.classify(event.text, conservative=bool(settings.conservative()) and before_training)
    diagnosis = Diagnosis(
        log_name, trainer, True, verdict.kind, event.phase, event.step, _when(event, intermittent), "",
        reason=verdict.reason, message=verdict.message, line=event.line, tried_bytes=verdict.tried_bytes,
        free_bytes=verdict.free_bytes, total_bytes=verdict.total_bytes, events=len(scan.events))
    diagnosis.row = _row(verdict.kind, event, intermittent)
    diagnosis.unplaced = _unplaced(event) if event.phase == "unknown" else None
    row = ROWS[diagnosis.row]
    diagnosis.cause = (row.video_cause if settings.video else None) or row.cause
    _choose_first_change(diagnosis, row, settings, editable)
    diagnosis.notes = _notes(verdict, scan, settings, job)
    return diagnosis


CUT_ADVICE = ("none yet: the error is not in the log; paste the rest of it (from the 'Traceback' line to the "
              "end), or run again with the output saved whole (`... 2>&1 | tee train.log`)")


def _without_oom(failure: oom.Failure | None, trainer: str, log_name: str) -> Diagnosis:
    """A log that shows no OOM: the error it ends in, or a traceback cut before its exception line,
    each with the phase its frames (or the progress lines) name."""
    if failure is None:
        return Diagnosis(log_name, trainer, False, "not_oom", "unknown", None, None,
                         "none: there is no out-of-memory failure, and no error, in this log")
    if failure.cut:
        where = f" in {failure.frame}" if failure.frame else ""
        likely = "likely an OOM; " if failure.phase != "unknown" else ""
        message = f"a traceback{where} without its exception line: {likely}paste the rest"
        return Diagnosis(log_name, trainer, False, "cut", failure.phase, failure.step, None, CUT_ADVICE,
                         message=message, line=failure.line)
    return Diagnosis(log_name, trainer, False, "not_oom", failure.phase, failure.step, None,
                     "none: this run did not fail for memory; fix the error it shows",
                     error=failure.error, error_line=failure.line)


def _when(event: oom.OomEvent, intermittent: bool) -> str:
    if intermittent:
        return "intermittent"
    if event.step is None:
        return "unknown" if event.phase == "train" else "before_step_1"
    if event.phase == "sample":
        return "sample"
    return "steps_1_10" if event.step <= EARLY_STEPS else "later"


def _unplaced(event: oom.OomEvent) -> str:
    """Which line could not be placed in a phase, and what was looked at."""
    line = _shorten(event.verdict.message, 160)
    frames = (f"none of the {event.frames} traceback frames around it names a phase's work"
              if event.frames else "no traceback frame around it")
    return (f'line {event.line} ("{line}"): {frames}, and no progress line before it names a phase '
            "(loading, caching, sampling, a training bar)")


def _row(kind: str, event: oom.OomEvent, intermittent: bool) -> str:
    if kind in ("environment", "host"):
        return kind
    if event.phase == "sample":
        return "first_sample" if event.step is None else "sample"
    if event.phase in ("load", "text_encoder", "latents"):
        return event.phase
    if intermittent:
        return "intermittent"
    if event.phase == "train" or event.step is not None:
        return "steps_1_10" if event.step is None or event.step <= EARLY_STEPS else "later"
    return "before_step_1"


def _choose_first_change(diagnosis: Diagnosis, row: Row, settings: Settings, job) -> None:
    """The first lever of the row's order not already taken; with a job file, its exact edits."""
    if row.key == "environment":
        diagnosis.first_change = ENVIRONMENT_ADVICE
        diagnosis.next_step = ("fix the card first; `fitfinder search --gpu N` checks that the card is clean "
                               "before it starts")
        return
    order = [LEVERS[name] for name in ((row.video_levers or row.levers) if settings.video else row.levers)]
    open_levers = [lever for lever in order if lever.state(settings) is not True]
    if not open_levers:
        diagnosis.first_change = "none left in the guides' order: every lever for this moment is already taken"
        diagnosis.next_step = ("`fitfinder search` finds what fits on this card, and what quality that costs; "
                               "or train on a larger card")
        return
    first = open_levers[0]
    diagnosis.lever = first.name
    # The change in the job's own keys or options, by its trainer (trainers.lever_changes).
    changes = [] if job is None else trainers.lever_changes(job, first.name)
    if changes:  # a job file, or the config AI Toolkit echoed into the log
        diagnosis.changes = changes
        diagnosis.first_change = f"{first.text} (" + "; ".join(
            f"{key}: {_yaml(old)} -> {_yaml(new)}" for key, old, new in diagnosis.changes) + ")"
    else:  # no job, or a change no job key makes (swap)
        diagnosis.first_change = _lever_text(first, settings, diagnosis.trainer)
        if first.state(settings) is None and len(open_levers) > 1:
            diagnosis.first_change += "; if that is already so: " + _lever_text(open_levers[1], settings,
                                                                               diagnosis.trainer)
    diagnosis.next_step = _next_step(row, open_levers)


def _lever_text(lever: Lever, settings: Settings, trainer: str) -> str:
    where = lever.where.get(trainer)
    if where and "{accumulation}" in where:  # batch x accumulation stays the same
        effective = settings.batch * (settings.accumulation or 1) if settings.batch else None
        where = where.format(accumulation=effective or "N")
    return f"{lever.text} ({where})" if where else lever.text


def _next_step(row: Row, open_levers: list[Lever]) -> str | None:
    if row.key in ("later", "intermittent"):
        return ("`fitfinder search` is the better next step: a borderline job needs its peak measured on the "
                "largest bucket with a margin, not another relaunch")
    if len(open_levers) > 1 and row.key in ("steps_1_10", "load", "text_encoder", "latents"):
        return ("if one change is not enough, `fitfinder search` probes the rest of this order in minutes "
                "instead of a relaunch each")
    return None


def _notes(verdict: oom.Verdict, scan: oom.LogScan, settings: Settings, job) -> list[str]:
    notes = []
    if verdict.kind == "config" and _fragmented(verdict):
        notes.append(f"{format_bytes(verdict.unallocated_bytes)} was reserved by PyTorch but unallocated, more "
                     f"than the {format_bytes(verdict.tried_bytes)} it asked for: fragmentation; set "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    skipped = sum(e.skipped_batches for e in scan.events)
    if skipped:
        notes.append(f"AI Toolkit skipped {skipped} batch(es) for OOM during this run")
    if verdict.kind == "config" and job is None and settings.conservative() is None and \
            any(m in verdict.message for m, _ in oom.ENVIRONMENT_MARKERS):
        notes.append("nothing was free: if the job is already conservative (batch 1, checkpointing on, buckets "
                     "up to 768), the card was not clean; give --job to check")
    return notes


def _fragmented(verdict: oom.Verdict) -> bool:
    """Reserved-but-unallocated memory could have served the request, and is worth having back."""
    unallocated, tried, total = verdict.unallocated_bytes, verdict.tried_bytes, verdict.total_bytes
    return bool(unallocated and tried and total and unallocated >= tried
                and unallocated >= FRAGMENTATION_SHARE * total)


# -- the command ---------------------------------------------------------------------------------------
def run(log_path: Path, job_path: Path | None = None, output: Path | None = None,
        script: str | None = None) -> Diagnosis:
    """`fitfinder diagnose`: check the paths, read, diagnose, and write the fixed job file to `output`
    (a kohya job in its own form: the shell file or config TOML `output` names, its dataset TOML
    beside it where the change is there)."""
    _check_paths(log_path, job_path, output)
    text, cut_note = load_log(log_path)
    job = trainers.load(job_path, script=script) if job_path is not None else None  # AI Toolkit's YAML, or kohya
    diagnosis = diagnose(text, job, str(log_path))
    if cut_note:
        diagnosis.notes.append(cut_note)
    if output is not None and diagnosis.changes:
        after = job.copy()
        for key, _, new in diagnosis.changes:
            after.set(key, new)
        header = [f"fitfinder diagnose: the first change after the OOM in {log_path.name} "
                  f"({ROWS[diagnosis.row].when}: {diagnosis.cause})."]
        header += [f"  {key}: {_yaml(old)} -> {_yaml(new)}" for key, old, new in diagnosis.changes]
        diagnosis.written = str(after.write(output, header))
        if diagnosis.next_step is None:
            diagnosis.next_step = f"relaunch with {output}"
    elif output is not None:
        diagnosis.notes.append(f"nothing written to {output}: there is no change to the job file to make")
    elif diagnosis.changes:
        suffix = job_path.suffix if job_path is not None and job_path.suffix else ".yaml"
        diagnosis.notes.append(f"give -o FIXED{suffix} to write the job file with this change" if job is not None else
                               "give --job JOB.yaml -o FIXED.yaml to write the job file with this change")
    return diagnosis


def _check_paths(log_path: Path, job_path: Path | None, output: Path | None) -> None:
    if output is not None and job_path is None:
        raise UserError("-o: needs --job, the job file to apply the first change to")
    if output is not None and output.resolve() == job_path.resolve():
        raise UserError(f"-o {output}: is the input job file; write the changed job to another file "
                        "(the input is never written to)")
    if output is not None and output.resolve() == log_path.resolve():
        raise UserError(f"-o {output}: is the log being read; write the changed job to another file")
    if output is not None and output.is_dir():
        raise UserError(f"-o {output}: is a folder; give the file to write the changed job to")


# A failed run's log is a few MiB (10,000 steps of tqdm redraws are about 1.5 MiB). Past MAX_LOG_BYTES
# only its start (AI Toolkit's echoed config, kohya's settings) and its end (the failure) are read:
# every reader is linear, and this keeps the longest read to a few seconds.
MAX_LOG_BYTES = 16 << 20
LOG_HEAD_BYTES = 1 << 20


def read_log(path: Path) -> str:
    """The log as text: UTF-8, or UTF-16 as PowerShell's Tee-Object writes it; colours removed. A log
    over MAX_LOG_BYTES is its first LOG_HEAD_BYTES and its end (see load_log)."""
    return load_log(path)[0]


def load_log(path: Path) -> tuple[str, str | None]:
    """The log's text, and for a log over MAX_LOG_BYTES the note that says which parts were read.
    Only a regular file is read: a FIFO would block, /dev/zero never ends (refused in one line)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without a writer
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; give the path of a training log") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UserError(f"{path}: is a folder; give the path of a training log")
        raise UserError(f"{path}: not a regular file (a FIFO, a device or a socket); save the log to a file "
                        "and give its path")
    size = info.st_size
    with open(fd, "rb") as handle:
        try:
            if size <= MAX_LOG_BYTES:
                data = handle.read(MAX_LOG_BYTES)  # bounded even if the file grows while it is read
                return _decode_log(data), None
            head = handle.read(LOG_HEAD_BYTES)
            handle.seek(size - (MAX_LOG_BYTES - LOG_HEAD_BYTES))
            tail = handle.read(MAX_LOG_BYTES - LOG_HEAD_BYTES)
        except OSError as exc:
            raise UserError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    return _joined(head, tail, size)


def _joined(head: bytes, tail: bytes, size: int) -> tuple[str, str]:
    """A long log's first and last parts, each cut at a line end, with a line where the rest was."""
    utf16 = head.startswith((b"\xff\xfe", b"\xfe\xff"))
    if utf16:  # the tail starts at an even byte of the same encoding, without its own byte-order mark
        tail = tail[len(tail) % 2:]
        first, rest = _decode_log(head), _decode_log(head[:2] + tail)
    else:
        first, rest = _decode_log(head), _decode_log(tail)
    first, rest = first[:first.rfind("\n") + 1], rest[rest.find("\n") + 1:]
    skipped = size - len(head) - len(tail)
    cut_line = first.count("\n") + 1
    text = f"{first}[fitfinder: {format_bytes(skipped)} of the log not read here]\n{rest}"
    note = (f"the log is {format_bytes(size)}, more than the {format_bytes(MAX_LOG_BYTES)} diagnose reads: it read "
            f"the first {format_bytes(LOG_HEAD_BYTES)} and the last {format_bytes(len(tail))}; line numbers after "
            f"line {cut_line} count from there, not from the start of the file")
    return text, note


def _decode_log(data: bytes) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16", errors="replace")
    else:
        text = data.decode("utf-8", errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


# -- helpers -------------------------------------------------------------------------------------------
def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _shorten(text: str | None, width: int = 220) -> str:
    text = text or ""
    return text if len(text) <= width else text[:width - 3] + "..."


def _memory_text(d: Diagnosis) -> str:
    parts = []
    if d.tried_bytes is not None:
        parts.append(f"tried to allocate {format_bytes(d.tried_bytes)}")
    if d.total_bytes is not None and d.free_bytes is not None:
        parts.append(f"{format_bytes(d.free_bytes)} free of {format_bytes(d.total_bytes)}")
    return "; ".join(parts)
