"""`fitfinder diagnose` as a user runs it: exit codes, --json, -o, and bad input as one line."""

import json
import shutil
import time
from pathlib import Path

import pytest

from fitfinder import diagnose
from tests.conftest import run_cli
from tests.test_diagnose import JOB

LOGS = Path(__file__).parent / "logs"
JSON_KINDS = {"oom": bool, "kind": str, "phase": str, "step": (int, type(None)), "first_change": str}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("aitk_flux_3_times_in_a_row.log", "aitk_flux_dirty_card.log", "pytorch_not_oom_shapes.log"):
        shutil.copy(LOGS / name, tmp_path / name)
    (tmp_path / "job.yaml").write_text(JOB)
    return tmp_path


def _json(result) -> dict:
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()  # one JSON object on stdout; the lines for people go to stderr
    answer = json.loads(line)
    for key, kind in JSON_KINDS.items():
        assert isinstance(answer[key], kind), key
    return answer


def test_json_answer_has_the_promised_shape(folder):
    answer = _json(run_cli("diagnose", "aitk_flux_3_times_in_a_row.log", "--json", cwd=folder))
    assert {k: answer[k] for k in JSON_KINDS} == {
        "oom": True, "kind": "config", "phase": "train", "step": 3,
        "first_change": "turn gradient checkpointing on (train.gradient_checkpointing: false -> true)"}
    assert answer["when"] == "steps_1_10" and answer["written"] is None


def test_environment_says_do_not_relaunch(folder):
    answer = _json(run_cli("diagnose", "aitk_flux_dirty_card.log", "--json", cwd=folder))
    assert (answer["kind"], answer["phase"], answer["step"]) == ("environment", "load", None)
    assert answer["first_change"].startswith("do not relaunch")


def test_a_log_without_an_oom_points_to_its_error(folder):
    result = run_cli("diagnose", "pytorch_not_oom_shapes.log", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "not an out-of-memory failure" in result.stdout
    assert "error at line 15: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in result.stdout
    answer = _json(run_cli("diagnose", "pytorch_not_oom_shapes.log", "--json", cwd=folder))
    assert (answer["oom"], answer["kind"], answer["phase"], answer["step"]) == (False, "not_oom", "train", 1)
    assert answer["error"] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x4096 and 3072x3072)"


def test_output_for_people(folder):
    result = run_cli("diagnose", "aitk_flux_3_times_in_a_row.log", cwd=folder)
    assert result.returncode == 0 and result.stderr == ""
    assert "  kind: config    when: in steps 1-10, step 3    phase: train" in result.stdout
    assert "  first change: turn gradient checkpointing on" in result.stdout


def test_o_writes_the_changed_job_and_leaves_the_input_alone(folder):
    job = folder / "job.yaml"
    before = job.read_bytes()
    answer = _json(run_cli("diagnose", "aitk_flux_3_times_in_a_row.log", "--job", "job.yaml", "-o", "fixed.yaml",
                           "--json", cwd=folder))
    assert answer["written"] == "fixed.yaml" and job.read_bytes() == before
    assert answer["changes"] == [{"key": "train.gradient_checkpointing", "old": False, "new": True}]
    header, body = (folder / "fixed.yaml").read_text().split("# my Flux LoRA", 1)
    assert header.startswith("# fitfinder diagnose: the first change")
    before_lines, after_lines = JOB.splitlines(), ("# my Flux LoRA" + body).splitlines()
    assert len(before_lines) == len(after_lines)
    changed = [(a, b) for a, b in zip(before_lines, after_lines) if a != b]
    assert changed == [("        gradient_checkpointing: false   # off: faster",
                        "        gradient_checkpointing: true    # fitfinder: was false (off: faster)")]
    assert not [p for p in folder.iterdir() if p.name.startswith(".fixed.yaml")]  # no temporary file left


@pytest.mark.parametrize("args, expected", [
    (("nowhere.log",), "nowhere.log: no such file"),
    (("aitk_flux_3_times_in_a_row.log", "--job", "job.yaml", "-o", "job.yaml"), "is the input job file"),
    (("aitk_flux_3_times_in_a_row.log", "-o", "fixed.yaml"), "-o: needs --job"),
    (("aitk_flux_3_times_in_a_row.log", "--job", "job.yaml", "-o", "."), "is a folder"),
    (("aitk_flux_3_times_in_a_row.log", "--job", "nojob.yaml"), "nojob.yaml: no such file"),
    (("aitk_flux_3_times_in_a_row.log", "--job", "aitk_flux_dirty_card.log"), "not a job file fitfinder reads"),
])
def test_bad_input_is_one_line_and_exit_2(folder, args, expected):
    result = run_cli("diagnose", *args, cwd=folder)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert (folder / "job.yaml").read_text() == JOB and not (folder / "fixed.yaml").exists()


