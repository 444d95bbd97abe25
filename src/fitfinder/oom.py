"""The one OOM classifier: an exception or a line of log text -> is it an OOM, and whose fault.

Only an OOM changes the configuration; anything else is reported as the error it is. Each known
string says where it comes from. `kind` is "config" (this configuration needs more memory than
the card has), "environment" (the card or worker was not clean: nothing was free even for a
conservative configuration), or "not_oom".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fitfinder.units import parse_bytes

# (substring, where it comes from). Matched case-sensitively, as the libraries print them.
OOM_MARKERS: tuple[tuple[str, str], ...] = (
    ("CUDA out of memory", "PyTorch's CUDA caching allocator (torch.OutOfMemoryError)"),
    ("CUDA error: out of memory", "the CUDA runtime itself (cudaErrorMemoryAllocation), e.g. at context creation"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS could not allocate its handle or workspace"),
    ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", "cuDNN, listed as an OOM by accelerate and Lightning"),
    ("CUDNN_STATUS_ALLOC_FAILED", "cuDNN could not allocate its workspace"),
    ("DefaultCPUAllocator: can't allocate memory", "PyTorch's CPU allocator (accelerate's and Lightning's lists)"),
    ("HIP out of memory", "PyTorch on ROCm"),
    ("XPU out of memory", "PyTorch on Intel GPUs (accelerate's list)"),
    ("MPS backend out of memory", "PyTorch on Apple silicon"),
    ("OOM during training step 3 times in a row", "AI Toolkit gives up after three OOM retries of a step"),
    ("torch.OutOfMemoryError", "a traceback naming PyTorch's OOM exception"),
    ("torch.cuda.OutOfMemoryError", "the same exception under its older name"),
)
# Markers that mean nothing at all was free: a dirty card when the configuration is conservative.
ENVIRONMENT_MARKERS: tuple[tuple[str, str], ...] = (
    ("0 bytes is free", "PyTorch's OOM message when the card has no free memory at all"),
    ("0 bytes free", "the same, in PyTorch before 2.1"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS failing to allocate a few MiB of workspace"),
)
_TRIED = re.compile(r"Tried to allocate ([0-9.]+ ?[KMGT]i?B)")
_TOTAL_FREE = re.compile(r"total capacity of ([0-9.]+ ?[KMGT]i?B) of which ([0-9.]+ ?[KMGT]i?B|0 bytes) is free")


@dataclass(frozen=True)
class Verdict:
    is_oom: bool
    kind: str  # "config" | "environment" | "not_oom"
    message: str
    marker: str | None = None
    tried_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None


def classify(error: BaseException | str, conservative: bool = False) -> Verdict:
    """Classify an exception or log text; `conservative` says the configuration was already minimal."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    is_oom_type = isinstance(error, BaseException) and type(error).__name__ == "OutOfMemoryError"
    marker = next((m for m, _ in OOM_MARKERS if m in text), None)
    if not is_oom_type and marker is None:
        return Verdict(False, "not_oom", _first_line(text))
    nothing_free = any(m in text for m, _ in ENVIRONMENT_MARKERS)
    kind = "environment" if nothing_free and conservative else "config"
    total, free = _total_free(text)
    return Verdict(True, kind, _first_line(text), marker or "OutOfMemoryError", _size(_TRIED, text), total, free)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return ""


def _size(pattern: re.Pattern, text: str) -> int | None:
    match = pattern.search(text)
    return parse_bytes(match.group(1).replace(" ", "")) if match else None


def _total_free(text: str) -> tuple[int | None, int | None]:
    match = _TOTAL_FREE.search(text)
    if not match:
        return None, None
    free = 0 if match.group(2) == "0 bytes" else parse_bytes(match.group(2).replace(" ", ""))
    return parse_bytes(match.group(1).replace(" ", "")), free
