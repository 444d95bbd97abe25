"""Optimizers as AI Toolkit builds them: names, the knob, each state at its real size, the estimate exact."""

import pytest
import torch

from fitfinder import optimizers, probe, space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.errors import ConfigError
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import tiny_job

OPTIMIZERS = ["adafactor", "lion8bit", "adam8bit", "adamw8bit", "lion", "adam", "adamw", "prodigy"]


def _state(name: str, **optimizer_params) -> dict:
    """{parameter: {state key: (shape, dtype, bytes)}} after one step of a bf16 matrix and vector."""
    torch.manual_seed(0)
    matrix = torch.nn.Parameter(torch.randn(128, 64, dtype=torch.bfloat16))
    vector = torch.nn.Parameter(torch.randn(128, dtype=torch.bfloat16))
    optimizer = optimizers.build(name, [matrix, vector], 1e-4, optimizer_params)
    for param in (matrix, vector):
        param.grad = torch.randn_like(param)
    optimizer.step()
    return {label: {key: (tuple(value.shape), value.dtype, value.numel() * value.element_size())
                    for key, value in optimizer.state[param].items() if isinstance(value, torch.Tensor)}
            for label, param in (("matrix", matrix), ("vector", vector))}


def test_every_name_ai_toolkit_accepts_is_read_and_others_are_refused():
    assert [aitoolkit_job.optimizer_name(n) for n in ("AdamW", "adam", "AdamW8bit", "adam8bit", "Lion", "lion8bit",
                                                  "Adafactor", "prodigy", "Prodigy", "prodigyopt")] == \
        ["adamw", "adam", "adamw8bit", "adam8bit", "lion", "lion8bit", "adafactor", "prodigy", "prodigy", "prodigy"]
    assert aitoolkit_job.optimizer_name("prodigy8bit") is None and aitoolkit_job.optimizer_name("sgd") is None
    with pytest.raises(ConfigError) as refused:
        aitoolkit_job.loads(tiny_job("flux").dumps().replace("optimizer: adamw", "optimizer: sgd"), "<job>")
    message = str(refused.value)
    assert ("train.optimizer: expected one of adafactor, adam, adamw, adam8bit, adamw8bit, lion, lion8bit, prodigy"
            in message)


def test_each_state_has_its_real_shape_and_dtype():
    f32, bf16, u8 = torch.float32, torch.bfloat16, torch.uint8
    # adafactor: factored fp32 second moments (a row and a column) for a matrix, a full one for a vector
    assert _state("adafactor") == {
        "matrix": {"exp_avg_sq_row": ((128,), f32, 512), "exp_avg_sq_col": ((64,), f32, 256), "RMS": ((), f32, 4)},
        "vector": {"exp_avg_sq": ((128,), f32, 512), "RMS": ((), f32, 4)}}
    # bitsandbytes: one byte per moment and element, an fp32 scale per 256; 32-bit under 4096 elements
    eight_bit = {"state1": ((128, 64), u8, 8192), "qmap1": ((256,), f32, 1024), "absmax1": ((32,), f32, 128)}
    assert _state("lion8bit") == {"matrix": eight_bit, "vector": {"state1": ((128,), f32, 512)}}
    adam8 = _state("adamw8bit")
    assert adam8["matrix"] == {**eight_bit, "state2": ((128, 64), u8, 8192), "qmap2": ((256,), f32, 1024),
                               "absmax2": ((32,), f32, 128)}
    assert _state("adam8bit") == adam8
    # lion one moment, adam(w) two, prodigy four (s and p0 too), all in the weights' dtype
    assert _state("lion")["matrix"] == {"exp_avg": ((128, 64), bf16, 16384)}
    assert {k: v[2] for k, v in _state("adamw")["matrix"].items()} == {"step": 4, "exp_avg": 16384, "exp_avg_sq": 16384}
    assert {k: v[2] for k, v in _state("prodigy")["matrix"].items()} == {"s": 16384, "p0": 16384, "exp_avg": 16384,
                                                                         "exp_avg_sq": 16384}


def test_optimizer_params_that_change_the_state_change_it():
    assert _state("adafactor", beta1=0.9)["matrix"]["exp_avg"] == ((128, 64), torch.float32, 32768)
    assert _state("adamw", amsgrad=True)["matrix"]["max_exp_avg_sq"][2] == 16384
    sliced = _state("prodigy", slice_p=11)["matrix"]
    assert sliced["s"][0] == sliced["p0"][0] == (745,)  # every 11th element of 8192
    assert _state("adamw8bit", min_8bit_size=16384)["matrix"]["state1"][1] == torch.float32  # 32-bit below it


def test_the_knob_offers_only_the_precision_twin_lightest_first():
    def knob(name, override=None):
        changes = {"train.optimizer": name}
        job = tiny_job("flux", changes)
        if override is not None:
            job.settings.candidates["optimizer"] = override
        built = spaces.build(job).by_name.get("optimizer")
        return built and built.candidates

    assert knob("adamw") == ("adamw8bit", "adamw")
    assert knob("AdamW") == ("adamw8bit", "adamw")
    assert knob("adam") == ("adam8bit", "adam")
    assert knob("lion") == ("lion8bit", "lion")
    assert knob("adafactor") is None and knob("prodigy") is None and knob("adamw8bit") is None
    # a user's list is ordered by state size and never goes past the desired optimizer
    assert knob("prodigy", ["adamw", "adafactor"]) == ("adafactor", "adamw", "prodigy")
    assert knob("adamw8bit", ["adamw", "adafactor"]) == ("adafactor", "adamw8bit")


@pytest.fixture(scope="module")
def runner():
    return probe.ProbeRunner(timeout_s=300)


# LoRA and full fine-tune alternate, so each optimizer meets one of them at the cost of one pair of runs.
# adafactor also in fp16, whose stochastic rounding takes fp32 temporaries; adamw on a LoRA is
# benchmarks/estimate_accuracy.py's own case.
@pytest.mark.slow
@pytest.mark.parametrize("name, full, dtype", [("adafactor", True, "bf16"), ("adafactor", True, "fp16"),
                                               ("lion8bit", False, "bf16"), ("adamw8bit", True, "bf16"),
                                               ("lion", True, "bf16"), ("prodigy", False, "bf16")])
def test_the_estimate_counts_each_state_to_the_byte(runner, name, full, dtype):
    job = tiny_job("flux", {"train.optimizer": name, "train.dtype": dtype})
    if full:
        del job.process["network"]
    request = probe.request_for(job, 4, "sim", None)
    sim = runner.run(request)
    fake = runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    assert {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()} == \
        {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()}
