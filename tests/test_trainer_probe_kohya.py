"""Trainer probes of kohya jobs on the CPU: sd-scripts' FLUX.1 job as a shell file, run through a
trainer fitfinder did not write (tests/trainers/kohya_like.py, driven as flux_train_network.py is,
`--config_file {job}`), metered from inside its process, in real subprocesses.

The probe marks every phase from the stand-in's own log lines; under a small budget it runs out in
training, as the built-in probe of the same point does; what fitfinder writes for the trainer is the
point for a probe (the steps, no saving, every output and cache inside its folder, previews at the
first and last step of at most the request's denoising steps); musubi-tuner's job keeps the caches
its caching scripts made; a command naming another trainer's script is one line, exit 2.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

from fitfinder import probe, trainers
from fitfinder.probe import dialects
from fitfinder.units import parse_budget
from tests.conftest import ROOT, assert_one_clean_line, run_cli
from tests.test_trainer_probe import _flux_folder, _images, _snapshot

pytestmark = pytest.mark.slow

STAND_IN = ROOT / "tests" / "trainers" / "kohya_like.py"
COMMAND = f"{sys.executable} {STAND_IN} --config_file {{job}}"
BUDGET = "5MiB"  # training with checkpointing off holds 5.3 MiB; every phase before it, 3.8 MiB at most

DATASET = """[general]
caption_extension = ".txt"

[[datasets]]
resolution = 256
batch_size = 1

  [[datasets.subsets]]
  image_dir = "../images"
"""
# sd-scripts' FLUX.1 LoRA as its README writes one, on the tiny model's folders (relative paths: the
# trainer runs in the probe's folder), with an epoch count and saves a probe must not keep.
SD_SCRIPTS = """#!/usr/bin/env bash
accelerate launch --mixed_precision no flux_train_network.py \\
  --pretrained_model_name_or_path ../flux/transformer --clip_l ../flux/text_encoder \\
  --t5xxl ../flux/text_encoder_2 --ae ../flux/vae --dataset_config dataset.toml \\
  --network_module networks.lora_flux --network_dim 8 --network_train_unet_only \\
  --optimizer_type adamw --learning_rate 1e-4 --cache_text_encoder_outputs --cache_latents_to_disk \\
  --t5xxl_max_token_length 32 --max_train_epochs 10 --save_every_n_epochs 1 --save_state \\
  --sample_prompts prompts.txt --sample_every_n_epochs 1 --sample_at_first \\
  --output_name tiny-flux --output_dir out
"""
MUSUBI = """#!/usr/bin/env bash
python src/musubi_tuner/qwen_image_cache_latents.py --dataset_config dataset.toml --vae vae.safetensors
accelerate launch --mixed_precision bf16 src/musubi_tuner/qwen_image_train_network.py \\
    --dit qwen_image_bf16.safetensors --vae vae.safetensors --text_encoder qwen_2.5_vl_7b.safetensors \\
    --dataset_config dataset.toml --sdpa --mixed_precision bf16 --some_newer_flag 0.5 \\
    --optimizer_type adamw8bit --learning_rate 5e-5 --gradient_checkpointing --logging_dir logs \\
    --network_module networks.lora_qwen_image --network_dim 8 --save_every_n_steps 100 --output_name tiny-qwen
"""
MUSUBI_DATASET = """[general]
caption_extension = ".txt"
resolution = [256, 256]
batch_size = 1

[[datasets]]
image_directory = "../images"
cache_directory = "cache"
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kohya-trainer-probe")
    model, images = _flux_folder(root / "flux"), _images(root / "images")
    work = root / "work"
    work.mkdir()
    (work / "dataset.toml").write_text(DATASET)
    (work / "prompts.txt").write_text("# the previews\na small thing --w 128 --h 128 --s 20\n"
                                      "a photo of a thing --w 256 --h 256 --s 20\n")
    (work / "run.sh").write_text(SD_SCRIPTS)
    return {"root": root, "model": model, "images": images, "work": work}


def _probe(project, *options: str) -> tuple[int, dict, str]:
    done = run_cli("probe", "run.sh", "--arch", "flux-tiny", "--steps", "3", "--timeout", "300", "--json",
                   "--trainer-command", COMMAND, *options, cwd=project["work"])
    return done.returncode, json.loads(done.stdout), done.stderr


@pytest.fixture(scope="module")
def probed(project) -> dict:
    """`fitfinder probe run.sh --trainer-command "python kohya_like.py --config_file {job}"`, no budget."""
    before = {name: _snapshot(project[name]) for name in ("images", "model", "work")}
    code, result, stderr = _probe(project)
    return {**project, "code": code, "result": result, "stderr": stderr, "before": before}


