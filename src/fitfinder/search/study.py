"""The Optuna study that holds a search: one trial per probe, every probe fact as a user attribute.

How results map onto trial states (the plan, search.sampler.FitSampler, and the dashboard read them):

- fits under the limit            -> COMPLETE, constraint `peak_over_limit` <= 0
- tight: ran, under the budget but past the limit -> COMPLETE, constraint `peak_over_limit` > 0 (infeasible)
- ran out of memory               -> PRUNED. A run that died has no objective values to report;
  the dashboard shows them as pruned, the way users read an OOM.
- crashed, hung, no result line   -> FAIL, with the reason in `error`.
- its worker is gone              -> FAIL with `status: abandoned` and the reason in `error`
  (`fail_stale`); its point is planned again.
- decided without a probe         -> PRUNED with `status: decided` and `decided_by` (the trial
  whose result rules it out): points the plan would have probed, had dominance not settled them.
- estimated well over the budget  -> PRUNED with `status: oom` and `estimated: true` (the search's
  pre-screen, search.estimated.Prescreen): the predicted phase and peaks instead of measured ones. It
  reads back on resume as the out-of-memory it stands for, so dominance treats it as one.

Each trial's `purpose` says which stage of the plan asked for it: base, rollback, quality,
speed or confirm (a confirmation runs longer).

Objectives: `quality` (the lexicographic quality key as one integer, maximize) and
`seconds_per_sample` (minimize); the study's user attributes `objective_quality` and
`objective_seconds_per_sample` say so in words, with the knobs and levels of this study, for
the dashboard's reader. Each trial's `verdict` is verdict.py's: fits, tight or does not fit.

Several workers share one study (processes on one machine, machines on one PostgreSQL), and any
of them may be killed at any instant. A claimed trial is born RUNNING with its whole point, its
purpose and its owner (host and process id) in one storage transaction (`claim`), so no reader
ever sees half a trial. Two workers may still plan the same point at the same moment: of the
trials with the same point and stage, the lowest-numbered one that did not fail is probed and the
others are failed as duplicates. While a probe runs its worker records heartbeats. A RUNNING
trial whose worker is gone -- its process no longer lives on this machine, its heartbeat went
stale, or it never sent one -- is failed with the reason by the next worker that looks
(`fail_stale`); its point, known no better than before, is planned again. A result is read only
from a finished trial with a whole point, so attributes half written by a killed worker are
never taken for a result.

The storage is SQLite (studies/NAME.db) unless `--storage` names another -- also with several
workers on one machine: Optuna's journal file has no heartbeats, and a search writes a handful
of rows per probe, seconds apart, which SQLite serializes without trouble. One thing SQLite does
not do is lock rows between a read and a write, so claims on a SQLite study, and the creation of
its tables by two searches started together, hold a file lock beside it (NAME.db.lock;
benchmarks/scaleout.py measures why).
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from fitfinder import files
from fitfinder.errors import UserError
from fitfinder.probe import faults, request as requests
from fitfinder.probe.protocol import ProbeResult, Purpose
from fitfinder.search.planner import HOST_MEMORY, Knowledge, Result
from fitfinder.space import Point, Space
from fitfinder.verdict import NO_FIT, of_probe

METRICS = ("quality", "seconds_per_sample")


MAX_NAME = 100  # studies/NAME.db(.lock) and results/NAME/ must stay file names (255 bytes at most)


def check_name(name: str) -> None:
    """A study name that can be a file name here, or one line saying why not (before anything is
    written, and not as a --storage error the user never gave). The one rule: the CLI's names
    (cli._study_name) and a search started from Python both pass through it."""
    if len(name.encode()) > MAX_NAME:
        raise UserError(f"study name {name[:20]}...: {len(name.encode())} characters, at most {MAX_NAME}; "
                        "shorten config.name or give --study NAME")


def sqlite_file(name: str, studies_dir: Path, storage: str | None) -> Path | None:
    """The SQLite file the study lives in (studies/NAME.db unless --storage names another), or
    None for a storage that is no SQLite file. An in-memory SQLite storage (`sqlite:///`,
    `sqlite://`, `:memory:`) is refused: its study ends with the search and can never resume."""
    if storage is None:
        return Path(studies_dir) / f"{name}.db"
    if not storage.startswith("sqlite:"):
        return None
    path = storage[len("sqlite:///"):].split("?")[0] if storage.startswith("sqlite:///") else ""
    if path in ("", ":memory:") or "mode=memory" in storage:
        raise UserError(f"--storage {storage}: an in-memory SQLite study ends with the search and cannot be "
                        "resumed; give a file, e.g. sqlite:///studies/NAME.db")
    return Path(path)


OPTUNA_TABLES = ("studies", "version_info")


def is_study_file(path: Path) -> bool:
    """Whether the SQLite file `path` holds Optuna's tables (read only: nothing is created)."""
    import sqlite3

    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        try:
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            db.close()
    except sqlite3.DatabaseError:  # not a SQLite file at all
        return False
    return set(OPTUNA_TABLES) <= names


