"""The estimate meter: the sim meter's bookkeeping on fake tensors, turned into what a card would show.

It enters the counting fake mode (`_fake_mode`), installs the replays (`_replay`) and turns each
phase's allocator peak into the card's with the GPU overhead model (`probe/overhead.py`). The
`fitfinder estimate` command, which runs the probe's recipe on this meter, is `probe/estimate.py`.
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch._subclasses import fake_tensor  # imported by torch itself

from fitfinder.probe.meters import _host
from fitfinder.probe.meters._clock import PhaseClock
from fitfinder.probe.meters._fake_mode import counting_fake_mode
from fitfinder.probe.meters._replay import CheckpointedBlocks, RepeatedBlocks, RepeatedUpdates
from fitfinder.probe.meters._tracker import AllocatorTracker
from fitfinder.probe.meters.sim import SimMeter
from fitfinder.probe.overhead import GpuOverhead


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

    def __init__(self, budget_bytes: int | None, overhead=None, ram_bytes: int | None = None):
        PhaseClock.__init__(self)
        self.budget_bytes = budget_bytes
        self.ram_bytes = ram_bytes  # judged afterwards, as the device's budget is
        # The trainer's process before its first model: this one's, as it was at the first estimate
        # (Python, torch and the libraries; `_host.process_bytes`). A CUDA build's libraries add more.
        self.host_outside_bytes = _host.process_bytes()
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
        self.fake_mode = counting_fake_mode(self.tracker)
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
        tracker.start_phase()
        start = time.perf_counter()
        try:
            yield
        finally:
            allocated, reserved = self.overhead.device_peaks(tracker.peak_allocated_bytes)
            self._record(name, allocated, reserved, time.perf_counter() - start, peak_live=tracker.peak_bytes,
                         owners=self._owners(tracker, allocated, reserved), host=self._host_peaks(tracker, False))

    def _owners(self, tracker, allocated: int, reserved: int) -> dict[str, int]:
        """The device's peak by owner, the GPU's own overhead included, summing to the reserved peak."""
        owners = dict(tracker.peak_owners)
        overhead = self.overhead
        owners["allocator rounding"] = tracker.peak_allocated_bytes - sum(owners.values())
        owners["cuBLAS workspace"] = overhead.workspace_bytes
        owners["fragmentation"] = reserved - allocated
        owners["CUDA context"] = overhead.context_bytes
        return owners

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
