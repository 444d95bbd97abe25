"""The one OOM classifier: an exception or log text -> is it an OOM, whose fault, and where.

Only an OOM changes the configuration; anything else is reported as the error it is. Every string
known here says where it comes from.

`kind` is "config" (this configuration needs more memory than the card has), "environment" (the
card or worker was not clean: nothing was free even for a conservative configuration, or memory
was held outside this process), "host" (the machine's RAM ran out, not the card's: the kernel's OOM
killer, a MemoryError, a data-loader worker killed; read from log text only) or "not_oom". `phase`
is where the memory ran out: "load", "text_encoder", "latents", "sample", "train", or None when
nothing in the text says.

Three ways in:
- `classify(exception_or_text)`: one failure (the probe calls it on the exception it caught).
- `scan_log(text)`: a whole training log (AI Toolkit, kohya sd-scripts, musubi-tuner, SimpleTuner,
  OneTrainer, diffusion-pipe, diffusers example scripts, plain PyTorch), walked line by line: every
  OOM in it with its phase (from the traceback's frames first, then the progress lines before it)
  and the training step that was running, and whether training went on after it; and the failure
  that ended the run otherwise (`Failure`: its error with its phase and step, or a traceback the log
  ends inside, cut before its exception line).
- `phase_of_line(line)`: the phase one line of a running trainer's output marks, for a reader that
  follows it line by line (a trainer probe); `scan_log` walks the same rules.

Every pattern is bounded, so a log costs what its length costs (a 20,000-digit line included).
"""

from __future__ import annotations

import itertools
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
    ("CUDA driver error: out of memory",
     "c10's CUDA driver-API check (cuMemCreate/cuMemMap under expandable segments)"),
    ("cuda runtime error (2) : out of memory", "PyTorch < 0.4 (THC), the exception line: loop#36, pytorch#958"),
    ("error=2 : out of memory", "PyTorch < 0.4 (THC), its 'THCudaCheck FAIL ... error=2 : out of memory' line"),
    ("Allocation on device", "torch.OutOfMemoryError under the cudaMallocAsync backend (ComfyUI and trainers in it)"),
    ("memory mapping failed with OOM",
     "CUDACachingAllocator's expandable_segments warning before a compiled kernel fails (SimpleTuner#3176)"),
    ("CUDNN_STATUS_NOT_INITIALIZED", "cuDNN cannot create its handle on a full card (LLaVA#392, Info-HCVAE#7)"),
)
# Handle failures that mean memory only before any training step: cuBLAS creates its handle at the first
# matrix product, so on a card that loading (or caching) has filled, cublasCreate fails with this
# status. Later, or in another program, it is as often a wrong index on the card: not read as memory there.
LOAD_MARKERS: tuple[tuple[str, str], ...] = (
    ("CUBLAS_STATUS_NOT_INITIALIZED", "PyTorch's CUDA error 'CUBLAS_STATUS_NOT_INITIALIZED when calling "
     "`cublasCreate(handle)`' (issue 33: at load, the card was full)"),
)
# The machine's RAM, not the card's (read from log text only: a probe's own exceptions keep their
# classification, and the search never prunes a GPU setting for them).
HOST_MARKERS: tuple[tuple[str, str], ...] = (
    ("Out of memory: Killed process", "the kernel's OOM killer in dmesg (ai-toolkit#787)"),
    ("oom-kill", "the kernel's OOM killer, cgroup form ('oom-kill:constraint=...')"),
    ("(exitcode: -9)", "torch.distributed.elastic: a rank died of SIGKILL, the OOM killer's signal (x-flux#55)"),
    ("exit status -9", "subprocess.CalledProcessError of a child killed by SIGKILL"),
    ("<Signals.SIGKILL: 9>", "subprocess / accelerate launcher: a child killed by SIGKILL"),
)
# A line that is "Killed" alone (the shell reporting the OOM killer), a MemoryError (Python ran out of
# RAM: OneTrainer#835), a DataLoader worker killed by a signal other than a crash.
_HOST_LINE = re.compile(r"^[ \t]*Killed[ \t\r]*$|(?<![A-Za-z.])MemoryError\b"
                        r"|DataLoader worker \(pid \d{1,10}\) is killed by"
                        r"(?! signal: (?:Segmentation|Terminated|Aborted|Bus|Floating))", re.MULTILINE)