def refuse_foreign_sqlite(path: Path, storage: str | None) -> None:
    """A SQLite file that exists and is not empty must be a study storage already: Optuna would
    add its 13 tables to anyone's database (`fitfinder dashboard` refuses the same file)."""
    if path.is_file() and path.stat().st_size > 0 and not is_study_file(path):
        shown = f"--storage {storage}" if storage else f"--studies-dir: {path}"
        raise UserError(f"{shown}: {path} is not an Optuna study database (made by `fitfinder search`); "
                        "give a new file or a study's, or move it")


def storage_url(name: str, studies_dir: Path, storage: str | None) -> str:
    """`--storage` as given, or the SQLite file studies/NAME.db."""
    if storage:
        return storage
    studies_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(studies_dir / f'{name}.db').resolve()}"


def heartbeat() -> tuple[int, int]:
    """(seconds between heartbeats, seconds of silence after which a trial is failed):
    FITFINDER_HEARTBEAT="10,30" by default; tests shorten it."""
    value = os.environ.get("FITFINDER_HEARTBEAT", "10,30")
    interval, _, grace = value.partition(",")
    try:
        interval_s = int(interval)
        grace_s = int(grace) if grace else 3 * interval_s
    except ValueError:
        interval_s = grace_s = 0
    if interval_s < 1 or grace_s <= interval_s:
        raise UserError(f"FITFINDER_HEARTBEAT: {value[:40]!r} is not INTERVAL,GRACE in whole seconds with "
                        "GRACE > INTERVAL >= 1, e.g. 10,30")
    return interval_s, grace_s


def storage(url: str):
    """An Optuna RDB storage with heartbeats and patience for SQLite's lock when several workers
    write at once. A trial whose worker died is failed by `fail_stale` and planned again, not
    retried by Optuna's callback (a copy waiting in the queue would be a trial no plan asked for)."""
    import optuna

    import time

    from sqlalchemy.exc import IntegrityError, ProgrammingError

    interval, grace = heartbeat()
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine, heartbeat_interval=interval, grace_period=grace)
        except (IntegrityError, ProgrammingError):
            # Workers starting together on an empty PostgreSQL database race to create Optuna's
            # tables: the loser sees them half made. A moment later they are all there. (On SQLite
            # `open_study` holds a file lock instead.)
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def objectives_explained(space: Space) -> dict[str, str]:
    """The two objectives in words, as study user attributes: the dashboard shows `quality` as a
    bare integer otherwise."""
    knobs = "; then ".join(f"{k.name}: {' < '.join(k.label(v) for v in k.candidates)}" for k in space.quality_knobs)
    return {
        "objective_quality": (
            "maximize. The quality knobs' levels as one integer (Space.quality_rank), each knob weighing more "
            f"than all later ones together, lightest level 0: {knobs or 'no quality knobs'}. 0 is the lightest "
            f"point, {space.quality_rank(space.desired())} the job file as written; a higher number gives up less."),
        "objective_seconds_per_sample": (
            "minimize. Seconds per training sample: each bucket's median step after the first, by the probe's "
            "own clock, over the batch size; it breaks ties between points of the same quality."),
    }


