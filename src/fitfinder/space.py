"""The search space: knobs, their candidate values, the desired point, dominance, quality.

The user's job file is the *desired point*: what they would train with unlimited memory. Every
knob lists its candidates from the lightest (least memory) to the heaviest. Memory is assumed
monotone in each knob, which gives dominance: a point at least as heavy as one that ran out of
memory runs out too; a point at most as heavy as one that fit fits too.

Quality knobs cost training or preview fidelity when lowered and never go past the desired
value; speed knobs cost only time and may go past it (batch instead of accumulation,
checkpointing off) when memory allows. Quality is lexicographic over the quality knobs in
priority order; among equal quality the faster point (fewer seconds per sample) wins.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from fitfinder.errors import ConfigError
from fitfinder.jobconfig import JobFile

Point = dict[str, Any]  # knob name -> one of its candidates (a JSON scalar)

# Phases of a probe, in the order they run (see probe.py).
PHASES = ("load", "text_encoder", "latents", "sample", "train", "last_sample")
_TRAIN_ON = frozenset({"latents", "train"})
_MODEL_ON = frozenset(PHASES)


@dataclass(frozen=True)
class Knob:
    name: str
    role: str  # "quality" or "speed"
    candidates: tuple  # lightest first
    desired: Any
    paths: tuple[str, ...]  # the job-file keys it writes
    phases: frozenset  # probe phases whose memory it changes

    def level(self, value: Any) -> int:
        return self.candidates.index(value)

    def label(self, value: Any) -> str:
        return _LABELS.get(self.name, str)(value)


class Space:
    """Knobs in priority order: quality knobs first (most important first), then speed knobs."""

    def __init__(self, knobs: list[Knob], job: JobFile):
        self.knobs = tuple(knobs)
        self.by_name = {knob.name: knob for knob in knobs}
        self.job = job
        self.effective_batch = int(job.get("train.batch_size")) * job.accumulation

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
        return set(point) == set(self.names) and all(
            point[k.name] in k.candidates for k in self.knobs)

    # -- order -----------------------------------------------------------------------------
    def heavier_or_equal(self, a: Point, b: Point) -> bool:
        """True when `a` needs at least as much memory as `b` on every knob."""
        return all(k.level(a[k.name]) >= k.level(b[k.name]) for k in self.knobs)

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
            _APPLY[knob.name](out, point[knob.name], self)
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
        return " ".join(f"{k.name}={k.label(point[k.name])}" for k in self.knobs)


def build(job: JobFile) -> Space:
    """The space around the job's desired point, with the `fitfinder:` candidate overrides."""
    overrides = job.settings.candidates
    problems: list[str] = []
    knobs = []
    for name, make in _BUILDERS.items():
        try:
            knob = make(job, overrides.get(name))
        except ValueError as exc:
            problems.append(f"fitfinder.candidates.{name}: {exc}")
            continue
        if knob is not None and len(knob.candidates) > 1:
            knobs.append(knob)
    unknown = [n for n in overrides if n not in _BUILDERS]
    problems += [f"fitfinder.candidates.{n}: this knob is not searched yet" for n in unknown]
    if problems:
        raise ConfigError(job.source, problems)
    return Space(_prioritized(knobs, job.settings.priorities), job)


def _prioritized(knobs: list[Knob], priorities: list[str]) -> list[Knob]:
    """Quality knobs in the user's priority order (unnamed ones keep theirs), then speed knobs."""
    quality = [k for k in knobs if k.role == "quality"]
    named = [k for name in priorities for k in quality if k.name == name]
    rest = [k for k in quality if k not in named]
    return named + rest + [k for k in knobs if k.role == "speed"]


# -- buckets: datasets[*].resolution ------------------------------------------------------------
def bucket_label(resolutions: list[int]) -> str:
    return ",".join(str(r) for r in sorted(set(resolutions)))


def bucket_list(label: str) -> list[int]:
    return [int(r) for r in str(label).split(",")]


def resolutions(job: JobFile) -> list[int]:
    values = []
    for res in job.get("datasets[*].resolution"):
        values += list(res) if isinstance(res, list) else [res]
    return sorted(set(int(v) for v in values))


def _buckets(job: JobFile, override: list | None) -> Knob:
    desired = resolutions(job)
    if override is None:
        # Drop the largest bucket first, as the seeds' rollback does: [a, b, c] -> [a, b] -> [a].
        sets = [desired[:n] for n in range(1, len(desired) + 1)]
    else:
        sets = []
        for entry in override:
            entry = entry if isinstance(entry, list) else [entry]
            if not entry or not all(isinstance(v, int) and v > 0 for v in entry):
                raise ValueError(f"expected bucket lists of positive integers, got {entry!r}")
            sets.append(sorted(set(entry)))
        sets.append(desired)
    labels = sorted({bucket_label(s) for s in sets}, key=lambda l: (max(bucket_list(l)), len(bucket_list(l))))
    return Knob("buckets", "quality", tuple(labels), bucket_label(desired), ("datasets[*].resolution",),
                _TRAIN_ON)