# -- the probe through the stand-in -----------------------------------------------------------------
def test_the_trainer_runs_and_every_phase_is_marked_from_its_log(probed):
    result = probed["result"]
    assert probed["code"] == 0 and result["status"] == "ok", probed["stderr"][-2000:]
    assert result["meter"].endswith("inside the trainer") and result["steps_run"] == 3
    run = result["trainer_run"]
    assert run["dialect"] == "sd-scripts" and run["phases_from"] == "log" and run["exit_code"] == 0
    # NetworkTrainer.train's order: load, latents, text encoder outputs, "running training", the
    # sample_at_first preview, the steps, the preview after the last step
    assert run["marked"] == ["load", "latents", "text_encoder", "train", "sample", "last_sample"]
    assert set(result["phases"]) == {"load", "latents", "text_encoder", "sample", "train", "last_sample"}
    assert result["phases"]["train"] > result["phases"]["load"]


def test_it_wrote_only_inside_its_folder_and_saved_and_sampled_only_where_a_probe_does(probed):
    wrote = probed["result"]["trainer_run"]["files"]
    assert {"job.toml", "job_dataset.toml", "job_prompts.txt", "output/tiny-flux.safetensors"} <= set(wrote)
    # the previews at step 0 and after the last step, none at an epoch's end; no state, no epoch save
    assert sorted(f for f in wrote if f.startswith("output/sample/")) == [
        "output/sample/tiny-flux_000000.png", "output/sample/tiny-flux_000003.png"]
    # sd-scripts caches beside the images: in the mirror of links, not in the user's folder
    assert sorted(f for f in wrote if f.endswith(".npz")) == [f"datasets/0-0/{i}_0256x0256_flux.npz" for i in range(4)]
    assert {name: _snapshot(probed[name]) for name in ("images", "model", "work")} == probed["before"]


def test_under_a_small_budget_it_runs_out_in_training_as_the_builtin_probe_does(project):
    code, result, stderr = _probe(project, "--vram", BUDGET)
    assert code == 1 and result["status"] == "oom" and result["phase"] == "train", stderr[-2000:]
    assert result["trainer_run"]["exit_code"] == 1  # sd-scripts catches no OOM: it stops
    assert "out-of-memory error in the trainer, the first in train" in result["error"]
    assert max(peak for phase, peak in result["phases"].items() if phase != "train") < parse_budget(BUDGET, "--vram")
    job = trainers.load(project["work"] / "run.sh", arch="flux-tiny")
    builtin = probe.ProbeRunner(300).run(probe.request_for(job, 3, "sim", parse_budget(BUDGET, "--vram")))
    assert builtin["status"] == "oom" and builtin["phase"] == "train"


# -- what is written for the trainer ----------------------------------------------------------------
def _written(job, folder: Path, steps: int = 5) -> tuple[dict, dict, Path]:
    job.settings.trainer_command = COMMAND
    request = probe.request_for(job, steps, "sim", None)
    path = dialects.dialect_of(job).write(request["trainer_job"], folder, request)
    return tomllib.loads(path.read_text()), tomllib.loads((folder / "job_dataset.toml").read_text()), path


def test_the_sd_scripts_job_is_the_point_for_a_probe_in_one_config_toml(project, tmp_path):
    options, dataset, path = _written(trainers.load(project["work"] / "run.sh", arch="flux-tiny"), tmp_path)
    assert path == tmp_path / "job.toml"  # what {job} names: the --config_file
    assert options["max_train_steps"] == 5 and options["output_dir"] == str(tmp_path / "output")
    for gone in ("max_train_epochs", "save_every_n_epochs", "save_state", "sample_every_n_epochs", "config_file"):
        assert gone not in options, gone
    assert options["sample_at_first"] is True and options["sample_every_n_steps"] == 5
    assert options["console_log_simple"] is True  # one plain line a message, not rich's wrapped ones
    # the largest preview only, at the request's two denoising steps
    assert Path(options["sample_prompts"]).read_text() == "a photo of a thing --w 256 --h 256 --s 2\n"
    assert options["pretrained_model_name_or_path"] == str(project["model"] / "transformer")
    assert options["ae"] == str(project["model"] / "vae") and options["network_dim"] == 8
    assert options["dataset_config"] == str(tmp_path / "job_dataset.toml")
    subset = dataset["datasets"][0]["subsets"][0]
    mirror = Path(subset["image_dir"])
    assert mirror.parent.parent == tmp_path and (mirror / "0.png").resolve() == project["images"] / "0.png"
    assert dataset["general"]["caption_extension"] == ".txt" and dataset["datasets"][0]["resolution"] == 256


