"""The Optuna study that holds a search: one trial per probe, every probe fact as a user attribute.

How results map onto trial states (the sampler and the dashboard both read them):

- fits under the limit            -> COMPLETE, constraint `peak_over_limit` <= 0
- ran, but inside the margin      -> COMPLETE, constraint `peak_over_limit` > 0 (infeasible)
- ran out of memory               -> PRUNED. A run that died has no objective values to report;
  Optuna's TPE ranks pruned trials below every completed one, so the sampler learns to avoid
  the region, and the dashboard shows them as pruned, the way users read an OOM.
- crashed, hung, no result line   -> FAIL, with the reason in `error`.
- decided without a probe         -> PRUNED with `status: decided` and `decided_by` (the trial
  whose result rules it out): points the plan would have probed, had dominance not settled them.
- estimated well over the budget  -> PRUNED with `status: oom` and `estimated: true` (the search's
  pre-screen, estimate.Prescreen): the predicted phase and peaks instead of measured ones. It
  reads back on resume as the out-of-memory it stands for, so dominance treats it as one.

Each trial's `purpose` says which stage of the plan asked for it: base, rollback, quality,
speed or confirm (a confirmation runs longer).

Objectives: `quality` (the lexicographic quality key as one integer, maximize) and
`seconds_per_sample` (minimize).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fitfinder.errors import UserError
from fitfinder.search import Knowledge, Result
from fitfinder.space import Point, Space

METRICS = ("quality", "seconds_per_sample")


def storage_url(name: str, studies_dir: Path, storage: str | None) -> str:
    """`--storage` as given, or the SQLite file studies/NAME.db."""
    if storage:
        return storage
    studies_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(studies_dir / f'{name}.db').resolve()}"


def open_study(url: str, name: str, space: Space, setup: dict[str, Any]):
    """Create the study, or load it to resume; refuses one made for a different space or budget."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    signature = space_signature(space)
    study = optuna.create_study(
        storage=url, study_name=name, load_if_exists=True, directions=["maximize", "minimize"],
        sampler=optuna.samplers.TPESampler(seed=0),
    )
    stored = study.user_attrs.get("space")
    if stored is None:
        study.set_metric_names(list(METRICS))
        study.set_user_attr("space", signature)
        for key, value in setup.items():
            study.set_user_attr(key, value)
    elif stored != signature or study.user_attrs.get("budget_bytes") != setup.get("budget_bytes"):
        raise UserError(
            f"study {name!r} in {url} was made for a different job or budget; "
            f"use --study with a new name, or delete the study to start over"
        )
    return study


def space_signature(space: Space) -> dict[str, list]:
    return {k.name: list(k.candidates) for k in space.knobs}


def distributions(space: Space) -> dict[str, Any]:
    import optuna

    return {k.name: optuna.distributions.CategoricalDistribution(list(k.candidates)) for k in space.knobs}


def load_knowledge(study, space: Space, limit_bytes: int | None, fail_running: bool = False) -> Knowledge:
    """Rebuild what is known from the finished trials.

    With `fail_running` (one worker, starting up), trials still marked running were left by a
    search that died mid-probe: they are marked failed so their points are planned again.
    """
    from optuna.trial import TrialState

    known = Knowledge(space, limit_bytes)
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.RUNNING and fail_running:
            trial_id = trial._trial_id
            study._storage.set_trial_user_attr(trial_id, "error", "the search stopped during this probe")
            study._storage.set_trial_state_values(trial_id, TrialState.FAIL)
            continue
        finished = trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        if finished and trial.user_attrs.get("status") in ("ok", "oom", "error", "timeout"):
            known.add(result_from_trial(trial))
    return known


def result_from_trial(trial) -> Result:
    attrs = trial.user_attrs
    return Result(trial=trial.number, point=dict(attrs["point"]), status=attrs["status"],
                  peak_bytes=attrs.get("peak_bytes"), seconds_per_sample=attrs.get("seconds_per_sample"),
                  phase=attrs.get("phase"), error=attrs.get("error"), phases=dict(attrs.get("phases") or {}),
                  confirm=attrs.get("purpose") == "confirm",
                  extra={"seconds_per_step": attrs.get("seconds_per_step"), "purpose": attrs.get("purpose"),
                         "wall_seconds": attrs.get("wall_seconds"), "estimated": bool(attrs.get("estimated"))})


def decided_keys(study, space: Space) -> set[tuple]:
    """Points already recorded as decided, so a resumed search does not record them twice."""
    return {space.key(t.user_attrs["point"]) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("status") == "decided"}


def ask(study, space: Space, point: Point, purpose: str = ""):
    """Enqueue the planned point and take it: the trial's parameters are exactly that point."""
    study.enqueue_trial(point, user_attrs={"purpose": purpose}, skip_if_exists=False)
    trial = study.ask(distributions(space))
    if {k: trial.params.get(k) for k in point} != point:  # an older enqueued point came first
        study.tell(trial, state=fail_state(), skip_if_finished=True)
        trial = study.ask(distributions(space))
    return trial


def fail_state():
    from optuna.trial import TrialState

    return TrialState.FAIL


def record_decided(study, space: Space, point: Point, decider: Result) -> None:
    """A point the plan did not probe because `decider`'s result rules it out."""
    import optuna
    from optuna.trial import TrialState

    phases = ", ".join(decider.failed_phases) or "every phase"
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.PRUNED, params=point, distributions=distributions(space),
        user_attrs={"point": point, "status": "decided", "decided_by": decider.trial, "verdict": "nofit",
                    "reason": f"at least as heavy as trial {decider.trial}, which did not fit ({phases}), "
                              "on every knob that matters there"},
    ))


def record(study, trial, space: Space, result: Result, probe_result: dict[str, Any], limit_bytes: int | None,
           purpose: str = "") -> None:
    """Write the probe's facts as user attributes and finish the trial in the matching state."""
    from optuna.trial import TrialState

    attrs = {
        "purpose": purpose,
        "point": result.point,
        "status": result.status,
        "phase": result.phase,
        "peak_bytes": result.peak_bytes,
        "limit_bytes": limit_bytes,
        "phases": probe_result.get("phases", {}),
        "phase_stats": probe_result.get("phase_stats", {}),
        "seconds_per_step": probe_result.get("seconds_per_step"),
        "seconds_per_sample": result.seconds_per_sample,
        "wall_seconds": probe_result.get("wall_seconds"),
        "error": result.error,
        "oom_kind": probe_result.get("oom_kind"),
        "meter": probe_result.get("meter"),
        "verdict": result.verdict,
        "failed_phases": list(result.failed_phases),
        "estimated": bool(probe_result.get("estimated")),
    }
    for key, value in attrs.items():
        trial.set_user_attr(key, _jsonable(value))
    if result.status == "ok":
        over = 0.0 if limit_bytes is None else result.peak_bytes / limit_bytes - 1.0
        trial.set_constraint("peak_over_limit", over)
        speed = result.seconds_per_sample if result.seconds_per_sample is not None else math.inf
        study.tell(trial, [float(space.quality_rank(result.point)), speed])
    elif result.status == "oom":
        trial.set_constraint("peak_over_limit", 1.0)
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
