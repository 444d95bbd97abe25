"""The plan as the study's Optuna sampler: `FitSampler`, whose relative sampling is the plan.

Optuna's extension point for "which point next" is `BaseSampler.sample_relative`; here it reads
what the study knows and which points its RUNNING trials are probing, and answers with
`planner.next_step` (plan_around those pending points, or plan_guided on estimates). Every study
a search opens is created with it, and the CLI's workers ask it for their next point too
(`FitSampler.next_step`), so one plan decides every trial.

The workers do not let Optuna create their trials, though: `study.ask()` writes an empty
RUNNING trial first and each parameter after it, one storage call each (tests/test_sampler.py
shows the trial visible with no point while the sampler runs), so a second worker reading in
between sees a trial without a point and plans that point again, and neither finds the other a
duplicate. `study.claim` creates the trial with its whole point, purpose and owner in one
transaction instead (under a file lock on SQLite), which is what keeps several workers from
probing a point twice. One process continuing a search from Python has no such race:

    study = optuna.load_study(study_name=NAME, storage=URL, sampler=FitSampler(space, limit_bytes))
    study.optimize(search.probe_objective(job, space, limit_bytes))   # stops when the plan is done
"""

from __future__ import annotations

from typing import Any

import optuna

from fitfinder.search import study as studies
from fitfinder.search.planner import Knowledge, Step, next_step
from fitfinder.space import Point, Space

class FitSampler(optuna.samplers.BaseSampler):
    """Samples the point the plan asks for next; `guide`: estimates the plan trusts (or None)."""

    NAME = "FitSampler: fitfinder's plan (search.planner.next_step) over the study's trials"

    def __init__(self, space: Space, limit_bytes: int | None, guide=None, ram_bytes: int | None = None):
        self.space, self.limit_bytes, self.guide = space, limit_bytes, guide
        self.ram_bytes = ram_bytes  # the host's budget (--ram), or None
        self.purposes: dict[int, str] = {}  # trial number -> the stage of the plan that sampled it

    def next_step(self, known: Knowledge, pending: list[Point]) -> Step:
        """The plan's next step, given what is known and the points being probed."""
        return next_step(self.space, known, pending, self.guide)

    def infer_relative_search_space(self, study, trial) -> dict[str, Any]:
        return studies.distributions(self.space)

    def sample_relative(self, study, trial, search_space: dict[str, Any]) -> dict[str, Any]:
        """The plan's next point, its stage as the trial's `purpose`; {} when the plan asks for none
        (done, or waiting for the pending probes), and the objective then probes nothing."""
        if not search_space:
            return {}
        known, pending = studies.read(study, self.space, self.limit_bytes, self.ram_bytes)
        step = self.next_step(known, pending)
        if step.point is None:
            return {}
        study._storage.set_trial_user_attr(trial._trial_id, "purpose", step.purpose)  # for the dashboard
        self.purposes[trial.number] = step.purpose
        return dict(step.point)

    def sample_independent(self, study, trial, param_name: str, param_distribution) -> Any:
        raise RuntimeError(f"FitSampler: the plan asked for no point, so there is no {param_name} to suggest; "
                           "a probe objective checks the trial's `purpose` before suggesting")

    def after_trial(self, study, trial, state, values) -> None:
        """Inside `study.optimize`: stop once the plan has nothing left to probe, so that no trial
        is asked for after the last one. Optuna calls this before it stores the trial's state: the
        trial still reads as RUNNING, so it is taken for the result its attributes already hold."""
        if not getattr(study._thread_local, "in_optimize_loop", False):
            return  # a worker's own tell: its loop asks the plan itself
        known, pending = studies.read(study, self.space, self.limit_bytes, self.ram_bytes)
        point = studies.params_of(trial)
        if point in pending:
            pending.remove(point)
        if trial.user_attrs.get("status") in studies.PROBED and self.space.contains(point):
            known.add(studies.result_from_trial(trial, point))
        if self.next_step(known, pending).point is None and not pending:
            study.stop()
