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

        with meter.concrete():       # code that reads tensor values (code books) sees real ones
            optimizer = make_optimizer()

The sim meter counts the bytes of every live tensor storage through a TorchDispatchMode and
raises `torch.OutOfMemoryError` when they pass the budget, so a CPU behaves like a small GPU:
the probe fails at the same place, with the same exception, as it would on the card.

The estimate meter runs the same tracker under FakeTensorMode on the full-size architecture:
no tensor holds data, so a 12-billion-parameter job runs in seconds in well under a GiB, and
each storage is also counted as the CUDA caching allocator hands it out; a GPU overhead model
(`overhead.py`) turns that into what the card would show.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch._subclasses import fake_tensor  # imported by torch itself
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_map_only

from fitfinder.probe.overhead import GpuOverhead
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
        # Storages that stay in host memory however ops view them (a kohya trainer's swapped blocks'
        # weights, which its layers use in place): a view an op returns would count them again.
        self.in_host: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # A quantized weight (quanto's) computes with its inner tensors: let its own dispatch
            # run and count what that makes (the weight it dequantizes for a backward, which a GPU
            # allocates too), as FakeTensorMode does for the estimate.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for tensor in tensors_returned(out):
                self.add(tensor)
        return out

    def add(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a quantized weight: its inner tensors hold the bytes
            for inner in inner_tensors(tensor):
                self.add(inner)
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        key, size = storage._cdata, storage.nbytes()
        if key in self.in_host:
            return
        old = self.live.get(key)
        if old == size:
            return
        if old is None:
            weakref.finalize(storage, self._forget, key)
        self.live[key] = size
        self._grown(key, size, old or 0)
        if self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            needed = size - (old or 0)
            self.drop(tensor)  # the allocation "failed": it must not stay counted
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated). Tried to allocate {format_bytes(needed)}. "
                f"Simulated GPU budget {format_bytes(self.budget_bytes)}, of which "
                f"{format_bytes(self.live_bytes)} is in use by live tensors."
            )

    def _grown(self, key: int, size: int, old: int) -> None:
        self.live_bytes += size - old
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def hold_in_host(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor's storage and never count it again, views of it included, while it
        lives (its key may be a new storage's after it dies)."""
        self.drop(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key not in self.in_host:
            self.in_host.add(key)
            weakref.finalize(storage, self.in_host.discard, key)

    def drop(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor's storage (it left the simulated device)."""
        if is_traceable_wrapper_subclass(tensor):
            for inner in inner_tensors(tensor):
                self.drop(inner)
            return
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        self._forget(key)

    def _forget(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)


def tensors_returned(out: Any) -> Iterator[torch.Tensor]:
    """The tensors an op returned. Most ops return one tensor or a flat tuple of them: those skip
    the pytree walk, a good share of the per-op cost under FakeTensorMode."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None for o in out):
        yield from (o for o in out if o is not None)
    else:
        found: list[torch.Tensor] = []
        tree_map_only(torch.Tensor, found.append, out)
        yield from found


# The CUDA caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize in
# c10/cuda/CUDACachingAllocator.cpp, round_size), and nothing for an empty tensor.
CUDA_BLOCK_BYTES = 512


def allocator_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator gives a storage of `nbytes`: rounded up to its 512-byte blocks."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


class AllocatorTracker(StorageTracker):
    """The estimate's tracker: every storage counted exactly (as the sim meter counts it) and as
    the CUDA caching allocator would hold it (`allocator_bytes`), each with its live total and
    peak. Never raises: an estimate wants every phase's peak, over the budget or not.

    The estimate's fake mode (`_counting_fake_mode`) hands it each op's outputs; it is entered
    as a dispatch mode of its own only where real tensors are made (`EstimateMeter.concrete`).
    """

    def __init__(self) -> None:
        super().__init__(budget_bytes=None)
        self.blocks: dict[int, int] = {}  # storage id -> allocator bytes
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        # Storage ids are addresses, which a new storage may take over from a freed one: the order
        # of births tells them apart (CheckpointedBlocks compares what a block's run made and freed).
        self.births = 0
        self.born: dict[int, int] = {}  # storage id -> its birth's number

    def _grown(self, key: int, size: int, old: int) -> None:
        super()._grown(key, size, old)
        if key not in self.blocks:
            self.births += 1
            self.born[key] = self.births
        blocks = allocator_bytes(size)
        self.allocated_bytes += blocks - self.blocks.get(key, 0)
        self.blocks[key] = blocks
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)

    def _forget(self, key: int) -> None:
        super()._forget(key)
        self.allocated_bytes -= self.blocks.pop(key, 0)
        self.born.pop(key, None)

    def made_since(self, births: int) -> set[int]:
        """The live storages born after the `births`-th."""
        return {key for key, born in self.born.items() if born > births}

    def window(self) -> PeakWindow:
        """Start measuring how far a stretch of work raises the peaks (`PeakWindow.close`)."""
        return PeakWindow(self)

    def reach(self, rise: tuple[int, int]) -> None:
        """A replay of measured work: the peaks it rose to (`PeakWindow.close`) over what is live now."""
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + rise[0])
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes + rise[1])


class PeakWindow:
    """How far a stretch of work raises the tracker's peaks over the live bytes at its start, in both
    counts, measured without losing the peaks reached before it: open, do the work, `close()`.
    Every replay (repeated work, blocks, updates) measures its first run this way."""

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.live, self.allocated = tracker.live_bytes, tracker.allocated_bytes
        self.peaks = tracker.peak_bytes, tracker.peak_allocated_bytes
        tracker.peak_bytes, tracker.peak_allocated_bytes = self.live, self.allocated

    def close(self) -> tuple[int, int]:
        """(bytes, allocator bytes) the peaks rose over the live counts at the start."""
        tracker = self.tracker
        rise = tracker.peak_bytes - self.live, tracker.peak_allocated_bytes - self.allocated
        tracker.peak_bytes = max(self.peaks[0], tracker.peak_bytes)
        tracker.peak_allocated_bytes = max(self.peaks[1], tracker.peak_allocated_bytes)
        return rise


def _counting_fake_mode(tracker: AllocatorTracker):
    """A FakeTensorMode that hands the outputs of every op to `tracker` (unless paused).

    One Python mode per op instead of two (a tracker mode above the fake mode): about a third
    faster, since every op, down to the device queries autograd makes, passes through each.
    Only the outermost op counts: FakeTensorMode runs some ops as decompositions into others,
    whose intermediates a GPU kernel never allocates and a tracker above it never sees.
    Non-fake inputs are allowed: small constants made from Python values (code books, noise
    schedules) mix with the fake weights, as they would with real ones.
    """
    # Queries (device, sizes, strides) answered straight from the fake tensor, as FakeTensorMode's
    # dispatch answers them first: autograd and the linear kernels ask for devices 100,000 times
    # a training step, each a trip through Python.
    queries = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {})

    class _CountingFakeMode(FakeTensorMode):
        same_as = _same_fake_ops()  # op -> the op it is answered as
        direct = _DIRECT_OPS if fake_internals_known() else {}  # op -> its direct answer

        def __init__(self) -> None:
            super().__init__(allow_non_fake_inputs=True)
            self.depth = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            query = queries.get(func)
            if query is not None:
                return query(args)
            func, kwargs = self.same_as.get(func, func), kwargs or {}
            out = None
            answer = self.direct.get(func)
            if answer is not None and self.shape_env is None:
                out = answer(self, func, args, kwargs)
                if out is not None and CROSSCHECK_DIRECT_OPS:
                    _crosscheck(out, self.fake_answer(func, types, args, kwargs), func, args)
            if out is None:
                out = self.fake_answer(func, types, args, kwargs)
            if self.depth == 0 and not tracker.paused:
                if isinstance(out, torch.Tensor):  # most ops: no generator for those
                    tracker.add(out)
                else:
                    for tensor in tensors_returned(out):
                        tracker.add(tensor)
            return out

        def fake_answer(self, func, types, args, kwargs):
            """FakeTensorMode's answer; the ops it runs inside (decompositions) are not counted."""
            self.depth += 1
            try:
                return self.dispatch(func, types, args, kwargs)
            finally:
                self.depth -= 1

    if fake_internals_known():
        _CountingFakeMode._prep_args_for_hash = _key_by_layout
        _CountingFakeMode._get_output_tensor_from_cache_entry = _new_output_from_cache
        _CountingFakeMode._validate_cache_key = _cacheable_quanto_ops
        _CountingFakeMode.cacheable_quanto_ops = _quanto_cacheable()
    return _CountingFakeMode()


def _cacheable_quanto_ops(mode, func, args, kwargs) -> None:
    """FakeTensorMode's `_validate_cache_key`, with quanto's two functional ops cacheable.

    The mode caches no operator from outside torch (it cannot know whether its output depends on
    more than its inputs' layouts), so every quantized layer's matmul (`quanto::qbytes_mm`, 227
    times in a FLUX.1-dev estimate) ran quanto's Python on meta tensors
    (`benchmarks/fake_dispatch.py`: 372 -> 37 us). Both compute from their inputs' sizes and
    dtypes alone (optimum/quanto/library/qbytes_mm.py, quantize.py) and make a new tensor; the
    mode's own checks of what it caches (no alias of an input, a fake output) still run on their
    outputs.
    """
    if func not in mode.cacheable_quanto_ops:
        FakeTensorMode._validate_cache_key(mode, func, args, kwargs)


def _quanto_cacheable() -> frozenset:
    """quanto's cacheable ops, where optimum.quanto registered them (it is imported by then)."""
    names = ("qbytes_mm", "quantize_symmetric")
    return frozenset(getattr(torch.ops.quanto, name).default for name in names if hasattr(torch.ops.quanto, name))


@functools.cache
def fake_internals_known() -> bool:
    """Whether FakeTensorMode's internals are those the counting mode's own keys, outputs and direct
    answers follow: its key builder appends to a list (torch 2.13 here), where older ones returned a
    tuple (`_prep_args_for_hash(self, args)`). Another keeps the mode's own ways."""
    return "result" in inspect.signature(FakeTensorMode._prep_args_for_hash).parameters


def _same_fake_ops() -> dict:
    """Ops FakeTensorMode makes with the very function of a cacheable op: answered as that op.

    `aten._unsafe_view` (matmul's and linear's reshape of their fresh output, 395 times in a
    FLUX.1-dev estimate) is `aten.view` to the fake mode (torch/_subclasses/fake_impls.py, one
    `_view_meta` registered for both): the same view of the same storage. But the mode never
    caches `_unsafe_view` (autograd does not treat it as a view, so a cached copy could not say
    what it aliases), and runs its reshape checks each time; as `aten.view` it is a cache hit
    that remakes the view (`benchmarks/fake_dispatch.py`: 121 -> 34 us). Only where this torch
    registers one function for both: another torch keeps the mode's own way.
    """
    from torch._subclasses import fake_impls

    implementations, aten = fake_impls.op_implementations_dict, torch.ops.aten
    view = implementations.get(aten.view.default)
    if view is None or implementations.get(aten._unsafe_view.default) is not view:
        return {}
    return {aten._unsafe_view.default: aten.view.default}


# Ops the counting mode answers itself, as FakeTensorMode would: a new empty tensor (the
# materialized and quantized weights, the replays' outputs, the optimizers' state) or a view of
# one input (detach, transpose, slices). Counted while profiling, some 14,000 of a FLUX.1-dev
# estimate's 27,000 ops. FakeTensorMode answers each from its cache (its key, its entry, its
# remaking of the output) or, the first time, through Python reference code; the meta kernels make
# the same tensor in C++ (`benchmarks/fake_dispatch.py`: a detach 31 -> 23 us). Not `aten.view`:
# for a size-1 dimension the mode's reference code gives another stride than the meta kernel.
# Each answers None where it is not sure (an input that is not a plain fake tensor of the mode, an
# argument it does not know), and the mode's own way takes over. CROSSCHECK_DIRECT_OPS holds each
# answer to FakeTensorMode's (tests/test_estimate.py, a tiny estimate of every family).
CROSSCHECK_DIRECT_OPS = False


def _plain_fake(mode, tensor) -> bool:
    return (type(tensor) is FakeTensor and tensor.fake_mode is mode and tensor.constant is None
            and tensor.layout is torch.strided and not tensor.is_conj() and not tensor.is_neg())


def _meta_over(tensor: FakeTensor, shape, stride, offset: int, dtype=None, requires_grad=False) -> torch.Tensor:
    """A plain meta tensor of `shape` and `stride` over the fake tensor's own (meta) storage: its
    twin for a meta kernel to read, or a view of it (call with the mode's dispatch off)."""
    empty = torch.empty_strided(shape, stride, dtype=dtype or tensor.dtype, device="meta", requires_grad=requires_grad)
    return empty.set_(tensor.untyped_storage(), offset, shape, stride)


def _made_directly(mode, func, args, kwargs) -> FakeTensor | None:
    """A new empty tensor of given sizes: FakeTensorMode's `constructors` (torch/_subclasses/
    fake_impls.py) makes it on meta and puts it on the requested device, by default the CPU. (Not
    `zeros` or the `_like`s: their meta kernels take longer than the mode's cache hit.)"""
    if (kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory")
            or set(kwargs) - _FACTORY_KWARGS or not all(type(arg) in (list, tuple) for arg in args)):
        return None
    with torch._C._DisableTorchDispatch():
        made = func(*args, **{**kwargs, "device": _META})
    return FakeTensor(mode, made, kwargs.get("device") or _CPU)


def _viewed_directly(mode, func, args, kwargs) -> FakeTensor | None:
    """A view of one plain fake tensor, by arguments that are no tensors: the meta kernel's view
    of its storage, on its device, as FakeTensorMode's view outputs are."""
    base = args[0]
    if kwargs or not _plain_fake(mode, base) or any(isinstance(a, torch.Tensor) for a in args[1:]):
        return None
    with torch._C._DisableTorchDispatch():
        view = func(_meta_over(base, base.shape, base.stride(), base.storage_offset()), *args[1:])
    return FakeTensor(mode, view, base.fake_device)


def _crosscheck(out: FakeTensor, expected, func, args) -> None:
    """A direct answer is what FakeTensorMode answers: the same tensor, on the same device, over
    the same input's storage (a view) or a new one (a factory)."""
    def described(tensor):
        storage = tensor.untyped_storage()
        aliased = [i for i, arg in enumerate(args)
                   if isinstance(arg, torch.Tensor) and arg.untyped_storage()._cdata == storage._cdata]
        return (type(tensor), tensor.fake_device, tensor.dtype, tensor.shape, tensor.stride(),
                tensor.storage_offset(), storage.nbytes(), tensor.requires_grad, tensor.is_inference(), aliased)

    if type(expected) is not FakeTensor or described(out) != described(expected):
        raise AssertionError(f"{func} answered directly as {described(out)}, by FakeTensorMode as "
                             f"{described(expected) if type(expected) is FakeTensor else expected!r}")


_aten = torch.ops.aten
_FACTORY_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})
_CPU, _META = torch.device("cpu"), torch.device("meta")
_DIRECT_OPS = {
    **dict.fromkeys([_aten.empty_strided.default, _aten.empty.memory_format], _made_directly),
    **dict.fromkeys([_aten.detach.default, _aten.t.default, _aten.transpose.int,
                     _aten.permute.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default,
                     _aten.as_strided.default, _aten.slice.Tensor, _aten.select.int], _viewed_directly),
}


# Arguments an op's cache key holds as they are, with their type (1 and 1.0 make different dtypes).
_PLAIN_ARGUMENTS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                              torch.memory_format})
_FAKE_LAYOUT = "fake tensor"  # marks a fake tensor's layout tuple in a cache key


