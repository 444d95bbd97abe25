"""The probe honours every memory-relevant key of the job file, read with AI Toolkit's defaults."""

import pytest

from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.errors import ConfigError, UserError
from tests.conftest import EXAMPLES, tiny_job

GC_B1 = {"train.gradient_checkpointing": True, "train.batch_size": 1}


# -- the request: what the probe is told, from the job file ----------------------------------------
def _reference(name: str):
    job = aitoolkit_job.load(EXAMPLES / name)
    job.settings.weights = "random"  # the shipped architecture: nothing to download
    return job


def test_the_flux_reference_job_reads_with_ai_toolkit_defaults():
    request = probe.request_for(_reference("train_lora_flux_24gb.yaml"), 20, "sim", 24 * 2**30)
    assert (request["model"]["family"], request["model"]["arch_name"]) == ("flux", "flux-dev")
    assert (request["quantize"], request["quantize_te"]) == (8, 8)  # qfloat8; quantize_te follows quantize
    assert request["dtype"] == "bf16" and request["optimizer"] == "adamw8bit"
    assert request["text_encoder"] == "keep" and request["cache_latents"] is True and request["low_vram"] is False
    assert request["shapes"] == [[512, 1], [768, 1], [1024, 1]]
    assert request["batch_size"] == 1 and request["accumulation"] == 1 and request["gradient_checkpointing"] is True
    assert (request["rank"], request["alpha"]) == (16, 16.0)
    assert request["sample"] == {"first": True, "last": True, "width": 1024, "height": 1024, "frames": 1,
                                 "steps": probe.SAMPLE_STEPS, "guidance_scale": 4.0}
    assert request["trained"] == ["transformer"]


def test_the_wan22_reference_job_resolves_to_two_experts_at_4_bit():
    request = probe.request_for(_reference("train_lora_wan22_14b_24gb.yaml"), 20, "sim", 24 * 2**30)
    model = request["model"]
    assert (model["family"], model["arch_name"]) == ("wan22", "wan22-14b")
    assert set(model["arch"]["parts"]) == {"transformer", "transformer_2", "text_encoder", "vae"}
    assert model["arch"]["parts"]["transformer"] == model["arch"]["parts"]["transformer_2"]
    # uint4|adapter; UMT5 is quantized with model.qtype, as AI Toolkit's Wan loader does (qtype_te is unused)
    assert (request["quantize"], request["quant_type"], request["quantize_te"], request["quant_type_te"]) == (
        4, "uint4", 4, "uint4")
    assert request["low_vram"] is True and request["text_encoder"] == "cache" and request["cache_latents"] is False
    assert request["trained"] == ["transformer", "transformer_2"] and request["switch_every"] == 10
    assert request["sample"]["frames"] == 1 and request["sample"]["guidance_scale"] == 3.5


def test_defaults_fill_what_the_job_leaves_out():
    job = tiny_job("flux")
    for section, key in (("train", "gradient_checkpointing"), ("train", "dtype"), ("train", "optimizer")):
        del job.process[section][key]
    del job.process["datasets"][0]["cache_latents_to_disk"]
    request = probe.request_for(job, 4, "sim", None)
    assert request["gradient_checkpointing"] is True and request["dtype"] == "fp32" and request["optimizer"] == "adamw"
    assert request["cache_latents"] is False and request["quantize"] is None and request["quantize_te"] is None
    assert request["text_encoder"] == "keep" and request["low_vram"] is False


@pytest.mark.parametrize("changes, expected", [
    ({"model.quantize": True, "model.quantize_te": False}, (8, None)),
    # T5 is quantized with model.qtype (AI Toolkit's Flux loader): qtype_te does not apply to it
    ({"model.quantize": False, "model.quantize_te": True, "model.qtype_te": "nf4"}, (None, 8)),
    ({"model.quantize": True, "model.qtype": "fp4"}, (4, 4)),
])
def test_quantization_of_base_and_text_encoder(changes, expected):
    request = probe.request_for(tiny_job("flux", changes), 4, "sim", None)
    assert (request["quantize"], request["quantize_te"]) == expected


