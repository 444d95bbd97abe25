"""Trainer probes on the CPU: a trainer fitfinder did not write (tests/trainers/aitk_like.py, driven
as AI Toolkit's run.py is), run with the meter inside its own process, in real subprocesses.

One search through it (module-scoped: a few trainer probes) is read by most tests: it finds and
confirms a winner; its first probe runs out of memory in a step the trainer catches, and the
built-in probe of that point runs out in the same phase; data-loader workers that hold more than
the budget are not metered; nothing is written outside the probes' folders; every probe keeps its
estimate, and `fitfinder calibrate --study` fits them. The failures use one-line commands.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import optuna
import pytest

from fitfinder import probe, search, space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import dialects, estimate, trainer
from fitfinder.search import estimated as estimates
from fitfinder.units import parse_budget
from tests.conftest import ROOT, assert_one_clean_line, run_cli
from tests.standin import MiB, make_space

STAND_IN = ROOT / "tests" / "trainers" / "aitk_like.py"
BUDGET = "10.5MiB"  # the point as written (checkpointing off) runs out, with checkpointing it fits

JOB = """\
job: extension
config:
  name: trainer_probe
  process:
    - type: sd_trainer
      training_folder: output
      device: cuda:0
      network: {{type: lora, linear: 16, linear_alpha: 16}}
      datasets:
        - folder_path: {images}
          caption_ext: txt
          cache_latents_to_disk: true
          resolution: [256, 384]
      train: {{batch_size: 1, steps: 2000, gradient_checkpointing: false, optimizer: adamw, lr: 0.0001, dtype: fp32}}
      model: {{name_or_path: {model}, is_flux: true}}
      sample: {{width: 256, height: 256, sample_steps: 20, prompts: ["a photo of a thing"]}}
fitfinder:
  probe_steps: 3
  candidates: {{rank: [16], batch: [1], quantize: [none], optimizer: [adamw], sampling: [true],
               sample_size: [256x256], text_encoder: [keep], low_vram: [false]}}
