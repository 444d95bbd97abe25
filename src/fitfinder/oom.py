"""The one OOM classifier: an exception or log text -> is it an OOM, whose fault, and where.

Only an OOM changes the configuration; anything else is reported as the error it is. Every string
known here says where it comes from.

`kind` is "config" (this configuration needs more memory than the card has), "environment" (the
card or worker was not clean: nothing was free even for a conservative configuration, or memory
was held outside this process), or "not_oom". `phase` is where the memory ran out: "load",
"text_encoder", "latents", "sample", "train", or None when nothing in the text says.

Two ways in:
- `classify(exception_or_text)`: one failure (the probe calls it on the exception it caught).
- `scan_log(text)`: a whole training log (AI Toolkit, kohya sd-scripts, musubi-tuner, diffusers
  example scripts, plain PyTorch), walked line by line: every OOM in it with its phase and the
  training step that was running, and whether training went on after it.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field, replace

from fitfinder.errors import UserError
from fitfinder.units import format_bytes, parse_bytes

PHASES = ("load", "text_encoder", "latents", "sample", "train")

# -- what an OOM looks like -------------------------------------------------------------------------
# (substring, where it comes from). Matched case-sensitively, as the libraries print them.
OOM_MARKERS: tuple[tuple[str, str], ...] = (
    ("CUDA out of memory", "PyTorch's CUDA caching allocator (torch.OutOfMemoryError); accelerate's list"),
    ("CUDA error: out of memory", "the CUDA runtime itself (cudaErrorMemoryAllocation), e.g. at context creation"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS could not allocate its handle or workspace (cublasCreate)"),
    ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", "cuDNN, counted as an OOM by accelerate's and Lightning's lists"),
    ("CUDNN_STATUS_ALLOC_FAILED", "cuDNN could not allocate its workspace"),
    ("DefaultCPUAllocator: can't allocate memory", "PyTorch's CPU allocator (accelerate's and Lightning's lists)"),
    ("HIP out of memory", "PyTorch on ROCm"),
    ("XPU out of memory", "PyTorch on Intel GPUs (accelerate's list)"),
    ("MPS backend out of memory", "PyTorch on Apple silicon"),
    ("OOM during training step 3 times in a row", "AI Toolkit gives up after three OOM retries of a step"),
    ("OOM during training step, skipping batch", "AI Toolkit caught an OOM in a step and skipped the batch"),
    ("torch.OutOfMemoryError", "a traceback naming PyTorch's OOM exception"),
    ("torch.cuda.OutOfMemoryError", "the same exception under its name before PyTorch 2.3"),
)
# AI Toolkit's marker for an OOM it survived: the step is skipped and training goes on.
SKIPPED_MARKER = "OOM during training step, skipping batch"
# Markers that mean nothing at all was free: a dirty card when the configuration is conservative.
ENVIRONMENT_MARKERS: tuple[tuple[str, str], ...] = (
    ("0 bytes is free", "PyTorch >= 2.1's OOM message when the card has no free memory at all"),
    ("0 bytes free", "the same, in PyTorch before 2.1"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS failing to allocate a few MiB of workspace"),
)

# -- the numbers in PyTorch's OOM message ------------------------------------------------------------
_SIZE = r"[0-9]+(?:\.[0-9]+)? ?(?:bytes|[KMGTP]iB|B)"
_TRIED = re.compile(rf"Tried to allocate ({_SIZE})")
# PyTorch >= 2.1: "GPU 0 has a total capacity of 23.65 GiB of which 3.06 MiB is free." (2.1 itself
# printed "capacty"); then "Process 123 has 10 GiB memory in use." per process on the card, and
# "Including non-PyTorch memory, this process has 23.6 GiB memory in use." for its own.
_TOTAL_FREE = re.compile(rf"total capac(?:ity|ty) of ({_SIZE}) of which ({_SIZE}) is free")
_THIS_PROCESS = re.compile(rf"this process has ({_SIZE}) memory in use")
_OTHER_PROCESS = re.compile(rf"Process (\d+) has ({_SIZE}) memory in use")
_ALLOCATED_NEW = re.compile(rf"Of the allocated memory ({_SIZE}) is allocated by PyTorch")
_UNALLOCATED_NEW = re.compile(rf"({_SIZE}) is reserved by PyTorch but unallocated")
# PyTorch < 2.1: "(GPU 0; 23.69 GiB total capacity; 22.52 GiB already allocated; 11.25 MiB free;
# 22.93 GiB reserved in total by PyTorch)".
_TOTAL_OLD = re.compile(rf"({_SIZE}) total capacity")
_FREE_OLD = re.compile(rf"({_SIZE}) free[;)]")
_ALLOCATED_OLD = re.compile(rf"({_SIZE}) already allocated")
_RESERVED_OLD = re.compile(rf"({_SIZE}) reserved in total by PyTorch")

# Memory held outside this process that says the card was not ours alone: a display takes up to a
# GiB or so, a CUDA context a few hundred MiB; more than this was another job.
OUTSIDE_FLOOR_BYTES = 2 * 2**30
OUTSIDE_SHARE = 0.10

# -- where an OOM happened: traceback frames ---------------------------------------------------------
# (function name, phase, where it comes from). A sampling frame anywhere makes it "sample" (a
# validation loads a pipeline and encodes prompts: still the sample's memory); otherwise the
# innermost frame that names a phase wins: an AI Toolkit step that encodes its captions on the fly
# runs out in `encode_prompt`, not in training.
FRAME_PHASES: tuple[tuple[str, str, str], ...] = (
    ("sample", "sample", "AI Toolkit BaseSDTrainProcess.sample (baseline and periodic samples)"),
    ("generate_images", "sample", "AI Toolkit StableDiffusion.generate_images"),
    ("sample_images", "sample", "kohya sd-scripts / musubi-tuner NetworkTrainer.sample_images"),
    ("sample_images_common", "sample", "kohya sd-scripts train_util.sample_images_common"),
    ("sample_image_inference", "sample", "kohya sd-scripts train_util / flux_train_utils"),
    ("log_validation", "sample", "diffusers example scripts' validation"),
    ("cache_text_encoder_outputs_if_needed", "text_encoder", "kohya sd-scripts NetworkTrainer"),
    ("cache_text_encoder_outputs", "text_encoder", "kohya sd-scripts train_util"),
    ("encode_prompt", "text_encoder", "diffusers pipelines and AI Toolkit StableDiffusion.encode_prompt"),
    ("compute_text_embeddings", "text_encoder", "diffusers dreambooth examples"),
    ("cache_latents", "latents", "kohya sd-scripts / AI Toolkit latent caching"),
    ("cache_batch_latents", "latents", "kohya sd-scripts train_util"),
    ("compute_vae_encodings", "latents", "diffusers train_text_to_image_lora_sdxl"),
    ("encode_images", "latents", "AI Toolkit StableDiffusion.encode_images (VAE encode)"),
    ("from_pretrained", "load", "diffusers / transformers model loading"),
    ("quantize_model", "load", "AI Toolkit toolkit/util/quantize.py"),
    ("load_model", "load", "AI Toolkit StableDiffusion.load_model"),
    ("load_target_model", "load", "kohya sd-scripts"),
    ("load_transformer", "load", "musubi-tuner"),
    ("load_flow_model", "load", "kohya sd-scripts flux_utils"),
    ("hook_train_loop", "train", "AI Toolkit SDTrainer"),
    ("train_single_accumulation", "train", "AI Toolkit SDTrainer"),
    ("call_dit", "train", "musubi-tuner NetworkTrainer"),
    ("backward", "train", "torch.Tensor.backward / accelerate's Accelerator.backward"),
)
_FRAME_PHASE = {name: phase for name, phase, _ in FRAME_PHASES}
_FRAME = re.compile(r'File "[^"]+", line \d+, in (\S+)')

# -- where an OOM happened: what trainers print on entering a phase ----------------------------------
# (lower-case substring, phase, where it comes from). Once training has started only the sample
# markers and the training progress bar move the phase: nothing loads again.
LINE_PHASES: tuple[tuple[str, str, str], ...] = (
    ("loading flux model", "load", "AI Toolkit"),
    ("loading wan model", "load", "AI Toolkit"),
    ("loading transformer", "load", "AI Toolkit"),
    ("quantizing transformer", "load", "AI Toolkit"),
    ("loading dit model", "load", "musubi-tuner"),
    ("loading state dict from", "load", "kohya sd-scripts flux_utils"),
    ("loading checkpoint shards", "load", "transformers / diffusers from_pretrained"),
    ("move text encoders to gpu", "text_encoder", "kohya sd-scripts flux_train_network"),
    ("caching text encoder outputs", "text_encoder", "kohya sd-scripts"),
    ("caching text embeddings", "text_encoder", "AI Toolkit with train.cache_text_embeddings"),
    ("caching latents", "latents", "AI Toolkit and kohya sd-scripts ('Caching latents', 'caching latents.')"),
    ("generating baseline samples before training", "sample", "AI Toolkit, the first sample"),
    ("generating images", "sample", "AI Toolkit's sampling progress bar"),
    ("generating samples", "sample", "AI Toolkit's sampling progress bar (newer versions)"),
    ("generating sample images at step", "sample", "kohya sd-scripts and musubi-tuner"),
    ("running validation", "sample", "diffusers example scripts"),
    ("running training / 学習開始", "train", "kohya sd-scripts and musubi-tuner"),
    ("***** running training *****", "train", "diffusers example scripts"),
)

# -- which progress bar counts training steps ---------------------------------------------------------
# tqdm: "DESC:  12%|##        | 240/2000 [01:02<07:35,  3.86it/s, POSTFIX]". The training bar is
# "steps" in kohya sd-scripts and musubi-tuner, "Steps" in diffusers examples, the job name in AI
# Toolkit; any other bar whose postfix reports a loss is taken as a training loop too.
_BAR = re.compile(r"(?P<desc>[^\r\n|]*?)\s*(?P<pct>\d{1,3})%\|[^|\r\n]*\|\s*(?P<n>\d+)/(?P<total>\d+)"
                  r"(?:\s*\[(?P<inside>[^\]\r\n]*)\]?)?")
# AI Toolkit run.py's banner "# Running job: NAME" starts a job: loading, and NAME is its bar's desc.
_JOB_NAME = re.compile(r"#\s*Running job: (\S.*?)\s*$")
_TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Verdict:
    is_oom: bool
    kind: str  # "config" | "environment" | "not_oom"
    message: str
    marker: str | None = None
    tried_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None  # this process, PyTorch and not (PyTorch >= 2.1)
    reserved_bytes: int | None = None  # reserved by PyTorch's caching allocator
    unallocated_bytes: int | None = None  # reserved but not allocated: fragmentation when large
    other_process_bytes: int | None = None  # other processes on the card, when the message names them
    phase: str | None = None  # from the traceback, when there is one
    reason: str | None = None  # why "environment"

    @property
    def outside_bytes(self) -> int | None:
        """Card memory held outside this process when it ran out (total - free - its own)."""
        own = self.process_bytes if self.process_bytes is not None else self.reserved_bytes
        if self.total_bytes is None or self.free_bytes is None or own is None:
            return None
        return max(0, self.total_bytes - self.free_bytes - own)


def classify(error: BaseException | str, conservative: bool = False,
             occupied_at_start: bool = False) -> Verdict:
    """Classify an exception or log text.

    `conservative`: the configuration was already minimal (batch 1, checkpointing on, small
    buckets), so "nothing free" means the card. `occupied_at_start`: another process held the card
    before the job began (a preflight reading).
    """
    if isinstance(error, BaseException):
        text = f"{type(error).__name__}: {error}"
        frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
        is_oom_type = type(error).__name__ == "OutOfMemoryError"
    else:
        text = str(error)
        frames = _FRAME.findall(text)
        is_oom_type = False
    marker = next((m for m, _ in OOM_MARKERS if m in text), None)
    if not is_oom_type and marker is None:
        return Verdict(False, "not_oom", _message_line(text))
    numbers = _numbers(text)
    verdict = Verdict(True, "config", _message_line(text, marker), marker or "OutOfMemoryError",
                      phase=phase_of_frames(frames), **numbers)
    reason = _environment_reason(verdict, text, conservative, occupied_at_start)
    return verdict if reason is None else replace(verdict, kind="environment", reason=reason)


def phase_of_frames(function_names: list[str]) -> str | None:
    """The phase the traceback frames name: "sample" if any sampling frame, else the innermost."""
    if any(_FRAME_PHASE.get(name) == "sample" for name in function_names):
        return "sample"
    for name in reversed(function_names):
        if name in _FRAME_PHASE:
            return _FRAME_PHASE[name]
    return None


def _environment_reason(verdict: Verdict, text: str, conservative: bool, occupied_at_start: bool) -> str | None:
    if occupied_at_start:
        return "the card was already occupied when the job started"
    outside = verdict.outside_bytes
    if outside is not None and outside >= max(OUTSIDE_FLOOR_BYTES, OUTSIDE_SHARE * verdict.total_bytes):
        return (f"{format_bytes(outside)} of the {format_bytes(verdict.total_bytes)} card was held outside "
                "this process (another job, or memory a crashed run never gave back)")
    nothing_free = next((m for m, _ in ENVIRONMENT_MARKERS if m in text), None)
    if nothing_free and conservative:
        what = "cuBLAS could not get a few MiB" if "CUBLAS" in nothing_free else "nothing was free"
        return f"{what} at a conservative configuration"
    return None


# -- a whole log ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OomEvent:
    """One out-of-memory failure in a log: the lines that report it, with where and when."""

    verdict: Verdict  # classified without knowing the configuration (kind may change with it)
    text: str  # the lines of this failure: traceback and message
    line: int  # line number (1-based) of its first OOM message
    phase: str  # "load" | "text_encoder" | "latents" | "sample" | "train" | "unknown"
    step: int | None  # training step running (for a sample: the step it followed); None before step 1
    training_started: bool
    recovered: bool = False  # training went on to a later step after it
    skipped_batches: int = 0  # AI Toolkit's "skipping batch" lines in it


@dataclass(frozen=True)
class LogScan:
    events: tuple[OomEvent, ...]
    last_step: int | None  # last training step completed
    total_steps: int | None
    last_error: str | None  # the last exception line, for a log without an OOM
    last_error_line: int | None
    lines: int


@dataclass
class _Cluster:
    """OOM lines that report one failure: no training progress between them."""

    first: int  # index into the records
    last: int
    phase: str
    step: int | None
    training_started: bool
    done_at_last: int  # training steps completed when its last line came (-1: none yet)
    done_after: int  # most training steps completed seen after its last line


@dataclass
class _Walk:
    """State while walking a log: the phase and step at each line."""

    phase: str = "unknown"
    training_started: bool = False
    step_done: int | None = None
    total_steps: int | None = None
    job_name: str | None = None
    clusters: list[_Cluster] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (line number, exception line)


def scan_log(text: str) -> LogScan:
    """Every OOM in a training log, each with its phase and step, and the last error in it."""
    records = _records(text)
    walk = _Walk()
    for index, (number, line) in enumerate(records):
        _follow_phase(walk, line)
        if _is_oom_line(line):
            _add_to_cluster(walk, index, line)
        else:
            _note_error(walk, number, line)
    events = tuple(_event(records, cluster) for cluster in walk.clusters)
    error_line, error = _last_error(walk.errors)
    return LogScan(events, walk.step_done, walk.total_steps, error, error_line, records[-1][0] if records else 0)


def _records(text: str) -> list[tuple[int, str]]:
    """(line number, text) for every line and every tqdm redraw (`\\r`) within a line."""
    out = []
    for number, line in enumerate(text.split("\n"), start=1):
        out.extend((number, part) for part in line.split("\r") if part.strip())
    return out


def _follow_phase(walk: _Walk, line: str) -> None:
    name = _JOB_NAME.search(line)
    if name:  # a new AI Toolkit job: everything starts again
        walk.phase, walk.training_started, walk.step_done, walk.job_name = "load", False, None, name.group(1)
        return
    lower = line.lower()
    for marker, phase, _ in LINE_PHASES:
        if marker in lower and (phase in ("sample", "train") or not walk.training_started):
            walk.phase = phase
            if phase == "train":  # "running training": a (new) training loop begins
                walk.training_started, walk.step_done = True, 0
            break
    bar = _BAR.search(line) if "%|" in line else None
    if bar and _is_training_bar(bar, walk.job_name):
        done = int(bar.group("n"))
        for cluster in walk.clusters:
            cluster.done_after = max(cluster.done_after, done)
        walk.training_started, walk.step_done, walk.total_steps = True, done, int(bar.group("total"))
        walk.phase = "train"


def _is_training_bar(bar: re.Match, job_name: str | None) -> bool:
    desc = bar.group("desc").strip().rstrip(":").strip()
    desc = desc.split("] ")[-1]  # "[2024-09-07 08:47:52] [INFO] steps" (fluxgym)
    inside = (bar.group("inside") or "").lower()
    return desc.lower() == "steps" or bool(job_name and desc.endswith(job_name)) or "loss" in inside


def _is_oom_line(line: str) -> bool:
    return any(marker in line for marker, _ in OOM_MARKERS)


def _add_to_cluster(walk: _Walk, index: int, line: str) -> None:
    """One failure prints several OOM lines (AI Toolkit: the error, then the traceback); AI
    Toolkit's "skipping batch 2/3" and "3 times in a row" continue the streak that began at 1/3."""
    done = -1 if walk.step_done is None else walk.step_done
    last = walk.clusters[-1] if walk.clusters else None
    streak = "3 times in a row" in line or re.search(r"skipping batch [23]/3", line) is not None
    if last is not None and (last.done_after <= last.done_at_last or streak):
        last.last, last.done_at_last, last.done_after = index, done, done
        return
    walk.clusters.append(_Cluster(index, index, walk.phase, _step_now(walk), walk.training_started, done, done))


