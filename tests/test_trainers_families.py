"""Every kohya script beyond the first two (sd-scripts' FLUX.1, musubi-tuner's Qwen-Image), each read
from a command line as its docs write one, on its tiny architecture (`--arch`, random weights).

The reading, knobs and recipe of each script are plain data (no torch, fast); the estimate equals the
sim meter's count phase by phase for the U-Net path (SDXL: fp8 on convolutions, an fp32 VAE, the VAE
through a whole preview) and for musubi-tuner's Wan 2.2 (two experts with one LoRA, block swap on
both, clips of target_frames, previews by the low-noise model), the two recipes unlike the first two.
"""

from __future__ import annotations

import pytest

from fitfinder import probe, space, trainers
from fitfinder.errors import UserError
from fitfinder.probe import estimate
from fitfinder.probe import request as requests
from fitfinder.probe.overhead import GpuOverhead

IMAGES = """[general]
caption_extension = ".txt"

[[datasets]]
resolution = {resolution}
batch_size = 2

  [[datasets.subsets]]
  image_dir = "images"
"""
IMAGES_MUSUBI = """[general]
resolution = [{resolution}, {resolution}]
caption_extension = ".txt"
batch_size = 1

[[datasets]]
image_directory = "images"
cache_directory = "cache"
"""
VIDEOS = """[general]
resolution = [{resolution}, {resolution}]
caption_extension = ".txt"
batch_size = 1

[[datasets]]
video_directory = "videos"
cache_directory = "cache"
target_frames = [1, 5, 9]
frame_extraction = "head"
"""
SD_SCRIPTS = """accelerate launch --mixed_precision bf16 {script} \\
  --pretrained_model_name_or_path model.safetensors {files} --dataset_config dataset.toml \\
  --network_module {module} --network_dim 8 --network_train_unet_only --optimizer_type adamw8bit \\
  --learning_rate 1e-4 --cache_latents --gradient_checkpointing --mixed_precision bf16 --sdpa \\
  --sample_prompts prompts.txt --sample_every_n_steps 100 --sample_at_first --output_name tiny {flags}
"""
MUSUBI = """python src/musubi_tuner/{stem}_cache_latents.py --dataset_config dataset.toml --vae vae.safetensors
python src/musubi_tuner/{stem}_cache_text_encoder_outputs.py --dataset_config dataset.toml --batch_size 4
accelerate launch --mixed_precision bf16 src/musubi_tuner/{stem}_train_network.py \\
    --dit dit.safetensors --vae vae.safetensors --dataset_config dataset.toml --sdpa --mixed_precision bf16 \\
    --optimizer_type adamw8bit --learning_rate 1e-4 --gradient_checkpointing --network_module {module} \\
    --network_dim 8 --sample_prompts prompts.txt --sample_every_n_steps 100 --sample_at_first \\
    --output_name tiny {flags}
"""


def _sd(script, module, flags, files=""):
    return SD_SCRIPTS.format(script=script, module=module, flags=flags, files=files), IMAGES


def _musubi(stem, module, flags, dataset=IMAGES_MUSUBI):
    return MUSUBI.format(stem=stem, module=module, flags=flags), dataset


