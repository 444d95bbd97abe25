"""The probe: the demo's tiny Flux pipeline + peft LoRA, metered; the one-line protocol; crashes and hangs."""

import json
import subprocess
import sys

import pytest

from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from tests.conftest import DEMO, cli_env

MiB = 2**20


def _request(budget=None, steps=4, **changes):
    job = aitoolkit_job.load(DEMO)
    for path, value in changes.items():
        job.set(path.replace("__", "."), value)
    return probe.request_for(job, steps, "sim", budget)


@pytest.fixture(scope="module")
def runner():
    return probe.ProbeRunner(timeout_s=120)


def test_module_entry_prints_exactly_one_json_line():
    request = _request(steps=3)
    done = subprocess.run([sys.executable, "-m", "fitfinder.probe"], input=json.dumps(request),
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert result["status"] == "ok" and result["steps_run"] == 3
    assert list(result["phases"]) == ["load", "text_encoder", "latents", "sample", "train", "last_sample"]
    assert result["phases"]["train"] > result["phases"]["load"] > 0
    assert result["peak_bytes"] == result["phases"]["train"]  # the demo is about the training step


def test_budget_under_the_load_peak_fails_in_load(runner):
    result = runner.run(_request(budget=200 * 1024))
    assert result["status"] == "oom" and result["phase"] == "load"
    assert "out of memory" in result["error"]


def test_budget_between_the_other_phases_and_train_fails_in_train(runner):
    free = runner.run(_request())["phases"]
    others = max(peak for name, peak in free.items() if name != "train")
    result = runner.run(_request(budget=(others + free["train"]) // 2))
    assert result["status"] == "oom" and result["phase"] == "train" and result["oom_kind"] == "config"
    assert list(result["phases"]) == ["load", "text_encoder", "latents", "sample", "train"]


def test_peaks_are_exact_and_repeatable(runner):
    first, second = runner.run(_request()), runner.run(_request())
    assert first["phases"] == second["phases"]


def test_train_peak_grows_with_batch_and_shrinks_with_checkpointing(runner):
    base = runner.run(_request(train__batch_size=1, train__gradient_checkpointing=False))["phases"]["train"]
    bigger = runner.run(_request(train__batch_size=2, train__gradient_checkpointing=False))["phases"]["train"]
    checkpointed = runner.run(_request(train__batch_size=1, train__gradient_checkpointing=True))["phases"]["train"]
    assert bigger > base > checkpointed


@pytest.mark.parametrize("fault, status, reason", [
    ("abort", "error", "killed by SIGABRT"),
    ("silent", "error", "exited with code 0 without a result line"),
])
def test_a_crashed_probe_is_a_result_with_its_reason(runner, fault, status, reason):
    request = _request()
    request["fault"] = fault
    result = runner.run(request)
    assert result["status"] == status and reason in result["error"]


def test_a_hung_probe_is_killed_at_its_timeout():
    request = _request()
    request["fault"] = "hang"
    result = probe.ProbeRunner(timeout_s=3).run(request)
    assert result["status"] == "timeout" and "3 s timeout" in result["error"]
    assert result["wall_seconds"] < 30


def test_shape_schedule_puts_the_heaviest_first_middle_and_last():
    schedule = probe.shape_schedule([[256, 1], [384, 1], [512, 1]], 20)
    assert len(schedule) == 20
    assert schedule[0] == schedule[10] == schedule[19] == (512, 1)
    assert set(schedule) == {(256, 1), (384, 1), (512, 1)}


def test_shape_schedule_weighs_frames_with_pixels():
    # 64 px x 17 frames holds more than 96 px x 5 frames: the longest clip is the heaviest shape.
    schedule = probe.shape_schedule([[64, 5], [96, 5], [64, 17]], 7)
    assert schedule[0] == schedule[3] == schedule[6] == (64, 17)
    assert set(schedule) == {(64, 5), (96, 5), (64, 17)}


def test_step_timing_takes_medians_per_shape_so_one_slow_step_moves_nothing():
    schedule = probe.shape_schedule([[256, 1], [512, 1]], 12)
    quiet = [2.0 if shape == (512, 1) else 1.0 for shape in schedule]
    quiet[0] = 9.0  # the first step's one-time costs are left out
    busy = list(quiet)
    busy[5] *= 4  # another process took the CPU for one step
    assert probe.step_timing(schedule, quiet) == (1.5, 0.0)  # the two shapes in turn
    seconds, noise = probe.step_timing(schedule, busy)
    assert seconds == 1.5 and noise == 0.0
    jittery = [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(quiet)]
    assert probe.step_timing(schedule, jittery)[1] == pytest.approx(0.1, abs=0.01)


@pytest.mark.slow
def test_a_probe_started_by_the_fitfinder_command_holds_no_more_than_one_started_by_python_m(tmp_path):
    """Each probe process imports the script that started fitfinder (multiprocessing's `__mp_main__`).
    The `fitfinder` command's script, as pip writes it for the console-script entry point, imported
    fitfinder.cli, and with it typer and rich: 2.6 MB more in each probe at load than under
    `python -m fitfinder` (benchmarks/host_peaks.py --only spread), which a --ram budget counts."""
    from importlib.metadata import entry_points

    entry = entry_points(group="console_scripts")["fitfinder"]
    script = tmp_path / "fitfinder"  # what pip writes for the entry point (`pip install` puts it on PATH)
    script.write_text(f"import sys\nfrom {entry.module} import {entry.attr}\n"
                      f"if __name__ == '__main__':\n    sys.exit({entry.attr}())\n")

    def load_peak(*command: str) -> int:
        done = subprocess.run([*command, "probe", str(DEMO), "--json", "--steps", "1", "--vram", "1GiB"],
                              capture_output=True,
                              text=True, env=cli_env(), timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["host_phases"]["load"]

    by_module = load_peak(sys.executable, "-m", "fitfinder")
    by_command = load_peak(sys.executable, str(script))
    assert abs(by_command - by_module) < 1.5 * MiB, (by_command, by_module)
