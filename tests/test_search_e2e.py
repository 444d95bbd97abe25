"""fitfinder search end to end on the demo: real probes, a real SQLite study, a real job file out."""

import csv
import json
import signal
import subprocess
import sys

import optuna
import pytest

from fitfinder import probe, space as spaces
from fitfinder.trainers import aitoolkit_job
from tests.conftest import DEMO, cli_env, run_cli

pytestmark = pytest.mark.slow


def _exhaustive_optimum(job_path):
    """Probe every point of the demo's space through the same probe code; return the true optimum."""
    job = aitoolkit_job.load(job_path)
    space = spaces.build(job)
    limit = job.settings.vram_bytes * (1 - job.settings.margin)
    runner = probe.ProbeRunner(timeout_s=300)
    rows = []
    for point in space.points():
        result = runner.run(probe.request_for(space.apply(job, point), 4, "sim", job.settings.vram_bytes))
        fits = result["status"] == "ok" and result["peak_bytes"] <= limit
        rows.append((point, fits, result))
    feasible = [(p, r) for p, fits, r in rows if fits]
    top = max(space.quality_key(p) for p, _ in feasible)
    return space, rows, [(p, r) for p, r in feasible if space.quality_key(p) == top]


@pytest.mark.exhaustive  # every point of the demo probed; test_demo_sequence holds the same winner by default
def test_demo_winner_is_the_true_optimum(workdir):
    done = run_cli("search", "configs/demo.yaml", "--json", cwd=workdir)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "fit" and summary["proven"]

    space, rows, optimal = _exhaustive_optimum(workdir / "configs" / "demo.yaml")
    assert sum(1 for _, fits, _ in rows if fits) > 1  # more than one thing would fit
    assert not next(fits for p, fits, _ in rows if p == space.desired())  # the base does not
    fastest = min(optimal, key=lambda pr: pr[1]["seconds_per_step"] / pr[0]["batch"])
    # Same quality as the optimum; among equal quality the speed ranking decides, and in the demo
    # exactly one speed setting fits at the top quality, so the points must be equal.
    assert len(optimal) == 1
    assert summary["best"] == fastest[0]
    assert summary["peak_bytes"] == fastest[1]["peak_bytes"]  # the sim meter is exact
    assert summary["probes_run"] < space.size() / 4

    best = aitoolkit_job.load(workdir / "results" / "demo_flux_lora" / "best.yaml")
    assert best.get("network.linear") == fastest[0]["rank"]
    assert best.get("train.batch_size") * best.accumulation == 4  # effective batch kept
    header = (workdir / "results" / "demo_flux_lora" / "best.yaml").read_text().split("---")[0]
    assert "network.linear: 32 -> " in header
    assert "fitfinder:" not in best.dumps().split("meta:")[1]
    with open(workdir / "results" / "demo_flux_lora" / "trials.csv") as handle:
        assert len(list(csv.DictReader(handle))) == summary["trials"]
    assert (workdir / "configs" / "demo.yaml").read_text() == DEMO.read_text()


def test_killed_search_resumes_without_rerunning_finished_trials(workdir):
    command = [sys.executable, "-m", "fitfinder", "search", "configs/demo.yaml"]
    search = subprocess.Popen(command, cwd=workdir, env=cli_env(), stdout=subprocess.PIPE, text=True)
    lines = []
    for line in search.stdout:  # wait until three trials are done
        lines.append(line)
        if sum(seen.startswith("trial") for seen in lines) == 3:
            break
    search.send_signal(signal.SIGKILL)
    search.wait()
    storage = f"sqlite:///{workdir / 'studies' / 'demo_flux_lora.db'}"
    before = {t.number: t.datetime_complete
              for t in optuna.load_study(study_name="demo_flux_lora", storage=storage).trials
              if t.state.is_finished()}
    assert len(before) >= 3

    done = run_cli("search", "configs/demo.yaml", "--json", cwd=workdir)
    assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name="demo_flux_lora", storage=storage)
    for number, completed in before.items():
        assert study.trials[number].datetime_complete == completed  # not run again
    ran_again = [t for t in study.trials if t.number >= len(before)]
    probed = [t for t in study.trials if t.user_attrs.get("status") in ("ok", "oom")]
    points = [json.dumps(t.user_attrs["point"], sort_keys=True) for t in probed if t.user_attrs["purpose"] != "confirm"]
    assert len(points) == len(set(points))  # no point probed twice (the winner's confirmation aside)
    assert json.loads(done.stdout)["status"] == "fit" and ran_again


def test_crashed_hung_and_silent_probes_are_recorded_and_the_search_goes_on(workdir):
    done = run_cli("search", "configs/demo.yaml", "--json", "--timeout", "30", cwd=workdir,
                   FITFINDER_PROBE_FAULT="1:abort,2:hang,3:silent")
    assert done.returncode == 0, done.stderr
    storage = f"sqlite:///{workdir / 'studies' / 'demo_flux_lora.db'}"
    trials = optuna.load_study(study_name="demo_flux_lora", storage=storage).trials
    reasons = {t.number: (t.state.name, t.user_attrs.get("status"), t.user_attrs.get("error")) for t in trials[1:4]}
    assert reasons[1][:2] == ("FAIL", "error") and "SIGABRT" in reasons[1][2]
    assert reasons[2][:2] == ("FAIL", "timeout") and "30 s timeout" in reasons[2][2]
    assert reasons[3][:2] == ("FAIL", "error") and "without a result line" in reasons[3][2]
    assert json.loads(done.stdout)["status"] == "fit"
