"""`fitfinder export NAME --format kohya`: the winner as kohya sd-scripts / musubi-tuner settings,
read back to the same values."""

import json
import shutil

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fitfinder.trainers import aitoolkit_job
from fitfinder.trainers import aitoolkit
from fitfinder.trainers import aitoolkit_to_kohya as kohya
from fitfinder.errors import UserError
from tests.conftest import run_cli

NAME = "demo_flux_lora"


def _knob_values(settings: dict) -> dict:
    """The search's knobs from AI Toolkit settings read back from kohya's files."""
    resolutions = sorted({r for key, value in settings.items() if key.endswith(".resolution") for r in value})
    return {"buckets": aitoolkit.bucket_label(resolutions), "rank": settings["network.linear"],
            "batch": settings["train.batch_size"], "gradient_checkpointing": settings["train.gradient_checkpointing"]}


def _same(job: aitoolkit_job.JobFile, setting: str, value) -> bool:
    """Whether a setting read back equals the job's, in AI Toolkit's own reading of the job."""
    if setting == "train.gradient_accumulation_steps":
        return value == job.accumulation
    if setting == "train.dtype":
        return value == aitoolkit_job.DTYPES[str(job.get("train.dtype")).lower()]
    if setting == "train.optimizer":
        return value == str(job.get("train.optimizer")).lower()
    if setting.endswith(".resolution"):
        return value == aitoolkit.resolutions(job)
    if setting.startswith("datasets[*]."):
        return value == any(job.get(setting))
    if setting == "train.disable_sampling":
        return value == (bool(job.get("train.disable_sampling")) or not job.get("sample.prompts", None))
    if setting == "train.cache_text_embeddings":
        return value == bool(job.get("train.cache_text_embeddings") or job.get("train.unload_text_encoder"))
    if setting == "sample.prompts":
        return value == [str(p) for p in job.get("sample.prompts")]
    if isinstance(value, bool):  # a switch the job leaves out is off
        return value == bool(job.get(setting))
    return value == job.get(setting) or (isinstance(value, float) and value == float(job.get(setting)))


