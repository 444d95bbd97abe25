"""A worker: one process probing the planned points of a study, alone or beside others.

Every worker runs the same loop against the shared study: fail the trials of workers that died
(heartbeats), read what is known and what others are probing, ask the plan for a point nobody
probes yet (search.plan_around), claim it through the study, probe it while recording
heartbeats, record the result. `launch` starts one worker process per GPU (each sees only its
card through CUDA_VISIBLE_DEVICES) or `--workers N` on the CPU; machines join a PostgreSQL study
by running the same command.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitfinder import probe
from fitfinder.errors import RunFailed, UserError
from fitfinder.probe import faults, overhead as overheads, preflight, trainer
from fitfinder.search import estimated, study as studies
from fitfinder.search.planner import CONFIRM_FACTOR, Knowledge, Result, Step, result_from_probe
from fitfinder.units import format_bytes


def work(job, space, study, options, limit: int | None, out) -> None:
    """Probe the study's planned points until the plan is done or the trial cap is reached."""
    from fitfinder.search.sampler import FitSampler  # optuna: imported once a search runs

    settings = job.settings
    log_dir = Path(options.results_dir) / options.study_name / "probes"
    log_dir.mkdir(parents=True, exist_ok=True)
    card = _card(options)
    _refuse_a_different_card(study, card, options.study_name)
    runner = trainer.runner_for(settings, probe.ProbeRunner(timeout_s=settings.probe_timeout))
    bench = _Bench(runner, estimated.prescreen_for(options.prescreen, runner, settings.vram_bytes, options.meter,
                                                  options.gpu), faults.probe_faults(), log_dir, card,
                   estimated.guide_for(options.guided, job, options.meter, options.gpu, runner))
    # The study's sampler is the plan; this worker's carries its guide (estimates from its runner).
    study.sampler = FitSampler(space, limit, bench.guide, settings.ram_bytes)
    pause = 0.5  # while others probe what the plan waits for: short, probes can be too
    with out.progress(settings.trials, "probing"):
        while True:
            studies.fail_stale(study)
            known, pending = studies.read(study, space, limit, settings.ram_bytes)
            stop_if_probes_keep_failing(known.results, log_dir)
            step = study.sampler.next_step(known, pending)
            _record_decided(study, space, step.decided)
            if studies.probes_in(study) >= settings.trials:
                return
            if step.point is None:
                if not pending:
                    return
                time.sleep(pause)  # others are probing what the plan waits for
                continue
            faults.kill_if_at("planned", len(study.get_trials(deepcopy=False)))
            trial = studies.claim(study, space, step.point, step.purpose)
            if trial is not None:
                first_attempt = known.failures_in_a_row(step.point) == 0  # not a retry
                _probe(trial, job, space, study, options, limit, bench, first_attempt, out)


@dataclass
class _Bench:
    """What a worker measures with: the probe runner, the pre-screen (or None), the injected
    faults of the tests, where probe logs go, and the card."""

    runner: Any
    screen: Any
    faults: dict
    log_dir: Path
    card: dict
    guide: Any = None  # search.Guide: estimates the plan trusts within a band (or None)