def open_study(url: str, name: str, space: Space, setup: dict[str, Any], sampler=None):
    """Create the study, or load it to resume; refuses one made for a different space, job or
    budget. `sampler`: the search's FitSampler (search.sampler), the plan as Optuna's sampler."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Heartbeats are meant for Study.optimize; ask-and-tell with a heartbeat thread per probe is
    # what optimize does inside, so the warning says nothing here.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    signature = space_signature(space)
    job = job_signature(space)
    try:
        with _sqlite_lock(url):  # two searches started together in a fresh folder: one creates, one waits
            study = optuna.create_study(
                storage=storage(url), study_name=name, load_if_exists=True, directions=["maximize", "minimize"],
                sampler=sampler,
            )
            stored = study.user_attrs.get("space")
            if stored is None:
                study.set_metric_names(list(METRICS))
                for key, words in objectives_explained(space).items():
                    study.set_user_attr(key, words)
                study.set_user_attr("space", signature)
                study.set_user_attr("job", job)
                if sampler is not None:  # the dashboard shows the study's attributes: which sampler plans it
                    study.set_user_attr("sampler", getattr(sampler, "NAME", type(sampler).__name__))
                for key, value in setup.items():
                    study.set_user_attr(key, value)
    except ImportError as exc:  # e.g. postgresql:// without its driver
        raise UserError(f"--storage {url}: {exc}; for PostgreSQL: pip install 'fitfinder[postgres]'") from None
    except Exception as exc:  # noqa: BLE001 - a storage that cannot be reached is bad input
        if _is_storage_error(exc):
            raise UserError(f"study {name!r} in {url}: cannot open it: {_first_line(exc)}") from None
        raise
    if stored is not None:
        changed = signature_changes(study.user_attrs, signature, job)
        if study.user_attrs.get("budget_bytes") != setup.get("budget_bytes"):
            changed.insert(0, "the budget")
        if changed:
            raise UserError(f"study {name!r} in {url} was made for another job: {'; '.join(changed[:3])} changed; "
                            "use --study with a new name, or delete the study to start over")
    return study


def _is_storage_error(exc: BaseException) -> bool:
    import optuna

    return (isinstance(exc, optuna.exceptions.StorageInternalError)
            or type(exc).__module__.startswith("sqlalchemy") or isinstance(exc, OSError))


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    lines = str(getattr(cause, "orig", None) or cause).strip().splitlines()
    return (lines[0] if lines else type(cause).__name__)[:300]


@contextmanager
def writable(name: str, url: str):
    """Turn a study that cannot be written any more (a full or read-only disk, mid-run) into one
    line. Every write is one transaction, so what was written before stays readable, and the
    trial left RUNNING is failed and planned again by the next run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only storage failures are turned into a line
        if not _is_storage_error(exc):
            raise
        raise UserError(f"study {name!r} in {url}: cannot write it any more: {_first_line(exc)}; make room or "
                        "fix its permissions, then run the same command to resume") from None


def space_signature(space: Space) -> dict[str, list]:
    return {k.name: list(k.candidates) for k in space.knobs}


def job_signature(space: Space) -> dict[str, Any]:
    """What every probe of the study trains besides its knobs: the probe request of the space's
    lightest point (each knob written, so what remains is what the knobs do not set: the model,
    its dtype and quantization, every fixed setting), less how a probe is run and where the
    weights lie on this machine, with the recipe's digest. A copy of a job with another model
    under the same name is another study (issue 35: it was answered with Flux's winner)."""
    request = requests.request_for(space.apply(space.job, space.lightest()), 1, "sim", None)
    signature = {key: value for key, value in request.items() if key not in requests.RUN_FIELDS}
    signature["model"] = {key: value for key, value in request["model"].items() if key != "path"}
    signature["recipe"] = requests.recipe_digest()
    return _jsonable(signature)


def signature_changes(attrs: dict[str, Any], space: dict[str, list], job: dict[str, Any]) -> list[str]:
    """What differs between a study's recorded signatures and these, as short phrases."""
    if attrs.get("space") != space:
        changed = sorted(set(space) ^ set(attrs.get("space") or {}))
        return ["the knobs' candidates" + (f" ({', '.join(changed)})" if changed else "")]
    stored = attrs.get("job")
    if stored is None:
        return ["the recorded job (the study was made by an earlier fitfinder)"]
    if stored.get("recipe") != job.get("recipe"):
        return ["fitfinder's probe recipe (another version made the study)"]
    old, new = _flattened(stored), _flattened(job)
    return [f"{path} ({_short(old.get(path))} -> {_short(new.get(path))})"
            for path in sorted(set(old) | set(new), key=_model_first) if old.get(path) != new.get(path)]


