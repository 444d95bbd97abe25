"""The search's loop: open the study, let the workers probe the plan, and summarize what is known.

`run` returns a SearchSummary and writes nothing under results/: the CLI writes the results
(results.report.write_results), as `fitfinder report` does from the same `summarize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitfinder import space as spaces, trainers
from fitfinder.probe import faults
from fitfinder.search import estimated, outputs, study as studies, worker as workers
from fitfinder.search.planner import ATTEMPTS, HOST_MEMORY, Knowledge, Result, best, best_tight, explain, plan
from fitfinder.space import Point, Space
from fitfinder.units import format_bytes
from fitfinder.verdict import FITS, NO_FIT


@dataclass
class SearchOptions:
    study_name: str
    meter: str = "sim"  # sim | cuda
    gpu: int = 0
    storage: str | None = None
    studies_dir: Any = "studies"
    results_dir: Any = "results"
    workers: int = 1  # worker processes on this machine
    gpus: tuple[int, ...] = ()  # with the cuda meter: one worker per GPU
    worker: bool = False  # this process is one of the workers a search launched
    budget_is_card: bool = False  # no --vram: the budget is the card's memory
    prescreen: bool | None = None  # estimate first, decide points well over the budget (None: with cuda)
    guided: bool | None = None  # plan on estimates, probe where they cannot decide (None: with cuda)


@dataclass
class SearchSummary:
    status: str  # fit | none
    study: str
    storage: str
    trials: int
    probes_run: int
    finished: bool  # the plan ended (else the trial cap stopped it)
    best: Result | None
    best_point: Point | None
    best_file: str | None
    budget_bytes: int | None
    limit_bytes: int | None
    space: Space | None = None
    lightest: Result | None = None
    explanation: list[dict[str, Any]] = field(default_factory=list)
    excluded: list[Result] = field(default_factory=list)  # points whose probes failed ATTEMPTS times
    # What writing the results reads (not part of the JSON summary):
    known: Knowledge | None = None
    optuna_study: Any = None
    margin: float = 0.0
    meter: str = ""
    trial_cap: int | None = None  # the search's --trials, for best.yaml's header when not proven
    ram_bytes: int | None = None  # the host's budget the results were judged against

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status, "verdict": FITS if self.best else NO_FIT,
            "study": self.study, "storage": self.storage, "trials": self.trials,
            "probes_run": self.probes_run, "proven": self.proven,
            "best": self.best_point, "best_file": self.best_file,
            "peak_bytes": self.best.peak_bytes if self.best else None,
            "seconds_per_sample": self.best.seconds_per_sample if self.best else None,
            "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
            "ram_bytes": self.ram_bytes, "host_peak_bytes": self.best.host_peak_bytes if self.best else None,
            "phase_peaks": phase_peaks(self.best) if self.best else None,
            "host_walls": [{"trial": r.trial, "point": r.point, "phases": list(r.host_failed_phases),
                            "reason": HOST_MEMORY} for r in self.host_walls()],
            "explanation": self.explanation,
            "excluded": [{"trial": r.trial, "point": r.point, "error": (r.error or "")[:300]} for r in self.excluded],
            "proven_around": self.proven_around(),  # '' when the proof is whole; the CLI and the report say it
        }

    def host_walls(self) -> list[Result]:
        """The probes that did not fit only because the host ran out (or passed the RAM budget)."""
        return [r for r in (self.known.results if self.known else []) if r.wall_reason == HOST_MEMORY]

    def closest_tight(self) -> Result | None:
        """The highest-quality probe that ran under the budget but past the limit (tight: a
        search picks it only with --margin 0), of at least the winner's quality; or None."""
        if self.known is None:
            return None
        return best_tight(self.space, self.known, self.budget_bytes, self.best_point)

    @property
    def proven(self) -> bool:
        """No other point can be better: the plan ended, and no point it needed stayed unknown
        because its probes failed (`excluded`). The CLI's line, summary.json and the report say this."""
        return self.finished and not self.excluded

    def proven_around(self) -> str:
        """'' when the proof is whole; else what it could not look at, for the summary line."""
        if not self.excluded:
            return ""
        trials = ", ".join(str(r.trial) for r in self.excluded)
        return (f"proven only around {len(self.excluded)} point(s) whose probes failed {ATTEMPTS} times "
                f"without running out of memory (trial {trials})")


def phase_peaks(result: Result) -> dict[str, dict[str, int | None]]:
    """Each phase's device peak and host peak (`host_peak_bytes`) of one result, for summary.json."""
    return {phase: {"peak_bytes": peak, "host_peak_bytes": result.host_phases.get(phase)}
            for phase, peak in result.phases.items()}