def _key_by_layout(mode, result: list, args, *rest) -> None:
    """FakeTensorMode's `_prep_args_for_hash` for the estimate's counting mode: the cache key of an
    op, as FakeTensorMode makes it, with a fake tensor's layout read in one tuple.

    Its own way builds a metadata record per tensor argument and flattens it field by field, half
    of a cache hit's time (`benchmarks/fake_dispatch.py`: an add 86 -> 40 us, its key 45 -> 7 us). The tuple holds
    everything that record does but what the shape and strides decide (the memory format) or the
    layout does (sparsity), so the same ops share a key. `rest`: the key state and the objects
    hashed by id, as this torch passes them on.
    """
    if mode.shape_env is not None or isinstance(args, dict):  # symbolic sizes; kwargs
        return FakeTensorMode._prep_args_for_hash(mode, result, args, *rest)
    if isinstance(args, (list, tuple)):
        result.append(type(args))
        result.append(len(args))
    for arg in args:
        kind = type(arg)
        if kind in _PLAIN_ARGUMENTS:
            result.append(kind)
            result.append(arg)
        elif kind is FakeTensor and arg.fake_mode is mode and arg.constant is None and arg.layout is torch.strided:
            result.append(_FAKE_LAYOUT)
            result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                           arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                           arg.is_inference(), arg.is_quantized))
        elif kind is list or kind is tuple:
            _key_by_layout(mode, result, arg, *rest)
        else:  # anything else (a symbolic int, a function, a foreign tensor) as FakeTensorMode keys it
            FakeTensorMode._prep_args_for_hash(mode, result, (arg,), *rest)