def test_a_log_it_cannot_place_says_which_line(tmp_path):
    shutil.copy(LOGS / "kohya_ss_flux_l40s_start.log", tmp_path / "train.log")
    result = run_cli("diagnose", "train.log", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "  kind: config    when: before step 1    phase: unknown\n  phase not placed: line 1 (" in result.stdout
    answer = _json(run_cli("diagnose", "train.log", "--json", cwd=tmp_path))
    assert answer["phase"] == "unknown" and answer["unplaced"].startswith('line 1 ("torch.cuda.OutOfMemoryError')


def test_host_ram_for_people(tmp_path):
    shutil.copy(LOGS / "aitk_oom_killer_dmesg.log", tmp_path / "dmesg.log")  # ai-toolkit#787
    result = run_cli("diagnose", "dmesg.log", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "  OOM at line 1: Out of memory: Killed process 1067104 (python)\n  kind: host    " in result.stdout
    assert "  first change: cache latents to disk instead of holding them in system RAM" in result.stdout


def test_a_traceback_cut_before_its_exception_line_says_so(tmp_path):
    shutil.copy(LOGS / "musubi_wan_backward_cut.log", tmp_path / "train.log")  # musubi-tuner#277, as posted
    result = run_cli("diagnose", "train.log", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:3] == [
        "  a traceback in _engine_run_backward without its exception line: likely an OOM; paste the rest "
        "(line 11: the log ends inside this traceback)", "  phase: train    step: 1"]
    assert "  first change: none yet: the error is not in the log; paste the rest of it" in result.stdout
    answer = _json(run_cli("diagnose", "train.log", "--json", cwd=tmp_path))
    assert (answer["oom"], answer["kind"], answer["phase"], answer["step"], answer["line"]) == (
        False, "cut", "train", 1, 11)


def test_an_error_that_is_not_an_oom_says_its_phase(tmp_path):
    shutil.copy(LOGS / "kohya_ss_sample_images_zerodivision.log", tmp_path / "train.log")  # kohya_ss#2123
    result = run_cli("diagnose", "train.log", cwd=tmp_path)
    assert result.stdout.splitlines()[1:4] == [
        "  not an out-of-memory failure", "  error at line 13: ZeroDivisionError: integer division or modulo by zero",
        "  phase: sample    step: 255"]


# -- bounded work on every log (issue 35): each reader linear, the read capped ------------------------
def _steps(n: int, total: int = 10_000) -> str:
    return "".join(f"steps:  {100 * i // total:2d}%|#####     | {i}/{total} [00:{i % 60:02d}<01:00,  1.50it/s, "
                   f"avr_loss=0.123]\n" for i in range(1, n + 1))


OOM_AT_THE_END = ('Traceback (most recent call last):\n  File "train_network.py", line 9, in train\n'
                  '    accelerator.backward(loss)\n'
                  'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n')


@pytest.mark.parametrize("shape, log", [
    ("10,000 kohya steps lines (61.5 s before)", _steps(10_000) + OOM_AT_THE_END),
    ("5,000 skipped batches between bars", "".join(f"{line}OOM during training step, skipping batch 1/3\n"
                                                   for line in _steps(5_000).splitlines(keepends=True))),
    ("100,000 blank lines, then Killed", "\n" * 100_000 + "Killed\n"),
    ("a 2 MB line of sample widths", "width: 512 " * 200_000 + "\n"),
])
def test_a_long_log_is_read_in_well_under_ten_seconds(tmp_path, shape, log):
    # The machine is shared and noisy: the bound is generous; the quadratic readers took a minute and more.
    (tmp_path / "train.log").write_text(log)
    started = time.monotonic()
    answer = diagnose.run(tmp_path / "train.log")
    assert time.monotonic() - started < 10, shape
    assert answer.kind in ("config", "host", "not_oom")


def test_a_log_over_the_cap_is_read_at_its_start_and_end(tmp_path, monkeypatch):
    # The same code path as a 200 MB log, at a cap small enough for a test.
    monkeypatch.setattr(diagnose, "MAX_LOG_BYTES", 64 << 10)
    monkeypatch.setattr(diagnose, "LOG_HEAD_BYTES", 8 << 10)
    (tmp_path / "train.log").write_text("--gradient_checkpointing --train_batch_size 4\n" + _steps(9_000)
                                        + OOM_AT_THE_END)
    answer = diagnose.run(tmp_path / "train.log")
    assert (answer.kind, answer.phase, answer.step, answer.message) == (
        "config", "train", 9_001, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    # The settings in the first part were read: checkpointing is on, so the next lever after the bucket is batch 1.
    assert answer.first_change.endswith("if that is already so: batch size 1, with gradient accumulation keeping "
                                        "the effective batch (--train_batch_size 1 --gradient_accumulation_steps 4)")
    [note] = [n for n in answer.notes if n.startswith("the log is ")]
    assert "more than the 64 KiB diagnose reads: it read the first 8 KiB and the last 56 KiB" in note


def test_a_utf16_log_over_the_cap_keeps_its_encoding(tmp_path, monkeypatch):
    monkeypatch.setattr(diagnose, "MAX_LOG_BYTES", 64 << 10)
    monkeypatch.setattr(diagnose, "LOG_HEAD_BYTES", 8 << 10)
    (tmp_path / "train.log").write_bytes((_steps(3_000) + OOM_AT_THE_END).encode("utf-16"))  # PowerShell's Tee
    answer = diagnose.run(tmp_path / "train.log")
    assert (answer.kind, answer.step) == ("config", 3_001)