def test_a_config_toml_job_writes_the_same_options_and_a_point_without_previews_none(project, tmp_path):
    shell_job = trainers.load(project["work"] / "run.sh", arch="flux-tiny")
    (project["work"] / "kohya.toml").write_text(
        "[model]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in shell_job.options_set().items()))
    try:
        job = trainers.load(project["work"] / "kohya.toml", arch="flux-tiny")
    finally:
        (project["work"] / "kohya.toml").unlink()
    (tmp_path / "shell").mkdir()
    (tmp_path / "toml").mkdir()
    from_shell, _, _ = _written(shell_job, tmp_path / "shell")
    from_toml, _, _ = _written(job, tmp_path / "toml")
    folder_free = {key: value for key, value in from_shell.items() if str(tmp_path) not in str(value)}
    assert folder_free == {key: value for key, value in from_toml.items() if str(tmp_path) not in str(value)}
    job.set("sample_prompts", None)  # the sampling knob off
    (tmp_path / "off").mkdir()
    options, _, _ = _written(job, tmp_path / "off")
    assert not {"sample_prompts", "sample_at_first", "sample_every_n_steps"} & set(options)
    assert not (tmp_path / "off" / "job_prompts.txt").exists()


def test_musubi_tuners_job_reads_the_caches_its_caching_scripts_made(project, tmp_path):
    folder = project["root"] / "musubi"
    folder.mkdir(exist_ok=True)
    (folder / "dataset.toml").write_text(MUSUBI_DATASET)
    (folder / "run.sh").write_text(MUSUBI)
    job = trainers.load(folder / "run.sh", arch="qwen_image-tiny")
    options, dataset, _ = _written(job, tmp_path, steps=4)
    assert dialects.dialect_of(job).key == "musubi-tuner"
    assert options["max_train_steps"] == 4 and "save_every_n_steps" not in options
    assert options["logging_dir"] == str(tmp_path / "logs") and options["output_dir"] == str(tmp_path / "output")
    assert options["dit"] == str(folder / "qwen_image_bf16.safetensors")  # not there: absolute all the same
    assert options["some_newer_flag"] == 0.5  # a flag fitfinder does not know, kept, a number in TOML
    assert dataset["datasets"][0] == {"image_directory": str(project["images"]),
                                      "cache_directory": str(folder / "cache")}
    assert not (tmp_path / "datasets").exists()  # nothing to mirror: the training writes no cache


def test_kohya_log_lines_mark_the_phases():
    follow = dialects.DIALECTS["sd-scripts"].log_follower()
    lines = ["INFO     Building Flux model dev from BFL checkpoint", "INFO     caching latents with caching strategy.",
             "INFO     move text encoders to gpu", "running training / 学習開始",
             "INFO     generating sample images at step / サンプル画像生成 ステップ: 0",
             "100%|##########| 2/2 [00:00<00:00, 12.1it/s]",  # the preview's own denoising bar
             "steps:  50%|#####     | 1/2 [00:01<00:01, 1.2it/s, avr_loss=0.41]",
             "steps: 100%|##########| 2/2 [00:02<00:00, 1.2it/s, avr_loss=0.40]",
             "INFO     generating sample images at step / サンプル画像生成 ステップ: 2"]
    marks = [follow(line) for line in lines]
    assert [mark.phase for mark in marks] == ["load", "latents", "text_encoder", "train", "sample", "sample",
                                              "train", "train", "last_sample"]
    assert [mark.steps_done for mark in marks][-3:] == [1, 2, 2]


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("job, command, expected", [
    ("run.sh", "python /opt/ai-toolkit/run.py {job}", "run.py belongs to AI Toolkit, which cannot read this kohya "
                                                      "sd-scripts job"),
    ("run.sh", "python qwen_image_train_network.py --config_file {job}", "belongs to musubi-tuner"),
    ("run.sh", "python sdxl_train_network.py --config_file {job}", "the job is for flux_train_network.py"),
    ("../musubi/run.sh", "python -m musubi_tuner.flux_train_network --config_file {job}",
     "flux_train_network.py belongs to kohya sd-scripts"),
])
def test_a_command_naming_another_trainers_script_is_one_line_before_any_probe(project, job, command, expected):
    folder = project["root"] / "musubi"
    folder.mkdir(exist_ok=True)
    (folder / "dataset.toml").write_text(MUSUBI_DATASET)
    (folder / "run.sh").write_text(MUSUBI)
    done = run_cli("probe", job, "--arch", "qwen_image-tiny" if "musubi" in job else "flux-tiny",
                   "--trainer-command", command, cwd=project["work"])
    assert_one_clean_line(done, expected)