def _apply_buckets(job: JobFile, label: str, space: Space) -> None:
    allowed = bucket_list(label)
    for i, res in enumerate(job.get("datasets[*].resolution")):
        mine = list(res) if isinstance(res, list) else [res]
        kept = [r for r in mine if r in allowed] or [max(allowed)]
        if kept != mine:
            job.set(f"datasets[{i}].resolution", kept if isinstance(res, list) or len(kept) > 1 else kept[0])


# -- rank: network.linear (+ linear_alpha keeping its ratio) -------------------------------------
MIN_RANK = 4  # below this a LoRA learns little; an override may still ask for less


def _rank_of(job: JobFile) -> int:
    return int(job.get("network.linear", None) or job.get("network.rank"))


def _alpha_of(job: JobFile) -> float:
    return float(job.get("network.linear_alpha", None) or job.get("network.alpha", 1.0))


def _rank(job: JobFile, override: list | None) -> Knob:
    desired = _rank_of(job)
    if override is None:
        values = [2**i for i in range(0, 16) if MIN_RANK <= 2**i < desired] + [desired]
    else:
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in override):
            raise ValueError(f"expected positive integers, got {override!r}")
        values = list(override) + [desired]
    return Knob("rank", "quality", tuple(sorted(set(values))), desired,
                ("network.linear", "network.linear_alpha"), _MODEL_ON)


def _apply_rank(job: JobFile, rank: int, space: Space) -> None:
    ratio = _alpha_of(space.job) / _rank_of(space.job)
    alpha = rank * ratio
    job.set("network.linear", rank)
    if job.has("network.rank"):
        job.set("network.rank", rank)
    job.set("network.linear_alpha", int(alpha) if float(alpha).is_integer() else alpha)


# -- batch: train.batch_size x accumulation = the desired effective batch ------------------------
def _batch(job: JobFile, override: list | None) -> Knob:
    desired = int(job.get("train.batch_size"))
    effective = desired * job.accumulation
    divisors = [b for b in range(1, effective + 1) if effective % b == 0]
    if override is not None:
        bad = [v for v in override if not isinstance(v, int) or isinstance(v, bool) or v not in divisors]
        if bad:
            raise ValueError(f"batch sizes must divide the effective batch {effective} "
                             f"(batch_size x accumulation), got {bad}")
        divisors = sorted(set(override) | {desired})
    return Knob("batch", "speed", tuple(divisors), desired,
                ("train.batch_size", "train.gradient_accumulation", "train.gradient_accumulation_steps"),
                _TRAIN_ON)


def _apply_batch(job: JobFile, batch: int, space: Space) -> None:
    job.set("train.batch_size", batch)
    accumulation = space.effective_batch // batch
    key = space.job.accumulation_key
    if job.has(key) or accumulation != 1:
        job.set(key, accumulation)


# -- gradient checkpointing ----------------------------------------------------------------------
def _checkpointing(job: JobFile, override: list | None) -> Knob:
    desired = bool(job.get("train.gradient_checkpointing"))
    values = [True, False] if override is None else [bool(v) for v in override] + [desired]
    # On (True) is the lighter setting, so it comes first.
    return Knob("gradient_checkpointing", "speed", tuple(v for v in (True, False) if v in values),
                desired, ("train.gradient_checkpointing",), frozenset({"train"}))


def _apply_checkpointing(job: JobFile, on: bool, space: Space) -> None:
    if job.has("train.gradient_checkpointing") or on != job.get("train.gradient_checkpointing"):
        job.set("train.gradient_checkpointing", bool(on))


_BUILDERS: dict[str, Callable[[JobFile, list | None], Knob | None]] = {
    "buckets": _buckets,
    "rank": _rank,
    "batch": _batch,
    "gradient_checkpointing": _checkpointing,
}
_APPLY: dict[str, Callable[[JobFile, Any, Space], None]] = {
    "buckets": _apply_buckets,
    "rank": _apply_rank,
    "batch": _apply_batch,
    "gradient_checkpointing": _apply_checkpointing,
}
_LABELS: dict[str, Callable[[Any], str]] = {
    "buckets": lambda v: f"[{v}]",
    "gradient_checkpointing": lambda v: "on" if v else "off",
}


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
