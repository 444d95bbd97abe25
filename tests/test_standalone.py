"""fitfinder on a bare GPU machine: what scripts/wheelhouse.sh leaves out is never imported by
probe, estimate or calibrate; the scripts parse; the GPU check runs its steps in order (with a
stand-in for the card) and its closing table says the right thing. (Building and installing the
wheels needs the package index: DEVELOPERS.md's manual check.)"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import DEMO, ROOT, cli_env, run_cli

GiB = 2**30
# What the wheelhouse leaves out: only `report`, `search` (its report) and `dashboard` import them.
LEFT_OUT = ("plotly", "optuna_dashboard")
BLOCKER = f"""\
import sys

class _LeftOut:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {LEFT_OUT!r}:
            raise ImportError(f"{{name}} is not in the wheelhouse (tests/test_standalone.py)")
        return None

sys.meta_path.insert(0, _LeftOut())
"""


@pytest.fixture
def without_left_out(tmp_path):
    """A PYTHONPATH entry whose sitecustomize refuses the left-out packages, in every process the
    command starts (probe children included)."""
    folder = tmp_path / "blocker"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return str(folder)


@pytest.mark.slow
def test_probe_estimate_and_calibrate_run_without_plotly_and_optuna_dashboard(tmp_path, without_left_out):
    probed = run_cli("probe", str(DEMO), "--json", cwd=tmp_path, PYTHONPATH=without_left_out)
    estimated = run_cli("estimate", str(DEMO), "--vram", "1GiB", "--json", cwd=tmp_path, PYTHONPATH=without_left_out)
    calibrated = run_cli("calibrate", "--gpu", "0", cwd=tmp_path, PYTHONPATH=without_left_out)
    assert json.loads(probed.stdout)["status"] == "oom", probed.stderr  # the demo's base does not fit its budget
    assert estimated.returncode == 0 and json.loads(estimated.stdout)["fits"] is True, estimated.stderr
    # No card here: one clean line; with one, the measurement imports only torch and NVML.
    assert calibrated.returncode == 2 and "no CUDA device" in calibrated.stderr, calibrated.stderr
    for done in (probed, estimated, calibrated):
        assert "not in the wheelhouse" not in done.stderr and "Traceback" not in done.stderr


def test_the_blocker_blocks(tmp_path, without_left_out):
    """The check above proves something only if the left-out packages really cannot be imported."""
    done = subprocess.run([sys.executable, "-c", "import plotly"], check=False, capture_output=True, text=True,
                          env={"PYTHONPATH": without_left_out, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and "not in the wheelhouse" in done.stderr


@pytest.mark.parametrize("script", ["scripts/wheelhouse.sh", "scripts/gpu_check.sh", ".ci/run"])
def test_the_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / script)], check=False, capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        checked = subprocess.run(["shellcheck", str(ROOT / script)], check=False, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout


# -- the GPU check's closing table ---------------------------------------------------------------------
def _table_module():
    spec = importlib.util.spec_from_file_location("gpu_check_table", ROOT / "scripts" / "gpu_check_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _point(jobs, name, label, budget, probe=None, estimate=None, seconds=None):
    (jobs / f"{name}.point.json").write_text(json.dumps({"label": label, "budget_bytes": budget}))
    if probe is not None:
        (jobs / f"{name}.probe.json").write_text(json.dumps(probe))
    if estimate is not None:
        (jobs / f"{name}.estimate.json").write_text(json.dumps(estimate))
    for what, value in (seconds or {}).items():
        (jobs / f"{name}.{what}.seconds").write_text(f"{value}\n")


def test_the_table_compares_each_phase_and_says_what_fit(tmp_path):
    _point(tmp_path, "1-fits", "512 capped", 24 * GiB,
           probe={"meter": "cuda (GPU 0)", "status": "ok", "phases": {"load": 20 * GiB, "train": 16 * GiB},
                  "peak_bytes": 20 * GiB},
           estimate={"fits": True, "peak_bytes": 21 * GiB, "phases": {"load": 21 * GiB, "train": 15 * GiB}},
           seconds={"probe": 61.4, "estimate": 19})
    _point(tmp_path, "2-runs-out", "1024 capped", 24 * GiB,
           probe={"meter": "cuda (GPU 0)", "status": "oom", "phase": "train",
                  "phases": {"load": 20 * GiB, "train": 23 * GiB}, "peak_bytes": 23 * GiB},
           estimate={"fits": False, "phase": "train", "peak_bytes": 29 * GiB,
                     "phases": {"load": 20 * GiB, "train": 29 * GiB, "last_sample": 18 * GiB}})
    _point(tmp_path, "3-no-probe", "512 bf16", None, estimate={"fits": None, "peak_bytes": 34 * GiB,
                                                                "phases": {"load": 34 * GiB}})
    lines = _table_module().render(tmp_path, "12 passed in 80.1s").splitlines()

    assert lines[0].split() == ["point", "phase", "cuda", "meter", "estimate", "error"]
    assert lines[1].split()[-1] == "+5.0%" and lines[2].split()[-1] == "-6.2%"  # (estimate - meter) / meter
    assert lines[3].split()[-1] == "+0.0%"
    assert lines[4].endswith("23.00 GiB  29.00 GiB  ran out")  # the failed allocation under the cap: no peak
    assert lines[5].split()[-4:] == ["-", "18.00", "GiB", "-"]  # after the failure: the estimate alone
    assert ("512 capped: probe fits 24 GiB (peak 20.00 GiB); estimate fits (peak 21.00 GiB) [probe 61 s, estimate 19 s]"
            in lines)
    assert "1024 capped: probe does not fit 24 GiB: ran out in train; estimate does not fit: over in train " \
           "(peak 29.00 GiB)" in lines
    assert "512 bf16: probe no probe result; estimate peak 34.00 GiB" in lines
    assert lines[-2].startswith("largest relative error -6.2% over 3 phases")
    assert lines[-1] == "GPU-marked tests: 12 passed in 80.1s"


def test_a_probe_that_fell_back_to_the_sim_meter_is_not_a_measurement(tmp_path):
    _point(tmp_path, "1", "512", 24 * GiB, probe={"meter": "sim meter", "status": "ok", "phases": {}},
           estimate={"fits": True, "peak_bytes": GiB, "phases": {}})
    text = _table_module().render(tmp_path)
    assert "probe not measured on a card (sim meter)" in text
    assert "no phase was measured by both the card and the estimate" in text


# -- the GPU check's flow, with a stand-in for the card -------------------------------------------------
# A PYTHON for gpu_check.sh that answers for the card: calibrate, probe and pytest give canned
# results, estimate too (the real one takes minutes of CPU); everything else runs for real
# (the job files, the table). The version check is told this is a dry run so that it does not
# ask for CUDA. What the test proves is the script's plumbing on the path a dry run skips.
STAND_IN = """#!/usr/bin/env bash
set -eu
GiB=1073741824
case "$*" in
  "-m fitfinder calibrate"*)
    echo '{"gpu_name": "Stand-in GPU"}'
    echo "Stand-in GPU: context 500 MiB" >&2 ;;
  "-m fitfinder estimate"*)
    echo "$*" >> "$CALLS"
    echo "{\\"fits\\": true, \\"peak_bytes\\": $((21 * GiB)), \
\\"phases\\": {\\"load\\": $((21 * GiB)), \\"train\\": $((15 * GiB))}}" ;;
  "-m fitfinder probe"*)
    echo "$*" >> "$CALLS"
    echo "{\\"meter\\": \\"cuda meter on Stand-in GPU\\", \\"status\\": \\"ok\\", \
\\"peak_bytes\\": $((20 * GiB)), \\"phases\\": {\\"load\\": $((20 * GiB)), \\"train\\": $((16 * GiB))}}" ;;
  "-m pytest"*)
    echo "$*" >> "$CALLS"
    echo "..."
    echo "3 passed, 40 deselected in 1.00s" ;;
  *)
    if [ "$#" -eq 3 ] && [ "$1" = "-" ] && [ "$2" = "0" ]; then set -- - 1 "$3"; fi
    exec "$REAL_PYTHON" "$@" ;;