def _step_now(walk: _Walk) -> int | None:
    """The step running now: the one after the last completed, or None before training."""
    if not walk.training_started or walk.step_done is None:
        return None
    if walk.phase == "sample":
        return walk.step_done or None  # a sample follows the step it shows; at step 0 it is the first
    return walk.step_done + 1


def _event(records: list[tuple[int, str]], cluster: _Cluster) -> OomEvent:
    start = _traceback_start(records, cluster.first)
    block = [line for _, line in records[start:cluster.last + 1]]
    text = "\n".join(block)
    verdict = classify(text)
    phase = verdict.phase or cluster.phase
    started = cluster.training_started and not (phase == "sample" and cluster.step is None)
    return OomEvent(verdict, text, records[cluster.first][0], phase, cluster.step, started,
                    recovered=cluster.done_after > cluster.done_at_last,
                    skipped_batches=sum(SKIPPED_MARKER in line for line in block))


def _traceback_start(records: list[tuple[int, str]], first: int, reach: int = 400) -> int:
    """Where the traceback that ends in the OOM at `first` begins (or `first` when none is near)."""
    for index in range(first, max(-1, first - reach), -1):
        line = records[index][1]
        if _TRACEBACK in line:
            return index
        if index < first and "%|" in line and _BAR.search(line):
            break
    return first


