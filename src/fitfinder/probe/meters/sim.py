"""The sim meter: the CPU as a GPU of a given budget, raising a real out-of-memory error past it.

Every live tensor storage made on the (simulated) device is counted by a `StorageTracker`; the
probe really runs, on one CPU thread, so it fails where and as it would on the card. The host's
tensors are counted beside them, on top of what the process held at the start; past a RAM budget
the tracker raises `MemoryError`, as a machine out of RAM does.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from fitfinder.probe.meters import _host
from fitfinder.probe.meters._clock import PhaseClock
from fitfinder.probe.meters._tensors import tensors_of
from fitfinder.probe.meters._tracker import StorageTracker
from fitfinder.units import format_bytes


class SimMeter(PhaseClock):
    """CPU stand-in for a GPU of `budget_bytes`: live tensor bytes, OOM past the budget."""

    kind = "sim"
    device = torch.device("cpu")

    def __init__(self, budget_bytes: int | None, ram_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.ram_bytes = ram_bytes
        # The process before any model (a probe forked from the forkserver: Python, torch and the
        # libraries), measured; host tensors come on top of it, against the RAM budget.
        self.host_outside_bytes = _host.resident_bytes() or 0
        host_budget = None if ram_bytes is None else max(ram_bytes - self.host_outside_bytes, 0)
        self.tracker = StorageTracker(budget_bytes, host_budget)

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

    def ran_out(self) -> BaseException | None:
        return self.tracker.ran_out

    def step_clock(self) -> float:
        # The probe computes on this one thread: its CPU time is what a step costs, and other
        # work on a shared machine does not inflate it as it does wall time (by 3x beside two
        # CPU-bound processes on two cores, benchmarks/timing_noise.py).
        return time.thread_time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current_phase = name
        gc.collect()  # what the last phase left for the collector must not count in this one
        tracker = self.tracker
        tracker.start_phase()
        measured = _host.reset_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            peak = tracker.peak_bytes
            self._record(name, peak, peak, time.perf_counter() - start, owners=tracker.peak_owners,
                         host=self._host_peaks(tracker, measured))

    def owning(self, owner: str):
        """Storages first made or seen inside belong to `owner` (`_tracker.OWNERS`)."""
        return self.tracker.owning(owner)

    def claim(self, owner: str, *objects: Any) -> None:
        """These tensors belong to `owner` from now on (gradients once accumulated, cached embeddings)."""
        for tensor in tensors_of(*objects):
            self.tracker.claim(owner, tensor)

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
        """These tensors are on neither side any more (freed, or handed to code that frees them)."""
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

    def to_host(self, obj: Any, pinned: bool = False) -> Any:
        """Move a module or tensor off the (simulated) device into host memory (pinned: page-locked)."""
        for tensor in tensors_of(obj):
            self.tracker.to_host(tensor, pinned)
        return obj

    @property
    def live_bytes(self) -> int:
        return self.tracker.live_bytes

    def describe(self) -> str:
        text = f"sim meter, budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "sim meter, no budget"
        if self.ram_bytes is not None:
            text += f", RAM {format_bytes(self.ram_bytes)}"
        return text
