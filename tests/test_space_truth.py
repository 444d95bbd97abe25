"""The space's claims about memory, checked against the real probe (sim meter, exact peaks).

The search trusts two facts per knob (space.py): the phases whose peak it changes, and that
more of it is never lighter in those phases (but where it says 'unordered'). Both are checked
here knob by knob on tiny models: changing a knob must leave every other phase's peak exactly
as it was, and must not lower the phases it claims.
"""

import pytest

from fitfinder import space as spaces
from fitfinder.models import FAMILIES
from tests.conftest import sweep, tiny_job

pytestmark = pytest.mark.slow

# Desired points with every other knob free. Quantization and the 8-bit optimizer are left out:
# on toy widths what bitsandbytes keeps beside quantized numbers (int8 activation copies, code
# books, block scales: a few KiB) outweighs what it saves, which real widths do not.
IMAGE = {"datasets[0].resolution": [128, 256], "network.linear": 16, "network.linear_alpha": 16,
         "train.batch_size": 2, "train.gradient_checkpointing": False, "sample.width": 256, "sample.height": 256}
VIDEO = {"datasets[0].resolution": [48, 64], "datasets[0].num_frames": 9, "train.batch_size": 2,
         "train.gradient_checkpointing": False, "sample.num_frames": 9}
# One job per family of the registry (a new family module gets it), and a full fine-tune with EMA
# (the ema knob), as AI Toolkit's Flex example.
JOBS = {
    **{name: VIDEO if family.video else IMAGE for name, family in FAMILIES.items()},
    "flux_full": {"datasets[0].resolution": [128, 256], "train.batch_size": 2, "train.gradient_checkpointing": False,
                  "train.optimizer": "adafactor", "train.dtype": "bf16", "train.ema_config": {"use_ema": True},
                  "sample.width": 256, "sample.height": 256},
}


def _space(family):
    job = tiny_job(family.removesuffix("_full"), JOBS[family])
    if family.endswith("_full"):
        del job.process["network"]
    job.settings.candidates = {"quantize": ["none"], "optimizer": ["adamw"]}
    return job, spaces.build(job)


def _steps(space):
    """(knob, lighter point, heavier point): each knob raised one level from a middle point."""
    middle = {k.name: k.candidates[len(k.candidates) // 2] for k in space.knobs}
    for knob in space.knobs:
        for level in range(len(knob.candidates) - 1):
            yield knob, {**middle, knob.name: knob.candidates[level]}, {**middle, knob.name: knob.candidates[level + 1]}


@pytest.fixture(scope="module")
def runner():
    from fitfinder import probe

    return probe.ProbeRunner(timeout_s=300)


@pytest.mark.parametrize("family", sweep(sorted(JOBS)))
def test_each_knob_changes_only_the_phases_it_claims_and_never_lowers_them(family, runner):
    from fitfinder import probe

    job, space = _space(family)
    done = {}

    def peaks(point):
        key = space.key(point)
        if key not in done:
            done[key] = runner.run(probe.request_for(space.apply(job, point), 3, "sim", None))
        result = done[key]
        assert result["status"] == "ok", result.get("error")
        assert list(result["phases"]) == space.phases_run(point)
        return result["phases"]

    checked = 0
    for knob, lighter, heavier in _steps(space):
        light, heavy = peaks(lighter), peaks(heavier)
        for phase in set(light) & set(heavy):
            if phase not in knob.phases:
                assert heavy[phase] == light[phase], f"{knob.name} changes {phase}, which it does not claim"
            elif phase not in knob.unordered:
                assert heavy[phase] >= light[phase], f"more {knob.name} lowers {phase}"
        checked += 1
    assert checked >= len(space.knobs)