# AI Toolkit's marker for an OOM it survived: the step is skipped and training goes on.
SKIPPED_MARKER = "OOM during training step, skipping batch"
# Markers that mean nothing at all was free: a dirty card when the configuration is conservative.
ENVIRONMENT_MARKERS: tuple[tuple[str, str], ...] = (
    ("0 bytes is free", "PyTorch >= 2.1's OOM message when the card has no free memory at all"),
    ("0 bytes free", "the same, in PyTorch before 2.1"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS failing to allocate a few MiB of workspace"),
)

# -- the numbers in PyTorch's OOM message ------------------------------------------------------------
# Bounded, and never started inside a run of digits: a 20,000-digit number on one line stays linear.
_SIZE = r"(?<![0-9.])[0-9]{1,15}(?:\.[0-9]{1,6})? ?(?:bytes|[KMGTP]iB|B)"
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

# Memory held outside this process that says the card was not ours alone: a desktop session (display
# server, compositor, a browser) holds up to 2-3 GiB, a CUDA context a few hundred MiB; more than this
# was another job. 2.4 GiB outside on a 24 GiB desktop card was a preset that did not fit (OneTrainer#841).
OUTSIDE_FLOOR_BYTES = 3 * 2**30
OUTSIDE_SHARE = 0.10

# -- where an OOM happened: traceback frames ---------------------------------------------------------
# (function name, phase, where it comes from): the trainers' own methods, each named for its work.
FRAME_PHASES: tuple[tuple[str, str, str], ...] = (
    ("sample", "sample", "AI Toolkit BaseSDTrainProcess.sample (baseline and periodic samples)"),
    ("generate_images", "sample", "AI Toolkit StableDiffusion.generate_images"),
    ("sample_images", "sample", "kohya sd-scripts / musubi-tuner NetworkTrainer.sample_images"),
    ("sample_images_common", "sample", "kohya sd-scripts train_util.sample_images_common"),
    ("sample_image_inference", "sample", "kohya sd-scripts train_util / flux_train_utils"),
    ("log_validation", "sample", "diffusers example scripts' validation"),
    ("log_images", "sample", "ControlNet / latent-diffusion image logging during training"),
    ("latents_to_image", "sample", "kohya sd-scripts sampling pipelines (VAE decode of a sample)"),
    ("decode_latents", "sample", "diffusers and kohya pipelines: VAE decode of a sample"),
    ("cache_text_encoder_outputs_if_needed", "text_encoder", "kohya sd-scripts NetworkTrainer"),
    ("cache_text_encoder_outputs", "text_encoder", "kohya sd-scripts train_util"),
    ("encode_prompt", "text_encoder", "diffusers pipelines and AI Toolkit StableDiffusion.encode_prompt"),
    ("encode_prompts", "text_encoder", "musubi-tuner / SimpleTuner text embed caches"),
    ("compute_text_embeddings", "text_encoder", "diffusers dreambooth examples"),
    ("cache_latents", "latents", "kohya sd-scripts / AI Toolkit latent caching"),
    ("new_cache_latents", "latents", "kohya sd-scripts train_util (caching strategies)"),
    ("cache_batch_latents", "latents", "kohya sd-scripts train_util"),
    ("compute_vae_encodings", "latents", "diffusers train_text_to_image_lora_sdxl"),
    ("encode_images", "latents", "AI Toolkit StableDiffusion.encode_images (VAE encode)"),
    ("encode_datasets", "latents", "musubi-tuner cache_latents.py"),
    ("from_pretrained", "load", "diffusers / transformers model loading"),
    ("quantize_model", "load", "AI Toolkit toolkit/util/quantize.py"),
    ("load_model", "load", "AI Toolkit StableDiffusion.load_model"),
    ("load_target_model", "load", "kohya sd-scripts"),
    ("load_transformer", "load", "musubi-tuner"),
    ("load_flow_model", "load", "kohya sd-scripts flux_utils"),
    ("prepare", "load", "accelerate's Accelerator.prepare moves the models to the card (kohya_ss#369)"),
    ("setup_train_device", "load", "OneTrainer model setups: every part to its training device (OneTrainer#841)"),
    ("hook_train_loop", "train", "AI Toolkit SDTrainer"),
    ("train_single_accumulation", "train", "AI Toolkit SDTrainer"),
    ("call_dit", "train", "musubi-tuner NetworkTrainer"),
    ("call_unet", "train", "kohya sd-scripts NetworkTrainer"),
    ("process_batch", "train", "kohya sd-scripts NetworkTrainer"),
    ("train_step", "train", "a training step (many loops, polyffusion#2)"),
    ("training_step", "train", "PyTorch Lightning"),
    ("train_batch", "train", "DeepSpeed's pipeline engine (diffusion-pipe)"),
    ("backward", "train", "torch.Tensor.backward / accelerate's Accelerator.backward"),
    ("run_backward", "train", "torch.autograd"),
    ("_engine_run_backward", "train", "torch.autograd, PyTorch >= 2.3"),
)
_FRAME_PHASE = {name: phase for name, phase, _ in FRAME_PHASES}
# Name shapes of the same families of methods: load_*, quantize*, enable_* (enable_block_swap,
# enable_model_cpu_offload) and OneTrainer's transformer_to / text_encoder_to / vae_to.
_FRAME_SHAPES = ((re.compile(r"^(?:load_|quantiz|enable_)\w{0,80}$|^\w{1,80}_to$"), "load"),)
# torch.nn.Module moving weights: load, unless a named frame above says whose weights (a text encoder
# moved to the card for caching is the text encoder's memory).
_MOVE_FRAMES = frozenset({"to", "cuda", "_apply", "convert"})
# A script or function that is a training loop: a denoiser's forward under it is a training step.
_TRAIN_FILE = re.compile(r"train", re.IGNORECASE)
_TRAIN_FUNCS = frozenset({"train", "train_model", "run_training", "training_loop", "train_loop", "train_epoch",
                          "train_one_epoch", "fit", "_fit_impl"})
# A whole process that only caches (musubi-tuner, kohya's cache scripts): its script says the phase.
_CACHE_SCRIPTS = ((re.compile(r"cache_text_encoder", re.IGNORECASE), "text_encoder"),
                  (re.compile(r"cache_latents", re.IGNORECASE), "latents"))
# 'File "x.py", line 9, in f' (also after "[rank0]:" or a logger prefix), and rich's "│ x.py:9 in f │".
# Each alternative starts only at a literal or after a space, so a long line costs its length.
_FRAME = re.compile(r'File "([^"\r\n]{1,1000})", line \d{1,9}, in (\S{1,200})'
                    r'|(?:^|(?<=[\s│]))([^\s│"]{1,300}\.py):\d{1,9} in (\w{1,200})', re.MULTILINE)

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
    ("caching text_embeddings", "text_encoder",
     "AI Toolkit's 'Caching text_embeddings for DATASET' (toolkit/dataloader_mixins.py, commit 27a03a91)"),
    ("caching latents", "latents", "AI Toolkit and kohya sd-scripts ('Caching latents', 'caching latents.')"),
    ("generating baseline samples before training", "sample", "AI Toolkit, the first sample"),
    ("generating images", "sample", "AI Toolkit's sampling progress bar"),
    ("generating samples", "sample", "AI Toolkit's sampling progress bar (newer versions)"),
    ("generating sample images at step", "sample", "kohya sd-scripts and musubi-tuner"),
    ("running validation", "sample", "diffusers example scripts"),
    ("running training / 学習開始", "train", "kohya sd-scripts and musubi-tuner"),
    ("***** running training *****", "train", "diffusers example scripts"),
    ("requested to load", "load", "ComfyUI's model management, under ComfyUI-based trainers"),
    ("loading pipeline components", "load", "diffusers DiffusionPipeline.from_pretrained"),
    ("moving text encoder", "text_encoder", "AI Toolkit moving its text encoder to the card to encode"),
    # kohya sd-scripts (library/train_util.py, sdxl_train_util.py, flux_train_network.py logger.info lines)
    ("load stablediffusion checkpoint", "load", "kohya sd-scripts train_util / sdxl_train_util._load_target_model"),
    ("load diffusers pretrained models", "load", "kohya sd-scripts train_util._load_target_model"),
    ("move text encoder to gpu", "text_encoder", "kohya sd-scripts anima_train_network"),
    ("move text encoders to ", "text_encoder", "kohya sd-scripts hunyuan_image_train_network ('... to encode')"),
    ("cache text encoder outputs for", "text_encoder", "kohya sd-scripts and musubi-tuner, the sample prompts"),
    # musubi-tuner (hv_train_network.py, wan_train_network.py, *_cache_text_encoder_outputs.py)
    ("encoding with text encoder", "text_encoder", "musubi-tuner ('encoding with Text Encoder 1')"),
    ("encoding with t5", "text_encoder", "musubi-tuner wan_cache_text_encoder_outputs"),
    # AI Toolkit (jobs/process/BaseSDTrainProcess.py, toolkit/dataloader_mixins.py)
    ("generating first sample", "sample", "AI Toolkit BaseSDTrainProcess ('from first sample config')"),
    ("caching text_embeddings", "text_encoder", "AI Toolkit dataloader_mixins.cache_text_embeddings"),
)
# One search a line for all of them (a loop of substring tests was most of the cost of a long log).
_LINE_PHASE = re.compile("|".join(re.escape(marker) for marker, _, _ in LINE_PHASES))
_LINE_PHASE_OF = {marker: phase for marker, phase, _ in LINE_PHASES}
# A line that starts a phase by its first word, after any logger prefix: AI Toolkit prints "Loading
# <part>" and "Quantizing <part>" for every part it loads (Transformer 1/2, UMT5EncoderModel, Mistral).
LINE_STARTS: tuple[tuple[str, str, str], ...] = (
    ("loading ", "load", "AI Toolkit, musubi-tuner, transformers ('Loading checkpoint shards')"),
    ("quantizing ", "load", "AI Toolkit quantizing each part it loads"),
    ("building ", "load", "kohya sd-scripts building each model it loads ('building U-Net', 'Building CLIP-L')"),
)
# kohya and musubi print the step of a sample: "generating sample images at step / サンプル画像生成 ステップ: 150".
_SAMPLE_STEP = re.compile(r"generating sample images at step[^:\n]{0,40}: ?(\d{1,9})")