esac
"""


@pytest.mark.slow
def test_the_check_runs_every_step_and_ends_with_the_table(tmp_path):
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    calls, log = tmp_path / "calls.txt", tmp_path / "gpu-check.txt"
    env = {**cli_env(), "PYTHON": str(stand_in), "REAL_PYTHON": sys.executable, "CALLS": str(calls),
           "LOG": str(log), "BUDGET_S": "300", "GPU": "0"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], check=False, capture_output=True,
                          text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    text = log.read_text()
    made = calls.read_text().splitlines()
    estimates = [line for line in made if line.startswith("-m fitfinder estimate")]
    probes = [line for line in made if line.startswith("-m fitfinder probe")]
    assert len(estimates) == 3 and all("--card Stand-in GPU" in line for line in estimates)
    assert [("--vram 24GiB" in line) for line in probes] == [True, True, False]  # 512 and 1024 capped, bf16 whole
    assert all("--steps 6" in line and "--gpu 0" in line for line in probes)
    assert any(line.startswith("-m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py") for line in made)
    assert "FLUX.1-dev 512 8-bit, 24 GiB cap   load" in text and "+5.0%" in text and "-6.2%" in text
    assert "FLUX.1-dev 1024 8-bit, 24 GiB cap: probe fits 24 GiB (peak 20.00 GiB); estimate fits" in text
    assert "FLUX.1-dev 512 bf16, whole card: probe fits the card (peak 20.00 GiB); estimate peak 21.00 GiB" in text
    assert "largest relative error -6.2% over 6 phases" in text
    assert "GPU-marked tests: 3 passed, 40 deselected in 1.00s" in text and "== done in" in text