def _flattened(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {key: leaf for name, item in value.items()
                for key, leaf in _flattened(item, f"{path}.{name}" if path else str(name)).items()}
    return {path: value}


def _model_first(path: str) -> tuple:
    """The model's name and family before its configs' thousand keys."""
    return (not path.startswith("model.") or path.startswith("model.arch."), path)


def _short(value: Any) -> str:
    text = "none" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def distributions(space: Space) -> dict[str, Any]:
    import optuna

    return {k.name: optuna.distributions.CategoricalDistribution(list(k.candidates)) for k in space.knobs}


PROBED = ("ok", "oom", "error", "timeout")


def load_knowledge(study, space: Space, limit_bytes: int | None, ram_bytes: int | None = None) -> Knowledge:
    """What the finished probes of the study say."""
    return read(study, space, limit_bytes, ram_bytes)[0]


def read(study, space: Space, limit_bytes: int | None, ram_bytes: int | None = None) -> tuple[Knowledge, list[Point]]:
    """The finished probes as Knowledge, and the points being probed.

    Only finished trials with a whole point of this space are results: a worker killed while
    writing leaves its trial RUNNING (failed later by `fail_stale`), never half a result."""
    from optuna.trial import TrialState

    known = Knowledge(space, limit_bytes, ram_bytes)
    pending = []
    for trial in trials_of(study):
        point = params_of(trial)
        if not space.contains(point):
            continue
        if trial.state == TrialState.RUNNING:
            pending.append(point)
        elif _finished_as_recorded(trial) and facts_readable(trial.user_attrs):
            known.add(result_from_trial(trial, point))
    return known, pending


def trials_of(study) -> list:
    """The study's trials; one line when Optuna cannot read them back (a value changed by hand in
    the database, such as a NULL objective where Optuna wrote a number, fails an assertion of its)."""
    try:
        return study.get_trials(deepcopy=False)
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"study {study.study_name!r}: Optuna cannot read its trials back ({type(exc).__name__}: "
                        f"{str(exc)[:100] or 'a value in the database is not what Optuna wrote'}); it was changed "
                        "by hand or is damaged: search under another --study name") from None


def _finished_as_recorded(trial) -> bool:
    """A probe's result, in the state `record` gives it (an abandoned trial is neither)."""
    from optuna.trial import TrialState

    status = trial.user_attrs.get("status")
    expected = {"ok": (TrialState.COMPLETE,), "oom": (TrialState.PRUNED,),
                "error": (TrialState.FAIL,), "timeout": (TrialState.FAIL,)}.get(status, ())
    return trial.state in expected


def facts_readable(attrs: dict[str, Any]) -> bool:
    """Whether a trial's facts are what `write_facts` writes where the plan and the report read
    numbers: bytes, seconds and per-phase peaks that are finite and not negative, a phase's name.
    A study changed by hand or by another tool (`peak_bytes: "abc"`, a NaN speed) broke the plan
    and the report with tracebacks; such a trial is read as no result, so its point is probed again."""
    def count(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and math.isfinite(value) and value >= 0)

    phases, host = attrs.get("phases") or {}, attrs.get("host_phases") or {}
    return (all(count(attrs.get(key)) for key in
                ("peak_bytes", "seconds_per_sample", "seconds_per_step", "timing_noise", "wall_seconds"))
            and all(isinstance(table, dict) and all(isinstance(name, str) and count(peak)
                                                    for name, peak in table.items()) for table in (phases, host))
            and isinstance(attrs.get("phase"), (str, type(None)))
            and (attrs.get("status") != "ok" or attrs.get("peak_bytes") is not None))


def budget_of(study) -> tuple[int | None, float]:
    """The study's budget (bytes, None: the whole card) and margin as recorded, or one line when
    they are not (a study attribute changed by hand)."""
    budget, margin = study.user_attrs.get("budget_bytes"), study.user_attrs.get("margin", 0.0)
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool) and budget > 0):
        raise UserError(f"study {study.study_name!r}: its budget_bytes is {_short(budget)}, not a number of bytes; "
                        "it was changed by hand: search under another --study name")
    if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and 0 <= margin < 1):
        raise UserError(f"study {study.study_name!r}: its margin is {_short(margin)}, not a share of the budget; "
                        "it was changed by hand: search under another --study name")
    return budget, float(margin)