# name -> (command line, dataset TOML, resolution, tiny architecture)
JOBS = {
    "sdxl": (*_sd("sdxl_train_network.py", "networks.lora", "--cache_text_encoder_outputs --fp8_base --no_half_vae"),
             128, "sdxl-tiny"),  # the U-Net's probe is the slowest: 128 px keeps it seconds
    "sd15": (*_sd("train_network.py", "networks.lora", "--fp8_base"), 256, "sd15-tiny"),
    "sd3": (*_sd("sd3_train_network.py", "networks.lora_sd3", "--cache_text_encoder_outputs --fp8_base",
                 "--clip_l l.safetensors --clip_g g.safetensors --t5xxl t5xxl_fp16.safetensors"), 256, "sd3-tiny"),
    "lumina": (*_sd("lumina_train_network.py", "networks.lora_lumina", "--cache_text_encoder_outputs",
                    "--gemma2 gemma2.safetensors --ae ae.safetensors"), 256, "lumina2-tiny"),
    "chroma": (*_sd("flux_train_network.py", "networks.lora_flux", "--model_type chroma --apply_t5_attn_mask "
                    "--cache_text_encoder_outputs --fp8_base",
                    "--t5xxl t5xxl_fp16.safetensors --ae ae.safetensors"), 256, "chroma-tiny"),
    "wan21": (*_musubi("wan", "networks.lora_wan", "--task t2v-1.3B --fp8_base --fp8_scaled --blocks_to_swap 1",
                       VIDEOS), 64, "wan21-tiny"),
    "wan21_i2v": (*_musubi("wan", "networks.lora_wan", "--task i2v-14B --fp8_base", VIDEOS), 64, "wan21_i2v-tiny"),
    "wan22": (*_musubi("wan", "networks.lora_wan", "--task t2v-A14B --dit_high_noise high.safetensors --fp8_base "
                       "--fp8_scaled --blocks_to_swap 1", VIDEOS), 64, "wan22-tiny"),
    "wan22_i2v": (*_musubi("wan", "networks.lora_wan", "--task i2v-A14B --dit_high_noise high.safetensors "
                           "--offload_inactive_dit --fp8_base --fp8_scaled", VIDEOS), 64, "wan22_i2v-tiny"),
    "kontext": (*_musubi("flux_kontext", "networks.lora_flux", "--fp8_base --fp8_scaled"), 256,
                "flux_kontext-tiny"),
    "zimage": (*_musubi("zimage", "networks.lora_zimage", "--fp8_base --fp8_scaled --fp8_llm"), 256, "zimage-tiny"),
    "flux2": (*_musubi("flux_2", "networks.lora_flux_2", "--fp8_base --fp8_scaled"), 256,
              "flux2-tiny"),
    "qwen_edit": (*_musubi("qwen_image", "networks.lora_qwen_image", "--model_version edit-2509 --fp8_base"), 256,
                  "qwen_image_edit_plus-tiny"),
}


def _job(tmp_path, name: str, tiny: bool = True, flags: str = ""):
    """The job on its tiny architecture, or (tiny=False) on the script's shipped full-size one."""
    text, dataset, resolution, arch = JOBS[name]
    (tmp_path / "dataset.toml").write_text(dataset.format(resolution=resolution))
    (tmp_path / "prompts.txt").write_text(f"a cat --w {resolution} --h {resolution} --f 5 --s 20\n")
    (tmp_path / "run.sh").write_text(text.rstrip("\n") + f" {flags}\n")
    return trainers.load(tmp_path / "run.sh", arch=arch if tiny else None)


def _request(job) -> dict:
    return requests.request_for(job, 3, "sim", None)