# -- the error in a log without an OOM --------------------------------------------------------------
# "RuntimeError: mat1 and mat2 shapes cannot be multiplied", "safetensors_rust.SafetensorError: ...",
# with any logger prefix before it. accelerate's launcher ends every failed run with its own
# CalledProcessError, which says only that the child failed: the child's error is the one to show.
_ERROR_LINE = re.compile(r"(?:^|[\s\]])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt)(?::\s.*|:?\s*$))")
_LAUNCHER_ERRORS = ("CalledProcessError",)


def _note_error(walk: _Walk, number: int, line: str) -> None:
    match = _ERROR_LINE.search(line)
    if match and not line.lstrip().startswith(("File ", "raise ", "except ")):
        walk.errors.append((number, match.group(1).strip()))


def _last_error(errors: list[tuple[int, str]]) -> tuple[int | None, str | None]:
    real = [e for e in errors if not e[1].split(":")[0].endswith(_LAUNCHER_ERRORS)]
    pick = (real or errors or [(None, None)])[-1]
    return pick[0], pick[1]


# -- helpers ----------------------------------------------------------------------------------------
_LOG_PREFIX = re.compile(r"^(?:\[[^\]]*\]\s*)+")  # "[2024-09-09 17:43:35] [INFO] " (fluxgym, GUIs)