def probes_in(study) -> int:
    """Probes the study has run or is running (what the trial cap counts); points the pre-screen
    decided on an estimate were not probed."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if (t.user_attrs.get("status") in PROBED and not t.user_attrs.get("estimated")
                   and t.state.is_finished()) or t.state == TrialState.RUNNING)


def result_from_trial(trial, point: Point | None = None) -> Result:
    attrs = trial.user_attrs
    return Result(trial=trial.number, point=dict(point or params_of(trial)), status=attrs["status"],
                  peak_bytes=attrs.get("peak_bytes"), seconds_per_sample=attrs.get("seconds_per_sample"),
                  phase=attrs.get("phase"), error=attrs.get("error"), phases=dict(attrs.get("phases") or {}),
                  host_phases=dict(attrs.get("host_phases") or {}), oom_kind=attrs.get("oom_kind"),
                  confirm=attrs.get("purpose") == "confirm",
                  extra={"seconds_per_step": attrs.get("seconds_per_step"), "timing_noise": attrs.get("timing_noise"),
                         "purpose": attrs.get("purpose"),
                         "wall_seconds": attrs.get("wall_seconds"), "estimated": bool(attrs.get("estimated"))})


def decided_keys(study, space: Space) -> set[tuple]:
    """Points already recorded as decided, so a resumed search does not record them twice."""
    return {space.key(point) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("status") == "decided" and space.contains(point := params_of(t))}


def claim(study, space: Space, point: Point, purpose: str = ""):
    """The trial of a planned point, owned by this process; None when it turns out to duplicate a
    trial another worker planned at the same moment.

    The trial is born RUNNING with its point, purpose and owner in one transaction, and gets its
    first heartbeat at once: from its first instant a reader can tell what it probes and whether
    its worker still lives.
    """
    import optuna
    from optuna.trial import TrialState

    with _claim_lock(study):
        template = optuna.trial.FrozenTrial(
            number=-1, state=TrialState.RUNNING, value=None, values=None, datetime_start=datetime.now(),
            datetime_complete=None, params=dict(point), distributions=distributions(space),
            user_attrs={"purpose": purpose, **owner()}, system_attrs={}, intermediate_values={}, trial_id=-1)
        trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
        study._storage.record_heartbeat(trial_id)
        trial = optuna.trial.Trial(study, trial_id)
        # One read decides both: another worker may abandon an earlier trial of this point meanwhile
        # (fail_stale does not take the claim lock), and two reads could see it first RUNNING, so no
        # retry, then FAILED, so no twin: a second probe of the point, linked to nothing.
        earlier = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number
                   and params_of(t) == trial.params and t.user_attrs.get("purpose") == purpose]
        twin = _twin_in(earlier)
        if twin is None and (failed := _failed_in(earlier)) is not None:
            study._storage.set_trial_system_attr(trial_id, "failed_trial", failed)  # as Optuna marks retries
    if twin is not None:
        trial.set_user_attr("error", f"duplicate of trial {twin}, planned by another worker at the same time")
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return None
    return trial


def owner() -> dict[str, Any]:
    """This process as a trial's owner: where to look whether it still lives."""
    host = socket.gethostname()
    return {"host": host, "pid": os.getpid(), "worker": f"{host}:{os.getpid()}"}


def _failed_in(earlier: list) -> int | None:
    """The last of these earlier trials of a point that failed (not as a duplicate), so the
    dashboard links its retry to it; None when none did."""
    from optuna.trial import TrialState

    failed = [t.number for t in earlier if t.state == TrialState.FAIL
              and t.user_attrs.get("status") in ("error", "timeout", "abandoned")]  # not a duplicate
    return failed[-1] if failed else None


@contextmanager
def _claim_lock(study):
    """Serialize claims on a SQLite study across the processes of this machine.

    Two workers that planned the same point at the same moment must see each other's trial to
    tell which one is the duplicate; SQLite does not lock a row between the read and the write
    (measured: two workers took the same trial), so on SQLite a file lock beside the database
    makes the claim atomic. PostgreSQL locks the rows itself.
    """
    backend = getattr(study._storage, "_backend", study._storage)  # under Optuna's cache
    url = str(getattr(backend, "url", ""))
    # FITFINDER_SQLITE_CLAIM_LOCK=0 turns the lock off, only so benchmarks/scaleout.py can show why it is on.
    if os.environ.get("FITFINDER_SQLITE_CLAIM_LOCK") == "0":
        url = ""
    with _sqlite_lock(url):
        yield


