"""`fitfinder estimate` and `fitfinder calibrate` as a user runs them: table, JSON, exit codes, errors."""

import json

import pytest

from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import overhead
from tests.conftest import DEMO, EXAMPLES, assert_one_clean_line, run_cli

MiB = 2**20
ALL_PHASES = ["load", "text_encoder", "latents", "sample", "train", "last_sample"]


@pytest.fixture(scope="module")
def demo_sim_peaks():
    """The demo probed on the sim meter without a budget: what the estimate must predict exactly."""
    job = aitoolkit_job.load(DEMO)
    result = probe.ProbeRunner(300).run(probe.request_for(job, 4, "sim", None))
    assert result["status"] == "ok", result.get("error")
    return result["phases"]


def test_json_gives_the_verdict_the_budget_and_every_phase(tmp_path, demo_sim_peaks):
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--json", cwd=tmp_path)
    found = json.loads(done.stdout)
    assert done.returncode == 1  # the demo's base does not fit its 13.2 MiB: that is its point
    assert found["verdict"] == "does not fit" and found["fits"] is False and found["budget_bytes"] == int(13.2 * MiB)
    # where it stops and what would take it: the job as written fits the smallest card sold
    assert found["wall"]["phase"] == "train" and found["wall"]["peak_bytes"] == found["peak_bytes"]
    assert found["would_take"]["card_gb"] == 8 and found["would_take"]["margin_at_most"] is None
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
    assert lines[header].split() == ["phase", "tensors", "allocated", "peak", "of", "the", "budget", "host"]
    rows = [line.split() for line in lines[header + 1:header + 7]]
    assert [row[0] for row in rows] == ALL_PHASES and all(row[-3].endswith("%") for row in rows)
    assert all(row[-1] == "MiB" for row in rows)  # each phase's host peak: the process and its host tensors
    # train: 66.5 MiB of tensors and 8 MiB of workspace, 2% on top, and the 300 MiB context
    headline = lines.index("fits: peak 376 MiB of 1 GiB, 648 MiB to spare "
                           "(under the limit 973 MiB: the budget less the 5% margin)")
    # then the highest phase by owner: the context the largest, the activations next
    assert lines[headline + 1:headline + 3] == ["the highest phase: train, 376 MiB", "  by owner, at the phase's peak:"]
    assert lines[headline + 3].split()[:3] == ["CUDA", "context", "300"]
    assert lines[headline + 4].split()[:4] == ["activations", "and", "transients", "62.4"]


def test_a_tight_estimate_warns_and_exits_0_where_the_search_would_not_take_it(tmp_path, demo_sim_peaks):
    from fitfinder.units import format_bytes

    peak = max(demo_sim_peaks.values())
    budget = int(peak / 0.965)  # under the budget, past the 5% margin's limit
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--vram", f"{budget}B", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert (found["verdict"], found["fits"], found["fits_with_margin"]) == ("tight", True, False)  # `fits` as before
    assert found["wall"]["phase"] == "train" and found["would_take"]["margin_at_most"] == 0.03
    lines = done.stderr.splitlines()  # with --json the lines go to stderr
    headline, *explained = lines[next(i for i, line in enumerate(lines) if line.startswith("tight: peak")):]
    assert headline.startswith(f"tight: peak {format_bytes(peak)} of {format_bytes(budget)}, ")
    assert headline.endswith("warning: it may run out, and a search picks it only with --margin 0")
    assert explained[0].startswith(f"the wall: train, {format_bytes(peak)} (") and "past the limit" in explained[0]
    assert explained[1] == "  by owner, at the phase's peak:"
    assert explained[-2:] == ["with --margin 0.03 or less it fits this card",
                              f"the smallest card that takes it: 8 GB, as written (peak {format_bytes(peak)})"]


