"""The trackers: live bytes of tensor storages, counted as they are made and die.

Two walls (issue 32): the device's storages (`live`) and the host's (`host`, `HostSide`: made inside
`meter.host()` or moved there; pinned ones marked), each with its peak. Every storage has an owner
(issue 33: a part's weights, the LoRA, its gradients, the optimizer's state, ...; `OWNERS`), the
tag active when it was first seen (`owning`), kept as it moves; each side's peak is kept with its
split by owner.

`StorageTracker` is the sim meter's (a dispatch mode; out of memory past a budget);
`AllocatorTracker` the estimate's (each storage also as the CUDA caching allocator rounds it);
`PeakWindow` measures how far a stretch of work raises a tracker's peaks, which every replay of
the estimate (`_replay`) needs.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from fitfinder.probe.meters._tensors import inner_tensors, tensors_returned
from fitfinder.units import format_bytes

# What holds memory, in the words the outputs use; `weights:<part>` names each part's weights.
# Whatever no code claims while it is made is the work's own: activations saved for the backward
# and the transients of each op.
ACTIVATIONS = "activations"
OWNERS = ("weights:<part>", "lora", "gradients", "optimizer", "ema", "embeddings", "latents", ACTIVATIONS)


class HostSide:
    """The storages in host memory, by key, with their total, peak and split by owner at the peak.
    Pinned (page-locked) storages are counted among them and, apart, as pinned."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.bytes = 0
        self.peak_bytes = 0
        self.pinned: set[int] = set()
        self.pinned_bytes = 0
        self.peak_pinned = 0  # the pinned bytes at the peak
        self.by_owner: dict[str, int] = {}
        self.peak_owners: dict[str, int] = {}

    def add(self, key: int, size: int, owner: str, pinned: bool) -> None:
        old = self.live.get(key, 0)
        self.live[key] = size
        self.bytes += size - old
        self.by_owner[owner] = self.by_owner.get(owner, 0) + size - old
        if pinned and key not in self.pinned:
            self.pinned.add(key)
            self.pinned_bytes += size
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
            self.peak_owners = dict(self.by_owner)
            self.peak_pinned = self.pinned_bytes

    def forget(self, key: int, owner: str | None) -> None:
        size = self.live.pop(key, None)
        if size is None:
            return
        self.bytes -= size
        self.by_owner[owner] = self.by_owner.get(owner, 0) - size
        if key in self.pinned:
            self.pinned.discard(key)
            self.pinned_bytes -= size

    def start(self) -> None:
        """A new phase: its peak starts from what is held now."""
        self.peak_bytes = self.bytes
        self.peak_owners = dict(self.by_owner)
        self.peak_pinned = self.pinned_bytes


class StorageTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created while active, or registered; exact and repeatable.

    A storage is counted once (views share it) and forgotten by a weakref finalizer when it dies.
    With a budget, an allocation that would pass it raises torch.OutOfMemoryError.
    """

    def __init__(self, budget_bytes: int | None = None, host_budget_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.paused = 0  # > 0 while tensors are made in host memory (meter.host())
        # Storages that stay in host memory however ops view them (a kohya trainer's swapped blocks'
        # weights, which its layers use in place): a view an op returns would count them again.
        self.in_host: set[int] = set()
        self.host = HostSide()
        self.host_budget_bytes = host_budget_bytes  # for host tensors: the RAM less what the process holds
        self.owner = ACTIVATIONS  # the tag of storages first seen now (`owning`)
        self.owner_of: dict[int, str] = {}  # storage id -> its owner, on either side
        self.by_owner: dict[str, int] = {}  # the device's live bytes by owner
        self.peak_owners: dict[str, int] = {}  # ... at the device's peak
        # Both sides' tensors at their joint peak: for the sim meter, whose device is this CPU, what
        # the process's resident memory should show above its start (benchmarks/host_peaks.py).
        self.peak_both_bytes = 0
        # The first out-of-memory error raised, on either side: a library may catch it and raise
        # another in its place (safetensors' loader does), and the probe must still read an OOM.
        self.ran_out: BaseException | None = None
        # Called with each out-of-memory error as it is raised, caught later or not (the trainer
        # meter's record of every OOM a trainer survives).
        self.on_out_of_memory: Callable[[BaseException], None] | None = None

    @contextmanager
    def owning(self, owner: str) -> Iterator[None]:
        """Storages first seen inside belong to `owner`."""
        outer, self.owner = self.owner, owner
        try:
            yield
        finally:
            self.owner = outer

    def claim(self, owner: str, tensor: torch.Tensor) -> None:
        """`tensor`'s storage belongs to `owner` from now on (a gradient, once accumulated)."""
        for inner in inner_tensors(tensor):
            key = _storage_key(inner)
            old = self.owner_of.get(key)
            if key is None or old is None or old == owner:
                continue
            self.owner_of[key] = owner
            size = self.live.get(key)
            if size is not None:
                self.by_owner[old] -= size
                self.by_owner[owner] = self.by_owner.get(owner, 0) + size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # A quantized weight (quanto's) computes with its inner tensors: let its own dispatch
            # run and count what that makes (the weight it dequantizes for a backward, which a GPU
            # allocates too), as FakeTensorMode does for the estimate.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        add = self.add_host if self.paused else self.add
        for tensor in tensors_returned(out):
            add(tensor)
        return out

    def _track(self, storage, key: int) -> None:
        """First sight of a storage: its owner, and a finalizer that forgets it on both sides when it dies."""
        if key not in self.owner_of:
            self.owner_of[key] = self.owner
            weakref.finalize(storage, self._died, key)

    def _died(self, key: int) -> None:
        self._forget(key)
        self.host.forget(key, self.owner_of.get(key))
        self.owner_of.pop(key, None)

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
        self._track(storage, key)
        self.host.forget(key, self.owner_of[key])  # on the device now: the host copy is gone
        self.live[key] = size
        self._grown(key, size, old or 0)
        if self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            needed = size - (old or 0)
            self.drop(tensor)  # the allocation "failed": it must not stay counted
            raise self._ran_out(torch.OutOfMemoryError(
                f"CUDA out of memory (simulated). Tried to allocate {format_bytes(needed)}. "
                f"Simulated GPU budget {format_bytes(self.budget_bytes)}, of which "
                f"{format_bytes(self.live_bytes)} is in use by live tensors."))

    def add_host(self, tensor: torch.Tensor, pinned: bool = False) -> None:
        """Count a tensor's storage in host memory (made there, or moved there off the device); past
        the host budget, Python's own out-of-memory error, as the machine's RAM would give."""
        for inner in inner_tensors(tensor):
            try:
                storage = inner.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key, size = storage._cdata, storage.nbytes()
            if key in self.live or (self.host.live.get(key) == size and (not pinned or key in self.host.pinned)):
                continue  # a view of a device tensor, or counted already
            self._track(storage, key)
            self.host.add(key, size, self.owner_of[key], pinned)
            self.peak_both_bytes = max(self.peak_both_bytes, self.live_bytes + self.host.bytes)
            budget = self.host_budget_bytes
            if budget is not None and self.host.bytes > budget:
                self.host.forget(key, self.owner_of[key])
                raise self._ran_out(MemoryError(
                    f"host out of memory (simulated): tried to allocate {format_bytes(size)} in host memory; "
                    f"{format_bytes(self.host.bytes)} of host tensors live, {format_bytes(budget)} left "
                    f"for them in the simulated RAM"))

    def _ran_out(self, error: BaseException) -> BaseException:
        if self.ran_out is None:  # a copy, never raised: a raised error's traceback would pin the tensors of its frames
            self.ran_out = type(error)(*error.args)
        if self.on_out_of_memory is not None:
            self.on_out_of_memory(error)
        return error

    def to_host(self, tensor: torch.Tensor, pinned: bool = False) -> None:
        """A tensor moved off the device into host memory (pinned: page-locked, as offloaded layers are)."""
        self.drop(tensor)
        self.add_host(tensor, pinned)

    def start_phase(self) -> None:
        """A new phase: every peak starts from what is held now."""
        self.peak_bytes = self.live_bytes
        self.peak_owners = dict(self.by_owner)
        self.host.start()
        self.peak_both_bytes = self.live_bytes + self.host.bytes

    def _grown(self, key: int, size: int, old: int) -> None:
        self.live_bytes += size - old
        owner = self.owner_of[key]
        self.by_owner[owner] = self.by_owner.get(owner, 0) + size - old
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._new_peak()
        self.peak_both_bytes = max(self.peak_both_bytes, self.live_bytes + self.host.bytes)

    def _new_peak(self) -> None:
        self.peak_owners = dict(self.by_owner)

    def hold_in_host(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor's storage and never count it again, views of it included, while it
        lives (its key may be a new storage's after it dies)."""
        self.to_host(tensor)
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
        key = _storage_key(tensor)
        if key is not None:
            self._forget(key)

    def _forget(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size is not None:
            self.live_bytes -= size
            owner = self.owner_of.get(key)
            self.by_owner[owner] = self.by_owner.get(owner, 0) - size


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


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

    The estimate's fake mode (`_fake_mode.counting_fake_mode`) hands it each op's outputs; it is entered
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
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
            self.peak_owners = dict(self.by_owner)

    def _new_peak(self) -> None:
        """The owners are kept at the allocator's peak, the one the estimate reports (`_grown`)."""

    def start_phase(self) -> None:
        super().start_phase()
        self.peak_allocated_bytes = self.allocated_bytes

    def peaks(self) -> tuple:
        """The peaks as they stand, to put back after work whose peak is replayed (`restore`)."""
        return self.peak_bytes, self.peak_allocated_bytes, self.peak_owners

    def restore(self, peaks: tuple) -> None:
        self.peak_bytes, self.peak_allocated_bytes, self.peak_owners = peaks

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
        if self.allocated_bytes + rise[1] > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes + rise[1]
            # What the replayed work made is the current owner's (the activations, in a training step).
            self.peak_owners = dict(self.by_owner)
            self.peak_owners[self.owner] = self.peak_owners.get(self.owner, 0) + rise[0]


class PeakWindow:
    """How far a stretch of work raises the tracker's peaks over the live bytes at its start, in both
    counts, measured without losing the peaks reached before it: open, do the work, `close()`.
    Every replay (repeated work, blocks, updates) measures its first run this way."""

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.live, self.allocated = tracker.live_bytes, tracker.allocated_bytes
        self.peaks = tracker.peaks()
        tracker.peak_bytes, tracker.peak_allocated_bytes = self.live, self.allocated

    def close(self) -> tuple[int, int]:
        """(bytes, allocator bytes) the peaks rose over the live counts at the start."""
        tracker = self.tracker
        rise = tracker.peak_bytes - self.live, tracker.peak_allocated_bytes - self.allocated
        tracker.peak_bytes = max(self.peaks[0], tracker.peak_bytes)
        if self.peaks[1] >= tracker.peak_allocated_bytes:  # the peak before the window stands, with its owners
            tracker.peak_allocated_bytes, tracker.peak_owners = self.peaks[1], self.peaks[2]
        return rise