@pytest.mark.slow
def test_demo_winner_round_trips_through_kohya(demo_run, tmp_path):
    folder, summary = demo_run
    results = tmp_path / "results"
    shutil.copytree(folder / "results" / NAME, results / NAME, ignore=shutil.ignore_patterns("probes"))
    done = run_cli("export", NAME, "--format", "kohya", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["trainer"] == "sd-scripts" and payload["script"] == "flux_train_network.py"
    assert {s["kind"] for s in payload["settings"]} == {"exact"}  # the demo uses nothing kohya lacks

    read = kohya.read(results / NAME)
    assert _knob_values(read) == summary["best"]  # the same knob values
    best = aitoolkit_job.load(results / NAME / "best.yaml")
    different = {k: v for k, v in read.items() if not _same(best, k, v)}
    assert different == {}

    args = tomllib.loads((results / NAME / "kohya.toml").read_text())
    flat = {k: v for section in args.values() for k, v in section.items()}
    assert flat["network_dim"] == summary["best"]["rank"] and flat["train_batch_size"] == summary["best"]["batch"]
    assert flat["gradient_checkpointing"] is summary["best"]["gradient_checkpointing"]
    assert flat["gradient_accumulation_steps"] * flat["train_batch_size"] == 4  # the effective batch kept
    assert flat["mixed_precision"] == "no" and flat["optimizer_type"] == "AdamW"

    # The export is a job the commands take, printed as a user reads it (not only with --json).
    estimated = run_cli("estimate", str(results / NAME / "kohya.sh"), "--arch", "flux-tiny", cwd=tmp_path)
    assert estimated.returncode == 0, estimated.stderr
    assert "estimate of" in estimated.stdout and "the highest phase" in estimated.stdout, estimated.stdout
    dataset = tomllib.loads((results / NAME / "kohya_dataset.toml").read_text())
    assert [d["resolution"] for d in dataset["datasets"]] == [256, 384, 512]
    assert all(d["subsets"][0]["image_dir"] == "/path/to/images/folder" for d in dataset["datasets"])
    script = (results / NAME / "kohya.sh").read_text()
    assert '--config_file "$here/kohya.toml"' in script and "flux_train_network.py" in script


FLUX_JOB = """
job: extension
config:
  name: flux_job
  process:
    - type: sd_trainer
      network: {type: lora, linear: 16, linear_alpha: 8}
      datasets:
        - {folder_path: /data/photos, caption_ext: txt, cache_latents_to_disk: true, resolution: [512, 768, 1024]}
      train: {batch_size: 2, gradient_accumulation: 2, gradient_checkpointing: true, optimizer: adamw8bit,
              lr: 0.0001, steps: 1500, dtype: bf16, skip_first_sample: true}
      model: {name_or_path: black-forest-labs/FLUX.1-dev, is_flux: true, quantize: true, quantize_te: false,
              layer_offloading: true, layer_offloading_transformer_percent: 0.4}
      sample:
        sample_every: 250
        width: 1024
        height: 768
        seed: 7
        walk_seed: true
        guidance_scale: 4
        sample_steps: 20
        prompts: ["a red fox in the snow", "a lighthouse at dusk --no flags here"]
"""

WAN_JOB = """
job: extension
config:
  name: wan_job
  process:
    - type: sd_trainer
      network: {type: lora, linear: 32, linear_alpha: 32}
      datasets:
        - {folder_path: /data/clips, caption_ext: txt, num_frames: 33, resolution: [256, 512]}
      train: {batch_size: 1, gradient_accumulation: 1, gradient_checkpointing: true, optimizer: adamw8bit,
              lr: 0.0001, steps: 2000, dtype: bf16, cache_text_embeddings: true}
      model: {name_or_path: ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16, arch: wan22_14b, quantize: true,
              qtype: "uint4|ostris/accuracy_recovery_adapters/wan22_14b_t2i_torchao_uint4.safetensors",
              quantize_te: true, qtype_te: qfloat8, low_vram: true}
      sample: {sample_every: 250, width: 832, height: 480, num_frames: 33, guidance_scale: 3.5,
               sample_steps: 25, seed: 42, prompts: ["a horse running on a beach"]}
"""


@pytest.mark.parametrize("text, repo, unmatched", [
    (FLUX_JOB, "sd-scripts", {"model.layer_offloading_transformer_percent", "sample.prompts"}),
    (WAN_JOB, "musubi-tuner", {"model.qtype", "model.low_vram"}),
], ids=["flux", "wan"])
def test_jobs_round_trip_and_say_what_differs(text, repo, unmatched, tmp_path):
    job = aitoolkit_job.loads(text, "job.yaml")
    done = kohya.write(job, tmp_path)
    assert done.trainer.repo == repo
    assert {r.setting for r in done.rows if r.kind != "exact"} == unmatched
    read = kohya.read(tmp_path)  # everything read back is the job's, but what the export said differs
    assert {k: v for k, v in read.items() if k not in unmatched and not _same(job, k, v)} == {}
    args = tomllib.loads((tmp_path / "kohya.toml").read_text())
    flat = {k: v for section in args.values() for k, v in section.items()}
    script = (tmp_path / "kohya.sh").read_text()
    if repo == "sd-scripts":
        assert flat["fp8_base_unet"] is True and "fp8_base" not in flat  # transformer only: quantize_te is off
        assert flat["blocks_to_swap"] == 14  # 40 % of FLUX.1's 35 swappable blocks
        assert read["model.layer_offloading_transformer_percent"] == 0.4 and read["model.quantize_te"] is False
        assert flat["sample_at_first"] is False and flat["cache_latents_to_disk"] is True
        assert read["sample.prompts"] == ["a red fox in the snow", "a lighthouse at dusk -no flags here"]
        assert read["sample.walk_seed"] is True and read["sample.seed"] == 7 and read["sample.height"] == 768
        assert "--guidance" not in script and "--sample_prompts" in script
    else:
        assert args["model"]["task"] == "t2v-A14B" and flat["fp8_base"] is True
        assert "train_batch_size" not in flat  # musubi-tuner refuses options it lacks
        dataset = tomllib.loads((tmp_path / "kohya_dataset.toml").read_text())
        assert [(d["resolution"], d["target_frames"]) for d in dataset["datasets"]] == [([256, 256], [33]),
                                                                                        ([512, 512], [33])]
        assert "--fp8_t5" in script and "--dit_high_noise" in script  # both Wan 2.2 experts
        assert "no equivalent: model.low_vram = true" in (tmp_path / "kohya.toml").read_text()


@pytest.mark.parametrize("arch, name, script, own", [
    ("flux", "black-forest-labs/FLUX.1-dev", "flux_train_network.py", {}),
    ("chroma", "lodestones/Chroma", "flux_train_network.py", {"model_type": "chroma", "apply_t5_attn_mask": True}),
    ("sd3", "stabilityai/stable-diffusion-3.5-large", "sd3_train_network.py", {}),
    ("qwen_image", "Qwen/Qwen-Image", "qwen_image_train_network.py", {}),
])
def test_an_export_is_a_kohya_job_fitfinder_reads_and_estimates(arch, name, script, own, tmp_path):
    from fitfinder import trainers
    from fitfinder.probe import request as requests

    text = FLUX_JOB.replace("is_flux: true", f"arch: {arch}").replace("black-forest-labs/FLUX.1-dev", name)
    kohya.write(aitoolkit_job.loads(text, "job.yaml"), tmp_path)
    job = trainers.load(tmp_path / "kohya.sh")  # `$here/kohya.toml`: the files beside it
    assert job.script.name == script and job.config_path == tmp_path / "kohya.toml"
    assert {key: job.get(key) for key in own} == own
    request = requests.request_for(job, 3, "sim", None)
    assert request["rank"] == 16 and request["shapes"] == [[512, 1], [768, 1], [1024, 1]]
    assert request["sample"]["width"] == 1024 and request["sample"]["first"] is False  # skip_first_sample


@pytest.mark.parametrize("arch, name, task, clip", [
    ("wan21_i2v:14b480p", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "i2v-14B", True),
    ("wan22_14b_i2v", "ai-toolkit/Wan2.2-I2V-A14B-Diffusers-bf16", "i2v-A14B", False),
])
def test_image_to_video_jobs_export_to_their_musubi_task(arch, name, task, clip, tmp_path):
    text = WAN_JOB.replace("name_or_path: ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16, arch: wan22_14b",
                           f"name_or_path: {name}, arch: {arch}")
    done = kohya.write(aitoolkit_job.loads(text, "job.yaml"), tmp_path)
    script = (tmp_path / "kohya.sh").read_text()
    assert tomllib.loads((tmp_path / "kohya.toml").read_text())["model"]["task"] == task
    assert ("--clip" in script) is clip  # Wan 2.1 I2V's CLIP image encoder; Wan 2.2 has none
    assert ("--dit_high_noise" in script) is (task == "i2v-A14B") and done.trainer.repo == "musubi-tuner"


def test_a_family_musubi_tuner_does_not_train_is_refused_in_one_line(tmp_path):
    text = WAN_JOB.replace("name_or_path: ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16, arch: wan22_14b",
                           "name_or_path: Wan-AI/Wan2.2-TI2V-5B-Diffusers, arch: wan22_5b")
    with pytest.raises(UserError) as caught:
        kohya.write(aitoolkit_job.loads(text, "job.yaml"), tmp_path)
    assert str(caught.value).startswith("kohya export: no kohya trainer known for the wan22_5b family")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_a_family_fitfinder_does_not_know_never_reaches_the_export(tmp_path):
    with pytest.raises(UserError) as caught:
        aitoolkit_job.loads(FLUX_JOB.replace("is_flux: true", "arch: not_a_model"), "job.yaml")
    assert "model.arch: fitfinder does not support the model 'not_a_model'; it supports: " in str(caught.value)


def test_export_bad_input_is_one_line(tmp_path):
    bad_format = run_cli("export", NAME, "--format", "onetrainer", cwd=tmp_path)
    assert bad_format.returncode == 2
    assert bad_format.stderr.startswith("fitfinder: error: --format: expected kohya, got 'onetrainer'")
    missing = run_cli("export", NAME, cwd=tmp_path)
    assert missing.returncode == 2 and "results/demo_flux_lora/best.yaml: no such file" in missing.stderr
    for result in (bad_format, missing):
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


# -- hostile strings in every exported field: nothing reaches a shell or a config file unescaped -----
HOSTILE = {
    "newline_command": "x\ntouch pwned #",
    "crlf_command": "x\r\ntouch pwned #",
    "line_separator": "x\u2028touch pwned\u2029#",
    "single_quotes": "x'; touch pwned; echo '",
    "double_quotes": 'x"; touch pwned; echo "',
    "dollar_paren": "$(touch pwned)",
    "backticks": "`touch pwned`",
    "ifs": "${IFS}touch${IFS}pwned;x",
    "nul": "x\x00touch pwned",
    "escape_sequence": "x\x1b]0;evil\x07\x1b[2J",
    "toml_breakout": '"\n[evil]\nkey = "x',
    "toml_backslash": "x\\\"\\nevil = 1",
    "kohya_options": "x --n evil --w 1 --d 5",
    "long": "$(touch pwned)" * 400,
}
# Where each field of the job lands in kohya's files (and so where an injection would try).
# network.type is not among them: the job's validation refuses any type but lora, lokr, locon and
# lycoris before an export is written (test_lokr).
FIELDS = ("config.name", "model.name_or_path", "trigger_word", "training_folder",
          "datasets[0].folder_path", "datasets[0].caption_ext", "sample.prompts", "sample.neg")
STUB = "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done >> \"$STUB_LOG\"\necho --- >> \"$STUB_LOG\"\n"


def _hostile_job(text: str, field: str, value: str, tmp_path, file_name: str = "job.yaml"):
    """The job with `value` in `field`, written out and read back as YAML (as best.yaml is)."""
    job = aitoolkit_job.loads(text, "job.yaml")
    if field == "config.name":
        job.data["config"]["name"] = value
    elif field == "sample.prompts":
        job.set("sample.prompts", ["[trigger] first", value])
    else:
        job.set(field, value)
    path = tmp_path / file_name
    path.write_text(job.dumps(), encoding="utf-8")
    return aitoolkit_job.load(path)


def _run_script(script, tmp_path) -> list[list[str]]:
    """kohya.sh under `env -i`, a stub trainer (accelerate, python) first on PATH: the argv of
    each call. The real /usr/bin stays on PATH, so an injected `touch` would run."""
    import subprocess

    stubs, work = tmp_path / "stubs", tmp_path / "work"
    stubs.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    for name in ("accelerate", "python"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    log = tmp_path / "argv.log"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    env = [f"PATH={stubs}:/usr/bin:/bin", f"STUB_LOG={log}", "FLUX_MODEL=/m/flux", "CLIP_L=/m/clip", "T5XXL=/m/t5",
           "AE=/m/ae", "WAN_DIT=/m/dit", "WAN_DIT_HIGH_NOISE=/m/dit_high", "WAN_VAE=/m/vae", "WAN_T5=/m/t5"]
    ran = subprocess.run(["env", "-i", *env, "bash", str(script)], cwd=work, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    calls = log.read_text().split("---\n")[:-1]
    return [call.splitlines() for call in calls]


def _nothing_else_ran(tmp_path) -> None:
    assert not list(tmp_path.rglob("pwned*")) and not list(tmp_path.rglob("evil*"))


@pytest.mark.parametrize("field", FIELDS)
def test_hostile_strings_in_every_exported_field_stay_data(field, tmp_path):
    for case, value in HOSTILE.items():
        folder = tmp_path / case
        folder.mkdir()
        job = _hostile_job(FLUX_JOB, field, value, folder)
        done = kohya.write(job, folder / "out")
        calls = _run_script(folder / "out" / "kohya.sh", folder)
        _nothing_else_ran(folder)
        out = folder / "out"
        assert calls == [["launch", "--num_cpu_threads_per_process", "1", "--mixed_precision", "bf16",
                          "flux_train_network.py", "--config_file", f"{out}/kohya.toml",
                          "--dataset_config", f"{out}/kohya_dataset.toml",
                          "--pretrained_model_name_or_path", "/m/flux", "--clip_l", "/m/clip", "--t5xxl", "/m/t5",
                          "--ae", "/m/ae", "--sample_prompts", f"{out}/kohya_prompts.txt"]], case
        args = tomllib.loads((out / "kohya.toml").read_text(encoding="utf-8"))
        assert set(args) == {"network", "training", "memory", "sampling", "saving"}, case
        dataset = tomllib.loads((out / "kohya_dataset.toml").read_text(encoding="utf-8"))
        assert set(dataset) == {"general", "datasets"}, case
        subset = dataset["datasets"][0]["subsets"][0]
        expected = {"config.name": (args["saving"]["output_name"], value),  # TOML holds the value exactly
                    "training_folder": (args["saving"]["output_dir"], value),
                    "datasets[0].folder_path": (subset["image_dir"], value),
                    "datasets[0].caption_extension": (subset["caption_extension"], "." + value.lstrip("."))}
        if field in expected:
            assert expected[field][0] == expected[field][1], case
        prompts = (out / "kohya_prompts.txt").read_text(encoding="utf-8").split("\n")
        assert len(prompts) == 3 and prompts[2] == "", case  # two prompts, one line each
        assert all(line.count(" --w ") == 1 and line.count(" --n ") <= 1 for line in prompts[:2]), case
        assert "approximate" in {r.kind for r in done.rows}  # ' --' in a prompt is reported


@pytest.mark.parametrize("file_name", ["x\ntouch pwned #.yaml", "$(touch pwned).yaml", "`touch pwned`.yaml",
                                       "x'; touch pwned; '.yaml", "x\r\x1b[2J.yaml"])
def test_a_hostile_job_file_name_stays_in_a_comment(file_name, tmp_path):
    job = _hostile_job(WAN_JOB, "datasets[0].folder_path", "$(touch pwned)\n/clips", tmp_path, file_name)
    kohya.write(job, tmp_path / "out")
    calls = _run_script(tmp_path / "out" / "kohya.sh", tmp_path)
    _nothing_else_ran(tmp_path)
    assert [call[0] for call in calls] == ["src/musubi_tuner/wan_cache_latents.py",
                                           "src/musubi_tuner/wan_cache_text_encoder_outputs.py", "launch"]
    comments = [line for line in (tmp_path / "out" / "kohya.sh").read_text().splitlines() if "fitfinder found" in line]
    assert len(comments) == 1 and comments[0].startswith("# musubi-tuner: train the LoRA")


def test_export_files_take_the_mode_the_umask_gives(tmp_path):
    import os

    old = os.umask(0o027)
    try:
        kohya.write(aitoolkit_job.loads(FLUX_JOB, "job.yaml"), tmp_path)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"kohya.toml": 0o640, "kohya_dataset.toml": 0o640, "kohya_prompts.txt": 0o640,
                     "kohya.sh": 0o750}
