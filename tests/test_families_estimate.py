"""Every family's estimate against the sim meter, and the UNet families' convolution LoRA.

Split from tests/test_families.py so that pytest-xdist's --dist loadfile runs the two files on
different workers: the tests of both grow with every family module.
"""

import pytest

from fitfinder.models import FAMILIES, known_archs
from tests.conftest import sweep

pytestmark = pytest.mark.slow
FAMILY_NAMES = tuple(FAMILIES)
ALL_PHASES = ["load", "text_encoder", "latents", "sample", "train", "last_sample"]
STEPS = 3  # the heaviest shape at the first, middle and last step


@pytest.fixture(scope="module")
def run(run_tiny):
    return run_tiny


# -- the estimate: the same recipe on fake tensors, equal to the sim meter to the byte ---------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_estimate_equals_the_sim_meter_to_the_byte_in_every_phase(family):
    from fitfinder import probe
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead
    from tests.conftest import tiny_job

    runner = probe.ProbeRunner(timeout_s=300)
    request = probe.request_for(tiny_job(family), STEPS, "sim", None)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    assert list(sim["phase_stats"]) == list(fake["phase_stats"]) == ALL_PHASES
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    estimated = {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()}
    assert estimated == measured


# -- the LoRA on a UNet's convolutions (network.conv) ------------------------------------------
UNET_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.lora_convs)


def test_a_unet_lora_wraps_its_1x1_convolutions_and_its_larger_ones_only_at_network_conv():
    import torch
    from diffusers import UNet2DConditionModel

    from fitfinder.models._weights import lora_targets

    with torch.device("meta"):
        unet = UNet2DConditionModel(**known_archs()["sd15-tiny"]["parts"]["unet"])
    at_rank, at_conv = lora_targets(unet, FAMILIES["sd15"].lora_blocks, convs=True, conv_rank=None)
    assert "down_blocks.0.attentions.0.proj_in" in at_rank  # a 1x1 Conv2d: SD 1.5 projects with convs
    assert "time_embedding.linear_1" in at_rank and at_conv == []
    _, at_conv = lora_targets(unet, FAMILIES["sd15"].lora_blocks, convs=True, conv_rank=4)
    assert {"conv_in", "down_blocks.0.resnets.0.conv1", "up_blocks.0.upsamplers.0.conv"} <= set(at_conv)


@pytest.mark.parametrize("family", sweep(UNET_FAMILIES))
def test_network_conv_trains_the_larger_convolutions_and_the_estimate_still_equals_the_sim_meter(run, family):
    from fitfinder import probe
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead
    from tests.conftest import tiny_job

    plain, conv = run(family, steps=2), run(family, {"network.conv": 8, "network.conv_alpha": 8}, steps=2)
    assert plain["status"] == conv["status"] == "ok", (plain.get("error"), conv.get("error"))
    assert conv["phases"]["train"] > plain["phases"]["train"]
    request = probe.request_for(tiny_job(family, {"network.conv": 8}), STEPS, "sim", None)
    runner = probe.ProbeRunner(timeout_s=300)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    assert ({phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()}
            == {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()})