"""


def _flux_folder(folder: Path) -> Path:
    """A tiny random FLUX.1 diffusers folder, as the Hub holds one (the tokenizer's length only)."""
    import torch

    from fitfinder.models import known_archs
    from fitfinder.models._weights import _construct, part_class

    arch = known_archs()["flux-tiny"]
    for part, config in arch["parts"].items():
        torch.manual_seed(1)
        _construct(part_class("flux", part), config).save_pretrained(folder / part)
    (folder / "tokenizer_2").mkdir()
    (folder / "tokenizer_2" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return folder


def _images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    for i in range(4):
        Image.effect_noise((96, 96), 40 + 10 * i).convert("RGB").save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a photo of thing number {i}")
    return folder


def _probe_folders(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("fitfinder-trainer-*")}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trainer-probe")
    model, images = _flux_folder(root / "flux"), _images(root / "images")
    work = root / "work"
    work.mkdir()
    (work / "job.yaml").write_text(JOB.format(images=images, model=model))
    return {"root": root, "model": model, "images": images, "work": work, "job": work / "job.yaml"}


@pytest.fixture(scope="module")
def searched(project) -> dict:
    """`fitfinder search job.yaml --vram 10.5MiB --trainer-command "python aitk_like.py {job}"`, its
    temporary files in a folder of its own, data-loader workers holding 64 MiB each."""
    before = {name: _snapshot(project[name]) for name in ("model", "images")}
    # Its own temporary folder: another test file's probes, in parallel, make theirs in the shared one.
    scratch = project["root"] / "tmp"
    scratch.mkdir()
    folders_before = _probe_folders(scratch)
    done = run_cli("search", "job.yaml", "--vram", BUDGET, "--margin", "0.02", "--timeout", "300", "--json",
                   "--trainer-command", f"{sys.executable} {STAND_IN} {{job}}", cwd=project["work"],
                   AITK_LIKE_WORKER_SCRATCH_BYTES=str(64 * MiB), TMPDIR=str(scratch))
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="trainer_probe",
                              storage=f"sqlite:///{project['work'] / 'studies' / 'trainer_probe.db'}")
    return {**project, "summary": json.loads(done.stdout), "stderr": done.stderr, "before": before,
            "left_behind": _probe_folders(scratch) - folders_before,
            "trials": [t for t in study.get_trials() if t.user_attrs.get("status") != "decided"]}


# -- the search through the trainer ---------------------------------------------------------------
def test_a_search_through_the_trainer_finds_and_confirms_a_winner(searched):
    summary, trials = searched["summary"], searched["trials"]
    assert summary["status"] == "fit" and summary["proven"], searched["stderr"][-2000:]
    assert summary["best"] != trials[0].user_attrs["point"]  # the job as written runs out: something was given up
    confirmed = [t for t in trials if t.user_attrs["purpose"] == "confirm" and t.user_attrs["status"] == "ok"]
    assert confirmed and confirmed[-1].user_attrs["point"] == summary["best"]
    for trial in trials:  # every probe ran the stand-in, metered from inside
        assert "inside the trainer" in trial.user_attrs["meter"]
        assert trial.user_attrs["trainer_run"]["phases_from"] == "log"
        assert trial.user_attrs["trainer_run"]["command"][-1] == "{job}"
    assert set(confirmed[-1].user_attrs["phases"]) == {"load", "latents", "sample", "train", "last_sample"}
    best = aitoolkit_job.load(searched["work"] / "results" / "trainer_probe" / "best.yaml")
    assert best.get("train.gradient_checkpointing") is summary["best"]["gradient_checkpointing"]


def test_an_oom_the_trainer_caught_still_counts_and_the_builtin_probe_runs_out_there_too(searched):
    base = searched["trials"][0]
    attrs = base.user_attrs
    assert attrs["purpose"] == "base" and attrs["status"] == "oom" and attrs["phase"] == "train"
    assert attrs["trainer_run"]["exit_code"] == 0  # it skipped the batches that ran out and finished
    assert "caught by it" in attrs["error"] and "out-of-memory" in attrs["error"]
    job = aitoolkit_job.load(searched["job"])
    point_job = spaces.build(job).apply(job, attrs["point"])
    builtin = probe.ProbeRunner(300).run(probe.request_for(point_job, 3, "sim", parse_budget(BUDGET, "--vram")))
    assert builtin["status"] == "oom" and builtin["phase"] == attrs["phase"]


def test_data_loader_workers_are_not_metered_and_nothing_is_written_outside(searched):
    for trial in searched["trials"]:
        assert "DataLoader" not in (trial.user_attrs.get("error") or "")
        assert trial.user_attrs["status"] in ("ok", "oom")
    # The stand-in caches latents next to the images and saves its LoRA and previews: all of it in the
    # probe's folder (its dataset a mirror of links), which is gone after the probe.
    assert {name: _snapshot(searched[name]) for name in ("model", "images")} == searched["before"]
    wrote = searched["trials"][-1].user_attrs["trainer_run"]["files"]
    assert any(f.startswith("datasets/") and "_latent_cache" in f for f in wrote)
    assert any(f.endswith("trainer_probe.safetensors") for f in wrote)
    assert not searched["left_behind"]
    assert sorted(p.name for p in searched["work"].iterdir()) == ["job.yaml", "results", "studies"]
    probes = searched["work"] / "results" / "trainer_probe" / "probes"
    assert (probes / "trial-0000.job.yaml").read_text().count("save_every: 4") == 1


def test_each_probe_keeps_its_estimate_and_calibrate_fits_them(searched):
    for trial in searched["trials"]:
        estimated = trial.user_attrs["estimate"]["phase_stats"]
        assert set(trial.user_attrs["phases"]) - {"text_encoder"} <= set(estimated)
    report = (searched["work"] / "results" / "trainer_probe" / "report.html").read_text()
    assert "The trainer against the estimate" in report
    done = run_cli("calibrate", "--study", "trainer_probe", "--json", cwd=searched["work"])
    assert done.returncode == 0, done.stderr
    fit = json.loads(done.stdout)
    assert fit["card"] == "cpu (sim meter)" and fit["dialect"] == "aitoolkit" and fit["pairs"] >= 8
    assert 0 < fit["band"] < 0.9 and Path(fit["file"]).is_file()
    # The estimate-guided search of this trainer here starts from that spread.
    job = aitoolkit_job.load(searched["job"])
    job.settings.trainer_command = f"{sys.executable} {STAND_IN} {{job}}"
    job.settings.vram_bytes = parse_budget(BUDGET, "--vram")
    guide = estimates.guide_for(True, job, "sim")
    assert guide.band == max(fit["band"], 0.02)


# -- failed trainers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def failing(project):
    """A trainer probe of the project's job with any command (no estimate is made for a failure)."""
    job = aitoolkit_job.load(project["job"])

    def run(code: str, timeout: float = 60.0, log: Path | None = None, **env):
        job.settings.trainer_command = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} {{job}}"
        request = probe.request_for(job, 2, "sim", 10 * MiB)
        runner = trainer.TrainerRunner(timeout, estimate.InProcess(60))
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            return runner.run(request, log)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    return run