def summarize(study, space: Space, known: Knowledge, url: str, best_file: Path | None,
              finished: bool | None = None, trial_cap: int | None = None, margin: float | None = None,
              meter: str | None = None, probes_run: int | None = None) -> SearchSummary:
    """What a study says: the winner, why, and what was left out. The one builder of the summary,
    for the search's end and for `fitfinder report` (`finished`: None asks the plan; `best_file`:
    where the winner is or will be written, if it is; `margin`, `meter`: this search's, else the
    study's; `probes_run`: what the search counted against its cap, else the results read)."""
    attrs = study.user_attrs
    winner = best(space, known)
    lightest = min((r for r in known.results if r.peak_bytes),
                   key=lambda r: (sum(k.level(r.point[k.name]) for k in space.knobs), r.peak_bytes), default=None)
    return SearchSummary(status="fit" if winner else "none", study=study.study_name, storage=url,
                         trials=len(study.trials), probes_run=len(known.results) if probes_run is None else probes_run,
                         finished=plan(space, known).point is None if finished is None else finished,
                         best=winner, best_point=winner.point if winner else None,
                         best_file=str(best_file) if winner and best_file is not None else None,
                         budget_bytes=attrs.get("budget_bytes"), limit_bytes=known.limit_bytes, space=space,
                         lightest=lightest, explanation=explain(space, known, winner.point) if winner else [],
                         excluded=known.excluded(), known=known, optuna_study=study,
                         margin=float(attrs.get("margin", 0.0)) if margin is None else margin,
                         meter=str(attrs.get("meter", "")) if meter is None else meter,
                         trial_cap=trial_cap, ram_bytes=known.ram_bytes)


def run(job, options: SearchOptions, out) -> SearchSummary | None:
    """Probe planned points until the best is confirmed or the trial cap is reached; summarize.

    With several workers this process only launches them (one per GPU, or --workers on the
    CPU) and waits; a worker probes and returns None.
    """
    from fitfinder.search.sampler import FitSampler  # optuna: imported once a search runs

    settings = job.settings
    space = spaces.build(job)
    _refuse_before_writing(job, options)
    budget, ram = settings.vram_bytes, settings.ram_bytes
    limit = int(budget * (1 - settings.margin)) if budget else None
    url = studies.storage_url(options.study_name, Path(options.studies_dir), options.storage)
    study = studies.open_study(url, options.study_name, space,
                               {"budget_bytes": budget, "margin": settings.margin, "meter": options.meter,
                                "job_file": str(job.source), "budget_is_card": options.budget_is_card,
                                "trainer_command": settings.trainer_command},
                               FitSampler(space, limit, ram_bytes=ram))
    if options.worker:
        with studies.writable(options.study_name, url):
            workers.work(job, space, study, options, limit, out)
        return None
    # The RAM budget may differ between runs (by default what the machine has available as each starts):
    # the study's results are judged against this run's, and the report reads the last one.
    with studies.writable(options.study_name, url):
        study.set_user_attr("ram_bytes", ram)
    known = studies.load_knowledge(study, space, limit, ram)
    out.note(f"study {options.study_name} ({url}): {len(space.knobs)} knobs, {space.size()} points, "
             f"{len(known.results)} trials already known; budget {format_bytes(budget)}, "
             f"limit {format_bytes(limit)} after the {settings.margin:.0%} margin"
             + (f"; RAM {format_bytes(ram)}" if ram else ""))
    count = len(options.gpus) or options.workers
    with studies.writable(options.study_name, url):
        if count > 1:
            workers.launch(job, options, url, count, out)
        else:
            workers.work(job, space, study, options, limit, out)
        studies.fail_stale(study)  # a worker killed after the others finished: its trial says why
    known, pending = studies.read(study, space, limit, ram)
    sampler = FitSampler(space, limit, estimated.guide_for(options.guided, job, options.meter, options.gpu), ram)
    finished = sampler.next_step(known, pending).point is None and not pending
    best_file = Path(options.results_dir) / options.study_name / getattr(job, "best_name", "best.yaml")
    return summarize(study, space, known, url, best_file, finished, settings.trials, settings.margin, options.meter,
                     studies.probes_in(study))


def _refuse_before_writing(job, options: SearchOptions) -> None:
    """Bad input found before studies/ and results/ are written: the test hooks' variables, a
    name too long for a file, a storage that is not a study's, the search's own outputs as its
    input or in the way (search.outputs), model weights not there."""
    faults.probe_faults()
    faults.kill_point()
    studies.heartbeat()
    studies.check_name(options.study_name)
    sqlite = studies.sqlite_file(options.study_name, Path(options.studies_dir), options.storage)
    outputs.check(job.source, options.results_dir, options.study_name, sqlite,
                  (*outputs.SEARCH, getattr(job, "best_name", "best.yaml")))
    if sqlite is not None:
        studies.refuse_foreign_sqlite(sqlite, options.storage)
    trainers.model_spec(job)  # a missing model path says so now, not after the study is made

