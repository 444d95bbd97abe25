"""kohya jobs probed and estimated as their trainers train, on tiny architectures (random weights).

The sd-scripts FLUX.1 job and the musubi-tuner Qwen-Image job, each as its docs write one, with the
tiny architecture (`--arch`): the sim meter's probe and the estimate agree phase by phase, block swap
takes exactly the swapped blocks' Linear weights off the card, and `tiers --write` gives one job per
card in the trainer's own form.
"""

from __future__ import annotations

import pytest

from fitfinder import probe, space, trainers
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

DATASET = """[general]
caption_extension = ".txt"

[[datasets]]
resolution = {resolution}
batch_size = 2

  [[datasets.subsets]]
  image_dir = "images"
"""
SD_SCRIPTS = """#!/usr/bin/env bash
accelerate launch --mixed_precision bf16 flux_train_network.py \\
  --pretrained_model_name_or_path flux1-dev.safetensors --clip_l clip_l.safetensors \\
  --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --dataset_config dataset.toml \\
  --network_module networks.lora_flux --network_dim 8 --network_train_unet_only \\
  --optimizer_type adamw8bit --learning_rate 1e-4 --cache_text_encoder_outputs --cache_latents \\
  --fp8_base --gradient_checkpointing --mixed_precision bf16 --sdpa \\
  --sample_prompts prompts.txt --sample_every_n_steps 100 --sample_at_first --output_name tiny-flux
"""
MUSUBI = """#!/usr/bin/env bash
python src/musubi_tuner/qwen_image_cache_latents.py --dataset_config dataset.toml --vae vae.safetensors
python src/musubi_tuner/qwen_image_cache_text_encoder_outputs.py --dataset_config dataset.toml \\
    --text_encoder qwen_2.5_vl_7b.safetensors --batch_size 1
accelerate launch --mixed_precision bf16 src/musubi_tuner/qwen_image_train_network.py \\
    --dit qwen_image_bf16.safetensors --vae vae.safetensors --text_encoder qwen_2.5_vl_7b.safetensors \\
    --dataset_config dataset.toml --sdpa --mixed_precision bf16 \\
    --optimizer_type adamw8bit --learning_rate 5e-5 --gradient_checkpointing \\
    --network_module networks.lora_qwen_image --network_dim 8 \\
    --fp8_base --fp8_scaled --blocks_to_swap 1 --output_name tiny-qwen
"""


def _job(tmp_path, text: str, resolution: int, arch: str):
    (tmp_path / "dataset.toml").write_text(DATASET.format(resolution=resolution))
    (tmp_path / "prompts.txt").write_text("a cat --w 256 --h 256 --s 20\n")
    (tmp_path / "run.sh").write_text(text)
    return trainers.load(tmp_path / "run.sh", arch=arch)


def _sim_and_estimate(job):
    request = probe.request_for(job, 3, "sim", None)
    probed = probe.ProbeRunner(600).run(request)
    assert probed["status"] == "ok", probed.get("error")
    found = estimate.run(job, estimate.InProcess(600), GpuOverhead.none())
    return ({name: stats["peak_allocated"] for name, stats in probed["phase_stats"].items()},
            {name: stats["peak_live"] for name, stats in found.phase_stats.items()})


@pytest.mark.parametrize("text, resolution, arch", [(SD_SCRIPTS, 256, "flux-tiny"),
                                                    (MUSUBI, 256, "qwen_image-tiny")])
def test_the_estimate_is_the_sim_meters_count_in_every_phase(tmp_path, text, resolution, arch):
    simulated, estimated = _sim_and_estimate(_job(tmp_path, text, resolution, arch))
    assert simulated.keys() == estimated.keys()
    for phase in ("load", "latents", "train"):
        assert estimated[phase] == simulated[phase], phase
    # Qwen2.5-VL under autocast: the estimate is 32 bytes low of 310 KiB (not traced yet)
    assert 0 <= simulated["text_encoder"] - estimated["text_encoder"] <= 64
    # A preview runs under autocast, whose cache keeps each LoRA weight's bf16 copy until the preview
    # ends: the probe's second denoising step starts with it, the estimate's one step builds it.
    for phase in set(simulated) & {"sample", "last_sample"}:
        assert 0 <= simulated[phase] - estimated[phase] <= 16 * 1024, phase


def test_block_swap_takes_the_swapped_blocks_linear_weights_off_the_card(tmp_path):
    job = _job(tmp_path, MUSUBI, 256, "qwen_image-tiny")
    found = space.build(job)
    runner, none = estimate.InProcess(600), GpuOverhead.none()
    swapped = estimate.run(job, runner, none).phase_stats["train"]["peak_live"]
    resident = estimate.run(found.apply(job, {**found.desired(), "layer_offloading": 0}), runner,
                            none).phase_stats["train"]["peak_live"]
    transformer = job.architecture_spec()["arch"]["parts"]["transformer"]
    width = transformer["num_attention_heads"] * transformer["attention_head_dim"]
    # QwenImageTransformerBlock's Linear weights in fp8 (one byte each): two streams of attention
    # (q, k, v, out), modulation (6 x width) and the MLP (4 x width and back)
    per_stream = 4 * width * width + width * 6 * width + 2 * width * 4 * width
    assert resident - swapped == 2 * per_stream


def test_tiers_write_one_job_per_card_in_the_trainers_form(tmp_path):
    _job(tmp_path, SD_SCRIPTS, 256, "flux-tiny")
    result = run_cli("tiers", "run.sh", "--cards", "8,12,16,24", "--write", "--arch", "flux-tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "results" / "tiny-flux" / "tiers"
    assert sorted(p.name for p in folder.iterdir()) == ["12gib.sh", "16gib.sh", "24gib.sh", "8gib.sh"]
    back = trainers.load(folder / "8gib.sh", arch="flux-tiny")
    assert back.get("network_dim") == 8 and back.dataset_path.resolve() == (tmp_path / "dataset.toml").resolve()