# -- which progress bar counts training steps ---------------------------------------------------------
# tqdm: "DESC:  12%|##        | 240/2000 [01:02<07:35,  3.86it/s, POSTFIX]". The training bar is
# "steps" in kohya sd-scripts and musubi-tuner, "Steps" in diffusers examples, the job name in AI
# Toolkit, "step:"/"epoch:" in OneTrainer, "Epoch N" in PyTorch Lightning, "Epoch 1/134 - steps" in
# ComfyUI-FluxTrainer, "Train (loss ...) epoch 1" in plain loops; any other bar whose postfix
# reports a loss is taken as a training loop too. Matched in a window around its "%|", so that a
# very long line costs what its length costs.
_BAR = re.compile(r"(?P<desc>[^\r\n|]{0,200}?)\s*(?P<pct>\d{1,3})%(?:\|[^|\r\n]{0,400}\|)?\s*(?P<n>\d{1,12})/"
                  r"(?P<total>\d{1,12})(?:\s*\[(?P<inside>[^\]\r\n]{0,200})\]?)?")
_BAR_WINDOW = 260
_TRAIN_BAR_WORDS = re.compile(r"\b(?:steps?|epoch|train(?:ing)?)\b", re.IGNORECASE)
_NOT_TRAIN_BAR_WORDS = re.compile(r"valid|eval|test|sampl|generat|cach|load|quantiz", re.IGNORECASE)
# AI Toolkit run.py's banner "# Running job: NAME" starts a job: loading, and NAME is its bar's desc.
_JOB_NAME = re.compile(r"#\s*Running job: (\S.*?)\s*$")
_TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Verdict:
    is_oom: bool
    kind: str  # "config" | "environment" | "host" | "not_oom"
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
             occupied_at_start: bool = False, before_training: bool = False) -> Verdict:
    """Classify an exception or log text.

    `conservative`: the configuration was already minimal (batch 1, checkpointing on, small
    buckets), so "nothing free" means the card. `occupied_at_start`: another process held the card
    before the job began (a preflight reading). `before_training`: no training step had completed, so
    a cuBLAS handle that could not be created (LOAD_MARKERS) was memory.
    """
    if isinstance(error, BaseException):
        outer, error = error, _memory_error_beneath(error)
        text = f"{type(error).__name__}: {error}"
        stack = traceback.extract_tb(outer.__traceback__)
        if error is not outer:  # the frames from the top down to the handler, then the handled error's own
            stack = stack + traceback.extract_tb(error.__traceback__)
        frames, files = [frame.name for frame in stack], [frame.filename for frame in stack]
        is_oom_type = type(error).__name__ == "OutOfMemoryError"
        host = "MemoryError" if isinstance(error, MemoryError) else None  # the host's RAM, not the card's
    else:
        text = str(error)
        frames, files = frames_of_text(text)
        is_oom_type = False
        host = host_marker(text)
    markers = OOM_MARKERS + (LOAD_MARKERS if before_training else ())
    marker = next((m for m, _ in markers if m in text), None)
    if not is_oom_type and marker is None and host is None:
        return Verdict(False, "not_oom", _message_line(text))
    if marker is None and host is not None:
        return Verdict(True, "host", _message_line(text, host), host, phase=phase_of_frames(frames, files))
    numbers = _numbers(text)
    verdict = Verdict(True, "config", _message_line(text, marker), marker or "OutOfMemoryError",
                      phase=phase_of_frames(frames, files), **numbers)
    reason = _environment_reason(verdict, text, conservative, occupied_at_start)
    return verdict if reason is None else replace(verdict, kind="environment", reason=reason)