def test_search_on_estimates_says_how_far_a_better_tight_point_is_past_the_limit(tmp_path, demo_sim_peaks):
    peak = max(demo_sim_peaks.values())
    budget = int(peak / 0.965)  # the job as written is tight: the search takes a lighter point
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--vram", f"{budget}B", "--search", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["verdict"] == "fits" and found["best"] != found["tight"]["point"]
    assert found["tight"]["peak_bytes"] == peak and found["tight"]["margin_at_most"] == 0.03
    assert done.stderr.splitlines()[-1].startswith("tight: buckets=[256,384,512] rank=32 gc=off batch=4 peaks ")
    assert done.stderr.splitlines()[-1].endswith("with --margin 0.03 or less a search takes it (it may run out)")


def test_a_long_estimate_says_its_phase_on_stderr_and_nothing_on_stdout(capfd):
    from fitfinder.probe import estimate

    found = estimate.run(aitoolkit_job.load(DEMO), estimate.InProcess(300, progress_after_s=0.0),
                         overhead.GpuOverhead.none())
    out, err = capfd.readouterr()
    assert out == "" and found.phases
    shown = [line for line in err.splitlines() if line.startswith("fitfinder: estimating: ")]
    assert shown and {line.split()[2] for line in shown} <= {"start", *ALL_PHASES}
    assert all(line.endswith(" s)") for line in shown)


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


def test_search_on_estimates_when_nothing_fits_says_the_wall_and_the_smallest_card(tmp_path):
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--vram", "4MiB", "--search", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    found = json.loads(done.stdout)  # stdout is the one JSON object; every line went to stderr
    assert (found["status"], found["verdict"], found["best"]) == ("none", "does not fit", None)
    wall, would_take = found["wall"], found["would_take"]
    # even the lightest point (one bucket, rank 4) passes the 3.8 MiB limit in its training step
    assert wall["phase"] == "train" and wall["peak_bytes"] > found["limit_bytes"] and "lightest" in wall["point"]
    # the job as written (66.5 MiB) fits the smallest card sold, so the best point there is the job itself
    assert would_take["card_gb"] == 8 and would_take["differs"] == "" and would_take["point"]["rank"] == 32
    lines = done.stderr.splitlines()
    wall_line = lines.index(next(line for line in lines if line.startswith("the wall: train, ")))
    assert lines[wall_line - 1].startswith(
        "does not fit: nothing is predicted to fit under the limit of 3.8 MiB (4 MiB less")
    assert lines[wall_line + 2].split()[:3] == ["activations", "and", "transients"]  # what stops it in train
    assert lines[-1].startswith("the smallest card that takes it: 8 GB")
    assert wall["owners"][0]["owner"] == "activations and transients"


def test_calibrate_without_that_gpu_is_bad_input(tmp_path):
    assert_one_clean_line(run_cli("calibrate", "--gpu", "7", cwd=tmp_path), "--gpu: no CUDA device 7 here")
    assert_one_clean_line(run_cli("calibrate", "--gpu", "first", cwd=tmp_path), "--gpu: expected a device index")


@pytest.mark.parametrize("command", ["search", "probe"])
def test_a_gpu_that_is_not_here_is_refused_as_calibrate_refuses_it(tmp_path, command):
    done = run_cli(command, str(DEMO), "--gpu", "0", cwd=tmp_path)
    assert_one_clean_line(done, "--gpu: no CUDA device 0 here (0 found); without a GPU, `fitfinder estimate")
    assert "`fitfinder tiers JOB`" in done.stderr and not (tmp_path / "studies").exists()


@pytest.mark.parametrize("command", ["search", "probe"])
def test_the_sim_meter_refuses_a_full_size_model_and_names_the_estimate(tmp_path, command):
    job = EXAMPLES / "train_lora_flux_24gb.yaml"
    done = run_cli(command, str(job), "--vram", "24GiB", cwd=tmp_path)
    assert_one_clean_line(done, "black-forest-labs/FLUX.1-dev (flux-dev, flux) is a full-size model; the sim meter")
    for named in (f"`fitfinder estimate {job} --vram 24GiB`", "--search", f"`fitfinder tiers {job}`"):
        assert named in done.stderr
    assert not (tmp_path / "studies").exists() and not (tmp_path / "results").exists()
