"""Full fine-tunes: a job without `network` trains the whole denoiser, as AI Toolkit does."""

import json

import pytest

from fitfinder import probe, space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import DEMO, run_cli, tiny_job


def full_fine_tune_demo(vram: str = "13.2MiB") -> str:
    """configs/demo.yaml without `network`, with adafactor (AI Toolkit's full fine-tune examples)."""
    text = DEMO.read_text()
    start, end = text.index("      network:"), text.index("      datasets:")
    text = text[:start] + text[end:]
    text = text.replace('optimizer: "adamw"', 'optimizer: "adafactor"').replace("    optimizer: [adamw]\n", "")
    text = text.replace("vram: 13.2MiB", f"vram: {vram}").replace('"demo_flux_lora"', '"demo_flux_full"')
    return text


def test_a_job_without_network_trains_the_whole_denoiser_in_its_dtype():
    job = tiny_job("flux", {"train.dtype": "bf16", "model.only_if_contains": ["transformer.transformer_blocks."]})
    del job.process["network"]
    request = probe.request_for(job, 4, "sim", None)
    assert (request["rank"], request["only_if_contains"]) == (None, ["transformer.transformer_blocks."])
    space = spaces.build(job)
    assert "rank" not in space.names and "quantize" not in space.names


def test_ema_is_a_quality_knob_only_where_the_job_asks_for_it():
    job = tiny_job("flux", {"train.ema_config": {"use_ema": True, "ema_decay": 0.99}})
    del job.process["network"]
    space = spaces.build(job)
    knob = space.by_name["ema"]
    assert (knob.candidates, knob.desired, knob.role) == ((False, True), True, "quality")
    # after the optimizer's precision, before the previews; no rank, no quantize for a full fine-tune
    assert space.names == ("optimizer", "ema", "sampling", "sample_size", "text_encoder",
                           "gradient_checkpointing", "low_vram")
    off = space.apply(job, {**space.desired(), "ema": False})
    assert off.get("train.ema_config.use_ema") is False and off.get("train.ema_config.ema_decay") == 0.99
    assert probe.request_for(off, 4, "sim", None)["ema_decay"] is None
    assert "ema" not in spaces.build(tiny_job("flux")).names


def test_a_lora_job_without_a_rank_still_says_what_is_missing():
    text = tiny_job("flux").dumps().replace("linear: 8, linear_alpha: 8", "type: lora")
    with pytest.raises(aitoolkit_job.ConfigError) as refused:
        aitoolkit_job.loads(text.replace("{type: lora, type: lora}", "{type: lora}"), "<job>")
    assert ("network.linear: missing; set the LoRA rank, or leave `network` out for a full fine-tune"
            in str(refused.value))


@pytest.mark.slow
def test_the_estimate_equals_the_sim_meter_on_the_full_fine_tune_demo():
    job = aitoolkit_job.loads(full_fine_tune_demo(), "<full fine-tune demo>")
    request = probe.request_for(job, 4, "sim", None)
    runner = probe.ProbeRunner(timeout_s=300)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    assert {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()} == \
        {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()}


@pytest.mark.slow
def test_the_full_fine_tune_demo_search_proves_a_winner(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "full.yaml").write_text(full_fine_tune_demo())
    done = run_cli("search", "configs/full.yaml", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "fit" and summary["proven"], summary
    assert set(summary["best"]) == {"buckets", "gradient_checkpointing", "batch"}  # no rank knob
    best = aitoolkit_job.load(tmp_path / "results" / "demo_flux_full" / "best.yaml")
    assert not best.has("network") and best.get("train.optimizer") == "adafactor"
    assert summary["peak_bytes"] <= 13.2 * 2**20 * 0.95


@pytest.mark.slow
def test_ema_holds_a_shadow_and_a_stored_copy_and_the_estimate_follows():
    """AI Toolkit's EMA (the Flex full fine-tune example's use_ema): a shadow of the trained
    weights from the load on (BaseSDTrainProcess.setup_ema: after the optimizer, before any
    caching), the weights stored for each preview and kept after it, and the next preview's copy
    made before the last one goes."""
    runner = probe.ProbeRunner(timeout_s=300)
    peaks = {}
    for ema in (False, True):
        job = tiny_job("flux", {"train.optimizer": "adafactor", "train.dtype": "bf16",
                                "train.ema_config": {"use_ema": ema, "ema_decay": 0.99}})
        del job.process["network"]
        request = probe.request_for(job, 4, "sim", None)
        assert request["ema_decay"] == (0.99 if ema else None)
        sim = runner.run(request)
        fake = runner.run(estimate.as_estimate(request, GpuOverhead.none()))
        assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
        peaks[ema] = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
        assert peaks[ema] == {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()}
    extra = {phase: peaks[True][phase] - peaks[False][phase] for phase in peaks[True]}
    trained = extra["sample"] // 2
    # In the last preview three copies exist for a moment (the old stored one, the new one), but
    # the preview's own activations peak higher than one copy of this tiny model: two copies there.
    # The VAE leaves the device right after the load, before the shadow is made (BaseSDTrainProcess
    # load_model, then setup_ema): the load phase's peak moves to after it, and grows by one copy at most.
    assert trained > 0 and 0 < extra.pop("load") <= trained
    assert extra == {"text_encoder": trained, "latents": trained,
                     "sample": 2 * trained, "train": 2 * trained, "last_sample": 2 * trained}
