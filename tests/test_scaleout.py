"""Scale-out: several worker processes, on one machine or several, share one study."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests import pgserver
from tests.conftest import cli_env


NAME = "demo_flux_lora"
FAST_HEARTBEAT = {"FITFINDER_HEARTBEAT": "1,4"}  # a dead worker's trial is failed after 4 s


@pytest.fixture(scope="module")
def postgres():
    """A real PostgreSQL server: the one .ci/run started, or a throwaway one on a free port."""
    url = os.environ.get("FITFINDER_TEST_POSTGRES")
    if url:
        yield url
        return
    if pgserver.binaries() is None:
        if os.environ.get("FITFINDER_REQUIRE_POSTGRES"):
            pytest.fail("PostgreSQL is not installed (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="fitfinder-pg-"))  # not under pytest's private tmp: the
    os.chmod(folder, 0o755)                                  # server runs as another user
    try:
        url = pgserver.start(folder / "server")
        yield url
    finally:
        pgserver.stop(folder / "server")
        shutil.rmtree(folder, ignore_errors=True)


def _probed(study):
    """(point, stage) of every trial that ran a probe, duplicates and retries included."""
    return [(json.dumps(t.params, sort_keys=True), t.user_attrs.get("purpose")) for t in study.trials
            if t.user_attrs.get("status") in ("ok", "oom", "error", "timeout")]


def _assert_nothing_lost(study):
    states = {t.state for t in study.trials}
    assert optuna.trial.TrialState.WAITING not in states and optuna.trial.TrialState.RUNNING not in states


@pytest.mark.slow
def test_three_workers_on_two_machines_share_a_postgres_study(postgres, workdir, demo_run):
    """One command with two workers and a second command (another machine) with one, on one
    PostgreSQL study: no point probed twice, none lost, the winner of a single worker."""
    command = [sys.executable, "-m", "fitfinder", "search", "configs/demo.yaml", "--json", "--storage", postgres]
    first = subprocess.Popen([*command, "--workers", "2"], cwd=workdir, env=cli_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    second_dir = workdir / "second-machine"
    second_dir.mkdir()
    (second_dir / "configs").mkdir()
    (second_dir / "configs" / "demo.yaml").write_text((workdir / "configs" / "demo.yaml").read_text())
    second = subprocess.run(command, cwd=second_dir, env=cli_env(), capture_output=True, text=True, timeout=900)
    out, err = first.communicate(timeout=900)
    assert first.returncode == 0, err
    assert second.returncode == 0, second.stderr
    winners = [json.loads(out)["best"], json.loads(second.stdout)["best"]]
    single_worker_winner = demo_run[1]["best"]
    assert winners == [single_worker_winner, single_worker_winner]

    study = optuna.load_study(study_name=NAME, storage=postgres)
    probed = _probed(study)
    assert len(probed) == len(set(probed)), "a point was probed twice"
    _assert_nothing_lost(study)
    workers = {t.user_attrs.get("worker") for t in study.trials if t.user_attrs.get("status") in ("ok", "oom")}
    assert len(workers) == 3  # every worker probed


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_trial_retried(workdir, demo_run):
    search = subprocess.Popen([sys.executable, "-m", "fitfinder", "search", "configs/demo.yaml", "--workers", "3",
                               "--force"], cwd=workdir, env=cli_env(**FAST_HEARTBEAT), stdout=subprocess.PIPE,
                              text=True)
    pids = {}
    for line in search.stdout:  # "fitfinder: worker 2 (pid 1234) on the CPU"
        if line.startswith("fitfinder: worker"):
            pids[int(line.split()[2])] = int(line.split("pid ")[1].split(")")[0])
        if len(pids) == 3:
            break
    storage = f"sqlite:///{workdir / 'studies' / f'{NAME}.db'}"
    # The victim is the worker running the base probe: the plan needs its result whatever else comes
    # back, so its trial must be retried (a speculative probe killed may rightly be left alone once
    # other results make it moot, which made this test depend on timing).
    workers_by_pid = {pid: index for index, pid in pids.items()}
    victim = index = killed_trial = None
    deadline = time.monotonic() + 300
    while killed_trial is None and time.monotonic() < deadline:
        time.sleep(0.2)
        trials = optuna.load_study(study_name=NAME, storage=storage).trials
        for trial in trials:
            # Not a trial its worker is about to fail as the duplicate of an earlier one (three
            # workers all plan the base at first): that one ends FAIL without dying.
            twin = any(other.number < trial.number and other.params == trial.params
                       and other.state != optuna.trial.TrialState.FAIL
                       and other.user_attrs.get("purpose") == trial.user_attrs.get("purpose") for other in trials)
            pid = int(trial.user_attrs.get("worker", ":0").rsplit(":", 1)[1])
            if (trial.state == optuna.trial.TrialState.RUNNING and not twin
                    and trial.user_attrs.get("purpose") == "base" and pid in workers_by_pid):
                victim, index = pid, workers_by_pid[pid]
                os.kill(victim, signal.SIGKILL)
                killed_trial = trial
                break
    assert killed_trial is not None, "no worker ran the base probe"
    rest = search.stdout.read()
    assert search.wait(timeout=900) == 0
    assert f"worker {index} (pid {victim}) ended with code -9" in rest

    study = optuna.load_study(study_name=NAME, storage=storage)
    dead = study.trials[killed_trial.number]
    assert dead.state == optuna.trial.TrialState.FAIL  # failed by a live worker: its process is gone
    assert (dead.user_attrs["status"] == "abandoned"
            and f"no process {victim} on this machine" in dead.user_attrs["error"])
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retries) == 1 and retries[0].params == dead.params
    assert retries[0].state.is_finished() and retries[0].user_attrs.get("status") in ("ok", "oom")
    assert retries[0].user_attrs["worker"] != dead.user_attrs["worker"]
    _assert_nothing_lost(study)
    best = json.loads((workdir / "results" / NAME / "summary.json").read_text())["best"]
    assert best == demo_run[1]["best"]


def test_a_study_whose_budget_is_the_card_refuses_a_card_of_another_size(tmp_path):
    """Each trial records its card; a worker on a card of another size is refused, with the way
    out (--vram: one budget for all). The cards here are NVML readings written as they would be."""
    from fitfinder import space as spaces
    from fitfinder.trainers import aitoolkit_job
    from fitfinder.search import study as studies, worker
    from fitfinder.errors import UserError
    from tests.conftest import DEMO

    job = aitoolkit_job.load(DEMO)
    space = spaces.build(job)
    url = f"sqlite:///{tmp_path / 'cards.db'}"
    study = studies.open_study(url, "cards", space, {"budget_bytes": 24 * 2**30, "budget_is_card": True})
    trial = studies.claim(study, space, space.desired(), "base")
    trial.set_user_attr("card", "NVIDIA GeForce RTX 4090")
    trial.set_user_attr("card_total_bytes", 24 * 2**30)
    worker._refuse_a_different_card(study, {"name": "NVIDIA RTX 4090 D", "total_bytes": 24 * 2**30}, "cards")
    with pytest.raises(UserError) as caught:
        worker._refuse_a_different_card(study, {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 * 2**30}, "cards")
    assert "measured on NVIDIA GeForce RTX 4090 (24 GiB)" in str(caught.value) and "give --vram" in str(caught.value)

    explicit = studies.open_study(url.replace("cards.db", "vram.db"), "vram", space,
                                  {"budget_bytes": 24 * 2**30, "budget_is_card": False})
    other = studies.claim(explicit, space, space.desired(), "base")
    other.set_user_attr("card_total_bytes", 24 * 2**30)
    worker._refuse_a_different_card(explicit, {"name": "H100", "total_bytes": 80 * 2**30}, "vram")  # --vram given
