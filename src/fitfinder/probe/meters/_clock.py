"""What every meter keeps alike: each phase's peaks and seconds, the step clock, and the replays
only the estimate meter makes (no-ops here)."""

from __future__ import annotations

import time
from typing import Any

import torch


class PhaseClock:
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
