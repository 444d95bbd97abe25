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


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it. A shell starts a background job with SIGINT ignored, and
    children inherit that (Python then installs no KeyboardInterrupt handler): a test run started
    with `&` saw the dashboard ignore the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


def test_the_study_says_what_its_objectives_mean_and_each_trial_its_verdict(demo_run):
    import optuna

    folder, summary = demo_run
    study = optuna.load_study(study_name=NAME, storage=f"sqlite:///{folder / 'studies' / f'{NAME}.db'}")
    quality = study.user_attrs["objective_quality"]
    assert quality.startswith("maximize. The quality knobs' levels as one integer")
    assert "buckets: [256] < [256,384] < [256,384,512]; then rank: 4 < 8 < 16 < 32" in quality
    assert study.user_attrs["objective_seconds_per_sample"].startswith("minimize. Seconds per training sample")
    verdicts = {t.user_attrs.get("status"): t.user_attrs.get("verdict") for t in study.trials}
    assert verdicts["ok"] == "fits" and verdicts["oom"] == "does not fit"


@pytest.mark.slow
def test_dashboard_serves_the_study_with_its_probe_facts_then_stops(demo_run):
    folder, summary = demo_run
    command = [sys.executable, "-m", "fitfinder", "dashboard", f"studies/{NAME}.db", "--port", "0"]
    process = subprocess.Popen(command, cwd=folder, env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=_as_in_a_terminal)
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
        assert oom_attrs["status"] == "oom" and oom_attrs["phase"] == "train" and oom_attrs["verdict"] == "does not fit"
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


# -- what a page on another site can do through the browser: nothing ------------------------------
@pytest.fixture
def served(tmp_path):
    """A real study served by the dashboard on 127.0.0.1 (a free port), in this process."""
    import threading

    import optuna

    from fitfinder.results import dashboard

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'mine.db'}"
    optuna.create_study(study_name="mine", storage=url)
    server = dashboard.Dashboard(url, "127.0.0.1", 0)
    thread = threading.Thread(target=server.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, url
    finally:
        server.server.shutdown()
        server.server.server_close()


def _request(port: int, method: str, path: str, **headers: str) -> tuple[int, str]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:  # a Host given here replaces the one http.client would write
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8")
    finally:
        connection.close()


def _study_names(url: str) -> list[str]:
    import optuna

    return [s.study_name for s in optuna.get_all_study_summaries(url)]


def test_dashboard_refuses_a_foreign_host_and_a_foreign_origin(served):
    server, url = served
    port = server.port
    ours = f"127.0.0.1:{port}"
    assert _request(port, "GET", "/api/studies", Host=ours)[0] == 200
    assert _request(port, "GET", "/api/studies", Host=f"localhost:{port}")[0] == 200
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1", f"127.0.0.1:{port + 1}",
                 f"localhost.attacker.example:{port}", f"10.0.0.1:{port}", ""):
        status, body = _request(port, "GET", "/api/studies", Host=host)
        assert (status, body.split(":")[0]) == (403, "fitfinder dashboard"), host
    # DNS rebinding: the page's own name in Host; the study must survive the DELETE
    status, body = _request(port, "DELETE", "/api/studies/1", Host=f"attacker.example:{port}")
    assert status == 403 and "Host 'attacker.example" in body
    assert _study_names(url) == ["mine"]
    # the right Host but a write from another site's page (the browser adds its Origin)
    status, body = _request(port, "DELETE", "/api/studies/1", Host=ours, Origin="http://attacker.example")
    assert status == 403 and "Origin 'http://attacker.example' may not change" in body
    assert _request(port, "POST", "/api/studies", Host=ours, Origin="null")[0] == 403
    assert _study_names(url) == ["mine"]
    # the dashboard's own page (its Origin), or a client that sends none (curl), may delete
    status, _ = _request(port, "DELETE", "/api/studies/1", Host=ours, Origin=f"http://{ours}")
    assert status == 204 and _study_names(url) == []


def test_dashboard_host_rules():
    from fitfinder.results.dashboard import LocalGuard

    loopback, wildcard, v6 = LocalGuard(None, "127.0.0.1", 8080), LocalGuard(None, "0.0.0.0", 80), \
        LocalGuard(None, "::1", 8080)
    assert [loopback.host_ok(h) for h in ("127.0.0.1:8080", "LOCALHOST:8080", "[::1]:8080", "127.0.0.2:8080",
                                          "evil.com:8080", "127.0.0.1:80", "127.0.0.1")] == \
        [True, True, True, True, False, False, False]
    assert [wildcard.host_ok(h) for h in ("192.168.1.7", "192.168.1.7:80", "[fe80::1]", "evil.com",
                                          "192.168.1.7:8080")] == [True, True, True, False, False]
    assert [v6.host_ok(h) for h in ("[::1]:8080", "localhost:8080", "[::1]", "::1:8080")] == \
        [True, True, False, False]


def test_dashboard_never_adds_tables_to_a_database_that_is_not_a_study(tmp_path):
    from fitfinder.results import dashboard
    from fitfinder.errors import UserError

    theirs = tmp_path / "someone_elses.db"
    with sqlite3.connect(theirs) as db:
        db.execute("CREATE TABLE customers (id INTEGER)")
        db.execute("CREATE TABLE studies (id INTEGER)")  # a name Optuna uses is not an Optuna storage
    before = theirs.read_bytes()
    for given in (str(theirs), f"sqlite:///{theirs}"):
        with pytest.raises(UserError) as caught:
            dashboard.storage_for(given, tmp_path)
        assert str(caught.value) == (f"{given}: not an Optuna study database (made by `fitfinder search`); "
                                     "give --create to add Optuna's tables to it")
    missing = f"sqlite:///{tmp_path / 'new.db'}"
    with pytest.raises(UserError) as caught:
        dashboard.storage_for(missing, tmp_path)
    assert str(caught.value) == f"{missing}: no such file; give --create to make a new study storage there"
    assert theirs.read_bytes() == before and not (tmp_path / "new.db").exists()
    # the command line says the same in one line, and leaves the file as it was
    result = run_cli("dashboard", f"sqlite:///{theirs}", "--port", "0", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "not an Optuna study database" in result.stderr and "Traceback" not in result.stderr
    assert theirs.read_bytes() == before
    # --create: the user asked for it
    assert dashboard.storage_for(missing, tmp_path, create=True) == (missing, missing)