def _message_line(text: str, marker: str | None = None) -> str:
    """The line that says what happened: the one with the marker, else the first line."""
    lines = [_LOG_PREFIX.sub("", line.strip()) for line in text.splitlines() if line.strip()]
    if marker:
        hits = [line for line in lines if marker in line]
        if hits:
            with_numbers = [line for line in hits if "Tried to allocate" in line]
            return (with_numbers or hits)[-1][:600]
    return lines[0][:600] if lines else ""


def _numbers(text: str) -> dict:
    total, free = _size(_TOTAL_FREE, text, 1), _size(_TOTAL_FREE, text, 2)
    if total is None:
        total, free = _size(_TOTAL_OLD, text), _size(_FREE_OLD, text)
    allocated = _size(_ALLOCATED_NEW, text)
    unallocated = _size(_UNALLOCATED_NEW, text)
    reserved = allocated + unallocated if allocated is not None and unallocated is not None else None
    if reserved is None:
        reserved = _size(_RESERVED_OLD, text)
        old_allocated = _size(_ALLOCATED_OLD, text)
        if reserved is not None and old_allocated is not None:
            unallocated = max(0, reserved - old_allocated)
    others = [_to_bytes(size) for _, size in _OTHER_PROCESS.findall(text)]
    this_process = _size(_THIS_PROCESS, text)
    return {
        "tried_bytes": _size(_TRIED, text), "total_bytes": total, "free_bytes": free,
        "process_bytes": this_process, "reserved_bytes": reserved, "unallocated_bytes": unallocated,
        # Without "this process has", a process listed may be this one under another pid (containers).
        "other_process_bytes": sum(others) if others and this_process is not None else None,
    }


def _size(pattern: re.Pattern, text: str, group: int = 1) -> int | None:
    match = pattern.search(text)
    return _to_bytes(match.group(group)) if match else None


def _to_bytes(size: str) -> int | None:
    size = size.replace(" ", "")
    if size.endswith("bytes"):
        return int(float(size[:-5]))
    try:
        return parse_bytes(size) if float(re.match(r"[0-9.]+", size).group(0)) > 0 else 0
    except UserError:
        return None
