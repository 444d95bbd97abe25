"""kohya jobs in their own files: read, knobs in the trainers' names, written back in the same form.

No torch here: the formats, the knobs and the requests are plain data (tests/test_trainers_probe.py
runs tiny probes and estimates of the same jobs).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from tests.conftest import ROOT, assert_one_clean_line, run_cli
from fitfinder import space, trainers
from fitfinder.errors import UserError
from fitfinder.probe import request as requests

SD = ROOT / "examples" / "sd_scripts"
MUSUBI = ROOT / "examples" / "musubi_tuner"


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


def test_an_sd_scripts_command_line_reads_with_the_parsers_defaults():
    job = trainers.load(SD / "flux_lora_24gb.sh")
    assert (job.trainer.REPO, job.script.name, job.form) == ("sd-scripts", "flux_train_network.py", "shell")
    assert job.get("network_dim") == 4 and job.get("fp8_base") is True
    assert job.get("network_alpha") == 1.0  # train_network.py's default
    assert job.get("blocks_to_swap") is None and job.get("vae_batch_size") == 1  # train_util.py's defaults
    assert job.get("datasets[0].batch_size") == 2 and job.get("datasets[0].resolution") == 1024
    assert job.launcher == {"mixed_precision": "bf16", "num_cpu_threads_per_process": "1"}
    assert job.name == "flux-lora-name"


def test_knobs_speak_the_trainers_names():
    sd = space.build(trainers.load(SD / "flux_lora_24gb.sh"))
    assert [k.short for k in sd.knobs] == ["gradient_checkpointing", "batch_size", "blocks_to_swap"]
    assert sd.by_name["layer_offloading"].candidates == tuple(range(35, -1, -1))  # FLUX.1: up to 35 blocks
    musubi = space.build(trainers.load(MUSUBI / "qwen_image_lora_24gb.sh"))
    assert [k.short for k in musubi.knobs] == ["network_dim", "fp8_base", "fp8_vl", "gradient_checkpointing",
                                               "blocks_to_swap"]  # fp8_vl: its text caching script's switch
    assert musubi.by_name["quantize"].candidates == ("fp8", "fp8_scaled")  # never past the job's own precision
    assert musubi.by_name["layer_offloading"].candidates[0] == 59  # Qwen-Image: one fewer than its 60 blocks
    point = {**musubi.desired(), "rank": 4, "layer_offloading": 45}
    assert musubi.describe(point) == "network_dim=4 fp8_base=fp8_base+fp8_scaled fp8_vl=off " \
                                     "gradient_checkpointing=on blocks_to_swap=45"


def test_a_shell_job_round_trips_with_only_the_changed_flags_differing(tmp_path):
    folder = _copy(SD, tmp_path)
    source = folder / "flux_lora_24gb.sh"
    source.write_text(source.read_text().replace("--guidance_scale 1.0", "--guidance_scale 1.0 --my_own_flag 7"))
    job = trainers.load(source)
    assert job.get("my_own_flag") == "7"  # an option the parser does not declare is kept as written
    found = space.build(job)
    point = {**found.desired(), "batch": 1, "layer_offloading": 16}
    written = found.apply(job, point).write(tmp_path / "results" / "best.yaml", ["fitfinder: a header line"])
    assert written.name == "best.sh" and (written.parent / "best_dataset.toml").is_file()
    before, after = source.read_text().splitlines(), written.read_text().splitlines()
    assert after[1] == "# fitfinder: a header line"
    changed = [line for line in after[2:] if line not in before]
    assert changed == ["  --highvram --max_train_epochs 4 --save_every_n_epochs 1 "
                       "--dataset_config best_dataset.toml \\",
                       "  --timestep_sampling shift --discrete_flow_shift 3.1582 --model_prediction_type raw "
                       "--guidance_scale 1.0 --my_own_flag 7 \\", "  --gradient_accumulation_steps 2 \\",
                       "  --blocks_to_swap 16"]
    dataset = (written.parent / "best_dataset.toml").read_text()
    assert dataset == (folder / "dataset_1024_bs2.toml").read_text().replace("batch_size = 2", "batch_size = 1")
    back = trainers.load(written)
    assert (back.get("blocks_to_swap"), back.get("datasets[0].batch_size"), back.get("gradient_accumulation_steps"),
            back.get("my_own_flag")) == (16, 1, 2, "7")


def test_a_config_toml_job_infers_its_script_and_round_trips(tmp_path):
    (tmp_path / "dataset.toml").write_text((SD / "dataset_1024_bs2.toml").read_text())
    config = tmp_path / "flux.toml"
    config.write_text('# my FLUX.1 settings\n[model]\npretrained_model_name_or_path = "flux1-dev.safetensors"\n'
                      't5xxl = "t5xxl_fp16.safetensors"  # the text encoder\nae = "ae.safetensors"\n'
                      'clip_l = "clip_l.safetensors"\n\n[training]\nnetwork_module = "networks.lora_flux"\n'
                      'network_dim = 16\nnetwork_alpha = 16\noptimizer_type = "AdamW"\n'
                      'dataset_config = "dataset.toml"\nmixed_precision = "bf16"\nfp8_base = true\n'
                      'my_unknown_key = "kept"\n')
    job = trainers.load(config)
    assert (job.form, job.script.name, job.get("network_dim")) == ("toml", "flux_train_network.py", 16)
    found = space.build(job)
    point = {**found.desired(), "rank": 8, "optimizer": "adamw8bit", "batch": 1}
    written = found.apply(job, point).write(tmp_path / "out" / "best.yaml")
    assert sorted(p.name for p in written.parent.iterdir()) == ["best.toml", "best_dataset.toml"]
    text = written.read_text()
    assert 't5xxl = "t5xxl_fp16.safetensors"  # the text encoder' in text and 'my_unknown_key = "kept"' in text
    assert "network_dim = 8" in text and "network_alpha = 8" in text and 'optimizer_type = "AdamW8bit"' in text
    assert 'dataset_config = "best_dataset.toml"' in text and "gradient_accumulation_steps = 2" in text
    back = trainers.load(written)
    assert (back.get("network_dim"), back.get("datasets[0].batch_size"), back.get("optimizer_type")) == (8, 1,
                                                                                                         "AdamW8bit")


def test_a_musubi_job_keeps_its_caching_commands_and_their_flags(tmp_path):
    folder = _copy(MUSUBI, tmp_path)
    source = folder / "qwen_image_lora_42gb.sh"
    source.write_text(source.read_text().replace("--batch_size 1 \\", "--batch_size 1 --fp8_vl \\"))
    job = trainers.load(source)
    assert [c["script"] for c in job.caching] == ["qwen_image_cache_latents.py",
                                                  "qwen_image_cache_text_encoder_outputs.py"]
    request = requests.request_for(job, 3, "sim", None)
    assert request["trainer"]["weights"] == {"transformer": "bf16", "text_encoder": "fp8", "vae": "bf16"}
    assert request["trainer"]["residency"]["text_encoder"] == ["text_encoder"]  # the caching script's own process
    assert request["lora_ignore"] == ["img_mod", "txt_mod"]  # lora_qwen_image.py leaves out `_mod_`
    found = space.build(job)
    written = found.apply(job, {**found.desired(), "quantize": "fp8_scaled"}).write(tmp_path / "r" / "best.yaml")
    after = written.read_text()
    assert after.rstrip().endswith("--fp8_base \\\n    --fp8_scaled")
    back = trainers.load(written)  # its dataset TOML named again relative to the new folder
    assert back.get("fp8_scaled") is True and back.dataset_path.resolve() == (folder / "dataset_1024.toml").resolve()


def test_the_request_follows_sd_scripts_recipe():
    request = requests.request_for(trainers.load(SD / "flux_lora_8gb.sh"), 20, "sim", None)
    recipe = request["trainer"]
    # t5xxl_fp8_e4m3fn.safetensors is read as is under fp8_base; CLIP-L is cast to bf16 when caching
    assert recipe["weights"] == {"transformer": "fp8", "text_encoder": "bf16", "text_encoder_2": "fp8",
                                 "vae": "bf16"}
    assert recipe["swapped"] == {"transformer_blocks": 14, "single_transformer_blocks": 28}  # 28 // 2, (28 - 14) * 2
    assert recipe["residency"]["load"] == [] and recipe["residency"]["train"] == ["transformer"]
    assert (request["quantize"], request["text_encoder"], request["cache_latents"]) == (None, "cache", True)
    assert (request["batch_size"], request["rank"], request["optimizer"]) == (1, 4, "adamw8bit")


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "F8_E4M3": 1}[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_a_checkpoints_header_decides_the_architecture_and_dtype(tmp_path):
    folder = _copy(SD, tmp_path)
    _safetensors(folder / "flux1-dev.safetensors", {"double_blocks.0.img_attn.qkv.weight": ("BF16", [4, 2])})
    (folder / "sd3").mkdir()
    _safetensors(folder / "sd3" / "t5xxl_fp16.safetensors", {"encoder.block.0.layer.0.weight": ("F8_E4M3", [4, 4])})
    job = trainers.load(folder / "flux_lora_24gb.sh")
    assert job.architecture_spec()["arch_name"] == "flux-schnell"  # no guidance_in: schnell
    assert "read from the header of flux1-dev.safetensors" in job.notes[0]
    # the header, not the name (t5xxl_fp16), says the file is fp8: read as is under fp8_base
    assert requests.request_for(job, 1, "sim", None)["trainer"]["weights"]["text_encoder_2"] == "fp8"


def test_a_flag_that_moves_memory_and_is_not_modelled_is_named(tmp_path):
    folder = _copy(MUSUBI, tmp_path)
    source = folder / "qwen_image_lora_42gb.sh"
    source.write_text(source.read_text().rstrip() + " --fused_backward_pass\n")
    job = trainers.load(source)
    assert any(note.startswith("--fused_backward_pass is not modelled") for note in job.notes)


@pytest.mark.parametrize("name, text, expected", [
    ("notes.txt", "hello world\n", "not a job file fitfinder reads"),
    ("job.toml", 'network_dim = 4\ndataset_config = "d.toml"\n', "give --script NAME"),
    ("data.toml", "[[datasets]]\nresolution = 512\n", "a dataset config"),
    ("run.sh", "accelerate launch hunyuan_image_train_network.py --network_dim 4\n", "does not follow yet"),
    ("run.sh", "echo training\n", "no sd-scripts or musubi-tuner training command"),
    ("run.sh", "accelerate launch flux_train_network.py --network_dim 4 --dataset_config 'x\n", "never closed"),
])
def test_bad_input_is_one_line_naming_the_formats(tmp_path, name, text, expected):
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError) as raised:
        trainers.load(tmp_path / name)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_the_cli_says_so_in_one_line(tmp_path):
    (tmp_path / "job.toml").write_text('network_dim = 4\n')
    assert_one_clean_line(run_cli("estimate", "job.toml", cwd=tmp_path), "give --script NAME")


def test_a_job_naming_its_files_by_its_own_folder_names_the_written_ones_so_and_runs_from_anywhere(tmp_path):
    # kohya.sh (the export) names its TOMLs "$here/...": the trainer runs from its own checkout, where a
    # bare name would not be found. The job written back keeps that, and bash finds every file.
    import subprocess

    folder = _copy(SD, tmp_path)
    source = folder / "flux_lora_24gb.sh"
    text = source.read_text().replace("--dataset_config dataset_1024_bs2.toml",
                                      '--dataset_config "$here/dataset_1024_bs2.toml"')
    source.write_text(text.replace("accelerate launch", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
                                   "accelerate launch", 1))
    job = trainers.load(source)
    found = space.build(job)
    written = found.apply(job, {**found.desired(), "batch": 1}).write(tmp_path / "results" / "best.yaml")
    assert '--dataset_config "$here/best_dataset.toml"' in written.read_text()
    assert trainers.load(written).get("datasets[0].batch_size") == 1
    stub = tmp_path / "bin"  # `accelerate` stands in for the trainer: it checks the dataset TOML is there
    stub.mkdir()
    (stub / "accelerate").write_text('#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do [ "$1" = --dataset_config ] && '
                                     'test -f "$2" && echo found "$2"; shift; done\n')
    (stub / "accelerate").chmod(0o755)
    checkout = tmp_path / "sd-scripts"
    checkout.mkdir()
    ran = subprocess.run(["bash", str(written)], cwd=checkout, capture_output=True, text=True,
                         env={"PATH": f"{stub}:/usr/bin:/bin"})
    assert ran.returncode == 0 and f"found {written.parent / 'best_dataset.toml'}" in ran.stdout, ran


def test_the_trainer_probe_writes_a_point_into_its_own_folder(tmp_path):
    job = trainers.load(SD / "flux_lora_24gb.sh")
    folder = tmp_path / "probe"
    written = trainers.write_job_files(job, folder, {"max_train_steps": 20, "output_dir": str(folder / "out")})
    assert sorted(p.name for p in written) == ["job.sh", "job_dataset.toml"]
    back = trainers.load(folder / "job.sh")
    assert back.get("max_train_steps") == 20 and back.get("output_dir") == str(folder / "out")
    assert back.get("dataset_config") == str(folder / "job_dataset.toml")


def test_diagnose_writes_the_first_change_into_a_copy_of_a_kohya_job_in_its_own_form(tmp_path):
    folder = _copy(SD, tmp_path)
    log = ROOT / "tests" / "logs" / "kohya_sdxl_step3_torch20.log"  # an OOM at step 3
    result = run_cli("diagnose", str(log), "--job", "flux_lora_24gb.sh", "-o", "fixed.sh", "--json", cwd=folder)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    # checkpointing is on already: batch 1, the accumulation keeping the effective batch of 2
    assert answer["changes"] == [{"key": "datasets[0].batch_size", "old": 2, "new": 1},
                                 {"key": "gradient_accumulation_steps", "old": 1, "new": 2}]
    fixed = trainers.load(folder / "fixed.sh")
    assert (fixed.get("datasets[0].batch_size"), fixed.get("gradient_accumulation_steps")) == (1, 2)
    assert (folder / "fixed_dataset.toml").is_file() and "--dataset_config fixed_dataset.toml" in \
        (folder / "fixed.sh").read_text()
    assert trainers.load(folder / "flux_lora_24gb.sh").get("datasets[0].batch_size") == 2  # the input is unchanged


def test_a_text_encoders_fp8_and_the_previews_size_are_written_where_the_trainer_reads_them(tmp_path):
    folder = _copy(MUSUBI, tmp_path)
    source = folder / "qwen_image_lora_24gb.sh"
    (folder / "prompts.txt").write_text("# previews\na cat --w 1024 --h 768 --s 20\na dog --s 10\n")
    source.write_text(source.read_text().replace("--network_dim 16", "--network_dim 16 --sample_prompts prompts.txt "
                                                 "--sample_every_n_steps 100"))
    job = trainers.load(source)
    found = space.build(job)
    assert found.by_name["text_encoder"].title == "fp8_vl"  # qwen_image_cache_text_encoder_outputs.py's switch
    assert found.by_name["sample_size"].candidates == ("512x384", "768x576", "1024x768")
    written = found.apply(job, {**found.desired(), "text_encoder": "fp8", "sample_size": "512x384"}).write(
        tmp_path / "out" / "best.yaml")
    lines = written.read_text().splitlines()
    caching = next(i for i, line in enumerate(lines) if "qwen_image_cache_text_encoder_outputs.py" in line)
    assert "--fp8_vl" in "".join(lines[caching:caching + 5])  # on the caching command, where it encodes
    assert (tmp_path / "out" / "best_prompts.txt").read_text() == \
        "# previews\na cat --w 512 --h 384 --s 20\na dog --s 10 --w 256 --h 256\n"  # 256x256: its default
    back = trainers.load(written)
    request = requests.request_for(back, 3, "sim", None)
    assert request["trainer"]["weights"]["text_encoder"] == "fp8"
    assert (request["sample"]["width"], request["sample"]["height"]) == (512, 384)
