"""fitfinder estimate: a job's peak memory per phase, predicted on a CPU, with no GPU and no weights.

The probe's own recipe (probe.py) runs on the estimate meter (meter.EstimateMeter): the job's
full-size architecture as fake tensors (models._fake), every phase as a probe runs it, the
storage tracker counting the bytes a card would hold. Two differences from a probe, both about
time and neither about memory:

- one training step, after the optimizer's state has been made with zero gradients
  (`prime_optimizer`), instead of the probe's 20: the heaviest shape meets the state (and, with
  accumulation, the gradients) as the probe's later steps meet them;
- one denoising step per preview instead of two: every denoising step holds the same memory.

Each phase's estimate is what the cuda meter would report: the storages rounded as the CUDA
caching allocator rounds them, the cuBLAS workspace, the fragmentation allowance and the CUDA
context (overhead.GpuOverhead: documented defaults, or what `fitfinder calibrate` measured).

A job fits when its highest phase peak is at most the budget; the search's limit is the budget
less its safety margin. `Prescreen` lets `fitfinder search` decide, without a probe, the points
the estimate puts at PRESCREEN_FACTOR times the budget or more; `search` runs the search's own
planner on estimates instead of probes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from fitfinder.errors import RunFailed
from fitfinder.overhead import GpuOverhead
from fitfinder.units import format_bytes

# "Well over the budget": the pre-screen decides a point without a probe when some phase is
# estimated at this many times the budget or more. The estimate matches the sim meter's bytes
# exactly on CPU; on a card it misses what it does not model (kernels' own scratch memory,
# fragmentation beyond the allowance), a few percent. A quarter of the budget leaves every
# point near the boundary to a real probe.
PRESCREEN_FACTOR = 1.25


def as_estimate(request: dict[str, Any], overhead: GpuOverhead) -> dict[str, Any]:
    """A probe request as the estimate runs it: the estimate meter, one primed step, one denoising step."""
    estimate = {key: value for key, value in request.items() if key != "fault"}
    estimate.update(meter="estimate", steps=1, prime_optimizer=True, overhead=overhead.as_dict(),
                    sample={**request["sample"], "steps": 1})
    return estimate


def request_for(job, overhead: GpuOverhead) -> dict[str, Any]:
    """The estimate request of a job file: its architecture, never its weights."""
    from fitfinder import models, probe

    request = probe.request_for(job, 1, "estimate", job.settings.vram_bytes, spec=models.architecture_spec(job))
    return as_estimate(request, overhead)


@dataclass
class Estimate:
    """One job's predicted peaks, phase by phase, against a budget."""

    arch_name: str
    phase_stats: dict[str, dict[str, Any]]  # phase -> peak_live, peak_allocated, peak_reserved, seconds
    budget_bytes: int | None
    margin: float
    overhead: GpuOverhead
    seconds: float | None = None  # the estimating process, start to result
    cpu_seconds: float | None = None  # its CPU time (on a busy machine, less than `seconds`)
    max_rss_bytes: int | None = None  # its host memory at the highest

    @property
    def phases(self) -> dict[str, int]:
        """Phase -> predicted peak: on the card (what the cuda meter would report), or with no
        overhead model the tensor bytes alone (what the sim meter would report)."""
        key = "peak_live" if self.overhead.source == "none" else "peak_reserved"
        return {name: int(stats[key]) for name, stats in self.phase_stats.items()}

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def limit_bytes(self) -> int | None:
        return int(self.budget_bytes * (1 - self.margin)) if self.budget_bytes else None

    @property
    def fits(self) -> bool | None:
        return None if not self.budget_bytes else self.peak_bytes <= self.budget_bytes

    @property
    def fits_with_margin(self) -> bool | None:
        return None if not self.budget_bytes else self.peak_bytes <= self.limit_bytes

    def first_phase_over(self, threshold_bytes: float) -> str | None:
        """The first phase (in the order they run) whose peak passes `threshold_bytes`."""
        return next((name for name, peak in self.phases.items() if peak > threshold_bytes), None)

    def as_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits, "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
            "limit_bytes": self.limit_bytes, "fits_with_margin": self.fits_with_margin,
            "headroom_bytes": self.budget_bytes - self.peak_bytes if self.budget_bytes else None,
            "phase": self.first_phase_over(self.budget_bytes) if self.budget_bytes else None,
            "phases": self.phases, "phase_stats": self.phase_stats, "arch": self.arch_name,
            "overhead": self.overhead.as_dict(), "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
            "max_rss_bytes": self.max_rss_bytes,
        }


