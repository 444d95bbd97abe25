"""The cuda meter on a real card (skipped without CUDA; scripts/gpu_check.sh runs these first).

Each probe runs in its own process, so a per-process memory cap set by one never limits another.
"""

import pytest

from fitfinder import probe
from tests.conftest import tiny_job

pytestmark = pytest.mark.gpu
MiB = 2**20
ALL_PHASES = ["load", "text_encoder", "latents", "sample", "train", "last_sample"]


@pytest.fixture(scope="module")
def runner():
    return probe.ProbeRunner(timeout_s=300)


def _cuda(job, budget=None, steps=3):
    return probe.request_for(job, steps, "cuda", budget, 0)


def test_cuda_meter_measures_each_phase_with_the_memory_outside_pytorch():
    import torch

    from fitfinder.probe.meters import CudaMeter

    meter = CudaMeter(None, 0)
    with meter:
        with meter.phase("load"):
            kept = torch.empty(64 * MiB, dtype=torch.uint8, device=meter.device)
        with meter.phase("train"):
            transient = torch.empty(128 * MiB, dtype=torch.uint8, device=meter.device)
            del transient
    load, train = meter.phases["load"], meter.phases["train"]
    assert meter.outside_bytes > 0  # the CUDA context at least
    assert load["peak_allocated"] >= 64 * MiB + meter.outside_bytes
    assert train["peak_allocated"] >= 192 * MiB + meter.outside_bytes  # kept + transient
    assert all(p["peak_reserved"] >= p["peak_allocated"] for p in meter.phases.values())
    del kept


@pytest.mark.parametrize("changes", [
    {},
    {"model.quantize": True},
    {"model.quantize": True, "model.qtype": "uint4", "model.low_vram": True},
    {"train.optimizer": "adamw8bit", "train.dtype": "bf16", "datasets[0].cache_latents_to_disk": False},
])
def test_a_tiny_probe_runs_every_phase_on_the_card(runner, changes):
    result = runner.run(_cuda(tiny_job("flux", changes)))
    assert result["status"] == "ok", result.get("error")
    assert list(result["phases"]) == ALL_PHASES
    assert result["outside_bytes"] > 0
    assert all(peak >= result["outside_bytes"] for peak in result["phases"].values())
    assert result["meter"].startswith("cuda meter on ")


def test_a_budget_smaller_than_the_card_is_an_emulated_card_that_runs_out(runner):
    free = runner.run(_cuda(tiny_job("flux")))
    budget = free["outside_bytes"] + 1 * MiB  # room for the context and almost nothing else
    result = runner.run(_cuda(tiny_job("flux"), budget=budget))
    assert (result["status"], result["phase"]) == ("oom", "load")
    assert "emulating a" in result["meter"]
    roomy = runner.run(_cuda(tiny_job("flux"), budget=free["peak_bytes"] + 256 * MiB))
    assert roomy["status"] == "ok" and "emulating a" in roomy["meter"]


def test_every_family_runs_on_the_card(runner):
    for family in ("sdxl", "wan21", "wan22"):
        result = runner.run(_cuda(tiny_job(family)))
        assert result["status"] == "ok", (family, result.get("error"))
        assert list(result["phases"]) == ALL_PHASES
