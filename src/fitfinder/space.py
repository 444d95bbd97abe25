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
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from fitfinder.errors import ConfigError
from fitfinder.jobconfig import (AITK_DEFAULTS, FRAMES, PIXELS, RANKS, JobFile, brief, int_in, is_full_fine_tune,
                                 network_type, optimizer_name)

Point = dict[str, Any]  # knob name -> one of its candidates (a JSON scalar)

# Phases of a probe, in the order they run (see probe/recipe.py).
PHASES = ("load", "text_encoder", "latents", "sample", "train", "last_sample")
_ALL = frozenset(PHASES)
_DATA = frozenset({"latents", "train"})
_PREVIEW = frozenset({"sample", "last_sample"})
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
    # A trainer's own knob (trainers/: a kohya job's): its name in that trainer's words, how its
    # values read, and how it writes itself into the job (else the AI Toolkit rules below).
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
        return self.labeler(value) if self.labeler else _LABELS.get(self.name, str)(value)

    @property
    def short(self) -> str:
        """The name in trial lines and tables, where width is scarce (a trainer's knob: its own name)."""
        return self.title or _SHORT.get(self.name, self.name)


class Space:
    """Knobs in priority order: quality knobs first (most important first), then speed knobs."""

    def __init__(self, knobs: list[Knob], job: JobFile):
        self.knobs = tuple(knobs)
        self.by_name = {knob.name: knob for knob in knobs}
        self.job = job
        own = getattr(job, "effective_batch", None)  # a trainer's job answers it (trainers/)
        self.effective_batch = own if own is not None else job.batch_size * job.accumulation

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
        if hasattr(self.job, "phases_run"):  # a trainer's job says when its trainer samples (trainers/)
            return self.job.phases_run(point)
        sampling = point.get("sampling", not self.job.get("train.disable_sampling"))
        skipped = {"sample", "last_sample"} if not sampling else set()
        if self.job.get("train.skip_first_sample"):
            skipped.add("sample")
        return [phase for phase in PHASES if phase not in skipped]

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
                (knob.writer or _APPLY[knob.name])(out, point[knob.name], self)
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


def build(job: JobFile) -> Space:
    """The space around the job's desired point, with the `fitfinder:` candidate overrides."""
    from fitfinder.models import is_video

    if hasattr(job, "knob_specs"):  # a trainer's job declares its knobs in its own names (trainers/)
        return Space(_prioritized([Knob(**vars(spec)) for spec in job.knob_specs()], job.settings.priorities), job)

    overrides = job.settings.candidates
    video = is_video(job)
    problems: list[str] = []
    knobs = []
    for name, make in _BUILDERS.items():
        try:
            knob = make(job, overrides.get(name), video)
        except ValueError as exc:
            problems.append(f"fitfinder.candidates.{name}: {exc}")
            continue
        if knob is not None and len(knob.candidates) > 1:
            knobs.append(knob)
        elif name in overrides and knob is None:
            problems.append(f"fitfinder.candidates.{name}: this knob does not apply to this job")
    if problems:
        raise ConfigError(job.source, problems)
    return Space(_prioritized(knobs, job.settings.priorities), job)


def _prioritized(knobs: list[Knob], priorities: list[str]) -> list[Knob]:
    """Quality knobs in the user's priority order (unnamed ones keep theirs), then speed knobs."""
    quality = sorted((k for k in knobs if k.role == "quality"), key=lambda k: QUALITY_ORDER.index(k.name))
    named = [k for name in priorities for k in quality if k.name == name]
    rest = [k for k in quality if k not in named]
    speed = sorted((k for k in knobs if k.role == "speed"), key=lambda k: SPEED_ORDER.index(k.name))
    return named + rest + speed


def _with_desired(values: list, desired: Any, allowed: Callable[[Any], bool], what: str) -> list:
    bad = [v for v in values if not allowed(v)]
    if bad:
        raise ValueError(f"expected {what}, got {brief(bad)}")
    return list(dict.fromkeys([*values, desired]))


def _set(job: JobFile, path: str, value: Any) -> None:
    """Write `value`, unless the file leaves the key out and the default already says it."""
    if job.has(path) or AITK_DEFAULTS.get(path, object()) != value:
        job.set(path, value)


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


