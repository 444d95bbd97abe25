"""Peak memory per phase of a probe: on a real GPU (cuda) or simulated on the CPU (sim).

Both meters have the same small surface, so the probe reads the same on either:

    with meter:                      # starts measuring
        with meter.phase("load"):    # peak of this phase, and its seconds
            with meter.host():       # made here, a tensor lives in host memory, not on the device
                part = build()
            part = meter.to_device(part)   # onto the device: it counts from now on
            meter.to_host(part)            # off the device (low_vram, unloaded encoders)
        meter.register(module)       # tensors made outside the meter's sight (safetensors loads)
    meter.phases                     # name -> {"peak_allocated", "peak_reserved", "seconds"}

The sim meter counts the bytes of every live tensor storage through a TorchDispatchMode and
raises `torch.OutOfMemoryError` when they pass the budget, so a CPU behaves like a small GPU:
the probe fails at the same place, with the same exception, as it would on the card.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from contextlib import contextmanager, nullcontext
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
        self.paused = 0  # > 0 while tensors are made in host memory (meter.host())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
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
                yield from _quantization_tensors(param)
                if param.grad is not None:
                    yield param.grad
            yield from obj.buffers()
            for module in obj.modules():
                yield from _quantization_tensors(getattr(module, "state", None))
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from tensors_of(*obj)
        elif isinstance(obj, dict):
            yield from tensors_of(*obj.values())


def _quantization_tensors(holder: Any) -> Iterator[torch.Tensor]:
    """What bitsandbytes keeps beside a quantized weight, outside parameters and buffers.

    Int8Params and a Linear8bitLt's matmul state hold `CB` (the int8 weight) and `SCB` (row
    scales); Params4bit holds a `quant_state` with the block absmax and the code book, nested once
    more with double quantization.
    """
    if holder is None:
        return
    for name in ("CB", "SCB"):
        value = getattr(holder, name, None)
        if isinstance(value, torch.Tensor):
            yield value
    state = getattr(holder, "quant_state", None)
    while state is not None:
        for name in ("absmax", "code", "offset"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                yield value
        state = getattr(state, "state2", None)


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
        # Tiny random models underflow into denormal floats, which the CPU computes up to 10x
        # slower; a GPU flushes them anyway. Memory is what is measured here, and it is unchanged.
        torch.set_flush_denormal(True)
        # One thread: a tiny model gains nothing from more, and on a shared CPU several threads
        # per probe wait on each other (10x slower when the cores are busy elsewhere).
        torch.set_num_threads(1)
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current_phase = name
        gc.collect()  # what the last phase left for the collector must not count in this one
        self.tracker.peak_bytes = self.tracker.live_bytes
        start = time.perf_counter()
        try:
            yield
        finally:
            peak = self.tracker.peak_bytes
            self._record(name, peak, peak, time.perf_counter() - start)

    @contextmanager
    def host(self) -> Iterator[None]:
        """Tensors made inside live in host memory: not counted until `to_device`."""
        self.tracker.paused += 1
        try:
            yield
        finally:
            self.tracker.paused -= 1

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

    Per phase: `max_memory_allocated` and `max_memory_reserved`, each plus the memory the process
    holds outside the caching allocator (CUDA context, cuBLAS/cuDNN handles, other processes on
    the card), read from `mem_get_info` at the phase's end. With a budget smaller than the card,
    the allocator is capped with `set_per_process_memory_fraction` at the budget minus that outside
    memory, so the card behaves like a smaller one (an emulation: the context of a real smaller
    card may differ by a few hundred MiB).
    """

    kind = "cuda"

    def __init__(self, budget_bytes: int | None, gpu: int = 0):
        super().__init__()
        torch.cuda.set_device(gpu)
        self.device = torch.device("cuda", gpu)
        _warm_up(self.device)  # loads the context and the math libraries, so they can be measured
        free, total = torch.cuda.mem_get_info(self.device)
        self.total_bytes = total
        self.outside_bytes = total - free - torch.cuda.memory_reserved(self.device)
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
        start = time.perf_counter()
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self._account_outside(total - free - torch.cuda.memory_reserved(self.device))
            allocated = torch.cuda.max_memory_allocated(self.device) + self.outside_bytes
            reserved = torch.cuda.max_memory_reserved(self.device) + self.outside_bytes
            self._record(name, allocated, reserved, time.perf_counter() - start)

    def _account_outside(self, outside_bytes: int) -> None:
        """Memory outside the allocator only grows (libraries load lazily); the cap shrinks with it."""
        if outside_bytes <= self.outside_bytes:
            return
        self.outside_bytes = outside_bytes
        if self.emulated:
            self.cap_bytes = max(self.budget_bytes - outside_bytes, 0)
            torch.cuda.set_per_process_memory_fraction(self.cap_bytes / self.total_bytes, self.device)

    def host(self):
        return nullcontext()  # torch makes tensors in host memory unless told otherwise

    def register(self, *objects: Any) -> None:
        return None

    def release(self, *objects: Any) -> None:
        return None

    def to_device(self, obj: Any) -> Any:
        return obj.to(self.device)

    def to_host(self, obj: Any) -> Any:
        moved = obj.to("cpu")
        torch.cuda.empty_cache()
        return moved

    @property
    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device)
        text = f"cuda meter on {name} ({format_bytes(self.total_bytes)}, {format_bytes(self.outside_bytes)} outside PyTorch)"
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


def make(kind: str, budget_bytes: int | None, gpu: int = 0):
    """The meter a probe request names."""
    if kind == "cuda":
        # Must be set before the allocator's first use; the runner sets it for its children too.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
        return CudaMeter(budget_bytes, gpu)
    if kind == "sim":
        return SimMeter(budget_bytes)
    raise ValueError(f"unknown meter {kind!r}; known: sim, cuda")


# Expandable segments: less fragmentation, as recent AI Toolkit versions recommend; a user's own
# PYTORCH_CUDA_ALLOC_CONF wins.
CUDA_ALLOC_CONF = "expandable_segments:True"