# name -> (script, family, the knobs in the trainer's names, the recipe's weights, what the train phase holds)
# (the tiny architectures have one or two blocks a list: sd-scripts swaps two fewer than a list has, so
# only musubi-tuner's Wan and Qwen-Image, one fewer, swap one)
DIM, SAMPLE, CHECKPOINTING, BATCH = "network_dim", "sample_prompts", "gradient_checkpointing", "batch_size"
SIZE = "--w/--h"  # the prompt file's preview size (not on the 64-pixel video jobs: half of 64 is 64)
EXPECTED = {
    "sdxl": ("sdxl_train_network.py", "sdxl", [DIM, SAMPLE, SIZE, CHECKPOINTING, BATCH],
             {"unet": "fp8", "text_encoder": "bf16", "text_encoder_2": "bf16", "vae": "fp32"}, ["unet"]),
    "sd15": ("train_network.py", "sd15", [DIM, SAMPLE, SIZE, CHECKPOINTING, BATCH],
             {"unet": "fp8", "text_encoder": "fp8", "vae": "bf16"}, ["unet", "text_encoder"]),
    "sd3": ("sd3_train_network.py", "sd3", [DIM, SAMPLE, SIZE, CHECKPOINTING, BATCH],
            {"transformer": "fp8", "text_encoder": "bf16", "text_encoder_2": "bf16", "text_encoder_3": "bf16",
             "vae": "bf16"}, ["transformer"]),
    "lumina": ("lumina_train_network.py", "lumina2", [DIM, "fp8_base", SAMPLE, SIZE, CHECKPOINTING, BATCH],
               {"transformer": "bf16", "text_encoder": "bf16", "vae": "bf16"}, ["transformer"]),
    "chroma": ("flux_train_network.py", "chroma", [DIM, SAMPLE, SIZE, CHECKPOINTING, BATCH],
               {"transformer": "fp8", "text_encoder": "bf16", "vae": "bf16"}, ["transformer"]),
    "wan21": ("wan_train_network.py", "wan21",
              ["target_frames", DIM, "fp8_base", SAMPLE, "fp8_t5", CHECKPOINTING, "blocks_to_swap"],
              {"transformer": "fp8_scaled", "text_encoder": "bf16", "vae": "fp16"}, ["transformer"]),
    "wan21_i2v": ("wan_train_network.py", "wan21_i2v",
                  ["target_frames", DIM, SAMPLE, "fp8_t5", CHECKPOINTING, "blocks_to_swap"],
                  {"transformer": "fp8", "text_encoder": "bf16", "vae": "fp16", "image_encoder": "fp16"},
                  ["transformer"]),
    "wan22": ("wan_train_network.py", "wan22",
              ["target_frames", DIM, "fp8_base", SAMPLE, "fp8_t5", CHECKPOINTING, "offload_inactive_dit",
               "blocks_to_swap"],
              {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled", "text_encoder": "bf16", "vae": "fp16"},
              ["transformer", "transformer_2"]),
    "wan22_i2v": ("wan_train_network.py", "wan22_i2v",
                  ["target_frames", DIM, "fp8_base", SAMPLE, "fp8_t5", CHECKPOINTING, "offload_inactive_dit"],
                  {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled", "text_encoder": "bf16", "vae": "fp16"},
                  ["transformer"]),
    "kontext": ("flux_kontext_train_network.py", "flux_kontext", [DIM, "fp8_base", SAMPLE, SIZE, "fp8_t5",
                                                                  CHECKPOINTING],
                {"transformer": "fp8_scaled", "text_encoder": "bf16", "text_encoder_2": "bf16", "vae": "bf16"},
                ["transformer"]),
    "zimage": ("zimage_train_network.py", "zimage", [DIM, "fp8_base", SAMPLE, SIZE, CHECKPOINTING],
               {"transformer": "fp8_scaled", "text_encoder": "fp8", "vae": "bf16"}, ["transformer"]),
    "flux2": ("flux_2_train_network.py", "flux2", [DIM, "fp8_base", SAMPLE, SIZE, "fp8_text_encoder", CHECKPOINTING],
              {"transformer": "fp8_scaled", "text_encoder": "bf16", "vae": "bf16"}, ["transformer"]),
    "qwen_edit": ("qwen_image_train_network.py", "qwen_image_edit_plus",
                  [DIM, SAMPLE, SIZE, "fp8_vl", CHECKPOINTING, "blocks_to_swap"],
                  {"transformer": "fp8", "text_encoder": "bf16", "vae": "bf16"}, ["transformer"]),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_each_script_reads_with_its_knobs_and_recipe(tmp_path, name):
    script, family, knobs, weights, train = EXPECTED[name]
    job = _job(tmp_path, name)
    assert (job.script.name, job.architecture_spec()["family"]) == (script, family)
    assert [knob.short for knob in space.build(job).knobs] == knobs
    request = _request(job)
    assert request["trainer"]["weights"] == weights
    assert request["trainer"]["residency"]["train"] == train
    assert request["trained"] == train[:1]  # one LoRA, on the first denoiser (Wan 2.2's two experts share it)


def test_sd_scripts_keeps_each_recipes_own_rules(tmp_path):
    sdxl = _request(_job(tmp_path, "sdxl"))["trainer"]
    # kohya's networks/lora.py: the U-Net's Transformer2DModel layers and their 1x1 convolutions
    assert sdxl["lora_blocks"].startswith("(down_blocks") and sdxl["lora_convs"] is True
    # train_util.sample_images_common: the VAE on the card for the whole preview, not only its decode
    assert "vae" in sdxl["residency"]["sample"] and "vae" not in sdxl["residency"]["train"]
    sd3 = _job(tmp_path, "sd3", tiny=False, flags="--blocks_to_swap 36")  # SD 3.5 Large: 38 joint blocks
    assert _request(sd3)["trainer"]["swapped"] == {"transformer_blocks": 36}  # MMDiT.enable_block_swap
    assert space.build(sd3).by_name["layer_offloading"].candidates[0] == 36  # two fewer than it has
    chroma = _request(_job(tmp_path, "chroma", tiny=False, flags="--blocks_to_swap 5"))["trainer"]
    # Chroma is a Flux: 5 blocks swap two double blocks and six single ones (Flux.enable_block_swap)
    assert chroma["swapped"] == {"transformer_blocks": 2, "single_transformer_blocks": 6}
    with pytest.raises(UserError) as raised:
        _job(tmp_path, "sd3", tiny=False, flags="--blocks_to_swap 37")
    assert "swaps at most 36 blocks" in str(raised.value)


def test_musubi_tuners_wan_follows_its_tasks_experts_and_clips(tmp_path):
    job = _job(tmp_path, "wan22")
    request = _request(job)
    assert request["shapes"] == [[64, 9]]  # the longest of target_frames
    assert request["sample"]["frames"] == 5  # the prompt's --f
    assert request["sample"]["guidance_scale"] == 3.0  # wan/configs: t2v-A14B's low-noise sample_guide_scale
    assert request["trainer"]["previews_by"] == "transformer"  # do_inference: the low-noise model alone
    found = space.build(job)
    point = {**found.desired(), "frames": 5, "low_vram": True, "layer_offloading": 0}
    written = found.apply(job, point).write(tmp_path / "out" / "best.yaml")
    back = trainers.load(written, arch="wan22-tiny")
    assert back.get("datasets[0].target_frames") == [1, 5] and back.get("offload_inactive_dit") is True
    assert back.get("blocks_to_swap") is None
    offloaded = _request(back)["trainer"]["residency"]
    assert offloaded["train"] == ["transformer"] and offloaded["load"] == ["transformer"]
    i2v = _request(_job(tmp_path, "wan21_i2v"))["trainer"]
    assert i2v["residency"]["latents"] == ["vae", "image_encoder"]  # wan_cache_latents.py: clip.visual


@pytest.mark.parametrize("flags, expected", [
    ("--task t2v-14B-FC", "the Fun-Control ones are to come"),
    ("--task t2v-1.3B --dit_high_noise high.safetensors", "only Wan 2.2's A14B tasks have a high-noise model"),
    ("--task t2v-A14B --dit_high_noise h.safetensors --offload_inactive_dit --blocks_to_swap 4", "refuses the two"),
])
def test_a_wan_job_musubi_would_refuse_is_one_line(tmp_path, flags, expected):
    (tmp_path / "dataset.toml").write_text(VIDEOS.format(resolution=64))
    (tmp_path / "run.sh").write_text(MUSUBI.format(stem="wan", module="networks.lora_wan", flags=flags))
    with pytest.raises(UserError) as raised:
        trainers.load(tmp_path / "run.sh")
    assert expected in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdxl", "wan22"])
def test_the_estimate_is_the_sim_meters_count_in_every_phase(tmp_path, name):
    job = _job(tmp_path, name)
    probed = probe.ProbeRunner(900).run(requests.request_for(job, 3, "sim", None))
    assert probed["status"] == "ok", probed.get("error")
    found = estimate.run(job, estimate.InProcess(900), GpuOverhead.none())
    simulated = {phase: stats["peak_allocated"] for phase, stats in probed["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in found.phase_stats.items()} == simulated


@pytest.mark.slow
def test_block_swap_takes_bf16_weights_off_the_card_in_training_too(tmp_path):
    """A swapped block's bf16 weights are used in place by its layers (no fp8 upcast makes a copy): the
    views its ops return must not count them again (meter.hold_in_host), in the sim meter and the estimate."""
    from tests.test_trainers_probe import DATASET, MUSUBI as QWEN

    (tmp_path / "dataset.toml").write_text(DATASET.format(resolution=256))
    (tmp_path / "run.sh").write_text(QWEN.replace("--fp8_base --fp8_scaled ", ""))  # bf16, one block swapped
    job = trainers.load(tmp_path / "run.sh", arch="qwen_image-tiny")
    found = space.build(job)
    resident = found.apply(job, {**found.desired(), "layer_offloading": 0})
    runner, none = estimate.InProcess(600), GpuOverhead.none()
    swapped_train = estimate.run(job, runner, none).phase_stats["train"]["peak_live"]
    resident_train = estimate.run(resident, runner, none).phase_stats["train"]["peak_live"]
    transformer = job.architecture_spec()["arch"]["parts"]["transformer"]
    width = transformer["num_attention_heads"] * transformer["attention_head_dim"]
    per_stream = 4 * width * width + width * 6 * width + 2 * width * 4 * width  # as the fp8 test counts them
    assert resident_train - swapped_train == 2 * per_stream * 2  # two streams, two bytes a weight
    probed = probe.ProbeRunner(900).run(requests.request_for(job, 3, "sim", None))
    assert probed["phase_stats"]["train"]["peak_allocated"] == swapped_train
