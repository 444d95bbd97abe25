"""Peak memory per phase of a probe: on a real GPU (cuda) or simulated on the CPU (sim).

Both meters have the same small surface, so the probe reads the same on either:

    with meter:                      # starts measuring
        with meter.phase("load"):    # peak of this phase, and its seconds
            ...
        meter.register(module)       # tensors made outside the meter's sight (safetensors loads)
        meter.release(module)        # tensors moved off the device (offload, unloaded encoders)
    meter.phases                     # name -> {"peak_allocated", "peak_reserved", "seconds"}

The sim meter counts the bytes of every live tensor storage through a TorchDispatchMode and
raises `torch.OutOfMemoryError` when they pass the budget, so a CPU behaves like a small GPU:
the probe fails at the same place, with the same exception, as it would on the card.
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from fitfinder.units import format_bytes


class StorageTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created while active, or registered; exact and repeatable.

    A storage is counted once (views share it) and forgotten by a weakref finalizer when it dies.
    With a budget, an allocation that would pass it raises torch.OutOfMemoryError.
    """

    def __init__(self, budget_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.add, out)
        return out

    def add(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        key, size = storage._cdata, storage.nbytes()
        old = self.live.get(key)
        if old == size:
            return
        if old is None:
            weakref.finalize(storage, self._forget, key)
        self.live[key] = size
        self.live_bytes += size - (old or 0)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            needed = size - (old or 0)
            self.drop(tensor)  # the allocation "failed": it must not stay counted
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated). Tried to allocate {format_bytes(needed)}. "
                f"Simulated GPU budget {format_bytes(self.budget_bytes)}, of which "
                f"{format_bytes(self.live_bytes)} is in use by live tensors."
            )

    def drop(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor's storage (it left the simulated device)."""
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        self._forget(key)

    def _forget(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)


def tensors_of(*objects: Any) -> Iterator[torch.Tensor]:
    """Every tensor held by modules (parameters, grads, buffers), optimizers (state) or given directly."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from tensors_of(*obj)
        elif isinstance(obj, dict):
            yield from tensors_of(*obj.values())


class _PhaseClock:
    """Shared bookkeeping: phase name -> peak allocated, peak reserved, seconds."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self.current_phase: str | None = None

    def _record(self, name: str, allocated: int, reserved: int, seconds: float) -> None:
        entry = self.phases.setdefault(name, {"peak_allocated": 0, "peak_reserved": 0, "seconds": 0.0})
        entry["peak_allocated"] = max(entry["peak_allocated"], int(allocated))
        entry["peak_reserved"] = max(entry["peak_reserved"], int(reserved))
        entry["seconds"] = round(entry["seconds"] + seconds, 4)

    @property
    def peak_bytes(self) -> int:
        return max((p["peak_reserved"] for p in self.phases.values()), default=0)


class SimMeter(_PhaseClock):
    """CPU stand-in for a GPU of `budget_bytes`: live tensor bytes, OOM past the budget."""

    kind = "sim"
    device = torch.device("cpu")

    def __init__(self, budget_bytes: int | None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.tracker = StorageTracker(budget_bytes)

    def __enter__(self) -> "SimMeter":
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current_phase = name
        self.tracker.peak_bytes = self.tracker.live_bytes
        start = time.perf_counter()
        try:
            yield
        finally:
            peak = self.tracker.peak_bytes
            self._record(name, peak, peak, time.perf_counter() - start)

    def register(self, *objects: Any) -> None:
        for tensor in tensors_of(*objects):
            self.tracker.add(tensor)

    def release(self, *objects: Any) -> None:
        for tensor in tensors_of(*objects):
            self.tracker.drop(tensor)

    def to_device(self, obj: Any) -> Any:
        """Bring a module or tensor onto the (simulated) device: it counts from now on."""
        self.register(obj)
        return obj

    def to_host(self, obj: Any) -> Any:
        """Move a module or tensor off the (simulated) device: it stops counting."""
        self.release(obj)
        return obj

    @property
    def live_bytes(self) -> int:
        return self.tracker.live_bytes

    def describe(self) -> str:
        return f"sim meter, budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "sim meter, no budget"


class CudaMeter(_PhaseClock):
    """A real GPU: torch.cuda peak statistics per phase, plus memory outside PyTorch's allocator.

    With a budget smaller than the card, the process is capped with
    `set_per_process_memory_fraction` after subtracting the measured CUDA context, to emulate a
    smaller card.
    """

    kind = "cuda"

    def __init__(self, budget_bytes: int | None, gpu: int = 0):
        super().__init__()
        torch.cuda.set_device(gpu)
        self.device = torch.device("cuda", gpu)
        torch.cuda.init()
        torch.empty(1, device=self.device)  # creates the context, so it can be measured
        free, total = torch.cuda.mem_get_info(self.device)
        self.total_bytes = total
        # Memory the process cannot use for tensors: CUDA context, other processes, cuBLAS.
        self.outside_bytes = total - free - torch.cuda.memory_reserved(self.device)
        self.budget_bytes = budget_bytes
        self.emulated = budget_bytes is not None and budget_bytes < total
        if self.emulated:
            usable = max(budget_bytes - self.outside_bytes, 0)
            torch.cuda.set_per_process_memory_fraction(usable / total, self.device)

    def __enter__(self) -> "CudaMeter":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current_phase = name
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            allocated = torch.cuda.max_memory_allocated(self.device) + self.outside_bytes
            reserved = torch.cuda.max_memory_reserved(self.device) + self.outside_bytes
            self._record(name, allocated, reserved, time.perf_counter() - start)

    def register(self, *objects: Any) -> None:
        return None

    def release(self, *objects: Any) -> None:
        return None

    def to_device(self, obj: Any) -> Any:
        return obj.to(self.device)

    def to_host(self, obj: Any) -> Any:
        return obj.to("cpu")

    @property
    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device)
        text = f"cuda meter on {name} ({format_bytes(self.total_bytes)})"
        if self.emulated:
            text += f", emulating a {format_bytes(self.budget_bytes)} card"
        return text


def make(kind: str, budget_bytes: int | None, gpu: int = 0):
    """The meter a probe request names."""
    if kind == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        return CudaMeter(budget_bytes, gpu)
    if kind == "sim":
        return SimMeter(budget_bytes)
    raise ValueError(f"unknown meter {kind!r}; known: sim, cuda")