def _buckets(job: JobFile, override: list | None, video: bool) -> Knob:
    desired = resolutions(job)
    if override is None:
        # Drop the largest bucket first, as the seeds' rollback does: [a, b, c] -> [a, b] -> [a].
        sets = [desired[:n] for n in range(1, len(desired) + 1)]
    else:
        sets = [desired]
        for entry in override:
            entry = entry if isinstance(entry, list) else [entry]
            if not entry or not all(int_in(v, *PIXELS) for v in entry):
                raise ValueError(f"expected bucket lists of positive integers (at most {PIXELS[1]}), "
                                 f"got {brief(entry)}")
            sets.append(sorted(set(entry)))
    # Memory follows the largest bucket; more buckets at the same size cost no memory, only coverage.
    labels = sorted({bucket_label(s) for s in sets},
                    key=lambda label: (max(bucket_list(label)), len(bucket_list(label))))
    return Knob("buckets", "quality", tuple(labels), bucket_label(desired), ("datasets[*].resolution",), _DATA)


def _apply_buckets(job: JobFile, label: str, space: Space) -> None:
    allowed = bucket_list(label)
    for i, res in enumerate(job.get("datasets[*].resolution")):
        mine = list(res) if isinstance(res, list) else [res]
        kept = [r for r in mine if r in allowed] or [max(allowed)]
        if kept != mine:
            job.set(f"datasets[{i}].resolution", kept if isinstance(res, list) or len(kept) > 1 else kept[0])


# -- frames: datasets[*].num_frames (video) -------------------------------------------------------
def frame_ladder(job: JobFile, desired: int) -> list[int]:
    """Clip lengths the family's VAE wants, down from `desired` (Wan: 4k+1, halving k: 81 -> 41, 21, 9, 5, 1)."""
    from fitfinder.models import frame_ladder

    return frame_ladder(job, desired)


def _frames(job: JobFile, override: list | None, video: bool) -> Knob | None:
    desired = max(int(f) for f in job.get("datasets[*].num_frames"))
    if not video and desired == 1:
        return None
    values = frame_ladder(job, desired) if override is None else _with_desired(
        override, desired, lambda v: int_in(v, *FRAMES), f"frame counts from 1 to {FRAMES[1]}")
    return Knob("frames", "quality", tuple(sorted(values)), desired, ("datasets[*].num_frames",), _DATA)


def _apply_frames(job: JobFile, frames: int, space: Space) -> None:
    for i, own in enumerate(job.get("datasets[*].num_frames")):
        job.set(f"datasets[{i}].num_frames", min(int(own), frames) if int(own) > 1 else own)


# -- rank: network.linear (+ linear_alpha keeping its ratio) -------------------------------------
MIN_RANK = 4  # below this a LoRA learns little; an override may still ask for less


def _rank(job: JobFile, override: list | None, video: bool) -> Knob | None:
    if is_full_fine_tune(job):
        return None  # no LoRA: the whole denoiser trains
    if network_type(job) == "lokr" and job.get("network.lokr_full_rank", True):
        return None  # NetworkConfig: a full-rank LoKr ignores network.linear (its factors are whole)
    desired = job.lora_rank
    if override is None:
        values = [2**i for i in range(0, 16) if MIN_RANK <= 2**i < desired] + [desired]
    else:
        values = _with_desired(override, desired, lambda v: int_in(v, *RANKS),
                               f"ranks from 1 to {RANKS[1]}")
    return Knob("rank", "quality", tuple(sorted(set(values))), desired,
                ("network.linear", "network.linear_alpha"), _ALL)


def _apply_rank(job: JobFile, rank: int, space: Space) -> None:
    alpha = rank * space.job.lora_alpha / space.job.lora_rank
    job.set("network.linear", rank)
    if job.has("network.rank"):
        job.set("network.rank", rank)
    job.set("network.linear_alpha", int(alpha) if float(alpha).is_integer() else alpha)


# -- quantize: model.quantize + model.qtype (base precision) ---------------------------------------
FOUR_BIT = ("uint4", "qint4", "int4", "nf4", "fp4", "uint3", "uint2")


def quantize_level(job: JobFile) -> str:
    if not job.quantize:
        return "none"
    return "4bit" if job.qtype in FOUR_BIT else "8bit"


def _quantize(job: JobFile, override: list | None, video: bool) -> Knob | None:
    ladder = ("4bit", "8bit", "none")
    desired = quantize_level(job)
    if is_full_fine_tune(job) and desired == "none" and override is None:
        # The trained weights are the base's own: quantizing them is another training, not a
        # memory trade (AI Toolkit's full fine-tune examples: "a crapshoot").
        return None
    values = ladder[:ladder.index(desired) + 1] if override is None else _with_desired(
        override, desired, lambda v: v in ladder, "none, 8bit or 4bit")
    # While loading, the weights arrive in full precision and are quantized on the device (AI
    # Toolkit without low_vram): the load peak of a quantized base is no lower than an unquantized one.
    return Knob("quantize", "quality", tuple(v for v in ladder if v in values), desired,
                ("model.quantize", "model.qtype"), _ALL, unordered=frozenset({"load"}))


