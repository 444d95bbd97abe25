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

Several workers share one study (processes on one machine, machines on one PostgreSQL). Every
planned point enters the study with `enqueue_trial`, and `ask` hands each waiting trial to exactly
one worker. Two workers may still plan the same point at the same moment: of the trials with the
same point and stage, the lowest-numbered one that did not fail is probed and the others are
failed as duplicates. While a probe runs its worker records heartbeats; a trial whose heartbeat
stops (its worker died) is failed by the next worker that looks, and retried once.

The storage is SQLite (studies/NAME.db) unless `--storage` names another -- also with several
workers on one machine: Optuna's journal file has no heartbeats, and a search writes a handful
of rows per probe, seconds apart, which SQLite serializes without trouble. One thing SQLite does
not do is lock the waiting trial a worker takes, so claims on a SQLite study hold a file lock
beside it (benchmarks/scaleout.py measures both).
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
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


def heartbeat() -> tuple[int, int]:
    """(seconds between heartbeats, seconds of silence after which a trial is failed):
    FITFINDER_HEARTBEAT="10,30" by default; tests shorten it."""
    import os

    interval, _, grace = os.environ.get("FITFINDER_HEARTBEAT", "10,30").partition(",")
    return int(interval), int(grace or 3 * int(interval))


def storage(url: str):
    """An Optuna RDB storage with heartbeats, a retry of trials whose worker died, and patience
    for SQLite's lock when several workers write at once."""
    import optuna

    import time

    from sqlalchemy.exc import IntegrityError, ProgrammingError

    interval, grace = heartbeat()
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine, heartbeat_interval=interval, grace_period=grace,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
            )
        except (IntegrityError, ProgrammingError):
            # Workers starting together on an empty database race to create Optuna's tables:
            # the loser sees them half made. A moment later they are all there.
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def open_study(url: str, name: str, space: Space, setup: dict[str, Any]):
    """Create the study, or load it to resume; refuses one made for a different space or budget."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Heartbeats are meant for Study.optimize; ask-and-tell with a heartbeat thread per probe is
    # what optimize does inside, so the warning says nothing here.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    signature = space_signature(space)
    try:
        study = optuna.create_study(
            storage=storage(url), study_name=name, load_if_exists=True, directions=["maximize", "minimize"],
            sampler=optuna.samplers.TPESampler(seed=0),
        )
    except ImportError as exc:  # e.g. postgresql:// without its driver
        raise UserError(f"--storage {url}: {exc}; for PostgreSQL: pip install 'fitfinder[postgres]'") from None
    except Exception as exc:  # noqa: BLE001 - a storage that cannot be reached is bad input
        if type(exc).__module__.startswith("sqlalchemy"):
            raise UserError(f"--storage {url}: cannot open it: {str(exc).splitlines()[0]}") from None
        raise
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


PROBED = ("ok", "oom", "error", "timeout")


def load_knowledge(study, space: Space, limit_bytes: int | None) -> Knowledge:
    """What the finished probes of the study say."""
    return read(study, space, limit_bytes)[0]


def read(study, space: Space, limit_bytes: int | None) -> tuple[Knowledge, list[Point]]:
    """The finished probes as Knowledge, and the points being probed or waiting for a worker."""
    from optuna.trial import TrialState

    known = Knowledge(space, limit_bytes)
    pending = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state in (TrialState.RUNNING, TrialState.WAITING):
            point = params_of(trial)
            if space.contains(point):  # a trial just asked for may still be writing its params
                pending.append(point)
        elif trial.state.is_finished() and trial.user_attrs.get("status") in PROBED:
            known.add(result_from_trial(trial))
    return known, pending


def probes_in(study) -> int:
    """Probes the study has run or is running (what the trial cap counts); points the pre-screen
    decided on an estimate were not probed."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if (t.user_attrs.get("status") in PROBED and not t.user_attrs.get("estimated"))
               or t.state == TrialState.RUNNING)


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


def claim(study, space: Space, point: Point, purpose: str = ""):
    """Enqueue the planned point and take the oldest waiting trial: this worker's point, one
    planned by another worker, or a retry. None when that trial turns out to be a duplicate."""
    with _claim_lock(study):
        study.enqueue_trial(point, user_attrs={"purpose": purpose}, skip_if_exists=False)
        return _take(study, space)


def claim_waiting(study, space: Space):
    """Take a waiting trial (a retry, or a point its planner left), or None if there is none."""
    from optuna.trial import TrialState

    with _claim_lock(study):
        if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return None
        return _take(study, space)


def _take(study, space: Space):
    trial = study.ask(distributions(space))
    if "purpose" not in trial.user_attrs:  # nothing was waiting: the sampler made this one up
        trial.set_user_attr("error", "nothing was waiting any more")
        study.tell(trial, state=fail_state())
        return None
    twin = _earlier_twin(study, trial)
    if twin is not None:
        trial.set_user_attr("error", f"duplicate of trial {twin}, planned by another worker at the same time")
        study.tell(trial, state=fail_state())
        return None
    return trial


@contextmanager
def _claim_lock(study):
    """Serialize claims on a SQLite study across the processes of this machine.

    Optuna hands a waiting trial to one worker by reading that it waits, then marking it
    running; PostgreSQL locks the row in between, SQLite does not (measured: two workers took
    the same trial), so on SQLite a file lock beside the database makes the claim atomic.
    """
    backend = getattr(study._storage, "_backend", study._storage)  # under Optuna's cache
    url = str(getattr(backend, "url", ""))
    # FITFINDER_SQLITE_CLAIM_LOCK=0 turns the lock off, only so benchmarks/scaleout.py can show why it is on.
    if not url.startswith("sqlite:///") or os.environ.get("FITFINDER_SQLITE_CLAIM_LOCK") == "0":
        yield
        return
    import fcntl

    with open(url[len("sqlite:///"):] + ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _earlier_twin(study, trial) -> int | None:
    """An earlier trial of the same point and stage that did not fail: it is the one to probe."""
    from optuna.trial import TrialState

    purpose = trial.user_attrs.get("purpose")
    for other in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING,
                                                          TrialState.COMPLETE, TrialState.PRUNED)):
        if (other.number < trial.number and params_of(other) == trial.params
                and other.user_attrs.get("purpose") == purpose and other.user_attrs.get("status") != "decided"):
            return other.number
    return None


def params_of(trial) -> dict:
    """A trial's point: its parameters, or for a trial still waiting, the ones it was enqueued with."""
    return dict(trial.params or trial.system_attrs.get("fixed_params") or {})


def heartbeat_while(study, trial):
    """A context that records the trial's heartbeat while its probe runs."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    return get_heartbeat_thread(trial._trial_id, study._storage)


def fail_stale(study) -> None:
    """Fail the trials whose worker stopped sending heartbeats; each is retried once."""
    import optuna

    optuna.storages.fail_stale_trials(study)


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
           purpose: str = "") -> bool:
    """Write the probe's facts as user attributes and finish the trial in the matching state.

    False when the study had already given the trial up (its heartbeat went stale): the result
    is dropped, and the retry stands.
    """
    import optuna

    try:
        _record(study, trial, space, result, probe_result, limit_bytes, purpose)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


def _record(study, trial, space, result, probe_result, limit_bytes, purpose) -> None:
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