def _memory_error_beneath(error: BaseException, depth: int = 8) -> BaseException:
    """The out-of-memory error an error was raised in handling of, else the error itself.

    Libraries rewrap what goes wrong beneath them: diffusers' `load_state_dict` answers any failure
    to read a checkpoint, a `MemoryError` or a CUDA `OutOfMemoryError` included, with
    `OSError: Unable to load weights from checkpoint file`. The memory error is what happened.
    """
    link = error
    for _ in range(depth):
        if isinstance(link, MemoryError) or type(link).__name__ == "OutOfMemoryError":
            return link
        link = link.__cause__ or link.__context__
        if link is None:
            break
    return error


def phase_of_frames(function_names: list[str], files: list[str] | None = None, loop: bool = True) -> str | None:
    """The phase a traceback names, outermost frame first in the lists.

    A sampling frame anywhere makes it "sample" (a validation loads a pipeline and encodes prompts:
    still the sample's memory); a caching script makes it its cache; otherwise the innermost frame
    that names a phase's work (an AI Toolkit step that encodes its captions on the fly runs out in
    `encode_prompt`, not in training); then torch moving weights (load); then, with `loop`, a
    training loop around an unnamed forward (train): the weakest, which a progress line may overrule."""
    files = files or [""] * len(function_names)
    named = [_frame_phase(name) for name in function_names]
    if "sample" in named:
        return "sample"
    script = next((f for f in files if f), "")
    for pattern, phase in _CACHE_SCRIPTS:
        if pattern.search(script.replace("\\", "/").rsplit("/", 1)[-1]):
            return phase
    for phase in reversed(named):
        if phase:
            return phase
    if any(name in _MOVE_FRAMES for name in function_names):
        return "load"
    if not loop:
        return None
    in_training = any(name in _TRAIN_FUNCS for name in function_names) or any(
        _TRAIN_FILE.search(f.replace("\\", "/").rsplit("/", 1)[-1]) for f, name in zip(files, function_names)
        if f and name != "<module>")
    return "train" if in_training else None