def _apply_quantize(job: JobFile, level: str, space: Space) -> None:
    if level == "none":
        job.set("model.quantize", False)
        return
    job.set("model.quantize", True)
    job.set("model.qtype", "uint4" if level == "4bit" else "qfloat8")


# -- optimizer: train.optimizer ------------------------------------------------------------------
# Every optimizer fitfinder probes, lightest state first (bytes per trained
# element: adafactor's factored fp32 moments, lion8bit 1, the 8-bit Adams 2, lion 1 and Adam(W) 2
# in the weights' dtype, prodigy 4).
OPTIMIZERS = ("adafactor", "lion8bit", "adam8bit", "adamw8bit", "lion", "adam", "adamw", "prodigy")
# Where AI Toolkit offers the same algorithm with 8-bit states, the two are a precision choice;
# any other change of optimizer is a different training and happens only when the user lists it.
PRECISION_TWINS = {"adamw": "adamw8bit", "adam": "adam8bit", "lion": "lion8bit"}


def _optimizer(job: JobFile, override: list | None, video: bool) -> Knob | None:
    desired = optimizer_name(job.get("train.optimizer"))
    if override is None:
        values = [PRECISION_TWINS[desired], desired] if desired in PRECISION_TWINS else [desired]
    else:
        values = _with_desired([optimizer_name(v) or str(v) for v in override], desired,
                               lambda v: v in OPTIMIZERS, ", ".join(OPTIMIZERS))
        # Never past the desired point: a heavier state than the user's is no better for fitting.
        values = [v for v in values if OPTIMIZERS.index(v) <= OPTIMIZERS.index(desired)]
    return Knob("optimizer", "quality", tuple(v for v in OPTIMIZERS if v in values), desired,
                ("train.optimizer",), frozenset({"train", "last_sample"}))


def _apply_optimizer(job: JobFile, name: str, space: Space) -> None:
    job.set("train.optimizer", name)


# -- EMA: train.ema_config.use_ema ------------------------------------------------------------------
def _ema(job: JobFile, override: list | None, video: bool) -> Knob | None:
    desired = bool(job.get("train.ema_config.use_ema"))
    if not desired:
        return None  # never past the desired point: no EMA asked, none added
    values = [False, True] if override is None else _with_desired(
        override, desired, lambda v: isinstance(v, bool), "true or false")
    # A shadow of the trained weights from the end of the load on (BaseSDTrainProcess.setup_ema, before
    # any caching), and a stored copy of them from the first preview on (AI Toolkit's toolkit/ema.py):
    # for a full fine-tune, two more copies of the model.
    return Knob("ema", "quality", tuple(v for v in (False, True) if v in values), desired,
                ("train.ema_config.use_ema",), _ALL)


def _apply_ema(job: JobFile, on: bool, space: Space) -> None:
    job.set("train.ema_config.use_ema", bool(on))


# -- preview sampling: on/off, size, frames --------------------------------------------------------
def _sampling(job: JobFile, override: list | None, video: bool) -> Knob | None:
    desired = not job.get("train.disable_sampling")
    values = [False, True] if override is None else _with_desired(
        override, desired, lambda v: isinstance(v, bool), "true or false")
    values = [v for v in (False, True) if v in values and (v <= desired)]
    # The sample prompts are encoded with the captions and kept for the last preview: sampling
    # at all weighs on every phase from the text encoder on, however large the previews are.
    return Knob("sampling", "quality", tuple(values), desired, ("train.disable_sampling",),
                _ALL - {"load"})


def _apply_sampling(job: JobFile, on: bool, space: Space) -> None:
    job.set("train.disable_sampling", not on)


def sample_size_label(width: int, height: int) -> str:
    return f"{width}x{height}"


