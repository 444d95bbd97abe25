"""network.type: LoKr and LoCon as AI Toolkit builds them; any other type refused in one line."""

import pytest

from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.errors import ConfigError, UserError
from tests.conftest import tiny_job


def test_factorization_splits_as_lokr_py_does():
    """toolkit/models/lokr.py factorization: (factor, dimension / factor) as they come when the factor
    divides; otherwise the most even divisor pair whose smaller side is at most the factor."""
    from fitfinder.models._lokr import factorization

    assert [factorization(d) for d in (127, 128, 360, 1024, 3072, 12288)] == [
        (1, 127), (8, 16), (18, 20), (32, 32), (48, 64), (96, 128)]
    assert factorization(3072, 16) == (16, 192) and factorization(64, 32) == (32, 2)
    assert factorization(360, 7) == (6, 60)  # 7 divides nothing: the largest divisor up to 7


def test_a_lokr_layer_holds_two_fp32_factors_and_the_weight_never_in_a_linear_forward():
    import torch

    from fitfinder.models import _lokr
    from fitfinder.probe.meters import StorageTracker

    torch.manual_seed(0)
    layers = torch.nn.ModuleDict({"full": torch.nn.Linear(64, 96), "low": torch.nn.Linear(64, 96)})
    layers.requires_grad_(False)
    _lokr.add(layers, ["full"], [], _lokr.FULL_RANK, _lokr.FULL_RANK, None, None, -1)
    _lokr.add(layers, ["low"], [], 2, 1, None, None, 16)
    full, low = layers["full"].lora_lokr, layers["low"].lora_lokr
    # 96 = 8 x 12 and 64 = 8 x 8: w1 (out_l, in_m), w2 (out_k, in_n), both fp32, scale 1 at full rank
    assert (full.w1.shape, full.w2.shape, full.scale) == ((8, 8), (12, 8), 1.0)
    # factor 16: 96 = 16 x 6, 64 = 16 x 4; dim 2 is under half of max(6, 4): w2 = w2_a (6, 2) @ w2_b (2, 4)
    assert (low.w1.shape, low.w2_a.shape, low.w2_b.shape, low.scale) == ((16, 16), (6, 2), (2, 4), 0.5)
    assert {p.dtype for p in layers.parameters() if p.requires_grad} == {torch.float32}
    assert not full.w2.any() and not low.w2_b.any()  # the update starts at zero
    x = torch.randn(4, 64)
    assert torch.equal(layers["full"](x), torch.nn.functional.linear(x, layers["full"].weight, layers["full"].bias))
    # a Linear layer's forward makes nothing of the weight's size: 4 MiB here in fp32
    big = torch.nn.ModuleDict({"layer": torch.nn.Linear(1024, 1024)}).requires_grad_(False)
    _lokr.add(big, ["layer"], [], _lokr.FULL_RANK, _lokr.FULL_RANK, None, None, -1)
    x = torch.randn(2, 1024)
    peaks = []
    for forward in (lambda: torch.nn.functional.linear(x, big["layer"].weight, big["layer"].bias),
                    lambda: big["layer"](x)):
        tracker = StorageTracker()
        with tracker:
            forward()
        peaks.append(tracker.peak_bytes)
    assert 0 < peaks[1] - peaks[0] < 1024 * 1024 * 4 // 16


@pytest.mark.parametrize(("family", "changes"), [
    ("flux", {"network.type": "lokr"}),
    ("sdxl", {"network.type": "lokr", "network.lokr_factor": 4}),  # the convolutions' full update too
    ("sdxl", {"network.type": "locon", "network.conv": 4}),
])
def test_lokr_and_locon_probe_as_ai_toolkit_builds_them_and_estimate_to_the_same_bytes(family, changes):
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    runner = probe.ProbeRunner(timeout_s=300)
    request = probe.request_for(tiny_job(family, changes), 3, "sim", None)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


def _trained(family: str, changes: dict):
    from fitfinder import models
    from fitfinder.probe import meters

    request = probe.request_for(tiny_job(family, changes), 1, "sim", None)
    meter = meters.SimMeter(None)
    with meter:
        pipe = models.load_pipeline(request["model"], request, meter)
    return {name: param for name, param in pipe.parts[pipe.family.denoisers[0]].named_parameters()
            if param.requires_grad}


def test_a_lokr_job_trains_lokr_factors_and_a_locon_job_lycoris_blocks_only():
    """toolkit/lora_special.py: 'lokr' puts a LokrModule on each layer a LoRA would take;
    BaseSDTrainProcess.run: 'locon' builds a LycorisSpecialNetwork, which leaves out the UNet's
    conv_in, conv_out and time embedding (outside its target classes)."""
    lora, lokr = _trained("flux", {}), _trained("flux", {"network.type": "lokr"})
    assert {name.rsplit(".lora_", 1)[0] for name in lora} == {name.rsplit(".lora_", 1)[0] for name in lokr}
    assert all(".lora_lokr." in name for name in lokr)
    assert sum(p.numel() for p in lokr.values()) < sum(p.numel() for p in lora.values())
    plain, locon = _trained("sdxl", {}), _trained("sdxl", {"network.type": "locon"})
    assert any(name.startswith(("conv_in.", "time_embedding.")) for name in plain)
    assert locon and not any(name.startswith(("conv_in.", "conv_out.", "time_embedding.", "add_embedding."))
                             for name in locon)
    assert {name.rsplit(".lora_", 1)[0] for name in locon} < {name.rsplit(".lora_", 1)[0] for name in plain}


def test_a_full_rank_lokr_has_no_rank_knob_and_other_network_types_are_refused():
    from fitfinder import space as spaces

    assert "rank" not in spaces.build(tiny_job("flux", {"network.type": "lokr"})).by_name
    assert "rank" in spaces.build(tiny_job("flux", {"network.type": "lokr", "network.lokr_full_rank": False})).by_name
    with pytest.raises(UserError) as refused:
        probe.request_for(tiny_job("flux", {"network.type": "locon"}), 1, "sim", None)
    assert "wraps UNet blocks only" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError) as dora:
        aitoolkit_job.loads(tiny_job("flux", {"network.type": "dora"}).dumps(), "<dora job>")
    assert "network.type: expected one of lora, lokr, locon, lycoris" in str(dora.value)