class InProcess:
    """Runs estimate requests in this process, with the ProbeRunner's `run(request)` surface.

    An estimate holds no memory worth isolating (fake tensors) and cannot run out of it, so the
    process boundary a probe needs buys it nothing but a second import of torch, diffusers,
    transformers, peft and bitsandbytes in the probe server: 6-8 s, as long as the estimate
    itself (benchmarks/estimate_speed.py). `fitfinder estimate` runs here; the search's
    pre-screen keeps using its own warm probe server. What the libraries print goes to
    /dev/null, as a probe's goes to its log, so --json's stdout stays one object.
    """

    def __init__(self, timeout_s: float = 600.0):
        if timeout_s <= 0:
            raise ValueError(f"the estimate's timeout must be positive but got {timeout_s}")
        self.timeout_s = timeout_s

    def run(self, request: dict[str, Any], log_path=None) -> dict[str, Any]:
        from fitfinder import probe

        with _quiet_fds():
            import fitfinder._preload  # noqa: F401 - the libraries, once, before the clock starts
        gc.collect()  # the last estimate's garbage, before probe.run freezes what is alive
        started, cpu = time.perf_counter(), time.process_time()
        try:
            with _quiet_fds(), _alarm(self.timeout_s):
                result = probe.run(request)  # turns an exception inside the recipe into a result
        except EstimateTimeout:  # raised outside the recipe
            result = {"status": "timeout", "phase": None, "phases": {}, "phase_stats": {}}
        if result["status"] == "timeout" or "EstimateTimeout" in (result.get("error") or ""):
            result.update(status="timeout", error=f"the estimate passed its {self.timeout_s:g} s timeout")
        result["wall_seconds"] = round(time.perf_counter() - started, 3)
        result["cpu_seconds"] = round(time.process_time() - cpu, 3)  # this estimate's, not the imports'
        return result


class EstimateTimeout(Exception):
    """Raised in the estimating thread when its time is up; probe.run turns it into a result."""