def _sample_size(job: JobFile, override: list | None, video: bool) -> Knob | None:
    if job.get("train.disable_sampling"):
        return None  # no previews: their size costs nothing
    width, height = int(job.get("sample.width")), int(job.get("sample.height"))
    desired = sample_size_label(width, height)
    if override is None:
        # Half and three quarters of the desired size, keeping the aspect, on a 64-pixel grid.
        sizes = {desired}
        for scale in (0.5, 0.75):
            sizes.add(sample_size_label(max(64, round(width * scale / 64) * 64),
                                        max(64, round(height * scale / 64) * 64)))
    else:
        sizes = set(_with_desired([str(v) for v in override], desired, _sample_size_ok,
                                  f"sizes such as 512x512 (each side from 1 to {PIXELS[1]})"))
    ordered = sorted(sizes, key=lambda s: math.prod(int(p) for p in s.split("x")))
    return Knob("sample_size", "quality", tuple(ordered), desired, ("sample.width", "sample.height"), _PREVIEW)


def _sample_size_ok(label: str) -> bool:
    match = re.fullmatch(r"([0-9]{1,6})x([0-9]{1,6})", label)  # ASCII digits: int("²") fails
    return bool(match) and all(PIXELS[0] <= int(side) <= PIXELS[1] for side in match.groups())


def _apply_sample_size(job: JobFile, label: str, space: Space) -> None:
    width, height = (int(p) for p in label.split("x"))
    job.set("sample.width", width)
    job.set("sample.height", height)


def _sample_frames(job: JobFile, override: list | None, video: bool) -> Knob | None:
    desired = int(job.get("sample.num_frames"))
    if desired == 1 or job.get("train.disable_sampling"):
        return None
    values = frame_ladder(job, desired) if override is None else _with_desired(
        override, desired, lambda v: int_in(v, *FRAMES), f"frame counts from 1 to {FRAMES[1]}")
    return Knob("sample_frames", "quality", tuple(sorted(values)), desired, ("sample.num_frames",), _PREVIEW)


def _apply_sample_frames(job: JobFile, frames: int, space: Space) -> None:
    job.set("sample.num_frames", frames)


# -- text encoder: cached embeddings, or kept on the device --------------------------------------
def _text_encoder(job: JobFile, override: list | None, video: bool) -> Knob | None:
    desired = job.text_encoder_mode
    if desired != "keep":
        return None  # already off the device during training
    values = ["cache", "keep"] if override is None else _with_desired(
        override, desired, lambda v: v in ("cache", "keep"), "cache or keep")
    return Knob("text_encoder", "quality", tuple(v for v in ("cache", "keep") if v in values), desired,
                ("train.cache_text_embeddings",), _ALL)


def _apply_text_encoder(job: JobFile, mode: str, space: Space) -> None:
    _set(job, "train.cache_text_embeddings", mode == "cache")


# -- speed: batch, gradient checkpointing, low_vram, layer offloading ----------------------------
def _batch(job: JobFile, override: list | None, video: bool) -> Knob:
    desired = job.batch_size
    effective = desired * job.accumulation
    divisors = divisors_of(effective)
    if override is not None:
        divisors = _with_desired(override, desired, lambda v: int_in(v, 1, effective) and v in divisors,
                                 f"batch sizes that divide the effective batch {effective} (batch_size x accumulation)")
    return Knob("batch", "speed", tuple(sorted(set(divisors))), desired,
                ("train.batch_size", "train.gradient_accumulation", "train.gradient_accumulation_steps"),
                frozenset({"text_encoder", "latents", "train"}))


