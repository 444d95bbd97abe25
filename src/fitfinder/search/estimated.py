"""The search's planner on estimates: `fitfinder estimate --search`, the pre-screen of `fitfinder
search` and the guide of the estimate-guided search (planner.plan_guided).

The estimates themselves (a job's predicted peaks, phase by phase) are probe.estimate's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fitfinder import probe
from fitfinder.probe import dialects, overhead as overheads
from fitfinder.probe.estimate import Estimate, Estimator, as_estimate
from fitfinder.probe.overhead import GpuOverhead
from fitfinder.probe.protocol import ProbeRequest, ProbeResult, Purpose
from fitfinder.search import planner
from fitfinder.units import format_bytes
from fitfinder.verdict import FITS, NO_FIT, limit_of

# "Well over the budget": the pre-screen decides a point without a probe when some phase is
# estimated at this many times the budget or more. The estimate matches the sim meter's bytes
# exactly on CPU; on a card it misses what it does not model (kernels' own scratch memory,
# fragmentation beyond the allowance), a few percent. A quarter of the budget leaves every
# point near the boundary to a real probe.
PRESCREEN_FACTOR = 1.25


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

    def outcome(self, request: ProbeRequest, purpose: Purpose = "") -> ProbeResult | None:
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
# (planner.Guide; it widens past any disagreement a probe shows). On the CPU the estimate matches
# the sim meter to the byte (benchmarks/estimate_accuracy.py holds it to 2%); on a card it misses
# what it does not model, a few percent, until scripts/gpu_check.sh measures it: 10%.
GUIDE_BAND = {"sim": 0.02, "cuda": 0.10}
_guides: dict[tuple, Any] = {}


def guide_for(enabled: bool | None, job, meter: str, gpu: int = 0, runner=None):
    """The estimates that guide a search (planner.plan_guided), or None: on by default with the
    cuda meter, whose probes cost minutes. One per job and card in a process, so that the loop
    and the search's end share what was estimated; they run from `runner` (a probe server)."""
    if not (meter == "cuda" if enabled is None else enabled):
        return None
    key = (str(job.source), meter, gpu, job.settings.vram_bytes, job.settings.trainer_command)
    if key not in _guides:
        runner = runner or probe.ProbeRunner(job.settings.probe_timeout)
        model = overheads.for_gpu(gpu) if meter == "cuda" else GpuOverhead.none()
        band = GUIDE_BAND[meter]
        fitted = _trainer_fit(job, meter, gpu)
        if fitted is not None:  # probes through the user's trainer: the fit of its earlier probes here
            model, band = fitted.overhead, max(fitted.band, GUIDE_BAND["sim"])
        estimator = Estimator(job, runner, model)
        _guides[key] = planner.Guide(estimator.phases_or_none, band)
    return _guides[key]


def _trainer_fit(job, meter: str, gpu: int):
    """`fitfinder calibrate --study`'s fit of the job's trainer on this card, or None (no trainer
    command, or no fit stored yet)."""
    if job.settings.trainer_command is None:
        return None
    card = overheads.gpu_name(gpu) if meter == "cuda" else overheads.SIM_CARD
    return overheads.trainer_fit(card, dialects.dialect_of(job).key) if card else None


def prescreen_for(enabled: bool | None, runner, budget_bytes: int | None, meter: str, gpu: int = 0) -> Prescreen | None:
    """The search's pre-screen: on by default with the cuda meter (whose probes cost minutes),
    off by default with the sim meter (whose probes cost what an estimate costs)."""
    if not (meter == "cuda" if enabled is None else enabled):
        return None
    model = overheads.for_gpu(gpu) if meter == "cuda" else GpuOverhead.none()
    return Prescreen(runner, budget_bytes, meter, model)


# -- fitfinder estimate --search: the search's planner on estimates --------------------------------
@dataclass
class EstimateSearch:
    """What the planner found when every point is estimated instead of probed."""

    space: Any
    best: Any  # planner.Result or None
    known: Any  # planner.Knowledge
    estimates_run: int
    proven: bool
    budget_bytes: int
    limit_bytes: int
    alternatives: list = field(default_factory=list)  # other speed settings predicted to fit at the best quality
    estimator: Estimator | None = None  # what was estimated, for a search at another budget (tiers)

    def as_json(self) -> dict[str, Any]:
        best = self.best
        return {"status": "fit" if best else "none", "verdict": FITS if best else NO_FIT,
                "best": best.point if best else None,
                "peak_bytes": best.peak_bytes if best else None, "phases": best.phases if best else None,
                "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                "ram_bytes": self.known.ram_bytes, "host_peak_bytes": best.host_peak_bytes if best else None,
                "host_phases": best.host_phases if best else None,
                "estimates": self.estimates_run, "proven": self.proven,
                "also_fit": [r.point for r in self.alternatives],
                "explanation": planner.explain(self.space, self.known, best.point) if best else []}


def search(job, runner, overhead: GpuOverhead, on_estimate=None, estimator: Estimator | None = None,
           budget_bytes: int | None = None, judge_host: bool = True) -> EstimateSearch:
    """The search's planner (planner.drive), each planned point estimated instead of probed.

    Nothing is written to studies/: a study holds measurements, and a later real search resuming
    it must not take predictions for them. An estimate is deterministic, so the planner's
    confirmation of the winner repeats it from memory, and one that fails stops the search with
    its error (the next point would fail the same way). Speed is not estimated: among the points
    of the best quality, every speed setting predicted to fit is reported. `estimator` shares
    estimates between searches of the same job at several budgets (`budget_bytes`, default the
    job's). With `judge_host` (the default) host peaks are held to the job's RAM budget, if it has one.
    """
    estimator = estimator or Estimator(job, runner, overhead)
    space = estimator.space
    budget = budget_bytes or job.settings.vram_bytes
    limit = limit_of(budget, job.settings.margin)
    known = planner.Knowledge(space, limit, job.settings.ram_bytes if judge_host else None)
    runs_before = estimator.runs

    def estimate_step(step) -> None:
        result = _as_result(len(known.results), step, estimator.of(step.point))
        known.add(result)
        if on_estimate is not None:
            on_estimate(space, result, budget)

    proven, _ = planner.drive(space, known, estimate_step, 0, job.settings.trials)
    best, alternatives = _fastest_candidates(space, known, planner.best(space, known))
    return EstimateSearch(space=space, best=best, known=known, estimates_run=estimator.runs - runs_before,
                          proven=proven, budget_bytes=budget, limit_bytes=limit, alternatives=alternatives,
                          estimator=estimator)


def _as_result(trial: int, step, found: Estimate):
    """An estimate as the planner's Result: every phase's peak, judged against the limit as a
    probe that ran would be (a phase over the limit rules out what is heavier on its knobs)."""
    return planner.Result(trial=trial, point=step.point, status="ok", peak_bytes=found.peak_bytes, phases=found.phases,
                  host_phases=host_phases(found.phase_stats), confirm=step.purpose == "confirm",
                  extra={"purpose": step.purpose, "estimated": True, "seconds": found.seconds})


def host_phases(phase_stats: dict[str, Any]) -> dict[str, int]:
    """Each phase's host peak (`peak_host`: the process and its host tensors) from a result's phase stats."""
    return {name: int(stats["peak_host"]) for name, stats in phase_stats.items() if stats.get("peak_host") is not None}


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
