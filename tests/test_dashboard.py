"""`fitfinder dashboard`: the stock optuna-dashboard over the demo's study, on 127.0.0.1, stopped by Ctrl-C."""

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import cli_env, run_cli

NAME = "demo_flux_lora"
PROBE_FACTS = ("status", "phase", "peak_bytes", "limit_bytes", "phases", "phase_stats", "seconds_per_step",
               "seconds_per_sample", "wall_seconds", "verdict", "error", "oom_kind", "meter", "point")


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read().decode("utf-8")


def _first_line(process, timeout: float = 60) -> str:
    """The dashboard's URL line, or the reason it never came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line:
            return line
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"no URL from the dashboard: {process.stderr.read()}")


@pytest.mark.slow
def test_dashboard_serves_the_study_with_its_probe_facts_then_stops(demo_run):
    folder, summary = demo_run
    command = [sys.executable, "-m", "fitfinder", "dashboard", f"studies/{NAME}.db", "--port", "0"]
    process = subprocess.Popen(command, cwd=folder, env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(process)
        assert line.startswith(f"fitfinder: dashboard of studies/{NAME}.db at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        base, port = url.split("/dashboard")[0], int(url.split(":")[2].split("/")[0])

        status, page = _get(url)  # the study's page
        assert status == 200 and "<title>Optuna Dashboard</title>" in page
        studies = json.loads(_get(f"{base}/api/studies")[1])["study_summaries"]
        assert [s["study_name"] for s in studies] == [NAME]
        study_id = studies[0]["study_id"]
        assert url == f"{base}/dashboard/studies/{study_id}"

        detail = json.loads(_get(f"{base}/api/studies/{study_id}")[1])
        assert detail["objective_names"] == ["quality", "seconds_per_sample"]
        assert len(detail["trials"]) == summary["trials"]
        for trial in detail["trials"]:
            attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
            assert set(PROBE_FACTS) <= set(attrs), sorted(set(PROBE_FACTS) - set(attrs))
            assert set(json.loads(attrs["phases"])) >= {"load"}
        oom = next(t for t in detail["trials"] if t["state"] == "Pruned")
        oom_attrs = {a["key"]: a["value"] for a in oom["user_attrs"]}
        assert oom_attrs["status"] == "oom" and oom_attrs["phase"] == "train" and oom_attrs["verdict"] == "nofit"
        best = next(t for t in detail["trials"] if {p["name"]: p["param_external_value"] for p in t["params"]}
                    == {k: str(v) for k, v in summary["best"].items()})
        assert {a["key"]: a["value"] for a in best["user_attrs"]}["peak_bytes"] == str(summary["peak_bytes"])
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            out, err = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, err
    assert "dashboard stopped" in out and "Traceback" not in err
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # nobody listens there any more
    with socket.socket() as again:  # and a server may listen there again (connections closed by the
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # dashboard linger in TIME_WAIT)
        again.bind(("127.0.0.1", port))
        again.listen()


def test_dashboard_picks_the_one_study_or_says_which(tmp_path):
    none = run_cli("dashboard", cwd=tmp_path)
    assert none.returncode == 2 and none.stderr.startswith("fitfinder: error: no studies in studies/")
    (tmp_path / "studies").mkdir()
    for name in ("a", "b"):
        with sqlite3.connect(tmp_path / "studies" / f"{name}.db") as db:
            db.execute("CREATE TABLE studies (study_id INTEGER)")
    two = run_cli("dashboard", cwd=tmp_path)
    assert two.returncode == 2
    assert two.stderr.strip() == ("fitfinder: error: 2 studies in studies/: a.db, b.db; "
                                  "say which, e.g. `fitfinder dashboard studies/a.db`")
    (tmp_path / "notes.db").write_text("not a database")
    wrong = run_cli("dashboard", "notes.db", cwd=tmp_path)
    assert wrong.returncode == 2 and "notes.db: not an Optuna study database" in wrong.stderr
    missing = run_cli("dashboard", "c", cwd=tmp_path)
    assert missing.returncode == 2 and "c: no such study file; studies in studies/: a.db, b.db" in missing.stderr
    for result in (none, two, wrong, missing):
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_dashboard_refuses_a_bad_port(tmp_path):
    bad = run_cli("dashboard", "--port", "70000", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "fitfinder: error: --port: must be between 0 and 65535, got 70000"


@pytest.mark.slow
def test_dashboard_on_a_busy_port_is_one_line(demo_run):
    folder, _ = demo_run
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli("dashboard", f"studies/{NAME}.db", "--port", str(port), cwd=folder)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in done.stderr