@contextmanager
def _sqlite_lock(url: str):
    """An exclusive file lock beside a SQLite database (NAME.db.lock); nothing for other storages."""
    if not url.startswith("sqlite:///"):
        yield
        return
    import fcntl

    # Never through a link planted there (it created its target) nor a FIFO (the open waited forever).
    fd = files.open_own_or_refuse(url[len("sqlite:///"):] + ".lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _twin_in(earlier: list) -> int | None:
    """The first of these earlier trials of a point that did not fail: it is the one to probe. A
    finished one whose facts `read` does not take as a result (changed by hand) is none: it is why
    the point is planned again, and taking it for a twin failed every new claim, for ever."""
    from optuna.trial import TrialState

    for other in earlier:
        if other.state == TrialState.FAIL or other.user_attrs.get("status") == "decided":
            continue
        if other.state == TrialState.RUNNING or facts_readable(other.user_attrs):
            return other.number
    return None


def params_of(trial) -> dict:
    """A trial's point: the parameters it was made with (a trial Optuna enqueued keeps them in
    `fixed_params` until a worker asks for it)."""
    return dict(trial.system_attrs.get("fixed_params") or trial.params or {})


@contextmanager
def heartbeat_while(study, trial):
    """Record the trial's heartbeat every interval while its probe runs. A failed write is left
    for the result's own write to report: a heartbeat thread must not print a traceback."""
    interval, _ = heartbeat()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                study._storage.record_heartbeat(trial._trial_id)
            except Exception:  # noqa: BLE001 - see the docstring
                pass

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fail_stale(study) -> list[int]:
    """Fail the RUNNING trials whose worker is gone, each with the reason why it is taken for
    gone; their points are planned again. Returns their numbers."""
    from optuna.trial import TrialState

    _, grace = heartbeat()
    silence = _seconds_since_heartbeat(study)
    gone = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        reason = _why_gone(trial, silence.get(trial._trial_id), grace)
        if reason is not None:
            _abandon(study, trial, reason)
            gone.append(trial.number)
    return gone


def _why_gone(trial, silent_s: float | None, grace: int) -> str | None:
    """Why the trial's worker is taken for gone, or None while it may still live."""
    attrs = trial.user_attrs
    who = attrs.get("worker") or "its worker"
    if attrs.get("host") == socket.gethostname() and isinstance(attrs.get("pid"), int) \
            and not _process_lives(attrs["pid"]):
        return f"abandoned: {who} is gone (no process {attrs['pid']} on this machine)"
    if silent_s is not None and silent_s > grace:
        return f"abandoned: no heartbeat from {who} for {silent_s:.0f} s (grace {grace} s)"
    if silent_s is None:
        started = trial.datetime_start or datetime.now()
        quiet = (datetime.now() - started).total_seconds()
        if quiet > grace:
            return f"abandoned: {who} never sent a heartbeat in the {quiet:.0f} s since the trial started"
    return None


def _process_lives(pid: int) -> bool:
    """Whether process `pid` exists on this machine and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: the signal said it exists
    return stat.rpartition(")")[2].split()[0] != "Z"


def _seconds_since_heartbeat(study) -> dict[int, float]:
    """Seconds since each trial's last heartbeat, by trial id, on the database's own clock (the
    clock the heartbeats were written with)."""
    import sqlalchemy
    from optuna.storages._rdb import models

    backend = getattr(study._storage, "_backend", study._storage)
    session = backend.scoped_session()
    try:
        now = session.execute(sqlalchemy.func.now()).scalar().replace(tzinfo=None)
        rows = session.query(models.TrialHeartbeatModel.trial_id, models.TrialHeartbeatModel.heartbeat).all()
        return {trial_id: (now - beat.replace(tzinfo=None)).total_seconds() for trial_id, beat in rows}
    finally:
        session.close()


def _abandon(study, trial, reason: str) -> None:
    """Fail a trial whose worker is gone. Its status is changed first: a trial killed while its
    result was being written may already say "ok", and a failed trial must never read as one."""
    import optuna
    from optuna.trial import TrialState

    try:
        study._storage.set_trial_user_attr(trial._trial_id, "status", "abandoned")
        study._storage.set_trial_user_attr(trial._trial_id, "error", reason)
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass  # another worker failed it first, or its own worker finished it after all


def fail_state():
    from optuna.trial import TrialState

    return TrialState.FAIL


def record_decided(study, space: Space, point: Point, decider: Result) -> None:
    """A point the plan did not probe because `decider`'s result rules it out."""
    import optuna
    from optuna.trial import TrialState

    phases = ", ".join(decider.failed_phases) or "every phase"
    if decider.wall_reason:  # the host ran out there: as heavy on the host, by the knobs' host order
        phases = f"{HOST_MEMORY} in {', '.join(p or 'some phase' for p in decider.host_failed_phases)}"
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.PRUNED, params=point, distributions=distributions(space),
        user_attrs={"point": point, "status": "decided", "decided_by": decider.trial, "verdict": NO_FIT,
                    "reason": f"at least as heavy as trial {decider.trial}, which did not fit ({phases}), "
                              "on every knob that matters there"},
    ))


