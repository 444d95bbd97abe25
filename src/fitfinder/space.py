"""The search space: knobs, their candidate values, the desired point, dominance, quality.

The user's job file is the *desired point*: what they would train with unlimited memory. Every
knob lists its candidates from the lightest (least memory) to the heaviest. Memory is assumed
monotone in each knob, which gives dominance: a point at least as heavy as one that ran out of
memory runs out too; a point at most as heavy as one that fit fits too. Each knob also names the
probe phases whose memory it changes, so an OOM in one phase says nothing about knobs that phase
does not depend on.

Quality knobs cost training or preview fidelity when lowered and never go past the desired
value; speed knobs cost only time and may go past it (batch instead of accumulation,
checkpointing off, offload off) when memory allows. Quality is lexicographic over the quality
knobs in priority order (training fidelity, then preview fidelity, then flexibility); among
equal quality the faster point (fewer seconds per sample) wins.

Sample steps are not a knob: every denoising step needs the same memory, so fewer steps never
make a job fit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from fitfinder import trainers
from fitfinder.trainers.aitoolkit_job import JobFile
from fitfinder.trainers._knob import PHASES

Point = dict[str, Any]  # knob name -> one of its candidates (a JSON scalar)

__all__ = ["PHASES", "Knob", "Point", "Space", "build"]  # PHASES: the probe's phases, in the order they run
# Default priority of the quality knobs: training fidelity > preview fidelity > flexibility.
QUALITY_ORDER = ("buckets", "frames", "rank", "quantize", "optimizer", "ema",
                 "sampling", "sample_size", "sample_frames", "text_encoder")
# The speed knobs' order. The search climbs the speed knob with the most levels one step at a
# time, then raises the others in this order, each alone before two together. low_vram lightens
# training only where the family's loader makes it (Wan 2.2's one expert at a time); for FLUX.1 it
# lowers the load alone and costs load time, not step time. Layer offloading comes last: it costs
# the most speed (every offloaded layer crosses to the card in each forward and again in each
# backward) and it is the last move of the seeds' rollback, so a job that fits without it never
# depends on it, and the search's tie-break takes the least offloading that fits
# (search.planner.best), since the sim meter's host-to-device copies cost no real time.
SPEED_ORDER = ("gradient_checkpointing", "batch", "low_vram", "layer_offloading")
# How a knob's levels weigh on the host (issue 32): "same" as on the device (more of it, more host memory,
# where it changes the host at all: a larger batch caches more latents there); "reversed" for the levers
# that move memory from the card to the host (low_vram loads and quantizes in host memory, offloaded layers
# wait there pinned), whose lightest level on the card is the heaviest on the host; "unordered" where
# neither way holds for sure (quantization: the full-precision weights read in host memory before they
# shrink, under low_vram or not; cached embeddings on the host against an encoder unloaded there).
HOST_ORDERS = ("same", "reversed", "unordered")
HOST_ORDER = {"low_vram": "reversed", "layer_offloading": "reversed", "quantize": "unordered",
              "text_encoder": "unordered"}


@dataclass(frozen=True)
class Knob:
    name: str
    role: str  # "quality" or "speed"
    candidates: tuple  # lightest first
    desired: Any
    paths: tuple[str, ...]  # the job-file keys it writes
    phases: frozenset  # probe phases whose peak memory it changes
    unordered: frozenset = frozenset()  # phases where more is not always heavier: compare for equality
    # As its trainer declares it (trainers/: KnobSpec): its name in that trainer's words, how its
    # values read, and how it writes itself into the job.
    title: str = ""
    labeler: Callable[[Any], str] | None = field(default=None, compare=False)
    writer: Callable | None = field(default=None, compare=False)
    host: str = ""  # its HOST_ORDERS entry; "" for HOST_ORDER's by its name ("same" when it has none)

    def level(self, value: Any) -> int:
        return self.candidates.index(value)

    @property
    def host_order(self) -> str:
        return self.host or HOST_ORDER.get(self.name, "same")

    def label(self, value: Any) -> str:
        return self.labeler(value) if self.labeler else str(value)

    @property
    def short(self) -> str:
        """The name in trial lines and tables, where width is scarce (a trainer's knob: its own name)."""
        return self.title or self.name


class Space:
    """Knobs in priority order: quality knobs first (most important first), then speed knobs."""

    def __init__(self, knobs: list[Knob], job: JobFile):
        self.knobs = tuple(knobs)
        self.by_name = {knob.name: knob for knob in knobs}
        self.job = job
        self.effective_batch = trainers.effective_batch(job)

    # -- points --------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(knob.name for knob in self.knobs)

    @property
    def quality_knobs(self) -> tuple[Knob, ...]:
        return tuple(k for k in self.knobs if k.role == "quality")

    @property
    def speed_knobs(self) -> tuple[Knob, ...]:
        return tuple(k for k in self.knobs if k.role == "speed")

    def desired(self) -> Point:
        return {k.name: k.desired for k in self.knobs}

    def lightest(self) -> Point:
        return {k.name: k.candidates[0] for k in self.knobs}

    def key(self, point: Point) -> tuple:
        """A hashable identity of a point."""
        return tuple(point[name] for name in self.names)

    def size(self) -> int:
        return math.prod(len(k.candidates) for k in self.knobs)

    def points(self) -> Iterator[Point]:
        for values in itertools.product(*(k.candidates for k in self.knobs)):
            yield dict(zip(self.names, values))

    def contains(self, point: Point) -> bool:
        return set(point) == set(self.names) and all(point[k.name] in k.candidates for k in self.knobs)

    # -- order -----------------------------------------------------------------------------
    def heavier_or_equal(self, a: Point, b: Point, phase: str | None = None) -> bool:
        """True when `a` needs at least as much memory as `b` in `phase` (in every phase if None).

        Only the knobs the phase depends on count; a knob that is not monotone in the phase
        (quantization while loading: the full-precision weights arrive before they shrink) must
        be equal.
        """
        for knob in self.knobs:
            if phase is not None and phase not in knob.phases:
                continue
            unordered = knob.unordered if phase is None else knob.unordered & {phase}
            if unordered and a[knob.name] != b[knob.name]:
                return False
            if knob.level(a[knob.name]) < knob.level(b[knob.name]):
                return False
        return True

    def host_heavier_or_equal(self, a: Point, b: Point, phase: str | None = None) -> bool:
        """True when `a` needs at least as much host memory as `b` in `phase` (in every phase if None).

        Each knob by its host order (Knob.host_order): a "same" knob as on the device, a "reversed"
        one the other way (more offloading, more host), an "unordered" one only when equal. A knob
        counts in the phases it changes on the device: what it moves between the two sides
        changes both in the same phases.
        """
        for knob in self.knobs:
            if phase is not None and phase not in knob.phases:
                continue
            mine, theirs = knob.level(a[knob.name]), knob.level(b[knob.name])
            order = knob.host_order
            unordered = knob.unordered if phase is None else knob.unordered & {phase}
            if order == "unordered" or (order == "same" and unordered):
                if mine != theirs:
                    return False
            elif (mine > theirs) if order == "reversed" else (mine < theirs):
                return False
        return True

    def phases_run(self, point: Point) -> list[str]:
        """The phases a probe of `point` runs: every one, but the previews it does not sample."""
        return trainers.phases_run(self.job, point)

    def quality_key(self, point: Point) -> tuple[int, ...]:
        """Lexicographic quality: compare tuples, larger is better."""
        return tuple(k.level(point[k.name]) for k in self.quality_knobs)

    def quality_rank(self, point: Point) -> int:
        """The quality key as one integer (mixed radix), for the study's objective."""
        rank = 0
        for knob in self.quality_knobs:
            rank = rank * len(knob.candidates) + knob.level(point[knob.name])
        return rank

    # -- the job file ------------------------------------------------------------------------
    def apply(self, job: JobFile, point: Point) -> JobFile:
        """A copy of `job` with every knob of `point` written into it."""
        out = job.copy()
        for knob in self.knobs:
            if point[knob.name] != knob.desired:
                knob.writer(out, point[knob.name], self)
        return out

    def changes(self, point: Point) -> list[tuple[str, Any, Any]]:
        """(key path, old value, new value) for every key `point` changes in the base file."""
        after = self.apply(self.job, point)
        rows = []
        for path in dict.fromkeys(p for k in self.knobs for p in k.paths):
            old, new = _plain(self.job.get(path)), _plain(after.get(path))
            if old != new:
                rows.append((path, old, new))
        return rows

    def describe(self, point: Point) -> str:
        return " ".join(f"{k.short}={k.label(point[k.name])}" for k in self.knobs)


def build(job) -> Space:
    """The space around the job's desired point, with the `fitfinder:` candidate overrides: the knobs
    its trainer declares in its own names (trainers/), in the priority order."""
    return Space(_prioritized([Knob(**vars(spec)) for spec in trainers.knob_specs(job)], job.settings.priorities), job)


def _prioritized(knobs: list[Knob], priorities: list[str]) -> list[Knob]:
    """Quality knobs in the user's priority order (unnamed ones keep theirs), then speed knobs."""
    quality = sorted((k for k in knobs if k.role == "quality"), key=lambda k: QUALITY_ORDER.index(k.name))
    named = [k for name in priorities for k in quality if k.name == name]
    rest = [k for k in quality if k not in named]
    speed = sorted((k for k in knobs if k.role == "speed"), key=lambda k: SPEED_ORDER.index(k.name))
    return named + rest + speed


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
