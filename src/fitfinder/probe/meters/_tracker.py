"""The trackers: live bytes of tensor storages, counted as they are made and die.

`StorageTracker` is the sim meter's (a dispatch mode; out of memory past a budget);
`AllocatorTracker` the estimate's (each storage also as the CUDA caching allocator rounds it);
`PeakWindow` measures how far a stretch of work raises a tracker's peaks, which every replay of
the estimate (`_replay`) needs.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from fitfinder.probe.meters._tensors import inner_tensors, tensors_returned
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