def test_a_trainer_that_hangs_is_killed_with_its_process_group(failing):
    result = failing("import subprocess, sys, time\n"
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                     "print('Loading transformer', flush=True)\ntime.sleep(120)", timeout=3)
    assert result["status"] == "timeout" and "process group" in result["error"]
    assert "Loading transformer" in result["error"]  # the last output says where it hung
    assert not trainer.group_alive(result["trainer_run"]["pgid"])


@pytest.mark.parametrize("code, status, expected", [
    ("import sys; print('Loading transformer'); sys.exit('broken checkpoint')", "error", "exited with code 1"),
    ("print('Loading transformer'); print('done')", "error", "exited 0 without training a step"),
    ("pass", "error", "printed nothing"),
])
def test_a_trainer_that_crashes_stops_early_or_is_silent_is_a_failed_probe(failing, code, status, expected):
    result = failing(code)
    assert result["status"] == status and expected in result["error"], result["error"]
    assert "estimate" not in result  # nothing measured: no pair to calibrate with


def test_the_users_sitecustomize_still_runs_and_the_meter_claims_one_process(failing, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE = 'ran'\n")
    code = ("import builtins, os, subprocess, sys\nprint('user site', getattr(builtins, 'USER_SITE', None))\n"
            "import torch\nprint('# Running job: trainer_probe')\nprint('Loading transformer')\n"
            "child = 'import torch, os; print(\"child\", os.environ.get(\"FITFINDER_TRAINER_METER_PID\"))'\n"
            "subprocess.run([sys.executable, '-c', child])\n"
            "print('trainer_probe: 100%|##########| 2/2 [00:01<00:00, loss: 1.0e-01]', flush=True)")
    result = failing(code, log=tmp_path / "trainer.log", PYTHONPATH=str(tmp_path))
    assert result["status"] == "ok", result["error"]
    assert result["trainer_run"]["marked"] == ["load", "train"] and result["steps_run"] == 2
    log = (tmp_path / "trainer.log").read_text()
    assert "user site ran" in log  # chained: the hook ran first, the user's after it
    assert f"child {result['trainer_run']['metered_pid']}" in log  # the child saw the claim: not metered


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command, expected", [
    ("python run.py", "no {job} in"),
    ("no-such-trainer-binary {job}", "not found on PATH"),
    ("python flux_train_network.py --config_file {job}", "flux_train_network.py belongs to kohya sd-scripts"),
    ("accelerate launch run.py {job}", "accelerate launch starts the training script"),
    ("python 'run.py {job}", "cannot split it into words"),
])
def test_a_bad_trainer_command_is_one_line_before_any_probe(project, command, expected):
    done = run_cli("probe", "job.yaml", "--trainer-command", command, cwd=project["work"])
    assert_one_clean_line(done, expected)


