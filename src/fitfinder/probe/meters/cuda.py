"""The cuda meter: a real card's peak statistics per phase, and a smaller card emulated on a larger one."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from fitfinder.probe.meters import _host
from fitfinder.probe.meters._clock import PhaseClock
from fitfinder.units import format_bytes


class CudaMeter(PhaseClock):
    """A real GPU: torch.cuda peak statistics per phase, plus memory outside PyTorch's allocator.

    Per phase: `max_memory_allocated` and `max_memory_reserved`, each plus the memory the process
    holds outside the caching allocator (CUDA context, cuBLAS/cuDNN handles, other processes on
    the card), read from `mem_get_info` at the phase's end. With a budget smaller than the card,
    the allocator is capped with `set_per_process_memory_fraction` at the budget minus that outside
    memory, so the card behaves like a smaller one (an emulation: the context of a real smaller
    card may differ by a few hundred MiB).
    """

    kind = "cuda"

    def __init__(self, budget_bytes: int | None, gpu: int = 0, ram_bytes: int | None = None):
        super().__init__()
        self.ram_bytes = ram_bytes  # judged on each phase's measured host peak (`peak_host`)
        self.host_outside_bytes = _host.resident_bytes() or 0
        torch.cuda.set_device(gpu)
        self.device = torch.device("cuda", gpu)
        _warm_up(self.device)  # loads the context and the math libraries, so they can be measured
        free, total = torch.cuda.mem_get_info(self.device)
        self.total_bytes = total
        self.outside_bytes = total - free - torch.cuda.memory_reserved(self.device)
        self.ooms_at_start = self.oom_count()
        self.budget_bytes = budget_bytes
        self.emulated = budget_bytes is not None and budget_bytes < total
        self.cap_bytes = None
        if self.emulated:
            self.cap_bytes = max(budget_bytes - self.outside_bytes, 0)
            torch.cuda.set_per_process_memory_fraction(self.cap_bytes / total, self.device)

    def __enter__(self) -> "CudaMeter":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current_phase = name
        _flush(self.device)  # as AI Toolkit flushes between stages: no cached block from before counts
        torch.cuda.reset_peak_memory_stats(self.device)
        measured = _host.reset_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self._account_outside(total - free - torch.cuda.memory_reserved(self.device))
            allocated = torch.cuda.max_memory_allocated(self.device) + self.outside_bytes
            reserved = torch.cuda.max_memory_reserved(self.device) + self.outside_bytes
            # The host: the process's resident peak in the phase, its workers' included (no tensor is counted).
            host = _host.peak_bytes() if measured else None
            self._record(name, allocated, reserved, time.perf_counter() - start,
                         host={"peak_host": host, "host_rss": host})

    def _account_outside(self, outside_bytes: int) -> None:
        """Memory outside the allocator only grows (libraries load lazily); the cap shrinks with it."""
        if outside_bytes <= self.outside_bytes:
            return
        self.outside_bytes = outside_bytes
        if self.emulated:
            self.cap_bytes = max(self.budget_bytes - outside_bytes, 0)
            torch.cuda.set_per_process_memory_fraction(self.cap_bytes / self.total_bytes, self.device)

    def oom_count(self) -> int:
        """How many OOMs the caching allocator has raised in this process, whatever became of them."""
        return int(torch.cuda.memory_stats(self.device).get("num_ooms", 0))

    def ran_out(self) -> str | None:
        """The caching allocator counts every OOM it raised, whatever became of the error."""
        counted = self.oom_count() - self.ooms_at_start
        if counted <= 0:
            return None
        return f"OutOfMemoryError: CUDA out of memory ({counted} counted by the caching allocator)"

    def host(self):
        return nullcontext()  # torch makes tensors in host memory unless told otherwise

    def concrete(self):
        return nullcontext()

    def register(self, *objects: Any) -> None:
        return None

    def release(self, *objects: Any) -> None:
        return None

    def to_device(self, obj: Any) -> Any:
        return obj.to(self.device)

    def to_host(self, obj: Any, pinned: bool = False) -> Any:
        moved = obj.to("cpu")
        torch.cuda.empty_cache()
        return moved

    @property
    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def step_clock(self) -> float:
        torch.cuda.synchronize(self.device)  # a step ends when its kernels do, not when they are queued
        return time.perf_counter()

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device)
        text = (f"cuda meter on {name} ({format_bytes(self.total_bytes)}, "
                f"{format_bytes(self.outside_bytes)} outside PyTorch)")
        if self.emulated:
            text += (f", emulating a {format_bytes(self.budget_bytes)} card: PyTorch capped at "
                     f"{format_bytes(self.cap_bytes)}")
        return text


def _warm_up(device: torch.device) -> None:
    """Create the CUDA context and load cuBLAS and the attention kernels with a few tiny ops."""
    x = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (x @ x).sum().item()
    q = x.view(1, 1, 64, 64)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().item()
    del x, q
    _flush(device)


def _flush(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