@contextlib.contextmanager
def _alarm(seconds: float):
    def expire(signum, frame):
        raise EstimateTimeout(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _quiet_fds():
    """stdout and stderr at the file-descriptor level to /dev/null (C libraries print there too)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def run(job, runner, overhead: GpuOverhead) -> Estimate:
    """Estimate a job file with `runner`: InProcess, or a probe.ProbeRunner (a fresh process)."""
    request = request_for(job, overhead)
    result = runner.run(request)
    if result["status"] != "ok":
        raise RunFailed(f"the estimate of {job.source} failed in phase {result.get('phase') or '-'}: "
                        f"{(result.get('error') or 'no result').splitlines()[0][:300]}")
    return Estimate(arch_name=request["model"]["arch_name"], phase_stats=result["phase_stats"],
                    budget_bytes=job.settings.vram_bytes, margin=job.settings.margin, overhead=overhead,
                    seconds=result.get("wall_seconds"), cpu_seconds=result.get("cpu_seconds"),
                    max_rss_bytes=result.get("max_rss_bytes"))


# -- the pre-screen of `fitfinder search` ---------------------------------------------------------
class Prescreen:
    """Decides before a probe the points the estimate puts well over the budget.

    `outcome(request, purpose)` estimates the probe request; when some phase is estimated at
    `factor` times the budget or more it returns the probe result that point would have, an
    out-of-memory in the first such phase, marked `estimated`, with the predicted peaks; else
    None, and the point is probed. Confirmations are always probed (a point that fit is never
    overruled by a prediction), and an estimate that fails decides nothing.

    The sim meter counts tensor bytes only, so under it the estimate's own bytes (no allocator
    rounding, no GPU overhead) are compared; under the cuda meter, the card's predicted peaks.
    """

    def __init__(self, runner, budget_bytes: int | None, meter: str, overhead: GpuOverhead,
                 factor: float = PRESCREEN_FACTOR):
        if factor <= 1:
            raise ValueError(f"the pre-screen factor must be above 1 but got {factor}")
        self.runner, self.budget_bytes, self.meter = runner, budget_bytes, meter
        self.overhead, self.factor = overhead, factor

    def outcome(self, request: dict[str, Any], purpose: str = "") -> dict[str, Any] | None:
        if not self.budget_bytes or purpose == "confirm":
            return None
        result = self.runner.run(as_estimate(request, self.overhead))
        if result["status"] != "ok":
            return None
        key = "peak_live" if self.meter == "sim" else "peak_reserved"
        peaks = {name: int(stats[key]) for name, stats in result["phase_stats"].items()}
        threshold = self.factor * self.budget_bytes
        phase = next((name for name, peak in peaks.items() if peak >= threshold), None)
        if phase is None:
            return None
        share = peaks[phase] / self.budget_bytes
        return {"status": "oom", "phase": phase, "estimated": True, "oom_kind": "config",
                "peak_bytes": max(peaks.values()), "phases": peaks, "phase_stats": result["phase_stats"],
                "budget_bytes": self.budget_bytes, "seconds_per_step": None, "steps_run": 0,
                "error": (f"estimated {format_bytes(peaks[phase])} in {phase}, {share:.2f} x the budget: "
                          f"decided without a probe (pre-screen at {self.factor:g} x)"),
                "meter": result.get("meter"), "wall_seconds": result.get("wall_seconds")}


# How far a probe's peak may lie from its estimate, where the estimate-guided search starts
# (search.Guide; it widens past any disagreement a probe shows). On the CPU the estimate matches
# the sim meter to the byte (benchmarks/estimate_accuracy.py holds it to 2%); on a card it misses
# what it does not model, a few percent, until scripts/gpu_check.sh measures it: 10%.
GUIDE_BAND = {"sim": 0.02, "cuda": 0.10}
_guides: dict[tuple, Any] = {}


def guide_for(enabled: bool | None, job, meter: str, gpu: int = 0, runner=None):
    """The estimates that guide a search (search.plan_guided), or None: on by default with the
    cuda meter, whose probes cost minutes. One per job and card in a process, so that the loop
    and the search's end share what was estimated; they run from `runner` (a probe server)."""
    if not (meter == "cuda" if enabled is None else enabled):
        return None
    key = (str(job.source), meter, gpu, job.settings.vram_bytes)
    if key not in _guides:
        from fitfinder import overhead, probe, search

        runner = runner or probe.ProbeRunner(job.settings.probe_timeout)
        model = overhead.for_gpu(gpu) if meter == "cuda" else GpuOverhead.none()
        estimator = Estimator(job, runner, model)
        _guides[key] = search.Guide(estimator.phases_or_none, GUIDE_BAND[meter])
    return _guides[key]


def prescreen_for(enabled: bool | None, runner, budget_bytes: int | None, meter: str, gpu: int = 0) -> Prescreen | None:
    """The search's pre-screen: on by default with the cuda meter (whose probes cost minutes),
    off by default with the sim meter (whose probes cost what an estimate costs)."""
    if not (meter == "cuda" if enabled is None else enabled):
        return None
    from fitfinder import overhead

    model = overhead.for_gpu(gpu) if meter == "cuda" else GpuOverhead.none()
    return Prescreen(runner, budget_bytes, meter, model)


# -- fitfinder estimate --search: the search's planner on estimates --------------------------------
@dataclass
class EstimateSearch:
    """What the planner found when every point is estimated instead of probed."""

    space: Any
    best: Any  # search.Result or None
    known: Any  # search.Knowledge
    estimates_run: int
    proven: bool
    budget_bytes: int
    limit_bytes: int
    alternatives: list = field(default_factory=list)  # other speed settings predicted to fit at the best quality

    def as_json(self) -> dict[str, Any]:
        from fitfinder import search

        best = self.best
        return {"status": "fit" if best else "none", "best": best.point if best else None,
                "peak_bytes": best.peak_bytes if best else None, "phases": best.phases if best else None,
                "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                "estimates": self.estimates_run, "proven": self.proven,
                "also_fit": [r.point for r in self.alternatives],
                "explanation": search.explain(self.space, self.known, best.point) if best else []}