def divisors_of(n: int) -> list[int]:
    """Every divisor of n, ascending, in sqrt(n) steps (an effective batch of 10^8 takes 10^4)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _apply_batch(job: JobFile, batch: int, space: Space) -> None:
    job.set("train.batch_size", batch)
    for i, own in enumerate(job.get("datasets[*].batch_size")):  # a dataset's own overrides train's
        if own is not None:
            job.set(f"datasets[{i}].batch_size", batch)
    _set(job, space.job.accumulation_key, space.effective_batch // batch)


def _switch(name: str, path: str, phases: frozenset, light: bool):
    """A boolean speed knob whose `light` setting saves memory (checkpointing on, low_vram on)."""

    def make(job: JobFile, override: list | None, video: bool) -> Knob:
        desired = bool(job.get(path))
        values = [True, False] if override is None else _with_desired(
            override, desired, lambda v: isinstance(v, bool), "true or false")
        order = (light, not light)
        return Knob(name, "speed", tuple(v for v in order if v in values), desired, (path,), phases)

    def apply(job: JobFile, value: bool, space: Space) -> None:
        _set(job, path, bool(value))

    return make, apply


_checkpointing, _apply_checkpointing = _switch("gradient_checkpointing", "train.gradient_checkpointing",
                                               frozenset({"train"}), light=True)
_low_vram_switch, _apply_low_vram = _switch("low_vram", "model.low_vram", _ALL, light=True)


def _low_vram(job: JobFile, override: list | None, video: bool) -> Knob | None:
    """model.low_vram moves only what the family's AI Toolkit loader and model class do with it
    (Family.low_vram_moves): for FLUX.1 the load alone, for SDXL nothing, so no knob there."""
    from fitfinder.models import family_for

    phases = family_for(job).low_vram_moves
    if not phases and override is None:
        return None
    return replace(_low_vram_switch(job, override, video), phases=phases)


# -- layer offloading: model.layer_offloading + its percents ---------------------------------------
# Shares of the layers offloaded, lightest first. AI Toolkit reads each percent as a fraction
# ("0 is off and 1.0 is 100% of the layers", toolkit/config_modules.py ModelConfig) and its UI sets
# it as a slider; quarters give the search five levels, each step a quarter of the denoiser's and
# text encoder's weights, which is as fine as a probe is worth on a card where 100% is the default.
OFFLOAD_SHARES = (1.0, 0.75, 0.5, 0.25, 0.0)


def _layer_offloading(job: JobFile, override: list | None, video: bool) -> Knob | None:
    from fitfinder.models import FAMILIES, family_of

    if is_full_fine_tune(job) or not FAMILIES[family_of(job)].layer_offloading:
        return None  # the family's AI Toolkit loader never offloads (Family.layer_offloading)
    on = job.get("model.layer_offloading", None)
    on = bool(job.get("model.auto_memory", False) if on is None else on)
    desired = float(job.get("model.layer_offloading_transformer_percent", 1.0)) if on else 0.0
    values = list(OFFLOAD_SHARES) if override is None else _with_desired(
        override, desired, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
        "shares of layers from 0 to 1")
    values = [float(v) for v in values]
    return Knob("layer_offloading", "speed", tuple(sorted(set(values), reverse=True)), desired,
                ("model.layer_offloading", "model.layer_offloading_transformer_percent",
                 "model.layer_offloading_text_encoder_percent"), _ALL,
                # Only the load is lighter for sure: after it, the device's rings hold copies of the
                # last offloaded layers (dequantized: twice an 8-bit weight), through the VAE-only
                # latents pass too, and the layers' autograd function saves every input, which
                # without checkpointing can outweigh the weights that went to the host (a Wan clip
                # of 81 frames: 335 MB of input against 141 MB of weight per FFN layer).
                unordered=_ALL - {"load"})


def _apply_layer_offloading(job: JobFile, share: float, space: Space) -> None:
    """Off at 0; else on, with the same share of the denoiser's and the text encoder's layers."""
    job.set("model.layer_offloading", share > 0)
    if share > 0:
        job.set("model.layer_offloading_transformer_percent", share)
        job.set("model.layer_offloading_text_encoder_percent", share)

_BUILDERS: dict[str, Callable[[JobFile, list | None, bool], Knob | None]] = {
    "buckets": _buckets, "frames": _frames, "rank": _rank, "quantize": _quantize, "optimizer": _optimizer, "ema": _ema,
    "sampling": _sampling, "sample_size": _sample_size, "sample_frames": _sample_frames,
    "text_encoder": _text_encoder, "batch": _batch, "gradient_checkpointing": _checkpointing,
    "low_vram": _low_vram, "layer_offloading": _layer_offloading,
}
_APPLY: dict[str, Callable[[JobFile, Any, Space], None]] = {
    "buckets": _apply_buckets, "frames": _apply_frames, "rank": _apply_rank, "quantize": _apply_quantize,
    "optimizer": _apply_optimizer, "ema": _apply_ema, "sampling": _apply_sampling, "sample_size": _apply_sample_size,
    "sample_frames": _apply_sample_frames, "text_encoder": _apply_text_encoder, "batch": _apply_batch,
    "gradient_checkpointing": _apply_checkpointing, "low_vram": _apply_low_vram,
    "layer_offloading": _apply_layer_offloading,
}
_LABELS: dict[str, Callable[[Any], str]] = {
    "buckets": lambda v: f"[{v}]",
    "gradient_checkpointing": lambda v: "on" if v else "off",
    "low_vram": lambda v: "on" if v else "off",
    "ema": lambda v: "on" if v else "off",
    "sampling": lambda v: "on" if v else "off",
    "layer_offloading": lambda v: f"{round(v * 100)}%",
}
_SHORT = {"gradient_checkpointing": "gc", "sample_size": "sample", "text_encoder": "te", "layer_offloading": "offload"}


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