def _probe(trial, job, space, study, options, limit, bench: _Bench, first_attempt: bool, out) -> None:
    """Probe the claimed trial's point and record it; a point the pre-screen estimates far over
    the budget is recorded as its predicted OOM instead."""
    faults.kill_if_at("claimed", trial.number)
    purpose = trial.user_attrs.get("purpose", "")
    step = Step(dict(trial.params), purpose, CONFIRM_FACTOR if purpose == "confirm" else 1)
    settings = job.settings
    request = probe.request_for(space.apply(job, step.point), settings.probe_steps * step.steps_factor,
                                options.meter, settings.vram_bytes, options.gpu,
                                fault=faults.probe_fault(bench.faults, trial.number, first_attempt),
                                ram_bytes=settings.ram_bytes)
    trial.set_user_attr("card", bench.card["name"])
    trial.set_user_attr("card_total_bytes", bench.card["total_bytes"])
    faults.kill_if_at("beating", trial.number)
    try:
        with studies.heartbeat_while(study, trial):
            probe_result = bench.screen.outcome(request, purpose) if bench.screen else None
            if probe_result is None:
                _kill_while_probing(trial.number)
                probe_result = bench.runner.run(request, bench.log_dir / f"trial-{trial.number:04d}.log")
    except KeyboardInterrupt:
        trial.set_user_attr("error", "interrupted: the search was stopped while this probe ran")
        study.tell(trial, state=studies.fail_state(), skip_if_finished=True)
        raise
    faults.kill_if_at("probed", trial.number)
    result = result_from_probe(trial.number, step, probe_result)
    if bench.guide is not None:  # how far the estimate was: the band widens past a disagreement
        for key, value in bench.guide.disagreement(result).items():
            trial.set_user_attr(key, value)
    judged = Knowledge(space, limit, settings.ram_bytes).add(result)
    if studies.record(study, trial, space, judged, probe_result, limit, purpose):
        faults.kill_if_at("recorded", trial.number)
        out.trial(space, judged, settings.vram_bytes, purpose)
        out.advance()


def _kill_while_probing(trial_number: int) -> None:
    """FITFINDER_KILL_AT=probing:N: SIGKILL this process a moment after trial N's probe started."""
    if faults.kill_point() == ("probing", trial_number):
        timer = threading.Timer(0.3, faults.kill_if_at, args=("probing", trial_number))
        timer.daemon = True
        timer.start()


def _record_decided(study, space, decided: list[tuple[dict, Result]]) -> None:
    if not decided:
        return
    recorded = studies.decided_keys(study, space)
    for point, decider in decided:
        if space.key(point) not in recorded:
            recorded.add(space.key(point))
            studies.record_decided(study, space, point, decider)


# -- cards --------------------------------------------------------------------------------------
def _card(options) -> dict:
    """The card this worker measures on: its name and total memory (NVML, no CUDA context)."""
    if options.meter != "cuda":
        return {"name": overheads.SIM_CARD, "total_bytes": None}
    reading = preflight.read_card(options.gpu)  # device 0 of the worker: its CUDA_VISIBLE_DEVICES card
    return {"name": reading.name, "total_bytes": reading.total_bytes}


def _refuse_a_different_card(study, card: dict, name: str) -> None:
    """A study whose budget is 'the whole card' must not mix cards of different sizes."""
    if not study.user_attrs.get("budget_is_card") or card["total_bytes"] is None:
        return
    for trial in study.get_trials(deepcopy=False):
        other = trial.user_attrs.get("card_total_bytes")
        if other and other != card["total_bytes"]:
            raise UserError(
                f"study {name!r} was measured on {trial.user_attrs.get('card')} ({format_bytes(other)}); "
                f"this card is a {card['name']} ({format_bytes(card['total_bytes'])}): give --vram to "
                "search with one budget for all cards, or use another --study"
            )


# -- launching ------------------------------------------------------------------------------------
def launch(job, options, url: str, count: int, out) -> None:
    """Start `count` worker processes on the study, relay their lines, wait for them all."""
    processes = []
    for index in range(count):
        env = dict(os.environ)
        gpu_note = "on the CPU"
        if options.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(options.gpus[index])
            gpu_note = f"on GPU {options.gpus[index]}"
        command = worker_command(job, options, url, index)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out.note(f"worker {index + 1} (pid {process.pid}) {gpu_note}")
        relay = threading.Thread(target=_relay, args=(process, f"[w{index + 1}] ", out), daemon=True)
        relay.start()
        processes.append((index + 1, process, relay))
    try:
        for number, process, relay in processes:
            code = process.wait()
            relay.join()
            if code != 0:
                out.note(f"worker {number} (pid {process.pid}) ended with code {code}; "
                         "the others retry its unfinished trial")
    except KeyboardInterrupt:
        for _, process, _ in processes:
            process.terminate()
        raise
    if all(process.returncode != 0 for _, process, _ in processes):
        raise RunFailed("every worker failed; see their lines above")