def _frame_phase(name: str) -> str | None:
    """The phase a function's name says, also under leading underscores (kohya's `_load_target_model`)."""
    for candidate in dict.fromkeys((name, name.lstrip("_"))):
        if candidate in _FRAME_PHASE:
            return _FRAME_PHASE[candidate]
        shaped = next((phase for pattern, phase in _FRAME_SHAPES if pattern.match(candidate)), None)
        if shaped:
            return shaped
    return None


def frames_of_text(text: str) -> tuple[list[str], list[str]]:
    """(function names, files) of every traceback frame in the text, outermost first."""
    names, files = [], []
    for match in _FRAME.finditer(text):
        files.append(match.group(1) or match.group(3))
        names.append(match.group(2) or match.group(4))
    return names, files


def host_marker(text: str) -> str | None:
    """The text that says the machine's RAM ran out, or None."""
    found = next((m for m, _ in HOST_MARKERS if m in text), None)
    if found is None:
        match = _HOST_LINE.search(text)
        found = match.group(0).strip() if match else None
    return found


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
    frames: int = 0  # traceback frames read around it (none named a phase when phase is "unknown")


@dataclass(frozen=True)
class Failure:
    """What ended a run that shows no OOM: its error, or a traceback the log ends inside, cut before its
    exception line (a paste that stopped short, a terminal's scrollback)."""

    line: int  # the error line, or the cut traceback's first line
    error: str | None  # the exception line; None when the traceback is cut
    phase: str  # from its traceback's frames, else the progress lines before it; "unknown"
    step: int | None  # the training step running (for a sample: the step it followed); None before step 1
    frame: str | None  # the innermost function its traceback shows

    @property
    def cut(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class LogScan:
    events: tuple[OomEvent, ...]
    last_step: int | None  # last training step completed
    total_steps: int | None
    last_error: str | None  # the last exception line, for a log without an OOM
    last_error_line: int | None
    lines: int
    failure: Failure | None = None  # the error (or cut traceback) that ended the run, OOM or not


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
    errors: list[tuple[_Mark, str]] = field(default_factory=list)  # where, and the exception line
    tracebacks: list[_Mark] = field(default_factory=list)  # each "Traceback (most recent call last)"
    bars: list[tuple[int, int]] = field(default_factory=list)  # (record index, steps done) of each training bar

    def mark(self, index: int, number: int, aitk: bool = False) -> _Mark:
        return _Mark(index, number, self.phase, self.step_done, self.training_started, aitk)


@dataclass(frozen=True)
class _Mark:
    """A line's place in the walk, with the phase and steps done when it came."""

    index: int  # into the records
    number: int  # line number
    phase: str
    step_done: int | None
    training_started: bool
    aitk: bool = False  # AI Toolkit's "Error running job:", printed before its traceback


def scan_log(text: str) -> LogScan:
    """Every OOM in a training log, each with its phase and step, and the last error in it."""
    records = _records(text)
    walk = _Walk()
    for index, (number, line) in enumerate(records):
        _follow_phase(walk, index, line)
        if _TRACEBACK in line:
            walk.tracebacks.append(walk.mark(index, number))
        if _is_oom_line(line) or (not walk.step_done and any(m in line for m, _ in LOAD_MARKERS)):
            _add_to_cluster(walk, index, line)
        else:
            _note_error(walk, index, number, line)
    _settle_done_after(walk)
    events = tuple(_event(records, cluster) for cluster in walk.clusters)
    error_line, error = _last_error([(mark.number, text) for mark, text in walk.errors])
    return LogScan(events, walk.step_done, walk.total_steps, error, error_line, records[-1][0] if records else 0,
                   _failure(records, walk))


@dataclass(frozen=True)
class LogPosition:
    """Where a training log is after a line: its phase ("unknown" before a line marks one), whether
    training has started, and the steps its training bar says are done (None before a bar)."""

    phase: str
    training_started: bool
    steps_done: int | None
    total_steps: int | None


def log_follower():
    """A follower of a log read as it streams, by scan_log's rules: call it with each line as it
    comes (tqdm's redraws within it included); it returns the LogPosition after that line."""
    walk = _Walk()
    records = itertools.count()  # scan_log's record index: one per line and per redraw within it

    def follow(line: str) -> LogPosition:
        for part in line.split("\r"):
            if part.strip():
                _follow_phase(walk, next(records), part)
        return LogPosition(walk.phase, walk.training_started, walk.step_done, walk.total_steps)

    return follow


def _records(text: str) -> list[tuple[int, str]]:
    """(line number, text) for every line and every tqdm redraw (`\\r`) within a line."""
    out = []
    for number, line in enumerate(text.split("\n"), start=1):
        out.extend((number, part) for part in line.split("\r") if part.strip())
    return out


def _follow_phase(walk: _Walk, index: int, line: str) -> None:
    name = _JOB_NAME.search(line) if "Running job:" in line else None
    if name:  # a new AI Toolkit job: everything starts again
        walk.phase, walk.training_started, walk.step_done, walk.job_name = "load", False, None, name.group(1)
        return
    phase = _marked_phase(line)
    if phase and (phase in ("sample", "train") or not walk.training_started):
        walk.phase = phase
        if phase == "train":  # "running training": a (new) training loop begins
            walk.training_started, walk.step_done = True, 0
    sample = _SAMPLE_STEP.search(line) if phase == "sample" else None
    if sample and int(sample.group(1)) > 0:  # a sample after step N: training ran N steps
        walk.training_started, walk.step_done = True, max(walk.step_done or 0, int(sample.group(1)))
    bar = _bar(line)
    if bar and _is_training_bar(bar, walk.job_name):
        done = int(bar.group("n"))
        walk.bars.append((index, done))
        if walk.clusters:  # only the latest failure can still grow; the others are settled at the end
            walk.clusters[-1].done_after = max(walk.clusters[-1].done_after, done)
        walk.training_started, walk.step_done, walk.total_steps = True, done, int(bar.group("total"))
        walk.phase = "train"


def phase_of_line(line: str, job_name: str | None = None) -> str | None:
    """The phase one log line marks, or None: a line a trainer prints on entering a phase (LINE_PHASES,
    LINE_STARTS: AI Toolkit, kohya sd-scripts, musubi-tuner, diffusers), else "train" for a training
    progress bar (kohya's and musubi's "steps:", AI Toolkit's bar named for its job: give `job_name`).

    One line, no state, for a reader that follows a running trainer's log line by line (a trainer probe)
    as `scan_log` does: what the order adds is the caller's. Once training has started only "sample" and
    "train" move the phase (nothing loads again), and a sample keeps the step it followed.
    """
    phase = _marked_phase(line)
    if phase:
        return phase
    bar = _bar(line)
    return "train" if bar and _is_training_bar(bar, job_name) else None


def _marked_phase(line: str) -> str | None:
    lower = line.lower()
    hit = _LINE_PHASE.search(lower)
    if hit:
        return _LINE_PHASE_OF[hit.group(0)]
    start = _LINE_PREFIX.sub("", lower.lstrip(), count=1)
    return next((phase for word, phase, _ in LINE_STARTS if start.startswith(word)), None)


# What loggers put before a message: "[2024-09-09 17:43:35] [INFO] " (fluxgym, GUIs), kohya's rich
# handler "2024-09-06 10:53:11 INFO     ", Python logging's "INFO:musubi_tuner.hv_train_network:".
_LINE_PREFIX = re.compile(r"^(?:\[[^\]\n]{0,200}\][ \t]*|\d{4}-\d\d-\d\d[ t]\d\d:\d\d:\d\d(?:[.,]\d{1,6})?[ \t]*"
                          r"|(?:info|warning|error|debug)(?::[\w.]{1,200}:|[ \t]+)){1,6}")


def _settle_done_after(walk: _Walk) -> None:
    """Each failure's most training steps done after its last line, in one pass from the end (updating
    every failure at every bar was quadratic: 10,000 bars and as many skipped batches)."""
    best, j = -1, len(walk.bars) - 1
    for cluster in reversed(walk.clusters):
        while j >= 0 and walk.bars[j][0] > cluster.last:
            best = max(best, walk.bars[j][1])
            j -= 1
        cluster.done_after = max(cluster.done_after, best)


def _bar(line: str) -> re.Match | None:
    """The tqdm bar in a line ("12%|##  | 240/2000", or "12% 240/2000" without a bar in Colab), matched
    in a bounded window around each of its first "%" signs."""
    at = line.find("%")
    for _ in range(4):
        if at < 0:
            return None
        bar = _BAR.search(line, max(0, at - _BAR_WINDOW), at + 2 * _BAR_WINDOW)
        if bar:
            return bar
        at = line.find("%", at + 1)
    return None


def _is_training_bar(bar: re.Match, job_name: str | None) -> bool:
    desc = bar.group("desc").strip().rstrip(":").strip()
    desc = desc.split("] ")[-1]  # "[2024-09-07 08:47:52] [INFO] steps" (fluxgym)
    inside = (bar.group("inside") or "").lower()
    if job_name and desc.endswith(job_name):
        return True
    named = bool(_TRAIN_BAR_WORDS.search(desc)) and not _NOT_TRAIN_BAR_WORDS.search(desc)
    return named or "loss" in inside


def _is_oom_line(line: str) -> bool:
    return any(key in line for key in OOM_KEYS) and _ANY_OOM.search(line) is not None


# Every OOM and host marker in one pattern, tried only on a line that holds one of the few substrings
# every marker has (a log is mostly other lines: 25 substring tests a line were most of its cost).
_ANY_OOM = re.compile("|".join(re.escape(m) for m, _ in OOM_MARKERS + HOST_MARKERS) + "|" + _HOST_LINE.pattern,
                      re.MULTILINE)
OOM_KEYS = ("emory", "OOM", "CUBLAS", "CUDNN", "Allocation on", "oom-kill", "exitcode: -9", "exit status -9",
            "SIGKILL", "Killed", "killed by")  # tests/test_oom.py checks every marker holds one


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
    end = _traceback_end(records, cluster.last)
    block = [line for _, line in records[start:end + 1]]
    text = "\n".join(block)
    verdict = classify(text, before_training=cluster.done_at_last <= 0)
    phase, step, started = verdict.phase or cluster.phase, cluster.step, cluster.training_started
    after = _bar_after(records, cluster.last) if phase == "unknown" and step is None else None
    if after is not None:  # tqdm redrew the training bar as the run died: the step it was in
        phase, step, started = "train", after + 1, True
    started = started and not (phase == "sample" and step is None)
    return OomEvent(verdict, text, records[cluster.first][0], phase, step, started,
                    recovered=cluster.done_after > max(cluster.done_at_last, 0),
                    skipped_batches=sum(SKIPPED_MARKER in line for line in block),
                    frames=len(frames_of_text(text)[0]))


def _traceback_end(records: list[tuple[int, str]], last: int, near: int = 15, reach: int = 400) -> int:
    """The end of a traceback printed after the OOM message (AI Toolkit prints "Error running job:
    ..." first), or `last`: its frames say where the OOM happened."""
    begin = next((i for i in range(last + 1, min(len(records), last + 1 + near)) if _TRACEBACK in records[i][1]
                  or _bar(records[i][1])), None)
    if begin is None or _TRACEBACK not in records[begin][1]:
        return last
    end = begin
    for index in range(begin + 1, min(len(records), begin + reach)):
        if _bar(records[index][1]) or _is_oom_line(records[index][1]):  # training went on, or another failure
            break
        end = index
    return end


def _bar_after(records: list[tuple[int, str]], last: int, reach: int = 3) -> int | None:
    """Steps done by a training bar tqdm redrew right after the OOM message, or None."""
    for _, line in records[last + 1:last + 1 + reach]:
        bar = _bar(line)
        if bar and _is_training_bar(bar, None):
            return int(bar.group("n"))
    return None


def _traceback_start(records: list[tuple[int, str]], first: int, reach: int = 400) -> int:
    """Where the traceback that ends in the OOM at `first` begins (or `first` when none is near)."""
    for index in range(first, max(-1, first - reach), -1):
        line = records[index][1]
        if _TRACEBACK in line:
            return index
        if index < first and _bar(line):
            break
    return first


# -- the error in a log without an OOM --------------------------------------------------------------
# "RuntimeError: mat1 and mat2 shapes cannot be multiplied", "safetensors_rust.SafetensorError: ...",
# with any logger prefix before it. accelerate's launcher ends every failed run with its own
# CalledProcessError, which says only that the child failed: the child's error is the one to show.
_ERROR_LINE = re.compile(r"(?:^|[\s\]])((?:[A-Za-z_]\w{0,80}\.){0,8}[A-Z]\w{0,80}(?:Error|Exception|Interrupt)"
                         r"(?::\s.*|:?\s*$))")
_LAUNCHER_ERRORS = ("CalledProcessError",)


def _note_error(walk: _Walk, index: int, number: int, line: str) -> None:
    if "Error" not in line and "Exception" not in line and "Interrupt" not in line:
        return  # most lines: no need for the pattern
    if _AITK_ERROR in line:  # AI Toolkit's run.py prints the error's text, then its traceback
        walk.errors.append((walk.mark(index, number, aitk=True), line.split(_AITK_ERROR, 1)[1].strip()[:600]))
        return
    match = _ERROR_LINE.search(line)
    if match and not line.lstrip().startswith(("File ", "raise ", "except ")):
        walk.errors.append((walk.mark(index, number), match.group(1).strip()))


# ostris/ai-toolkit run.py: `print_acc(f"Error running job: {e}")` before it re-raises.
_AITK_ERROR = "Error running job: "


def _failure(records: list[tuple[int, str]], walk: _Walk) -> Failure | None:
    """The run's last error, or the traceback the log ends inside; each with its phase and step."""
    cut = _cut_traceback(records, walk)
    if cut is not None:
        start = _chain_start(records, walk, cut)
        # Its outer frames (the script, the loop) and its inner ones (the work), however long it is.
        kept = records[start:] if len(records) - start <= 400 else records[start:start + 200] + records[-200:]
        block = [line for _, line in kept]
        phase, frame = _phase_of_block(block, cut.phase, cut=True)
        return Failure(cut.number, None, phase, _step_at(cut, phase), frame)
    real = [e for e in walk.errors if not e[1].split(":")[0].endswith(_LAUNCHER_ERRORS)]
    if not (real or walk.errors):
        return None
    mark, error = (real or walk.errors)[-1]
    if mark.aitk:
        start, end = mark.index, _traceback_end(records, mark.index)
    else:
        start, end = _traceback_start(records, mark.index), mark.index
    phase, frame = _phase_of_block([line for _, line in records[start:end + 1]], mark.phase, cut=False)
    return Failure(mark.number, error, phase, _step_at(mark, phase), frame)


def _cut_traceback(records: list[tuple[int, str]], walk: _Walk) -> _Mark | None:
    """The last traceback, when the log ends inside it: no exception line or OOM after it, and
    nothing but frames, their source lines and blank lines to the end."""
    if not walk.tracebacks:
        return None
    last = walk.tracebacks[-1]
    if walk.errors and (walk.errors[-1][0].index > last.index
                        or (walk.errors[-1][0].aitk and last.index - walk.errors[-1][0].index <= 40)):
        return None  # its exception line came, or AI Toolkit printed the error first
    if walk.clusters and walk.clusters[-1].last >= last.index - 40:
        return None  # an OOM's traceback
    return last if _only_traceback(line for _, line in records[last.index + 1:]) else None


def _chain_start(records: list[tuple[int, str]], walk: _Walk, last: _Mark) -> int:
    """Where the chain of tracebacks that ends in the cut one begins: a DataLoader worker's
    "Original Traceback" comes after the traceback of the loop that fetched the batch."""
    start = last.index
    for mark in reversed(walk.tracebacks[:-1]):
        between = [line for _, line in records[mark.index + 1:start]]
        if start - mark.index > 400 or not _only_traceback(between, errors_too=True):
            break
        start = mark.index
    return start


def _only_traceback(lines, errors_too: bool = False) -> bool:
    """Whether every line is part of a traceback: a frame, the source line under it (indented or not),
    an indented line or carets, a rich box, a header, a blank, a chained exception's sentence (and, with
    `errors_too`, an error line)."""
    after_frame = False
    for line in lines:
        core = _TRACEBACK_PREFIX.sub("", line, count=1)
        if _FRAME.search(core):
            after_frame = True
            continue
        stripped = core.strip()
        if not (not stripped or after_frame or core[:1] in " \t" or stripped[:1] in "│╭╰┃^~" or _TRACEBACK in core
                or stripped.startswith(_CHAINED) or (errors_too and _ERROR_LINE.search(core))):
            return False
        after_frame = False
    return True


_TRACEBACK_PREFIX = re.compile(r"^(?:\[rank\d{1,6}\]:|> ?|\[[^\]\n]{0,200}\] ?(?:\[[A-Z]{1,10}\] ?)?)")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# Calls on a frame's source line: `train_dataset_group.cache_latents(vae, ...` (a cut traceback's
# innermost frame shows where it was going; a rich box marks the failing line with ❱).
_CALL = re.compile(r"(\w{1,200})\(")
# A forward, backward or batch fetch under a training loop: what makes an unnamed error a training step's.
_STEP_WORK = frozenset({"forward", "_call_impl", "_wrapped_call_impl", "backward", "__next__", "_next_data"})


def _phase_of_block(block: list[str], progress_phase: str, cut: bool) -> tuple[str, str | None]:
    """(phase, innermost function) of a failure's traceback: the frames that name a phase's work, then
    the progress line before it, then a training loop around a forward, backward or batch fetch."""
    text = "\n".join(block)
    names, files = frames_of_text(text)
    calls = _calls_on_last_frame(text) if cut else []  # they stand for the frames cut off below the last one
    # The innermost frame that names a phase's work, else such a call, else the innermost frame shown.
    frame = next((name for name in [*reversed(names), *reversed(calls)] if _frame_phase(name)),
                 names[-1] if names else None)
    names, files = names + calls, files + [""] * len(calls)
    named = phase_of_frames(names, files, loop=False)
    if named:
        return named, frame
    if progress_phase != "unknown":
        return progress_phase, frame
    if any(name in _STEP_WORK for name in names):
        return phase_of_frames(names, files) or "unknown", frame
    return "unknown", frame


def _calls_on_last_frame(text: str) -> list[str]:
    last = None
    for last in _FRAME.finditer(text):
        pass
    if last is None:
        return []
    below = text[last.end():last.end() + 2000].split("\n")[1:9]
    marked = [line for line in below if "❱" in line]  # rich: the failing line
    return _CALL.findall(marked[0] if marked else (below[0] if below else ""))


def _step_at(mark: _Mark, phase: str) -> int | None:
    """The step running at a mark: the one after the last done, or for a sample the one it followed."""
    if not mark.training_started or mark.step_done is None:
        return None
    if phase == "sample":
        return mark.step_done or None
    return mark.step_done + 1


def _last_error(errors: list[tuple[int, str]]) -> tuple[int | None, str | None]:
    real = [e for e in errors if not e[1].split(":")[0].endswith(_LAUNCHER_ERRORS)]
    pick = (real or errors or [(None, None)])[-1]
    return pick[0], pick[1]


# -- helpers ----------------------------------------------------------------------------------------
_LOG_PREFIX = re.compile(r"^(?:\[[^\]]{0,200}\]\s*)+")  # "[2024-09-09 17:43:35] [INFO] " (fluxgym, GUIs)


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
