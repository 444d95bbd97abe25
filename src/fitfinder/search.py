"""The search: which point to probe next, what is known, when the answer is proven.

The plan is a pure function of what the study already knows, so rerunning the same command
resumes where it stopped, and every decision can be explained by the trials behind it:

1. Trial 0 is the base file as written (the desired point).
2. Quality, knob by knob in priority order: first the optimistic point (every remaining quality
   knob as desired, every speed knob at its lightest); if it does not fit, bisect the knob
   between the highest level known to fit and the lowest known not to, with the knobs after it
   at their lightest. Memory is monotone in every knob, so a point at least as heavy as one
   that failed fails, and one at most as heavy as one that fit fits: such points are never
   probed. This finds the lexicographic optimum exactly.
3. Speed, at the best quality: for each setting of the other speed knobs (checkpointing off
   first), the batch is raised one step at a time while it fits; each maximal point is probed
   once for its seconds per sample, unless a heavier point that fits makes it slower for sure.
   The fastest wins.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from fitfinder.space import Point, Space

FIT, NOFIT = "fit", "nofit"


@dataclass
class Result:
    """What one trial says about one point."""

    trial: int
    point: Point
    status: str  # ok | oom | error | timeout
    peak_bytes: int | None = None
    seconds_per_sample: float | None = None
    phase: str | None = None
    error: str | None = None
    verdict: str | None = None  # FIT, NOFIT, or None (an error says nothing about memory)
    extra: dict[str, Any] = field(default_factory=dict)


class Knowledge:
    """Every result so far, and what they imply through dominance."""

    def __init__(self, space: Space, limit_bytes: int | None):
        self.space = space
        self.limit_bytes = limit_bytes
        self.results: list[Result] = []
        self._by_key: dict[tuple, list[Result]] = {}

    def add(self, result: Result) -> Result:
        result.verdict = self.verdict_of(result.status, result.peak_bytes)
        self.results.append(result)
        self._by_key.setdefault(self.space.key(result.point), []).append(result)
        return result

    def verdict_of(self, status: str, peak_bytes: int | None) -> str | None:
        """ok under the limit fits; an OOM, or ok over the limit (inside the margin), does not."""
        if status == "oom":
            return NOFIT
        if status == "ok":
            over = self.limit_bytes is not None and peak_bytes is not None and peak_bytes > self.limit_bytes
            return NOFIT if over else FIT
        return None

    def probed(self, point: Point) -> list[Result]:
        return self._by_key.get(self.space.key(point), [])

    def state(self, point: Point) -> str | None:
        """FIT, NOFIT or unknown (None); a point that errored counts as NOFIT, for itself only."""
        return self.decider(point)[0]

    def decider(self, point: Point) -> tuple[str | None, Result | None]:
        """The state of `point` and the result that decides it. Failure wins over fit."""
        own = self.probed(point)
        for result in own:
            if result.verdict == NOFIT or result.verdict is None:
                return NOFIT, result
        heavier = self.space.heavier_or_equal
        for result in self.results:
            if result.verdict == NOFIT and heavier(point, result.point):
                return NOFIT, result
        for result in own:
            if result.verdict == FIT:
                return FIT, result
        for result in self.results:
            if result.verdict == FIT and heavier(result.point, point):
                return FIT, result
        return None, None

    def fits(self) -> list[Result]:
        return [r for r in self.results if r.verdict == FIT and self.state(r.point) == FIT]


# -- the plan ----------------------------------------------------------------------------------
def plan(space: Space, known: Knowledge) -> Point | None:
    """The next point to probe, or None when the best point is proven (or nothing fits)."""
    desired = space.desired()
    if not known.probed(desired):
        return desired
    probe, quality = _quality_stage(space, known)
    if probe is not None or quality is None:
        return probe
    return _speed_stage(space, known, quality)


def _lightest_speed(space: Space) -> Point:
    return {k.name: k.candidates[0] for k in space.speed_knobs}


def _quality_stage(space: Space, known: Knowledge) -> tuple[Point | None, Point | None]:
    """(point to probe, None), or (None, best quality values), or (None, None) if nothing fits."""
    light = _lightest_speed(space)
    quality = space.quality_knobs
    fixed: Point = {}
    for i, knob in enumerate(quality):
        rest = quality[i:]
        optimistic = {**fixed, **{k.name: k.desired for k in rest}, **light}
        state = known.state(optimistic)
        if state is None:
            return optimistic, None
        if state == FIT:
            return None, {**fixed, **{k.name: k.desired for k in rest}}
        lower = {k.name: k.candidates[0] for k in quality[i + 1:]}
        top = knob.level(knob.desired)
        lo, hi = _bounds(known, lambda level: {**fixed, knob.name: knob.candidates[level], **lower, **light}, top)
        if hi - lo > 1:
            # The desired value with everything after it at its lightest first: the knobs after
            # this one are what usually broke the optimistic point. Then bisect, leaning high.
            level = top if hi > top else (lo + hi + 1) // 2
            return {**fixed, knob.name: knob.candidates[level], **lower, **light}, None
        if lo < 0:
            return None, None  # not even the lightest value of the first knob fits
        fixed[knob.name] = knob.candidates[lo]
    return None, fixed


def _bounds(known: Knowledge, line, top: int) -> tuple[int, int]:
    """(highest level known to fit or -1, lowest level above it known not to fit or top + 1)."""
    states = [known.state(line(level)) for level in range(top + 1)]
    lo = max((level for level, s in enumerate(states) if s == FIT), default=-1)
    hi = min((level for level, s in enumerate(states) if s == NOFIT and level > lo), default=top + 1)
    return lo, hi


def _speed_stage(space: Space, known: Knowledge, quality: Point) -> Point | None:
    """Probe the largest batch that fits for each setting of the other speed knobs."""
    speed = space.speed_knobs
    if not speed:
        return None
    chain = max(speed, key=lambda k: len(k.candidates))  # the knob worth bisecting: batch
    others = [k for k in speed if k is not chain]
    maximal: list[Point] = []
    combos = itertools.product(*(reversed(k.candidates) for k in others))  # heaviest first
    for combo in combos:
        setting = {**quality, **dict(zip((k.name for k in others), combo))}
        line = lambda level, s=setting: {**s, chain.name: chain.candidates[level]}  # noqa: E731
        lo, hi = _bounds(known, line, len(chain.candidates) - 1)
        if hi - lo > 1:
            return line(lo + 1)  # escalate one step at a time, as the seeds do: chains are short
        if lo >= 0:
            maximal.append(line(lo))
    for point in maximal:
        surely_slower = any(other != point and space.heavier_or_equal(other, point) for other in maximal)
        if not surely_slower and not any(r.verdict == FIT for r in known.probed(point)):
            return point  # fits by dominance, but its speed is not measured yet
    return None


def best(space: Space, known: Knowledge) -> Result | None:
    """The highest-quality point that fits; among equals the fewest seconds per sample."""
    fits = known.fits()
    if not fits:
        return None
    return max(fits, key=lambda r: (space.quality_key(r.point), -(r.seconds_per_sample or math.inf)))


# -- the loop ----------------------------------------------------------------------------------
@dataclass
class SearchOptions:
    study_name: str
    meter: str = "sim"  # sim | cuda
    gpu: int = 0
    storage: str | None = None
    studies_dir: Any = "studies"
    results_dir: Any = "results"


@dataclass
class SearchSummary:
    status: str  # fit | none
    study: str
    storage: str
    trials: int
    probes_run: int
    proven: bool
    best: Result | None
    best_point: Point | None
    best_file: str | None
    budget_bytes: int | None
    limit_bytes: int | None
    space: Space | None = None
    lightest: Result | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status, "study": self.study, "storage": self.storage, "trials": self.trials,
            "probes_run": self.probes_run, "proven": self.proven,
            "best": self.best_point, "best_file": self.best_file,
            "peak_bytes": self.best.peak_bytes if self.best else None,
            "seconds_per_sample": self.best.seconds_per_sample if self.best else None,
            "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
        }


def run(job, options: SearchOptions, out) -> SearchSummary:
    """Probe planned points until the best is proven or the trial cap is reached; export it."""
    from pathlib import Path

    from fitfinder import probe, space as spaces, study as studies
    from fitfinder.output import usage_bar

    settings = job.settings
    space = spaces.build(job)
    budget = settings.vram_bytes
    limit = int(budget * (1 - settings.margin)) if budget else None
    url = studies.storage_url(options.study_name, Path(options.studies_dir), options.storage)
    study = studies.open_study(url, options.study_name, space,
                               {"budget_bytes": budget, "margin": settings.margin, "meter": options.meter,
                                "job_file": str(job.source)})
    known = studies.load_knowledge(study, space, limit, fail_running=True)
    probes_run = sum(1 for r in known.results)
    out.note(f"study {options.study_name} ({url}): {len(space.knobs)} knobs, {space.size()} points, "
             f"{probes_run} trials already known; budget {usage_bar(None, None) if not budget else _fmt(budget)}, "
             f"limit {_fmt(limit) if limit else '-'} after the {settings.margin:.0%} margin")
    log_dir = Path(options.results_dir) / options.study_name / "probes"
    log_dir.mkdir(parents=True, exist_ok=True)
    runner = probe.ProbeRunner(timeout_s=settings.probe_timeout)
    faults = _faults_from_env()
    point = plan(space, known)
    with out.progress(settings.trials, "probing"):
        while point is not None and probes_run < settings.trials:
            trial = studies.ask(study, space, point)
            request = probe.request_for(space.apply(job, point), settings.probe_steps, options.meter, budget,
                                        options.gpu)
            if trial.number in faults:
                request["fault"] = faults[trial.number]
            try:
                outcome = runner.run(request, log_dir / f"trial-{trial.number:04d}.log")
            except KeyboardInterrupt:
                study.tell(trial, state=studies._fail_state(), skip_if_finished=True)
                raise
            result = known.add(_result(trial.number, point, outcome))
            studies.record(study, trial, space, result, outcome, limit)
            probes_run += 1
            out.trial(space, result, budget)
            out.advance()
            _stop_if_probes_keep_failing(known, log_dir)
            point = plan(space, known)
    proven = point is None
    return _finish(job, space, study, known, options, settings, url, probes_run, proven, budget, limit, out)


MAX_ERRORS_IN_A_ROW = 5


def _stop_if_probes_keep_failing(known: Knowledge, log_dir) -> None:
    """Errors are not OOMs: when every recent probe fails with one, the job itself is broken."""
    from fitfinder.errors import RunFailed

    recent = known.results[-MAX_ERRORS_IN_A_ROW:]
    if len(recent) == MAX_ERRORS_IN_A_ROW and all(r.status in ("error", "timeout") for r in recent):
        last = recent[-1]
        raise RunFailed(f"the last {MAX_ERRORS_IN_A_ROW} probes failed with errors, not out of memory: "
                        f"{(last.error or '').splitlines()[0][:300]}; see {log_dir}/trial-{last.trial:04d}.log")


def _result(trial: int, point: Point, outcome: dict[str, Any]) -> Result:
    per_step = outcome.get("seconds_per_step")
    batch = point.get("batch")
    return Result(trial=trial, point=point, status=outcome["status"], peak_bytes=outcome.get("peak_bytes"),
                  seconds_per_sample=round(per_step / batch, 6) if per_step and batch else per_step,
                  phase=outcome.get("phase"), error=outcome.get("error"),
                  extra={"phases": outcome.get("phases", {}), "seconds_per_step": per_step})


def _finish(job, space, study, known, options, settings, url, probes_run, proven, budget, limit, out) -> SearchSummary:
    from pathlib import Path

    from fitfinder import report

    winner = best(space, known)
    results_dir = Path(options.results_dir) / options.study_name
    report.write_trials_csv(study, space, results_dir / "trials.csv")
    best_file = None
    if winner is not None:
        facts = report.fit_facts(winner, budget, settings.margin, options.meter, options.study_name)
        if not proven:
            facts.append(f"The search stopped at its cap of {settings.trials} probes before proving this is the best.")
        best_file = str(report.export_best(job, space, winner.point, results_dir, facts))
    lightest = min((r for r in known.results if r.peak_bytes),
                   key=lambda r: (sum(k.level(r.point[k.name]) for k in space.knobs), r.peak_bytes), default=None)
    summary = SearchSummary(status="fit" if winner else "none", study=options.study_name, storage=url,
                            trials=len(study.trials), probes_run=probes_run, proven=proven, best=winner,
                            best_point=winner.point if winner else None, best_file=best_file,
                            budget_bytes=budget, limit_bytes=limit, space=space, lightest=lightest)
    report.write_report(study, space, known, results_dir, summary.as_json())  # summary.json, report.html
    return summary


def _fmt(n: int | None) -> str:
    from fitfinder.units import format_bytes

    return format_bytes(n)


def _faults_from_env() -> dict[int, str]:
    """FITFINDER_PROBE_FAULT="1:abort,2:hang": make those trials' probes fail on purpose (tests)."""
    import os

    faults = {}
    for item in filter(None, os.environ.get("FITFINDER_PROBE_FAULT", "").split(",")):
        number, _, fault = item.partition(":")
        faults[int(number)] = fault
    return faults