def _new_output_from_cache(mode, state, entry, key, func, args) -> FakeTensor | None:
    """FakeTensorMode's `_get_output_tensor_from_cache_entry` for the estimate's counting mode: an
    output answered from the cache, as FakeTensorMode makes it, in one step when it is a new tensor.

    Most cache hits are ops that make a new tensor, or a view of an input, of sizes known in
    advance (not in place, no symbolic sizes, no conjugate or negative bit, strided). For those
    FakeTensorMode reads each size through a checker of symbolic values and makes the meta tensor
    (for a view, set onto the input's storage) under its kernel-invocation context; here it is made
    with the mode's dispatch off and wrapped as it wraps it (`benchmarks/fake_dispatch.py`: an add
    41 -> 32 us, a linear 109 -> 93 us). Everything else goes through FakeTensorMode's own code.
    """
    metadata = entry.metadata
    if (metadata is None or entry.inplace_idx is not None or mode.shape_env is not None
            or metadata.layout is not torch.strided or metadata.is_conj or metadata.is_neg):
        return FakeTensorMode._get_output_tensor_from_cache_entry(mode, state, entry, key, func, args)
    viewed = None
    if entry.view_idx is not None:  # a view: the same sizes over its input's storage
        viewed = args[entry.view_idx]
        if not (isinstance(func, torch._ops.OpOverload) and func.is_view and type(viewed) is FakeTensor):
            return FakeTensorMode._get_output_tensor_from_cache_entry(mode, state, entry, key, func, args)
    with torch._C._DisableTorchDispatch():
        if viewed is None:
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, device="meta",
                                        requires_grad=metadata.requires_grad)
        else:
            empty = _meta_over(viewed, metadata.shape, metadata.stride, metadata.storage_offset, metadata.dtype,
                               metadata.requires_grad)
    return FakeTensor(mode, empty, metadata.device)


def submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module.modules()`, in its order, each once: without the names `Module.named_modules` builds
    for every module on the way, recursively. The meters walk whole models (placing a part, each
    block's replay key) thousands of times an estimate; this walk takes under half the time
    (timed while profiling)."""
    found, seen, stack = [], set(), [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        stack.extend(child for child in reversed(current._modules.values()) if child is not None)
    return found


def members(modules: list[torch.nn.Module], table: str = "_parameters") -> list[torch.Tensor]:
    """The parameters (or `_buffers`) of `submodules(...)` as `Module.parameters()` (`buffers()`)
    gives them: in order, each once."""
    found, seen = [], set()
    for module in modules:
        for tensor in getattr(module, table).values():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(tensor)
    return found


def _trained(block: torch.nn.Module) -> list[torch.Tensor]:
    """The block's parameters that train (its LoRA's), in `Module.parameters()` order."""
    return [param for param in members(submodules(block)) if param.requires_grad]


def tensors_of(*objects: Any) -> Iterator[torch.Tensor]:
    """Every tensor held by modules (parameters, grads, buffers; not the weights of offloaded
    layers), optimizers (state) or given directly."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            modules = submodules(obj)
            for param in members(modules):
                if getattr(param, "_is_memory_managed", False):
                    continue  # an offloaded layer's weight, in host memory (models/_offload.py)
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from members(modules, "_buffers")
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from tensors_of(*obj)
        elif isinstance(obj, dict):
            yield from tensors_of(*obj.values())


def inner_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors inside a tensor subclass such as quanto's quantized weights (`_data` and
    `_scale`, each maybe a subclass again): the wrapper itself holds no memory."""
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    for name in tensor.__tensor_flatten__()[0]:
        yield from inner_tensors(getattr(tensor, name))


class _PhaseClock:
    """Shared bookkeeping: phase name -> peak allocated, peak reserved, seconds."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self.current_phase: str | None = None

    def _record(self, name: str, allocated: int, reserved: int, seconds: float, **more: int) -> None:
        entry = self.phases.setdefault(name, {"peak_allocated": 0, "peak_reserved": 0, "seconds": 0.0})
        entry["peak_allocated"] = max(entry["peak_allocated"], int(allocated))
        entry["peak_reserved"] = max(entry["peak_reserved"], int(reserved))
        entry["seconds"] = round(entry["seconds"] + seconds, 4)
        for key, value in more.items():
            entry[key] = max(entry.get(key, 0), int(value))

    @property
    def peak_bytes(self) -> int:
        return max((p["peak_reserved"] for p in self.phases.values()), default=0)

    def step_clock(self) -> float:
        """Seconds for timing one training step (the meters on the CPU count their own thread's time)."""
        return time.perf_counter()

    def replay_repeated_blocks(self, *parts: torch.nn.Module) -> None:
        """Only the estimate meter replays identical blocks (RepeatedBlocks); real tensors run."""

    def repeated(self, key: Any, make, remake) -> Any:
        """`make()`; only the estimate meter replays a repeat of the same `key` (see EstimateMeter)."""
        return make()

    def replay_repeated_updates(self, optimizer=None, ema=None) -> None:
        """Only the estimate meter replays per-parameter updates of the same layout (RepeatedUpdates)."""


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

    def step_clock(self) -> float:
        # The probe computes on this one thread: its CPU time is what a step costs, and other
        # work on a shared machine does not inflate it as it does wall time (by 3x beside two
        # CPU-bound processes on two cores, benchmarks/timing_noise.py).
        return time.thread_time()

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

    def concrete(self):
        return nullcontext()  # every tensor here is real

    def register(self, *objects: Any) -> None:
        for tensor in tensors_of(*objects):
            self.tracker.add(tensor)

    def release(self, *objects: Any) -> None:
        for tensor in tensors_of(*objects):
            self.tracker.drop(tensor)

    def hold_in_host(self, *tensors: torch.Tensor) -> None:
        """Tensors that stay in host memory while the device's ops use them in place (StorageTracker.hold_in_host)."""
        for tensor in tensors:
            self.tracker.hold_in_host(tensor)

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


class EstimateMeter(SimMeter):
    """No memory at all: the sim meter's bookkeeping on fake tensors, as a GPU would hold them.

    Parts are built as fake tensors (models._fake); every phase of the recipe runs as written.
    Per phase: `peak_live`, the storage bytes the sim meter would count; `peak_allocated`, the
    same storages rounded as the CUDA caching allocator rounds them, plus the cuBLAS workspace;
    `peak_reserved`, that plus the allocator's fragmentation -- each plus the CUDA context, as the
    cuda meter reports them (`overhead.GpuOverhead`). It never raises out of memory: the budget is
    judged afterwards, on every phase's peak.
    """

    kind = "estimate"
    fake = True
    _froze = False  # whether an estimate's phase in this process froze what was alive (`phase`)

    def __init__(self, budget_bytes: int | None, overhead=None):
        _PhaseClock.__init__(self)
        self.budget_bytes = budget_bytes
        self.overhead = GpuOverhead.from_dict(overhead)
        self.tracker = AllocatorTracker()
        self.outside_bytes = self.overhead.context_bytes
        self._repeated: dict = {}
        self._replays: list = []  # RepeatedBlocks, CheckpointedBlocks, RepeatedUpdates installed

    @classmethod
    def thaw(cls) -> None:
        """The last estimate's pipeline, frozen by its phases (`phase`) and garbage in reference
        cycles now, back to the collector, which frees it; what lives on is frozen again."""
        if cls._froze:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            cls._froze = False

    def __enter__(self) -> "EstimateMeter":
        EstimateMeter.thaw()  # estimate.InProcess has done it already, before its timeout started
        self.fake_mode = _counting_fake_mode(self.tracker)
        self.fake_mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fake_mode.__exit__(*exc)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current_phase = name
        gc.collect()
        # What survives a phase's collection is mostly the pipeline, alive until the estimate ends:
        # frozen, the next phases' collections skip it (the FLUX.1-dev estimate's collections 0.49
        # -> 0.14 s, benchmarks/estimate_collections.py). The next estimate unfreezes it (`thaw`).
        gc.freeze()
        EstimateMeter._froze = True
        tracker = self.tracker
        tracker.peak_bytes, tracker.peak_allocated_bytes = tracker.live_bytes, tracker.allocated_bytes
        start = time.perf_counter()
        try:
            yield
        finally:
            allocated, reserved = self.overhead.device_peaks(tracker.peak_allocated_bytes)
            self._record(name, allocated, reserved, time.perf_counter() - start, peak_live=tracker.peak_bytes)

    @contextmanager
    def concrete(self) -> Iterator[None]:
        """Factories make real tensors (the fake mode steps aside); ops on fake tensors stay fake.
        For code that reads values, such as bitsandbytes building its code books with .tolist().
        The tracker, entered as a dispatch mode meanwhile, counts the real tensors too."""
        with fake_tensor.unset_fake_temporarily(), self.tracker:
            yield

    def repeated(self, key: Any, make, remake) -> Any:
        """The first call of a `key` runs `make()` and records how far it rose over the live bytes;
        a repeat raises the peaks by as much and runs `remake()`, which makes the same outputs
        without the ops (fresh fake tensors of the same layouts). For work whose allocations depend
        on shapes only, such as quantizing 500 layers of a few shapes: the counts are what running
        it would give, at a fraction of the time."""
        tracker = self.tracker
        key = (key, tracker.paused > 0)
        rise = self._repeated.get(key)
        if rise is not None:
            tracker.reach(rise)
            return remake()
        window = tracker.window()
        out = make()
        self._repeated[key] = window.close()
        return out

    def replay_repeated_blocks(self, *parts: torch.nn.Module) -> RepeatedBlocks:
        """Identical blocks replayed: under no_grad (RepeatedBlocks) and, in training, checkpointed
        ones (CheckpointedBlocks; FITFINDER_REPLAY_CHECKPOINTED=0 runs them all, for tests and
        benchmarks that hold the two to the byte)."""
        blocks = RepeatedBlocks(self.tracker)
        blocks.install(*parts)
        self._replays.append(blocks)
        if os.environ.get("FITFINDER_REPLAY_CHECKPOINTED", "1") != "0":
            checkpointed = CheckpointedBlocks(self.tracker)
            checkpointed.install(*parts)
            self._replays.append(checkpointed)
        return blocks

    def replay_repeated_updates(self, optimizer=None, ema=None) -> RepeatedUpdates:
        updates = RepeatedUpdates(self.tracker)
        updates.install(optimizer, ema)
        self._replays.append(updates)
        return updates

    def replayed(self) -> dict[str, int]:
        """How many blocks and updates were replayed rather than run, by kind of replay."""
        counts: dict[str, int] = {}
        for replay in self._replays:
            name = type(replay).__name__
            counts[name] = counts.get(name, 0) + replay.replayed
        return counts

    def describe(self) -> str:
        return f"estimate meter (fake tensors), {self.overhead.describe()}"


class RepeatedBlocks:
    """Identical blocks run once under no_grad; their repeats replay what the first one did.

    A transformer is a stack of blocks with the same shapes (FLUX.1-dev: 19 double and 38 single
    blocks; T5-XXL: 24 layers), and on fake tensors each op costs the same whatever its values,
    so an inference pass (a preview, text encoding) repeats the same ops, allocations and frees
    once per block. The first block of each kind (same class, same parameter shapes and dtypes,
    same argument shapes) runs and is measured: its peak over the live bytes it started from, and
    its outputs. The next identical block makes that peak again over what is live then, and
    returns new fake outputs of the same shapes -- the tracker's counts are what running it would
    give, without its ops. A block is only replayed when that is exact: its outputs are fresh
    storages of its own making (or views of them, made again as such views: `_Layouts`), or
    inputs handed on, and it left nothing else alive. With gradients on (training, where the
    graph must exist), while tensors are made in host memory, or with module hooks, blocks run.
    """

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.traces: dict[tuple, Any] = {}  # key -> (peak rises, output structure, output layouts) or None
        self.replayed = 0

    def install(self, *parts: torch.nn.Module) -> None:
        for part in parts:
            for stack in part.modules():
                if isinstance(stack, torch.nn.ModuleList):
                    for block in stack:
                        self._wrap(block)

    def _wrap(self, block: torch.nn.Module) -> None:
        if any(getattr(module, "offloaded", False) for module in submodules(block)):
            return  # its offloaded layers' copies outlive it in the staging rings (models/_offload.py)
        forward = block.forward

        def replayed(*args, **kwargs):
            key = None if torch.is_grad_enabled() or self.tracker.paused else self._key(block, args, kwargs)
            if key is None or block._forward_hooks or block._forward_pre_hooks:
                return forward(*args, **kwargs)
            if key not in self.traces:
                out, self.traces[key] = self._record(forward, args, kwargs)
                return out
            trace = self.traces[key]
            return forward(*args, **kwargs) if trace is None else self._replay(trace, args, kwargs)

        block.forward = replayed

    def _key(self, block, args, kwargs) -> tuple | None:
        live = self.tracker.live
        modules = submodules(block)
        params = tuple((tuple(t.shape), t.dtype, t.untyped_storage()._cdata in live)
                       for held in [*members(modules), *members(modules, "_buffers")] for t in inner_tensors(held))
        signature = _signature((args, tuple(sorted(kwargs.items()))))
        return None if signature is None else (type(block), params, signature)

    def _record(self, forward, args, kwargs):
        tracker = self.tracker
        before = set(tracker.live)
        window = tracker.window()
        out = forward(*args, **kwargs)
        rise = window.close()
        inputs = list(tensors_returned((args, kwargs)))
        made: list[torch.Tensor] = []

        def describe(tensor: torch.Tensor):
            for index, given in enumerate(inputs):
                if tensor is given:  # passed through (T5 hands its position bias on)
                    return _Given(index)
            made.append(tensor)
            return _Made(tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)

        structure = tree_map_only(torch.Tensor, describe, out)
        # The outputs it made, as storages and views of them: FLUX's single block returns its text
        # and image streams as two slices of one storage (diffusers' FluxSingleTransformerBlock),
        # which a replay makes again the same way, so its 38 blocks replay in a preview too.
        layouts = _Layouts.of(made)
        own = (layouts is not None and not before.intersection(layouts.keys)
               and tracker.live_bytes - window.live == sum(layouts.sizes))
        return out, ((rise, structure, layouts) if own else None)

    def _replay(self, trace, args, kwargs):
        rise, structure, layouts = trace
        self.replayed += 1
        self.tracker.reach(rise)
        inputs = list(tensors_returned((args, kwargs)))
        made = iter(layouts.make())
        return tree_map_only((_Made, _Given), lambda d: next(made) if isinstance(d, _Made) else d.make(inputs),
                             structure)


class CheckpointedBlocks:
    """Identical gradient-checkpointed blocks of a training step: a few run, the rest replay.

    AI Toolkit turns checkpointing on with the denoiser's own `enable_gradient_checkpointing()`
    (jobs/process/BaseSDTrainProcess.py, run), as the recipe does (models/_pipeline.py). Under
    diffusers' checkpointing every module with a `gradient_checkpointing` flag calls
    `_gradient_checkpointing_func(block, *args)`, torch.utils.checkpoint with `use_reentrant=False`
    (ModelMixin.enable_gradient_checkpointing, diffusers 0.42), so a block's forward keeps nothing of its own
    but its outputs: autograd's saved tensors become placeholders, and the checkpoint frame keeps
    the block's inputs for the recomputation. Its backward recomputes the forward, keeps what the
    backward needs, and leaves the gradients of its inputs and of its LoRA parameters. On fake
    tensors each op costs the same whatever the values, so a stack of identical blocks pays for
    the same allocations once per block, twice over (forward, then recompute and backward): half
    of a FLUX.1-dev estimate.

    For each ModuleList of blocks (FLUX.1-dev: 19 double and 38 single blocks), the first block of
    each kind runs and its forward is measured (its peak over the live bytes at its start, and its
    outputs; FLUX's first double block takes inputs that need no gradient, so its second is);
    the one before the last runs, and its backward is measured, from the first of its nodes to
    the last (`_BackwardMark`: identities around it): its peak over the
    live bytes at the start, the gradients of its inputs, and which LoRA parameters it gave a new
    `.grad`. The last block always runs: its outputs feed other layers (or none: FLUX's last
    single block's text stream), so its backward starts differently. Every block in between, of
    the same kind (`_key`: class, parameter layouts and gradients, argument layouts), replays
    both through `_Replayed`: its forward makes the recorded peak over what is live then, and
    new outputs of the recorded layouts, and holds the inputs as the checkpoint frame does; its
    backward, which autograd runs after the measured block's (a stack goes back from its last
    block, so the one before the last is the first of its kind to go back), makes the measured
    peak over what is live then, new input gradients of the recorded layouts, and its own LoRA
    parameters' gradients.

    Exact where used, and used only there: checkpointing on, gradients on, nothing made in host
    memory, no module hooks, no offloaded layer (its copies outlive it in the staging rings), no
    list or dict argument, no trainable parameter but LoRA's (peft's `lora_` names), every output
    a storage of its own that needs a gradient, nothing else left alive by the forward, and every
    input that needs a gradient an output of the block before it in the same list (so its
    gradient is the block's alone, delivered as the measured block delivered it). The measured
    backward must have left only its input gradients and new LoRA gradients, freed only the
    gradients it was given and the inputs the frame held, and received gradients of the layouts
    a replay receives; a replay checks that, and refuses loudly (never guesses) when not.
    """

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.forwards: dict[tuple, Any] = {}  # key -> (peak rises, output structure, output layouts) or None
        self.backwards: dict[tuple, Any] = {}  # key -> _BackwardTrace or None
        self.places: dict[int, tuple[int, int, int]] = {}  # id(block) -> (id of its list, index, length)
        self.last_outputs: dict[int, tuple[int, list]] = {}  # id(list) -> (index, weak refs to its outputs)
        self.pending: dict[tuple, int] = {}  # key -> replays whose backward waits for a measurement
        self.replayed = 0

    def install(self, *parts: torch.nn.Module) -> None:
        for part in parts:
            for stack in part.modules():
                if isinstance(stack, torch.nn.ModuleList):
                    for index, block in enumerate(stack):
                        self.places[id(block)] = (id(stack), index, len(stack))
            for module in part.modules():
                checkpoint = getattr(module, "_gradient_checkpointing_func", None)
                if checkpoint is not None and getattr(module, "gradient_checkpointing", False):
                    module._gradient_checkpointing_func = self._wrap(checkpoint)

    def _wrap(self, checkpoint):
        def checkpointed(block, *args, **kwargs):
            place = self.places.get(id(block))
            key = self._key(block, args) if place is not None and not kwargs else None
            chained = key is not None and self._chained(place, args)
            if not chained:
                return self._remember(place, checkpoint(block, *args, **kwargs))
            _, index, length = place
            needing = any(t.requires_grad for t in tensors_returned(args))
            if index == length - 2 and self.pending.get(key) and key not in self.backwards and needing:
                out = self._measure_backward(checkpoint, block, args, key)
            elif index < length - 2 and key not in self.forwards:
                out = self._measure_forward(checkpoint, block, args, key)
            elif (index < length - 2 and self.forwards[key] is not None
                  and self.backwards.get(key, True) is not None and needing):  # not known to be inexact
                out = self._replay_forward(block, args, key)
            else:
                out = checkpoint(block, *args)
            return self._remember(place, out)

        return checkpointed

    def _remember(self, place, out):
        if place is not None:  # weakly: holding a block's outputs would keep their memory
            self.last_outputs[place[0]] = (place[1], [weakref.ref(t) for t in tensors_returned(out)])
        return out

    def _chained(self, place, args) -> bool:
        """Every input that needs a gradient is an output of the block before it in the same list."""
        stack, index, _ = place
        previous, outputs = self.last_outputs.get(stack, (None, []))
        needing = [t for t in tensors_returned(args) if t.requires_grad]
        return index == 0 or (previous == index - 1 and all(any(ref() is t for ref in outputs) for t in needing))

    def _key(self, block, args) -> tuple | None:
        tracker = self.tracker
        if not torch.is_grad_enabled() or tracker.paused:
            return None
        params, trained = [], []
        for name, param in block.named_parameters():
            if param.requires_grad:
                if "lora_" not in name:
                    return None  # a full fine-tune's weight: its gradient is not measured here
                trained.append(param)
            params.append(tuple((tuple(t.shape), t.dtype, t.untyped_storage()._cdata in tracker.live)
                                for t in inner_tensors(param)))
        modules = submodules(block)
        if any(getattr(module, "offloaded", False) or _hooked(module) for module in modules):
            return None
        grads = tuple(None if p.grad is None else _layout_of(p.grad) for p in trained)
        buffers = tuple((tuple(t.shape), t.dtype) for t in members(modules, "_buffers"))
        signature = _signature(args)
        return None if signature is None else (type(block), tuple(params), buffers, grads, signature)

    def _measure_forward(self, checkpoint, block, args, key):
        """Run the checkpointed block and record its forward, if a replay of it can be exact."""
        tracker = self.tracker
        births = tracker.births
        window = tracker.window()
        out = checkpoint(block, *args)
        rise = window.close()
        made = list(tensors_returned(out))
        layouts = _Layouts.of(made)
        # Exact only when the forward left nothing alive but its outputs, on storages of their own
        # (FLUX's single block returns two slices of one), each needing a gradient; the checkpoint
        # frame holds the inputs, alive before it too.
        own = (layouts is not None and tracker.made_since(births).issuperset(layouts.keys)
               and tracker.live_bytes - window.live == sum(layouts.sizes)
               and all(t.requires_grad and t.dtype.is_floating_point for t in made))
        structure = tree_map_only(torch.Tensor, lambda t: _Made(tuple(t.shape), t.stride(), t.dtype, t.device), out)
        self.forwards[key] = (rise, structure, layouts) if own else None
        return out

    def _replay_forward(self, block, args, key):
        """The block's forward without its ops: see `_Replayed`."""
        structure = self.forwards[key][1]
        inputs = list(tensors_returned(args))
        trained = _trained(block)
        made = iter(_Replayed.apply(self, key, len(inputs), trained, *inputs, *trained))
        self.pending[key] = self.pending.get(key, 0) + 1
        self.replayed += 1
        return tree_map_only(_Made, lambda _: next(made), structure)

    def _measure_backward(self, checkpoint, block, args, key):
        """Run the checkpointed block between two markers that measure its backward (`_BackwardTrace`)."""
        trace = _BackwardTrace(self, key, _trained(block))
        inputs = list(tensors_returned(args))
        needing = [index for index, tensor in enumerate(inputs) if tensor.requires_grad]
        trace.inputs = [(index, inputs[index].untyped_storage()._cdata) for index in needing]
        trace.input_count = len(inputs)
        trace.input_keys = {tensor.untyped_storage()._cdata for tensor in inputs}
        ended = dict(zip((id(inputs[index]) for index in needing),
                         _BackwardMark.apply(trace.ended, *(inputs[index] for index in needing))))
        out = checkpoint(block, *tree_map_only(torch.Tensor, lambda t: ended.get(id(t), t), args))
        outputs = [t for t in tensors_returned(out) if t.requires_grad]
        started = dict(zip((id(t) for t in outputs), _BackwardMark.apply(trace.started, *outputs)))
        return tree_map_only(torch.Tensor, lambda t: started.get(id(t), t), out)


class _BackwardTrace:
    """The backward of one checkpointed block, from its first node to its last, as a replay makes it
    again: the peak over the live bytes at its start, the layouts of the gradients it received and
    of those it returned, the LoRA parameters it gave a new gradient. `_exact()` keeps it in the
    blocks' `backwards` only when what it left and freed is what a replay leaves and frees."""

    def __init__(self, blocks: CheckpointedBlocks, key: tuple, trained: list):
        self.blocks, self.key, self.trained = blocks, key, trained
        self.inputs: list[tuple[int, int]] = []  # (flat index, storage) of each input that needs a gradient
        self.input_count = 0
        self.input_keys: set[int] = set()

    def started(self, grads) -> None:
        tracker = self.blocks.tracker
        self.incoming = _Layouts.of(grads)
        self.incoming_keys = {g.untyped_storage()._cdata for g in grads if g is not None}
        self.before = dict(tracker.live)
        self.births = tracker.births
        self.grads_before = [None if p.grad is None else p.grad.untyped_storage()._cdata for p in self.trained]
        self.window = tracker.window()

    def ended(self, grads) -> None:
        self.rise = self.window.close()
        self.blocks.backwards[self.key] = self if self._exact(grads) else None

    def _exact(self, grads) -> bool:
        """What the block left: its input gradients (storages of their own, or a gradient it was given
        handed on) and new LoRA gradients; what it freed: gradients it was given and inputs only the
        checkpoint frame held. A replay frees those two the same way (autograd drops the gradients
        it passed to the replay, and the replay's saved inputs, as soon as it returns)."""
        tracker = self.blocks.tracker
        live = tracker.live
        self.grads = _Layouts.of(grads)
        if self.incoming is None or self.grads is None or any(g is None for g in grads):
            return False
        made = tracker.made_since(self.births)  # by birth: a new storage may have a freed one's address
        freed = {key for key in self.before if key not in live or key in made}
        grad_keys = set(self.grads.keys)
        handed_on = (grad_keys - made) & self.incoming_keys
        new_params, self.new_grads = set(), []
        for param, before in zip(self.trained, self.grads_before):
            after = None if param.grad is None else param.grad.untyped_storage()._cdata
            if before is not None and (after != before or after in made):
                return False  # a gradient replaced rather than added to in place
            made_here = before is None and after is not None  # (a layer the block does not use gets none)
            if made_here and (after not in made or not _owns_storage(param.grad)):
                return False
            self.new_grads.append(_layout_of(param.grad) if made_here else None)
            if made_here:
                new_params.add(after)
        self.grad_indices = [index for index, _ in self.inputs]
        return ({key for key in made if live[key]} == (grad_keys - handed_on) | new_params
                and {key for key in freed if self.before[key]} <= self.incoming_keys | self.input_keys
                and self.incoming_keys - handed_on <= freed)


class _BackwardMark(torch.autograd.Function):
    """Identity on tensors whose backward calls `reached(grads)` as it passes: around a measured
    block's outputs, just before its first node (`_BackwardTrace.started`); around its inputs, just
    after its last (`_BackwardTrace.ended`)."""

    @staticmethod
    def forward(ctx, reached, *tensors):
        ctx.reached = reached
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as without it
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.reached(grads)
        return (None, *grads)


class _Replayed(torch.autograd.Function):
    """A checkpointed block replayed: the allocations of its forward and of its backward, no ops.

    Forward: the measured peak over what is live now, then outputs of the measured layouts; the
    inputs are saved, as the checkpoint frame saves them (`_NoopSaveInputs`), until the backward.
    Backward: the measured peak over what is live now, then gradients of the measured layouts for
    the inputs and for the LoRA parameters the measured block gave one. Those are made after the
    peak is raised, without raising it further: in the block they were made while it ran, inside
    the measured peak, and the gradients it was given and the inputs it saved, still alive here,
    are dropped by autograd the moment this returns, before anything else is allocated.
    """

    @staticmethod
    def forward(ctx, blocks, key, input_count, trained, *tensors):
        rise, _, layouts = blocks.forwards[key]
        blocks.tracker.reach(rise)
        ctx.blocks, ctx.key, ctx.input_count, ctx.trained = blocks, key, input_count, trained
        ctx.save_for_backward(*tensors[:input_count])
        ctx.set_materialize_grads(False)
        return tuple(layouts.make())

    @staticmethod
    def backward(ctx, *grads):
        trace = ctx.blocks.backwards.get(ctx.key)
        if trace is None or _Layouts.of(grads) != trace.incoming:
            raise RuntimeError("fitfinder: a replayed checkpointed block has no exact measurement of its "
                               "backward (set FITFINDER_REPLAY_CHECKPOINTED=0 and report it)")
        tracker = ctx.blocks.tracker
        tracker.reach(trace.rise)
        peaks = tracker.peak_bytes, tracker.peak_allocated_bytes
        made = dict(zip(trace.grad_indices, trace.grads.make()))
        input_grads = [made.get(index) for index in range(ctx.input_count)]
        for param, layout in zip(ctx.trained, trace.new_grads):
            if layout is not None:
                param.grad = _empty_like_layout(layout)
        tracker.peak_bytes, tracker.peak_allocated_bytes = peaks
        return (None, None, None, None, *input_grads, *(None for _ in ctx.trained))


@dataclass(frozen=True)
class _Layouts:
    """Tensors as storages and views of them: what `make()` builds again, fresh, without their values.

    `views`: per tensor (None for a missing gradient), its storage's index, shape, stride, offset,
    dtype and device; `sizes`: each storage's bytes. Comparable, so a replay can check that it
    receives what the measured block received. `keys` (the measured storages) do not compare.
    """

    views: tuple
    sizes: tuple
    keys: tuple = field(compare=False, default=())

    @classmethod
    def of(cls, tensors) -> "_Layouts | None":
        """None when some tensor is not plain, or does not fit its storage's size in its own dtype."""
        keys: list[int] = []
        views, sizes = [], []
        for tensor in tensors:
            if tensor is None:
                views.append(None)
                continue
            if is_traceable_wrapper_subclass(tensor):
                return None
            storage = tensor.untyped_storage()
            if storage._cdata not in keys:
                if storage.nbytes() % tensor.element_size():
                    return None
                keys.append(storage._cdata)
                sizes.append(storage.nbytes())
            views.append((keys.index(storage._cdata), tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
                          tensor.dtype, tensor.device))
        for index, size in enumerate(sizes):  # one dtype per storage: it is made as one tensor of it
            if len({view[4] for view in views if view is not None and view[0] == index}) != 1:
                return None
        return cls(tuple(views), tuple(sizes), tuple(keys))

    def make(self) -> list:
        storages: dict[int, torch.Tensor] = {}
        made = []
        for view in self.views:
            if view is None:
                made.append(None)
                continue
            index, shape, stride, offset, dtype, device = view
            if index not in storages:
                storages[index] = torch.empty(self.sizes[index] // dtype.itemsize, dtype=dtype, device=device)
            made.append(storages[index].as_strided(shape, stride, offset))
        return made


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def _layout_of(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _empty_like_layout(layout: tuple) -> torch.Tensor:
    shape, stride, dtype, device = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _owns_storage(tensor: torch.Tensor) -> bool:
    """A plain tensor whose storage is its own, just large enough: what `_empty_like_layout` makes."""
    return (not is_traceable_wrapper_subclass(tensor) and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == _strided_nbytes(tensor))


class RepeatedUpdates:
    """Per-parameter updates that change tensors in place run once per layout; repeats replay them.

    An optimizer step over a LoRA (FLUX.1-dev: 988 tensors of a few dozen shapes) runs the same
    ops once per tensor, and so does the EMA after it; on fake tensors those ops cost ~40-100 us each
    whatever the values, and a training step's optimizer and EMA were a fifth of its estimate.
    The first update of each key (the parameter's and its gradient's layouts, its state's, the
    settings) runs and is measured: its peak over the live bytes it started from. A repeat makes
    that peak again over what is live then, and runs `skipped` for what it changes in Python (a
    step counter). Only updates that leave the live storages exactly as they found them are
    replayed -- the same storages of the same sizes (bitsandbytes' update_step writes its 8-bit
    moments in place); one that makes or replaces a tensor (a state's first step, Adafactor's
    RMS) always runs.

    Hooked per instance: bitsandbytes' `update_step(group, p, gindex, pindex)`, which its
    `Optimizer8bit.step` calls for each parameter with a gradient, and `optimizers.Ema`'s
    `update_one(shadow, param)`.
    """

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.traces: dict[tuple, Any] = {}  # key -> peak rises (an update), (peak rises, layout) (a copy), or None
        self.replayed = 0

    def install(self, optimizer=None, ema=None) -> None:
        if hasattr(optimizer, "update_step") and hasattr(optimizer, "get_config"):  # bitsandbytes
            self._wrap_bitsandbytes(optimizer)
        if ema is not None:
            self._wrap_ema(ema)

    def _wrap_ema(self, ema) -> None:
        update_one, copy_of, write = ema.update_one, ema.copy_of, ema.write

        def updated(shadow, param):
            key = ("ema update", ema.decay, self._layout(shadow), self._layout(param))
            self.run(key, lambda: update_one(shadow, param), lambda: None)

        def written(target, source):
            key = ("ema write", self._layout(target), self._layout(source))
            self.run(key, lambda: write(target, source), lambda: None)

        ema.update_one, ema.write = updated, written
        ema.copy_of = lambda param: self.made(("ema copy", self._layout(param)), lambda: copy_of(param))

    def _wrap_bitsandbytes(self, optimizer) -> None:
        update_step = optimizer.update_step

        def stepped(group, p, gindex, pindex):
            state = optimizer.state[p]
            config = optimizer.get_config(gindex, pindex, group)
            key = ("bitsandbytes", type(optimizer), repr(sorted(config.items())), self._layout(p),
                   self._layout(p.grad), tuple((name, self._layout(value)) for name, value in state.items()
                                              if isinstance(value, torch.Tensor)))

            def counted():  # what update_step does besides the ops: `state["step"] += 1`
                state["step"] += 1

            self.run(key, lambda: update_step(group, p, gindex, pindex), counted)

        optimizer.update_step = stepped

    def _layout(self, tensor: torch.Tensor | None) -> tuple | None:
        if tensor is None:
            return None
        if is_traceable_wrapper_subclass(tensor):
            return (type(tensor), tuple(self._layout(inner) for inner in inner_tensors(tensor)))
        storage = tensor.untyped_storage()
        return (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device,
                storage.nbytes(), storage._cdata in self.tracker.live, tensor.requires_grad)

    def run(self, key: tuple, update, skipped) -> None:
        tracker = self.tracker
        key = (key, tracker.paused > 0)
        if key in self.traces:
            trace = self.traces[key]
            if trace is None:
                update()
                return
            self.replayed += 1
            tracker.reach(trace)
            skipped()
            return
        before = dict(tracker.live)
        window = tracker.window()
        update()
        rise = window.close()
        in_place = tracker.live == before and tracker.allocated_bytes == window.allocated
        self.traces[key] = rise if in_place else None

    def made(self, key: tuple, make) -> torch.Tensor:
        """`make()`, which returns one new tensor (a copy); a repeat of `key` makes a fresh fake tensor
        of the same layout instead, with the same peak. Replayed only when the first call's tensor
        was a storage of its own, just large enough, and nothing else stayed alive or went."""
        tracker = self.tracker
        key = (key, tracker.paused > 0)
        trace = self.traces.get(key, ())
        if trace is None:
            return make()
        if trace:
            self.replayed += 1
            rise, layout = trace
            tracker.reach(rise)
            return _empty_like_layout(layout)
        before = dict(tracker.live)
        window = tracker.window()
        out = make()
        rise = window.close()
        storage = out.untyped_storage()
        own = (_owns_storage(out) and storage._cdata not in before
               and tracker.live == {**before, storage._cdata: storage.nbytes()})
        self.traces[key] = (rise, _layout_of(out)) if own else None
        return out


@dataclass(frozen=True)
class _Made:
    """An output a block made: replayed as a new fake tensor of the same layout."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    def make(self, inputs: list) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class _Given:
    """An output that is one of the block's inputs, handed on."""

    index: int

    def make(self, inputs: list) -> torch.Tensor:
        return inputs[self.index]


def _signature(value: Any) -> Any:
    """A hashable description of a block's arguments (tensors by shape, stride and dtype), or None
    when an argument is something else than tensors, numbers, strings and tuples of them. Lists
    and dicts are refused: a block may fill them in (Wan's VAE keeps its causal cache in a list),
    which a replay would not do."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value) is tuple:
        items = tuple(_signature(v) for v in value)
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def _strided_nbytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


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

    def concrete(self):
        return nullcontext()

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


def make(kind: str, budget_bytes: int | None, gpu: int = 0, overhead: dict | None = None):
    """The meter a probe request names (`overhead`: the estimate's GPU overhead model)."""
    if kind == "estimate":
        return EstimateMeter(budget_bytes, overhead)
    if kind == "cuda":
        # Under the user's PYTORCH_CUDA_ALLOC_CONF, if any: AI Toolkit sets none (its run.py and
        # toolkit/ at commit 27a03a91 never write it), so neither does the probe.
        return CudaMeter(budget_bytes, gpu)
    if kind == "sim":
        return SimMeter(budget_bytes)
    raise ValueError(f"unknown meter {kind!r}; known: sim, cuda, estimate")

