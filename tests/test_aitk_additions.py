"""What AI Toolkit added after the families were written (issue 34, item 9): its own quantization
backends, uint8, validation loss, attention backends and compile, CogView4."""

import pytest

from fitfinder import models, probe, trainers
from fitfinder.trainers import aitoolkit_job
from fitfinder.errors import ConfigError, UserError
from tests.conftest import tiny_job


@pytest.mark.parametrize(("qtype", "backend"), [("orbit3", "OrbitQuant (toolkit/util/orbit_quant.py)"),
                                                ("orbitvq2", "OrbitVQ"), ("convrot4", "ConvRot"), ("nvfp4", "NVFP4")])
def test_ai_toolkits_own_quantization_backends_are_refused_in_one_line(qtype, backend):
    """toolkit/util/ostris_quant.py get_ostris_quantizer: packed states and forwards of their own."""
    job = tiny_job("flux", {"model.quantize": True, "model.qtype": qtype})
    with pytest.raises(ConfigError) as refused:
        aitoolkit_job.loads(job.dumps(), "<job>")
    line = str(refused.value)
    assert f"model.qtype: {qtype} is AI Toolkit's {backend}" in line and "does not follow yet" in line
    assert "\n" not in line


def test_uint8_leaves_every_layer_as_it_is():
    """toolkit/util/uintx_quant.py UIntXQuantizer.can_quantize refuses every layer at 8 bits."""
    import torch

    from fitfinder.models._weights import quantize

    stack = torch.nn.Sequential(torch.nn.Linear(128, 128, dtype=torch.bfloat16))
    aitoolkit_job.loads(tiny_job("flux", {"model.quantize": True, "model.qtype": "uint8"}).dumps(), "<job>")
    assert quantize(stack, "uint8") == 0 and type(stack[0]) is torch.nn.Linear


@pytest.mark.slow
def test_validation_predicts_every_sigma_of_an_image_at_once_without_gradients():
    """BaseSDTrainProcess.validate: each validation image at `resolution` with its sigmas as one batch,
    no gradients, between training steps (the optimizer's state held); the estimate follows."""
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    validation = {"validation_items": [{"image_path": "/images/a.png", "prompt": "a cat"}], "resolution": 320}
    request = probe.request_for(tiny_job("flux", {"train.validation_config": validation}), 3, "sim", None)
    assert request["validation"] == {"resolution": 320, "batch": 4}
    assert "validation" not in probe.request_for(tiny_job("flux", {"train.validation_config": {
        "validation_items": [{"prompt": "no image"}]}}), 3, "sim", None)  # skipped, as AI Toolkit skips it
    runner = probe.ProbeRunner(timeout_s=300)
    plain = runner.run(probe.request_for(tiny_job("flux"), 3, "sim", None))
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert plain["status"] == sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    assert sim["phases"]["train"] > plain["phases"]["train"]
    # the validation prompt is encoded with the others; the rest is untouched
    assert all(sim["phases"][phase] == plain["phases"][phase] for phase in ("load", "latents", "sample"))
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


def test_what_the_cpu_cannot_run_is_said_in_a_note():
    from fitfinder.cli import _note_assumptions

    class Notes:
        def __init__(self):
            self.lines = []

        def note(self, line):
            self.lines.append(line)

    out = Notes()
    _note_assumptions(out, tiny_job("flux", {"train.attention_backend": "flash", "model.compile": True}))
    assert len(out.lines) == 2 and "attention_backend flash" in out.lines[0] and "uncompiled" in out.lines[1]
    quiet = Notes()
    _note_assumptions(quiet, tiny_job("flux"))
    assert quiet.lines == []


def test_cogview4_is_known_and_not_probed_yet():
    """toolkit/models/cogview4.py CogView4 (arch 'cogview4')."""
    with pytest.raises(UserError) as told:
        trainers.model_spec(tiny_job("flux", {"model.arch": "cogview4", "model.name_or_path": "THUDM/CogView4-6B"}))
    assert "knows model.arch 'cogview4' but cannot probe the cogview4 family yet" in str(told.value)
    assert models.NAME_HINTS["cogview4"] == "cogview4"