def test_a_trainer_cannot_load_random_weights(project, tmp_path):
    text = project["job"].read_text().replace("fitfinder:\n", "fitfinder:\n  weights: random\n")
    (tmp_path / "random.yaml").write_text(text.replace(str(project["model"]), "fitfinder/flux-tiny"))
    done = run_cli("search", "random.yaml", "--vram", BUDGET, "--trainer-command", "python run.py {job}",
                   cwd=tmp_path)
    assert_one_clean_line(done, "the trainer loads model.name_or_path itself")
    assert not (tmp_path / "studies").exists()


# -- the parts ------------------------------------------------------------------------------------
def test_the_ai_toolkit_job_is_the_point_for_a_probe_written_inside_its_folder(project, tmp_path):
    job = aitoolkit_job.load(project["job"])
    job.settings.trainer_command = "python run.py {job}"
    request = probe.request_for(job, 5, "sim", None)
    path = dialects.DIALECTS["aitoolkit"].write(request["trainer_job"], tmp_path, request)
    written = aitoolkit_job.load(path)
    assert written.get("train.steps") == 5 and written.get("save.save_every") == 6
    assert written.get("sample.sample_every") == 6 and written.get("sample.sample_steps") == 2
    assert written.get("training_folder") == str(tmp_path / "output")
    mirror = Path(written.get("datasets[0].folder_path"))
    assert mirror.parent.parent == tmp_path and (mirror / "0.png").resolve() == project["images"] / "0.png"
    assert written.get("model.name_or_path") == str(project["model"])
    assert "fitfinder" not in path.read_text().split("\n", 1)[1]


def test_a_whole_run_peak_is_no_phase_fact():
    """A trainer whose log marks no phase gives one peak (phases {}): it proves its point and what
    is lighter everywhere, never a phase of a point heavier somewhere."""
    space = make_space()
    known = search.Knowledge(space, 100 * MiB)
    light = {**space.lightest(), "sampling": True}
    trains_big = {**light, "buckets": space.by_name["buckets"].desired, "batch": 4}
    samples_big = {**light, "sample_size": "1024x1024"}
    both = {**light, "buckets": trains_big["buckets"], "batch": 4, "sample_size": "1024x1024"}
    known.add(search.Result(trial=0, point=trains_big, status="ok", peak_bytes=10 * MiB, phases={}))
    known.add(search.Result(trial=1, point=samples_big, status="ok", peak_bytes=10 * MiB,
                            phases={"sample": 10 * MiB, "last_sample": 10 * MiB}))
    assert known.state(trains_big) == search.FIT and known.state(light) == search.FIT
    assert known.state(both) is None
    known.add(search.Result(trial=2, point=both, status="oom", phase=None, phases={}))
    assert known.state({**both, "gradient_checkpointing": False}) == search.NOFIT  # heavier everywhere
    assert known.state({**both, "batch": 1}) is None  # lighter in training: the whole-run OOM says nothing


def test_step_time_comes_from_the_bar_redraws_and_survives_skipped_ones():
    # The first step's end at 10 s; tqdm skipped the redraw of step 3 (within its 0.1 s), drew 4 twice.
    clock = [(9.0, 0), (10.0, 1), (10.5, 2), (11.5, 4), (11.5, 4), (12.0, 5)]
    seconds, noise = trainer.step_seconds(clock)
    assert seconds == 0.5 and noise == 0.0
    assert trainer.step_seconds([(9.0, 0), (10.0, 1)]) == (None, 0.0)  # the first step alone: no steady step
    assert trainer.visible_device(1, "4,6") == "6" and trainer.visible_device(0, None) == "0"
