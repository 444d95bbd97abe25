"""`fitfinder estimate` and `fitfinder calibrate` as a user runs them: table, JSON, exit codes, errors."""

import json

import pytest

from fitfinder import jobconfig, probe
from fitfinder.probe import overhead
from tests.conftest import DEMO, assert_one_clean_line, run_cli

MiB = 2**20
ALL_PHASES = ["load", "text_encoder", "latents", "sample", "train", "last_sample"]


@pytest.fixture(scope="module")
def demo_sim_peaks():
    """The demo probed on the sim meter without a budget: what the estimate must predict exactly."""
    job = jobconfig.load(DEMO)
    result = probe.ProbeRunner(300).run(probe.request_for(job, 4, "sim", None))
    assert result["status"] == "ok", result.get("error")
    return result["phases"]


def test_json_gives_the_verdict_the_budget_and_every_phase(tmp_path, demo_sim_peaks):
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--json", cwd=tmp_path)
    found = json.loads(done.stdout)
    assert done.returncode == 1  # the demo's base does not fit its 13.2 MiB: that is its point
    assert found["fits"] is False and found["budget_bytes"] == int(13.2 * MiB)
    assert found["phases"] == demo_sim_peaks  # tensor bytes only: exactly what the sim meter measures
    assert found["peak_bytes"] == max(demo_sim_peaks.values()) and found["phase"] == "train"
    assert found["limit_bytes"] == int(found["budget_bytes"] * 0.95) and found["fits_with_margin"] is False
    assert set(found["phase_stats"]["train"]) >= {"peak_live", "peak_allocated", "peak_reserved", "seconds"}
    assert found["overhead"]["source"] == "none"


def test_the_table_with_a_stored_calibration_picked_by_name(tmp_path):
    cache = tmp_path / "cache"
    measured = {"gpu_name": "NVIDIA GeForce RTX 4090", "total_bytes": 24 * 2**30}
    calibrated = overhead.GpuOverhead(300 * MiB, 8 * MiB, 0.02, "calibrated on NVIDIA GeForce RTX 4090")
    overhead.save(calibrated, measured, cache / "calibration")
    done = run_cli("estimate", str(DEMO), "--card", "rtx 4090", "--vram", "1GiB", cwd=tmp_path,
                   FITFINDER_CACHE=str(cache))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (f"estimate of {DEMO} (flux-tiny), GPU overhead (calibrated on NVIDIA GeForce RTX 4090): "
                        "context 300 MiB, cuBLAS workspace 8 MiB, fragmentation 2.0%")
    header = lines.index(next(line for line in lines if line.startswith("phase")))
    assert lines[header].split() == ["phase", "tensors", "allocated", "peak", "of", "the", "budget"]
    rows = [line.split() for line in lines[header + 1:header + 7]]
    assert [row[0] for row in rows] == ALL_PHASES and all(row[-1].endswith("%") for row in rows)
    # train: 66.5 MiB of tensors and 8 MiB of workspace, 2% on top, and the 300 MiB context
    assert lines[-1] == "fits: peak 376 MiB of 1 GiB, 648 MiB to spare (within the 5% safety margin, limit 973 MiB)"


def test_search_on_estimates_finds_what_the_real_search_finds(tmp_path, demo_run):
    _, real = demo_run
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--search", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["status"] == "fit" and found["proven"]
    assert found["best"] == real["best"] and found["peak_bytes"] == real["peak_bytes"]
    assert found["also_fit"] == []  # one speed setting fits at that quality, as the real search found
    assert not (tmp_path / "studies").exists() and not (tmp_path / "results").exists()  # nothing written


def test_an_estimate_cap_that_stops_the_search_early_does_not_say_nothing_fits(tmp_path):
    """Issue 35: `--trials 1` said "nothing is predicted to fit" after one estimate of the base."""
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--search", "--trials", "1", cwd=tmp_path)
    assert done.returncode == 1 and "nothing is predicted to fit" not in done.stderr, done.stderr
    assert "no point predicted to fit in the 1 estimates of the cap (--trials 1)" in done.stderr


@pytest.mark.parametrize("args, expected", [
    (["nowhere.yaml"], "nowhere.yaml: no such file"),
    ([str(DEMO), "--vram", "lots"], "--vram: 'lots' is not a size"),
    ([str(DEMO), "--card", "Voodoo 5"], "--card: 'Voodoo 5' matches no stored calibration"),
    ([str(DEMO), "--card", "x", "--no-overhead"], "--card and --no-overhead contradict each other"),
    ([str(DEMO), "--margin", "2"], "--margin: must be between 0 and 0.9"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, expected):
    done = run_cli("estimate", *args, cwd=tmp_path, FITFINDER_CACHE=str(tmp_path / "cache"))
    assert_one_clean_line(done, expected)


def test_search_without_a_budget_is_bad_input(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(DEMO.read_text().replace("  vram: 13.2MiB", ""))
    assert_one_clean_line(run_cli("estimate", str(job), "--search", cwd=tmp_path), "--search needs a memory budget")


def test_calibrate_without_that_gpu_is_bad_input(tmp_path):
    assert_one_clean_line(run_cli("calibrate", "--gpu", "7", cwd=tmp_path), "--gpu: no CUDA device 7 here")
    assert_one_clean_line(run_cli("calibrate", "--gpu", "first", cwd=tmp_path), "--gpu: expected a device index")