def test_unknown_qtype_optimizer_and_arch_are_reported_by_key():
    job = tiny_job("flux", {"train.optimizer": "sgd", "model.qtype": "int2", "model.arch": "omnigen2"})
    with pytest.raises(ConfigError) as raised:
        aitoolkit_job.loads(job.dumps())
    problems = raised.value.problems
    assert any(p.startswith("config.process[0].train.optimizer: expected one of adafactor, adam, adamw")
               for p in problems)
    assert any(p.startswith("config.process[0].model.qtype: expected one of qfloat8") for p in problems)
    # omnigen2 is a model fitfinder knows: the job file is fine, the family is refused when probed (below);
    # an unknown arch is a job-file problem (tests/test_models.py).
    assert not any(p.startswith("config.process[0].model.arch") for p in problems)
    with pytest.raises(UserError) as unknown:
        probe.request_for(tiny_job("flux", {"model.arch": "omnigen2"}), 4, "sim", None)
    assert "fitfinder knows model.arch 'omnigen2' but cannot probe the omnigen2 family yet" in str(unknown.value)


# -- the probe: each key changes the phases it should, and only those ------------------------------
@pytest.mark.slow
def test_quantization_shrinks_what_stays_on_the_device(run_tiny):
    def resident(**changes):
        return run_tiny("flux", {**GC_B1, **changes})["phases"]["text_encoder"]

    none, eight, four = resident(), resident(**{"model.quantize": True}), resident(
        **{"model.quantize": True, "model.qtype": "uint4"})
    assert four < eight < none


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sdxl", "wan21"])
def test_4_bit_runs_every_phase_and_keeps_fp32_modules_unquantized(run_tiny, family):
    """Wan keeps its time embedder in fp32 (followed by a SiLU): quantizing it breaks the forward.
    AI Toolkit's SDXL loader quantizes nothing, so an SDXL job holds what it holds unquantized."""
    result = run_tiny(family, {**GC_B1, "model.quantize": True, "model.qtype": "uint4"})
    assert result["status"] == "ok", result.get("error")
    plain = run_tiny(family, GC_B1)["phases"]["train"]
    assert result["phases"]["train"] == plain if family == "sdxl" else result["phases"]["train"] < plain


@pytest.mark.slow
def test_low_vram_keeps_one_wan22_expert_on_the_device_and_flux_whole(run_tiny):
    """low_vram does what each family's loader does with it (tests/test_fidelity.py, item 5): Wan 2.2's
    experts stay on the CPU but the active one; FLUX.1 without quantization loads as without it."""
    default = run_tiny("flux", GC_B1)["phases"]
    assert run_tiny("flux", {**GC_B1, "model.low_vram": True})["phases"] == default
    both = run_tiny("wan22", {"train.disable_sampling": True})["phases"]
    one = run_tiny("wan22", {"train.disable_sampling": True, "model.low_vram": True})["phases"]
    assert one["train"] < both["train"] and one["load"] < both["load"]


@pytest.mark.slow
def test_optimizer_and_dtype_change_the_train_peak(run_tiny):
    def train(**changes):
        result = run_tiny("flux", {**GC_B1, "network.linear": 128, "network.linear_alpha": 128, **changes})
        assert result["status"] == "ok", result.get("error")
        return result["phases"]["train"]

    adamw = train()
    assert train(**{"train.optimizer": "adamw8bit"}) < adamw  # 8-bit states for the large LoRA matrices
    assert train(**{"train.dtype": "bf16"}) < adamw
    assert train(**{"train.dtype": "fp16"}) < adamw


@pytest.mark.slow
def test_cached_or_unloaded_text_encoders_leave_the_device(run_tiny):
    keep = run_tiny("flux", {**GC_B1, "train.batch_size": 2})["phases"]
    for key in ("train.cache_text_embeddings", "train.unload_text_encoder"):
        gone = run_tiny("flux", {**GC_B1, "train.batch_size": 2, key: True})["phases"]
        assert gone["text_encoder"] < keep["text_encoder"]  # one prompt at a time, not a batch of captions
        assert gone["train"] < keep["train"]


@pytest.mark.slow
def test_uncached_latents_encode_a_batch_and_keep_the_vae_on_the_device(run_tiny):
    cached = run_tiny("flux", {**GC_B1, "train.batch_size": 2})["phases"]
    uncached = run_tiny("flux", {**GC_B1, "train.batch_size": 2, "datasets[0].cache_latents_to_disk": False})["phases"]
    assert uncached["latents"] > cached["latents"]
    assert uncached["train"] > cached["train"]


@pytest.mark.slow
def test_sampling_switches_remove_their_phases(run_tiny):
    assert list(run_tiny("flux", {**GC_B1, "train.skip_first_sample": True})["phases"]) == [
        "load", "text_encoder", "latents", "train", "last_sample"]
    assert list(run_tiny("flux", {**GC_B1, "train.disable_sampling": True})["phases"]) == [
        "load", "text_encoder", "latents", "train"]
