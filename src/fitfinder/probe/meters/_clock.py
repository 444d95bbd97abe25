"""What every meter keeps alike: each phase's peaks and seconds, the step clock, and the replays
only the estimate meter makes (no-ops here)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch

from fitfinder.probe.meters import _host


class PhaseClock:
    """Shared bookkeeping: phase name -> peak allocated, peak reserved, seconds."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self.current_phase: str | None = None

    host_outside_bytes = 0  # what the process holds in host memory outside the counted tensors

    def _record(self, name: str, allocated: int, reserved: int, seconds: float, owners: dict | None = None,
                host: dict | None = None, **more: int) -> None:
        """A phase's peaks (a phase met twice keeps the higher), with the split by owner at the
        device's peak (`owners`) and the host's peaks (`host`: `peak_host` and its parts,
        `host_owners` at its peak)."""
        entry = self.phases.setdefault(name, {"peak_allocated": 0, "peak_reserved": 0, "seconds": 0.0})
        if owners is not None and reserved >= entry["peak_reserved"]:
            entry["owners"] = _largest_first(owners)
        entry["peak_allocated"] = max(entry["peak_allocated"], int(allocated))
        entry["peak_reserved"] = max(entry["peak_reserved"], int(reserved))
        entry["seconds"] = round(entry["seconds"] + seconds, 4)
        host = dict(host or {})
        host_owners = host.pop("host_owners", None)
        if host_owners is not None and host.get("peak_host", 0) >= entry.get("peak_host", 0):
            entry["host_owners"] = _largest_first(host_owners)
        for key, value in {**more, **host}.items():
            if value is not None:
                entry[key] = max(entry.get(key, 0), int(value))

    def _host_peaks(self, tracker, measured: bool) -> dict:
        """The phase's host peaks: the counted host tensors (at their peak: pinned among them, by
        owner) plus what the process holds outside them (`peak_host`), and where Linux measures it,
        the process's resident peak (`host_rss`)."""
        side = tracker.host
        return {"peak_host": self.host_outside_bytes + side.peak_bytes, "host_tensors": side.peak_bytes,
                "host_pinned": side.peak_pinned, "host_owners": side.peak_owners,
                "both_tensors": tracker.peak_both_bytes,
                "host_rss": _host.peak_bytes() if measured else None}

    @property
    def peak_bytes(self) -> int:
        return max((p["peak_reserved"] for p in self.phases.values()), default=0)

    def ran_out(self) -> BaseException | str | None:
        """The out-of-memory error this meter saw in the probe, raised or counted, or None (the
        estimate meter never raises)."""
        return None

    def step_clock(self) -> float:
        """Seconds for timing one training step (the meters on the CPU count their own thread's time)."""
        return time.perf_counter()

    def owning(self, owner: str):
        """Only the meters that count tensors tag them with owners (SimMeter.owning)."""
        return nullcontext()

    def claim(self, owner: str, *objects: Any) -> None:
        """Only the meters that count tensors tag them with owners (SimMeter.claim)."""

    def replay_repeated_blocks(self, *parts: torch.nn.Module) -> None:
        """Only the estimate meter replays identical blocks (RepeatedBlocks); real tensors run."""

    def repeated(self, key: Any, make, remake) -> Any:
        """`make()`; only the estimate meter replays a repeat of the same `key` (see EstimateMeter)."""
        return make()

    def replay_repeated_updates(self, optimizer=None, ema=None) -> None:
        """Only the estimate meter replays per-parameter updates of the same layout (RepeatedUpdates)."""


def _largest_first(owners: dict[str, int]) -> dict[str, int]:
    """The owners that hold anything, largest first (a dict keeps its order in the JSON)."""
    return {owner: int(size) for owner, size in sorted(owners.items(), key=lambda item: -item[1]) if size > 0}