class Estimator:
    """One job's points estimated, each phase at most once for the knobs it depends on.

    A phase's peak depends only on the knobs that phase depends on (space.Knob.phases, which
    tests/test_space_truth.py holds to the real probe byte for byte), so a point whose every
    phase was already estimated at other points that agree on that phase's knobs is known
    without running: the planner's confirmation, a speed setting that changes only the training
    step once another point had it, a tier's search that walks what a smaller card's already
    walked. Estimates do not depend on the budget, so searches at several budgets share one.
    """

    def __init__(self, job, runner, overhead: GpuOverhead, space=None):
        from fitfinder import space as spaces

        self.job, self.runner, self.overhead = job, runner, overhead
        self.space = space or spaces.build(job)
        self.arch_name: str | None = None
        self.runs = 0  # estimates actually run
        self.recalled = 0  # points answered from the phases of others
        self._phases: dict[tuple, dict[str, Any]] = {}  # (phase, its knobs' values) -> phase stats
        self._failed: set[tuple] = set()

    def of(self, point) -> Estimate:
        stats = self._recall(point)
        if stats is not None:
            self.recalled += 1
            return Estimate(arch_name=self.arch_name, phase_stats=stats, budget_bytes=self.job.settings.vram_bytes,
                            margin=self.job.settings.margin, overhead=self.overhead, seconds=0.0)
        found = run(self.space.apply(self.job, point), self.runner, self.overhead)
        self.runs += 1
        self.arch_name = found.arch_name
        for phase, phase_stats in found.phase_stats.items():
            self._phases[self._phase_key(phase, point)] = phase_stats
        return found

    def phases_or_none(self, point) -> dict[str, int] | None:
        """A point's predicted peak per phase, or None when its estimate fails (asked once)."""
        key = self.space.key(point)
        if key in self._failed:
            return None
        try:
            return self.of(point).phases
        except RunFailed:
            self._failed.add(key)
            return None

    def _recall(self, point) -> dict[str, Any] | None:
        stats = {}
        for phase in self.space.phases_run(point):
            known = self._phases.get(self._phase_key(phase, point))
            if known is None:
                return None
            stats[phase] = known
        return stats

    def _phase_key(self, phase: str, point) -> tuple:
        return (phase, *(point[k.name] for k in self.space.knobs if phase in k.phases))


def search(job, runner, overhead: GpuOverhead, on_estimate=None, estimator: Estimator | None = None,
           budget_bytes: int | None = None) -> EstimateSearch:
    """The search's planner (search.drive), each planned point estimated instead of probed.

    Nothing is written to studies/: a study holds measurements, and a later real search resuming
    it must not take predictions for them. An estimate is deterministic, so the planner's
    confirmation of the winner repeats it from memory, and one that fails stops the search with
    its error (the next point would fail the same way). Speed is not estimated: among the points
    of the best quality, every speed setting predicted to fit is reported. `estimator` shares
    estimates between searches of the same job at several budgets (`budget_bytes`, default the
    job's).
    """
    from fitfinder import search as searching

    estimator = estimator or Estimator(job, runner, overhead)
    space = estimator.space
    budget = budget_bytes or job.settings.vram_bytes
    limit = int(budget * (1 - job.settings.margin))
    known = searching.Knowledge(space, limit)
    runs_before = estimator.runs

    def estimate_step(step) -> None:
        result = _as_result(len(known.results), step, estimator.of(step.point))
        known.add(result)
        if on_estimate is not None:
            on_estimate(space, result, budget)

    proven, _ = searching.drive(space, known, estimate_step, 0, job.settings.trials)
    best, alternatives = _fastest_candidates(space, known, searching.best(space, known))
    return EstimateSearch(space=space, best=best, known=known, estimates_run=estimator.runs - runs_before,
                          proven=proven, budget_bytes=budget, limit_bytes=limit, alternatives=alternatives)


def _as_result(trial: int, step, found: Estimate):
    """An estimate as the planner's Result: every phase's peak, judged against the limit as a
    probe that ran would be (a phase over the limit rules out what is heavier on its knobs)."""
    from fitfinder.search import Result

    return Result(trial=trial, point=step.point, status="ok", peak_bytes=found.peak_bytes, phases=found.phases,
                  confirm=step.purpose == "confirm",
                  extra={"purpose": step.purpose, "estimated": True, "seconds": found.seconds})


def _fastest_candidates(space, known, best):
    """Among the points of the best's quality predicted to fit, those no other one outweighs on
    the speed knobs (a larger batch, checkpointing or offload off: each only faster); which of
    them is fastest only a probe can tell. The first found stands as the answer."""
    if best is None:
        return None, []
    quality = space.quality_key(best.point)
    same: dict[tuple, Any] = {}
    for result in known.fits():
        if space.quality_key(result.point) == quality:
            same.setdefault(space.key(result.point), result)
    maximal = [r for key, r in same.items()
               if not any(other != key and space.heavier_or_equal(o.point, r.point) for other, o in same.items())]
    return maximal[0], maximal[1:]