def worker_command(job, options, url: str, index: int) -> list[str]:
    """The `fitfinder search` command line of one worker, with this search's effective settings."""
    settings = job.settings
    command = [sys.executable, "-m", "fitfinder", "search", str(job.source), "--worker",
               "--storage", url, "--study", options.study_name, "--results-dir", str(options.results_dir),
               "--margin", str(settings.margin), "--trials", str(settings.trials),
               "--probe-steps", str(settings.probe_steps), "--timeout", str(settings.probe_timeout)]
    if settings.vram_bytes is not None:
        command += ["--vram", str(settings.vram_bytes)]
    if settings.ram_bytes is not None:  # every worker holds the host to the budget the search started with
        command += ["--ram", str(settings.ram_bytes)]
    if options.gpus:
        command += ["--gpu", "0"]  # the one card CUDA_VISIBLE_DEVICES shows it
    if options.prescreen is not None:
        command += ["--prescreen" if options.prescreen else "--no-prescreen"]
    if options.guided is not None:
        command += ["--guided" if options.guided else "--no-guided"]
    if settings.trainer_command is not None:
        command += ["--trainer-command", settings.trainer_command]
    return command


def _relay(process, prefix: str, out) -> None:
    for line in process.stdout:
        out.line(prefix + line.rstrip("\n"))


# -- the same probe as an Optuna objective (one process continuing a search from Python) ---------
def probe_objective(job, space, limit_bytes: int | None, meter: str = "sim", gpu: int = 0, runner=None):
    """An objective for `study.optimize` on a study whose sampler is a FitSampler: it probes the
    point the plan sampled (its stage is the trial's `purpose`) and writes the probe's facts as
    the workers do; an OOM prunes the trial, a crashed probe fails it (NaN values), and a trial
    the plan asked nothing for stops the study and is pruned with no point (read as nothing)."""
    import math

    import optuna

    runner = runner or trainer.runner_for(job.settings, probe.ProbeRunner(job.settings.probe_timeout))
    settings = job.settings

    def objective(trial):
        if not trial.relative_params:  # FitSampler plans here (Optuna samples on first use)
            trial.study.stop()
            raise optuna.TrialPruned("the plan asks for no point: the search is done")
        purpose = trial.study.sampler.purposes.get(trial.number, "")
        point = {name: trial.suggest_categorical(name, dist.choices)
                 for name, dist in studies.distributions(space).items()}
        step = Step(point, purpose, CONFIRM_FACTOR if purpose == "confirm" else 1)
        request = probe.request_for(space.apply(job, point), settings.probe_steps * step.steps_factor, meter,
                                    settings.vram_bytes, gpu, ram_bytes=settings.ram_bytes)
        probe_result = runner.run(request)
        known = Knowledge(space, limit_bytes, settings.ram_bytes)
        result = known.add(result_from_probe(trial.number, step, probe_result))
        values = studies.write_facts(trial, space, result, probe_result, limit_bytes, purpose)
        if result.status == "oom":
            raise optuna.TrialPruned(result.error or "out of memory")
        return values if values is not None else [math.nan, math.nan]  # Optuna fails a trial with NaN values

    return objective


# -- probes that keep failing ----------------------------------------------------------------------
MAX_ERRORS_IN_A_ROW = 5


def stop_if_probes_keep_failing(results: list[Result], log_dir) -> None:
    """Errors are not OOMs: when every recent probe fails with one, the job itself is broken."""
    recent = results[-MAX_ERRORS_IN_A_ROW:]
    if len(recent) == MAX_ERRORS_IN_A_ROW and all(r.status in ("error", "timeout") for r in recent):
        last = recent[-1]
        raise RunFailed(f"the last {MAX_ERRORS_IN_A_ROW} probes failed with errors, not out of memory: "
                        f"{(last.error or '').splitlines()[0][:300]}; see {log_dir}/trial-{last.trial:04d}.log")
