"""A trainer probe: the user's own trainer run on a point, metered from inside its process.

The parent's side. For each probe whose request names a trainer (trainer_command.request_fields):

1. write the point as the trainer's own job in a private folder (dialects.TrainerDialect.write);
2. run the command, `{job}` replaced by that file, in the folder, in a process group of its own,
   with fitfinder's start-up hook first on its PYTHONPATH (probe/_hook/sitecustomize.py: the meter
   goes into the trainer's main process, probe/trainer_meter.py), TMPDIR inside the folder, the
   card chosen by CUDA_VISIBLE_DEVICES; its output goes to the probe's log;
3. end it at the probe's timeout, and kill its process group at the end whatever happened;
4. read what the meter wrote, the exit code and the log (oom.scan_log: an OOM the log reports counts
   even where the meter missed it), and make one result in the probe protocol's shape; a trainer that
   hangs, crashes, exits 0 without training or prints nothing is a failed probe that says so;
5. estimate the same point (probe/estimate.py) and keep its phases beside the trainer's, so every
   trainer probe is a pair that calibrates the estimate (`fitfinder calibrate --study NAME`);
6. delete the folder, after listing what the trainer wrote in it.

`TrainerRunner` has the runners' `run(request, log_path)` surface: a request without a trainer
(an estimate of the pre-screen or the guide) goes to the runner it wraps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from fitfinder import oom
from fitfinder.errors import UserError
from fitfinder.probe import dialects
from fitfinder.probe.estimate import as_estimate
from fitfinder.probe.overhead import GpuOverhead
from fitfinder.probe.protocol import ProbeRequest, ProbeResult

HOOK_DIR = Path(__file__).resolve().with_name("_hook")
SRC = Path(__file__).resolve().parents[2]  # src/, above fitfinder/: the meter is read from this fitfinder
KILL_WAIT_S = 5.0  # how long a killed process group may take to be gone
# multiprocessing binds its sockets under TMPDIR (pymp-XXXXXXXX/listener-XXXXXXXX), and a Unix socket's
# path has 107 bytes at most: a data-loader worker sending a batch failed with "AF_UNIX path too long"
# under a TMPDIR 80 characters deep, and hung. A folder deeper than this leaves the user's TMPDIR.
MAX_TMPDIR_CHARS = 60


def runner_for(settings, estimates):
    """The runner of a job's probes: `estimates` itself (a ProbeRunner or estimate.InProcess), or,
    when the job names a trainer, a TrainerRunner that sends it the estimates."""
    if settings.trainer_command is None:
        return estimates
    return TrainerRunner(settings.probe_timeout, estimates)


def one_probe_runner(settings):
    """The runner of `fitfinder probe`: a built-in probe in a fresh process, or the trainer, with the
    estimate of the same point made in this process (one estimate: no probe server to start)."""
    from fitfinder.probe.estimate import InProcess
    from fitfinder.probe.runner import ProbeRunner

    if settings.trainer_command is None:
        return ProbeRunner(settings.probe_timeout)
    return TrainerRunner(settings.probe_timeout, InProcess(settings.probe_timeout))


def beside_estimate(result: ProbeResult, meter: str) -> list[tuple[str, int, int | None]]:
    """(phase, the trainer's peak, the estimate's) for each phase the trainer measured. The estimate
    is as that meter counts: tensor bytes for the sim meter, allocator blocks (no overhead) on a card."""
    key = "peak_live" if meter == "sim" else "peak_allocated"
    estimated = (result.get("estimate") or {}).get("phase_stats") or {}
    rows = [(name, peak, estimated.get(name, {}).get(key)) for name, peak in (result.get("phases") or {}).items()]
    whole = (result.get("trainer_run") or {}).get("whole_run")
    if whole and not rows:
        rows.append(("whole run", whole["peak_reserved"], max((s.get(key, 0) for s in estimated.values()),
                                                              default=None)))
    return rows


class TrainerRunner:
    """Runs trainer probes with a timeout; every other request goes to `estimates`."""

    def __init__(self, timeout_s: float, estimates):
        if timeout_s <= 0:
            raise ValueError(f"the trainer's timeout must be positive but got {timeout_s}")
        self.timeout_s, self.estimates = timeout_s, estimates

    def run(self, request: ProbeRequest, log_path: str | Path | None = None) -> ProbeResult:
        if "trainer_run" not in request or request.get("meter") == "estimate":
            return self.estimates.run(request, log_path)
        started = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix="fitfinder-trainer-"))
        try:
            result = self._probe(request, folder, Path(log_path) if log_path else None)
            result["trainer_run"]["files"] = files_in(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if result["status"] in ("ok", "oom"):  # a run that measured something: the pair that calibrates
            result["estimate"] = self._estimate(request)
        result["wall_seconds"] = round(time.perf_counter() - started, 3)
        return result

    def _probe(self, request: ProbeRequest, folder: Path, log_path: Path | None) -> ProbeResult:
        dialect = dialects.DIALECTS[request["trainer_run"]["dialect"]]
        try:
            job_path = dialect.write(request["trainer_job"], folder, request)
        except (OSError, UserError) as exc:  # a full disk, a dataset that cannot be mirrored
            failed = judge(None, Ran(None, False, 0, 0.0, f"the trainer's job could not be written: {exc}"), "",
                           request)
            failed["trainer_run"].update(command=request["trainer_run"]["command"], dialect=dialect.key)
            return failed
        if log_path is not None:  # the job the trainer ran, kept beside its log
            shutil.copyfile(job_path, log_path.with_name(f"{log_path.stem}.job{job_path.suffix}"))
        command = [word.replace("{job}", str(job_path)) for word in request["trainer_run"]["command"]]
        meter_dir = folder / ".fitfinder"
        meter_dir.mkdir()
        config = {"meter": request["meter"], "budget_bytes": request.get("budget_bytes"), "gpu": 0,
                  "dialect": dialect.key, "result": str(meter_dir / "result.json"),
                  "claim": str(meter_dir / "claim"), "src": str(SRC), "parent": os.getpid()}
        log = log_path or folder / "trainer.log"
        ran = run_command(command, folder, environment(config, request, folder), log, self.timeout_s)
        facts = _read_json(meter_dir / "result.json")
        result = judge(facts, ran, _read_text(log), request)
        result["trainer_run"].update(command=request["trainer_run"]["command"], dialect=dialect.key,
                                     job_file=job_path.name)
        return result

    def _estimate(self, request: ProbeRequest) -> dict[str, Any]:
        """The estimate of the same point, tensor bytes and allocator blocks per phase, no overhead
        model: `fitfinder calibrate --study` fits one from the pairs."""
        plain = {key: value for key, value in request.items() if key not in ("trainer_run", "trainer_job")}
        try:
            found = self.estimates.run(as_estimate(plain, GpuOverhead.none()))
        except Exception as exc:  # noqa: BLE001 - the probe stands without its estimate
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}
        if found.get("status") != "ok":
            return {"error": (found.get("error") or found.get("status") or "no result")[:500]}
        return {"phase_stats": found.get("phase_stats", {})}


# -- the trainer's process ------------------------------------------------------------------------
def environment(config: dict[str, Any], request: ProbeRequest, folder: Path) -> dict[str, str]:
    """The user's environment, plus the hook first on PYTHONPATH and what the meter is told."""
    env = dict(os.environ)
    env.pop("FITFINDER_TRAINER_METER_PID", None)  # a probe started from inside another one
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR)] + paths)
    env["FITFINDER_TRAINER_METER"] = json.dumps(config)
    env["PYTHONUNBUFFERED"] = "1"  # the log shows each line when it is printed, also after a kill
    (folder / "tmp").mkdir()
    if len(str(folder / "tmp")) <= MAX_TMPDIR_CHARS:  # temporary files and compile caches stay in the folder
        env["TMPDIR"] = str(folder / "tmp")
    if request["meter"] == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = visible_device(request.get("gpu", 0), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return env


def visible_device(gpu: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the trainer: card `gpu` of those this process sees; the trainer's
    cuda:0 is then that card, and the meter meters device 0."""
    if visible:
        cards = [card.strip() for card in visible.split(",") if card.strip()]
        if gpu < len(cards):
            return cards[gpu]
    return str(gpu)


class Ran:
    """How the trainer's process ended."""

    def __init__(self, exit_code: int | None, timed_out: bool, pgid: int, seconds: float, error: str | None = None):
        self.exit_code, self.timed_out, self.pgid, self.seconds, self.error = exit_code, timed_out, pgid, seconds, error


def run_command(command: list[str], folder: Path, env: dict[str, str], log: Path, timeout_s: float) -> Ran:
    """Run `command` in `folder` in a session (so a process group) of its own, its output to `log`;
    kill the whole group at the timeout and, whatever happened, at the end."""
    started = time.perf_counter()
    with open(log, "wb") as output:
        try:
            process = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return Ran(None, False, 0, 0.0, f"the trainer command could not start: {exc.strerror or exc}")
        timed_out = False
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(process.pid)
            process.wait()
    return Ran(None if timed_out else process.returncode, timed_out, process.pid, time.perf_counter() - started)


def kill_group(pgid: int) -> None:
    """SIGKILL every process of the group, and wait until none is left running (zombies aside)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + KILL_WAIT_S
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (Linux's /proc; elsewhere, whether it exists)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


# -- the result -----------------------------------------------------------------------------------
def judge(facts: dict | None, ran: Ran, log_text: str, request: ProbeRequest) -> ProbeResult:
    """The probe's result from the meter's facts, how the process ended and its log.

    An OOM anywhere (the meter's, caught or not, or one the log reports) makes it an OOM; then a
    timeout; then a failed exit; a run that trained no step, printed nothing or was never metered
    is an error that says so; otherwise it fits as measured.
    """
    scan = oom.scan_log(log_text)
    measured = _measured(facts or {})
    result: ProbeResult = {"status": "ok", "phase": None, "error": None, "oom_kind": None, **measured["result"],
                           "budget_bytes": request.get("budget_bytes")}
    result["trainer_run"] = {"exit_code": ran.exit_code, "timed_out": ran.timed_out, "pgid": ran.pgid,
                         "seconds": round(ran.seconds, 3), **measured["trainer"]}
    ooms = _ooms(facts or {}, scan)
    steps = measured["result"].get("steps_run") or (scan.last_step or 0)
    failure = _failure(facts, ran, log_text, scan, steps)
    if ooms:
        first = ooms[0]
        kind = oom.classify(first["message"]).kind
        result.update(status="oom", phase=first["phase"], oom_kind=kind if kind != "not_oom" else "config",
                      error=_oom_line(ooms, facts or {}))
    elif failure is not None:
        result.update(status="timeout" if ran.timed_out else "error", phase=measured["phase_now"], error=failure)
        if facts and facts.get("uncaught") and not ran.timed_out:
            result["traceback"] = facts["uncaught"].get("traceback", "")
    return result


def _measured(facts: dict) -> dict[str, Any]:
    """The meter's peaks as the protocol has them: per phase where the log marked phases, else one
    peak for the whole run (phases empty: the planner then takes no phase as a fact)."""
    stats = {name: {key: value for key, value in entry.items() if key in ("peak_allocated", "peak_reserved",
                                                                           "seconds")}
             for name, entry in (facts.get("phase_stats") or {}).items()}
    whole = stats.pop(dialects.UNMARKED, None)
    peak = max([entry["peak_reserved"] for entry in stats.values()] + ([whole["peak_reserved"]] if whole else []),
               default=None)
    seconds, noise = step_seconds(facts.get("step_clock") or [])
    result = {"phases": {name: int(entry["peak_reserved"]) for name, entry in stats.items()}, "phase_stats": stats,
              "peak_bytes": peak, "seconds_per_step": seconds, "timing_noise": noise,
              "steps_run": facts.get("steps_done"), "meter": f"{facts['meter']} inside the trainer"
              if facts.get("meter") else "no meter ran inside the trainer",
              "outside_bytes": facts.get("outside_bytes"), "max_rss_bytes": facts.get("max_rss_bytes"),
              "cpu_seconds": facts.get("cpu_seconds")}
    trainer = {"phases_from": "log" if stats else ("whole run" if whole else "none"), "marked": facts.get("marked", []),
               "whole_run": whole, "metered_pid": facts.get("pid"), "nvml_bytes": facts.get("nvml_bytes"),
               "ooms": len(facts.get("ooms") or [])}
    phase_now = facts.get("phase_now")
    return {"result": result, "trainer": trainer, "phase_now": phase_now if phase_now in stats else None}


def step_seconds(clock: list) -> tuple[float | None, float]:
    """Seconds per training step from the meter's clock at each redraw of the training bar ((time,
    steps done) pairs): from the first step's end to the last one's, so the first step, which pays
    one-time costs, is left out, and a redraw the bar skipped (tqdm draws at most every 0.1 s) loses
    nothing. The noise: the relative median absolute deviation of the redraws' own rates."""
    steady = [(seconds, done) for seconds, done in clock if done >= 1]
    if len(steady) < 2 or steady[-1][1] <= steady[0][1]:
        return None, 0.0
    (first, done_first), (last, done_last) = steady[0], steady[-1]
    per_step = (last - first) / (done_last - done_first)
    rates = [(t2 - t1) / (n2 - n1) for (t1, n1), (t2, n2) in zip(steady, steady[1:]) if n2 > n1]
    noise = statistics.median(abs(r - per_step) for r in rates) / per_step if len(rates) >= 3 and per_step else 0.0
    return round(per_step, 5), round(noise, 4)


def _ooms(facts: dict, scan: oom.LogScan) -> list[dict[str, Any]]:
    """Every OOM: the meter's (caught ones included), the uncaught exception if it is one, else those
    the log reports (an allocation outside the caching allocator, cuBLAS's, leaves no count)."""
    found = list(facts.get("ooms") or [])
    uncaught = facts.get("uncaught") or {}
    if uncaught.get("is_oom") and not found:
        found.append({"phase": uncaught.get("phase"), "message": uncaught.get("error", "")})
    if not found:
        for event in scan.events:
            if event.verdict.kind != "host":
                phase = event.phase if event.phase != "unknown" else None
                if phase == "sample" and event.training_started:
                    phase = "last_sample"
                found.append({"phase": phase, "message": event.verdict.message})
    for entry in found:
        if entry.get("phase") not in (None, "load", "text_encoder", "latents", "sample", "train", "last_sample"):
            entry["phase"] = None  # START: before the log marked any phase
    return found


def _oom_line(ooms: list[dict[str, Any]], facts: dict) -> str:
    uncaught = facts.get("uncaught") or {}
    # An OOM the trainer let through ends the run as its uncaught exception; AI Toolkit's "3 times in
    # a row" is a RuntimeError of its own, raised after catching every one of them.
    let_through = (uncaught.get("error") or "").startswith("OutOfMemoryError")
    caught = len(facts.get("ooms") or []) - (1 if let_through else 0)
    where = f" in {ooms[0]['phase']}" if ooms[0].get("phase") else ""
    told = (f"{len(ooms)} out-of-memory errors in the trainer" if len(ooms) > 1 else "an out-of-memory error in the "
            "trainer") + (f" ({caught} caught by it)" if caught > 0 else "")
    return f"{told}, the first{where}: {ooms[0]['message']}"[:2000]


def _failure(facts: dict | None, ran: Ran, log_text: str, scan: oom.LogScan, steps: int) -> str | None:
    """Why a run without an OOM says nothing about memory, or None when it trained."""
    tail = _tail(log_text)
    told = f"; last output: {tail}" if tail else ""
    if ran.error:
        return ran.error
    if ran.timed_out:
        return f"the trainer passed its timeout ({ran.seconds:.0f} s) and was killed with its process group{told}"
    if not log_text.strip():
        return f"the trainer printed nothing and exited with code {ran.exit_code}"
    if ran.exit_code != 0:
        error = (facts or {}).get("uncaught", {}) or {}
        return f"the trainer exited with code {ran.exit_code}: {error.get('error') or scan.last_error or tail}"[:2000]
    if not steps:
        return f"the trainer exited 0 without training a step (its log shows no training progress){told}"
    if facts is None:
        return ("no meter ran inside the trainer: no Python process of it imported torch (or its Python was "
                f"started with -S, -I or -E, which skip the start-up hook){told}")
    if facts.get("meter_error"):
        return f"the meter inside the trainer could not start: {facts['meter_error']}"
    return None


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return " | ".join(kept[-lines:])[-500:]


def files_in(folder: Path, most: int = 40) -> list[str]:
    """What is in the probe's folder once the trainer ended (the dataset's links and the meter's own
    files aside), as relative paths: the job written for it, and what the trainer wrote."""
    found = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_symlink() or not path.is_file() or relative.parts[0] == ".fitfinder":
            continue
        found.append(relative.as_posix())
    return found[:most]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