# -- explanation -----------------------------------------------------------------------------
def explain(space: Space, known: Knowledge, winner: Point) -> list[dict[str, Any]]:
    """Knob by knob: desired, chosen, kept / given up / gone past, and the trial that forced it.

    A quality knob below its desired value was forced down by the result that rules out the next
    level up (with every knob after it at its lightest, so nothing else is to blame); a speed
    knob lighter than desired, by the result that rules out the next heavier step at the winner.
    """
    rows = []
    light = {k.name: k.candidates[0] for k in space.knobs}
    for index, knob in enumerate(space.knobs):
        chosen, desired = winner[knob.name], knob.desired
        level, wanted = knob.level(chosen), knob.level(desired)
        verdict = "kept" if level == wanted else ("given up" if level < wanted else "gone past")
        forced_by = None
        if level < wanted and level + 1 < len(knob.candidates):
            if knob.role == "quality":
                later = {k.name: light[k.name] for k in space.knobs[index + 1:]}
                probe_point = {**winner, **later, knob.name: knob.candidates[level + 1]}
            else:
                probe_point = {**winner, knob.name: knob.candidates[level + 1]}
            state, result = known.decider(probe_point)
            forced_by = result.trial if state == NOFIT and result is not None else None
        rows.append({"knob": knob.name, "role": knob.role, "desired": desired, "chosen": chosen,
                     "verdict": verdict, "forced_by": forced_by})
    return rows