def record(study, trial, space: Space, result: Result, probe_result: ProbeResult, limit_bytes: int | None,
           purpose: Purpose = "") -> bool:
    """Write the probe's facts as user attributes and finish the trial in the matching state.

    False when the study had already given the trial up (its heartbeat went stale): the result
    is dropped, and the point is planned again. `status` is written last and the state after it,
    so a worker killed in between leaves a RUNNING trial with no status, which `fail_stale` fails.
    """
    import optuna

    try:
        _record(study, trial, space, result, probe_result, limit_bytes, purpose)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


def _record(study, trial, space, result, probe_result, limit_bytes, purpose) -> None:
    from optuna.trial import TrialState

    values = write_facts(trial, space, result, probe_result, limit_bytes, purpose)
    if result.status == "ok":
        study.tell(trial, values)
    elif result.status == "oom":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def write_facts(trial, space: Space, result: Result, probe_result: ProbeResult, limit_bytes: int | None,
                purpose: Purpose = "") -> list[float] | None:
    """The probe's facts as the trial's user attributes (`status` last) and its `peak_over_limit`
    constraint; returns the objective values of a probe that ran (None for any other)."""
    attrs = {
        "purpose": purpose,
        "point": result.point,
        "phase": result.phase,
        "peak_bytes": result.peak_bytes,
        "limit_bytes": limit_bytes,
        "phases": probe_result.get("phases", {}),
        "phase_stats": probe_result.get("phase_stats", {}),
        "seconds_per_step": probe_result.get("seconds_per_step"),
        "timing_noise": probe_result.get("timing_noise"),
        "seconds_per_sample": result.seconds_per_sample,
        "wall_seconds": probe_result.get("wall_seconds"),
        "error": result.error,
        "oom_kind": probe_result.get("oom_kind"),
        "meter": probe_result.get("meter"),
        "verdict": NO_FIT if result.host_failed_phases else of_probe(
            result.status, result.verdict == "fit", result.peak_bytes, probe_result.get("budget_bytes")),
        "failed_phases": list(result.failed_phases),
        "host_phases": result.host_phases,
        "host_peak_bytes": result.host_peak_bytes,
        "ram_bytes": probe_result.get("ram_bytes"),
        "host_failed_phases": list(result.host_failed_phases),
        "reason": result.wall_reason or None,
        "estimated": bool(probe_result.get("estimated")),
        **({"trainer_run": probe_result["trainer_run"], "estimate": probe_result.get("estimate")}
           if "trainer_run" in probe_result else {}),  # a trainer probe, with the estimate of the same point
        "status": result.status,
    }
    for index, (key, value) in enumerate(attrs.items()):
        if index == len(attrs) // 2:
            faults.kill_if_at("recording", trial.number)
        trial.set_user_attr(key, _jsonable(value))
    if result.status == "ok":
        over = 0.0 if limit_bytes is None else result.peak_bytes / limit_bytes - 1.0
        if result.host_failed_phases:  # in the card, over the RAM: infeasible all the same
            over = max(over, 1.0)
        trial.set_constraint("peak_over_limit", over)
        speed = result.seconds_per_sample if result.seconds_per_sample is not None else math.inf
        return [float(space.quality_rank(result.point)), speed]
    if result.status == "oom":
        trial.set_constraint("peak_over_limit", 1.0)
    return None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
