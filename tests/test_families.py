"""Every family, every phase: real tiny pipelines (diffusers and transformers classes), sim meter.

Each test runs real probes in fresh processes against a simulated budget; the sim meter is exact
and repeatable, so the budgets below are computed from a free run and the outcomes asserted exactly.
Every test is parametrised over the registry (models.FAMILIES): a new family module with its
tiny arch (archs/FAMILY-tiny.json) gets all of them, video ones included when it is video.
"""

import json

import pytest

from fitfinder.models import FAMILIES, known_archs
from tests.conftest import sweep

pytestmark = pytest.mark.slow
FAMILY_NAMES = tuple(FAMILIES)
VIDEO_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.video)
ALL_PHASES = ["load", "text_encoder", "latents", "sample", "train", "last_sample"]
STEPS = 3  # the heaviest shape at the first, middle and last step


@pytest.fixture(scope="module")
def run(run_tiny):
    return run_tiny


def _between(low: int, high: int) -> int:
    assert low < high
    return (low + high) // 2


# -- every phase, and where each budget runs out -----------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_phase_runs_and_has_a_peak(run, family):
    result = run(family)
    assert result["status"] == "ok", result.get("error")
    assert list(result["phases"]) == ALL_PHASES
    assert all(peak > 0 for name, peak in result["phases"].items() if name != "load")
    assert result["phases"]["load"] > 0
    assert result["peak_bytes"] == max(result["phases"].values())
    assert result["steps_run"] == STEPS


# Previews larger than the training bucket, so the preview is the heaviest phase.
BIG_PREVIEW = {
    "image": {"datasets[0].resolution": 128, "sample.width": 384, "sample.height": 384},
    "video": {"datasets[0].num_frames": 5, "sample.width": 96, "sample.height": 96, "sample.num_frames": 9},
}


# HiDream E1 pads its input (the image and its control side by side) to the transformer's max_seq tokens,
# in training and in previews alike, unless the two make a square: only a preview twice as tall as wide
# (AI Toolkit's diffusers HiDreamImageTransformer2DModel.patchify) has more tokens than the training bucket.
BIG_PREVIEW_OF = {"hidream_e1": {"datasets[0].resolution": 128, "sample.width": 384, "sample.height": 768}}


def _kind(family: str) -> str:
    return "video" if FAMILIES[family].video else "image"


def _big_preview(family: str) -> dict:
    return BIG_PREVIEW_OF.get(family, BIG_PREVIEW[_kind(family)])


@pytest.mark.parametrize("family", sweep(FAMILY_NAMES))
def test_a_budget_between_the_train_and_the_sample_peak_runs_out_in_the_sample(run, family):
    free = run(family, _big_preview(family))["phases"]
    others = max(peak for name, peak in free.items() if name not in ("sample", "last_sample"))
    assert free["train"] < free["sample"] and others < free["sample"]
    result = run(family, _big_preview(family), budget=_between(others, free["sample"]))
    assert (result["status"], result["phase"], result["oom_kind"]) == ("oom", "sample", "config")
    assert list(result["phases"]) == ["load", "text_encoder", "latents", "sample"]  # training never started
    assert result["steps_run"] == 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_budget_under_the_load_peak_runs_out_at_load(run, family):
    free = run(family)["phases"]
    result = run(family, budget=free["load"] // 2)
    assert (result["status"], result["phase"]) == ("oom", "load")
    assert list(result["phases"]) == ["load"]
    assert "out of memory" in result["error"]


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_a_clip_longer_than_the_budget_runs_out_although_every_other_shape_fits(run, family):
    short = {"datasets[0].resolution": [64, 96], "datasets[0].num_frames": 5, "train.disable_sampling": True}
    # A second dataset of 17-frame clips at the smallest bucket: its clips are the longest.
    long_clips = [{"folder_path": "/data/long", "resolution": [64], "num_frames": 17, "cache_latents_to_disk": True}]
    fits, long_free = run(family, short), run(family, short, more_datasets=long_clips)
    assert fits["status"] == long_free["status"] == "ok"
    assert long_free["phases"]["train"] > fits["peak_bytes"]
    budget = _between(fits["peak_bytes"], long_free["phases"]["train"])
    assert run(family, short, budget=budget)["status"] == "ok"
    result = run(family, short, budget=budget, more_datasets=long_clips)
    assert (result["status"], result["phase"]) == ("oom", "train")


# -- the train phase follows the memory knobs --------------------------------------------------
LIGHT = {"train.gradient_checkpointing": False, "train.disable_sampling": True}


@pytest.mark.parametrize("family", sweep(FAMILY_NAMES))
def test_train_peak_grows_with_resolution_batch_and_frames_and_shrinks_with_checkpointing(run, family):
    resolution = {"image": 128, "video": 64}[_kind(family)]

    def train_peak(**changes):
        result = run(family, {**LIGHT, "datasets[0].resolution": resolution, **changes}, steps=2)
        assert result["status"] == "ok", result.get("error")
        return result["phases"]["train"]

    base = train_peak()
    assert train_peak(**{"datasets[0].resolution": resolution * 2}) > base
    assert train_peak(**{"train.batch_size": 2}) > base
    assert train_peak(**{"train.gradient_checkpointing": True}) < base
    if FAMILIES[family].video:
        assert train_peak(**{"datasets[0].num_frames": 17}) > base


# -- the same weights from a diffusers folder and from the architecture config ----------------
@pytest.mark.parametrize("family", sweep(FAMILY_NAMES))
def test_a_local_diffusers_folder_and_the_arch_config_give_the_same_peaks(run, family, tmp_path):
    arch = known_archs()[f"{family}-tiny"]
    folder = _save_pipeline(arch, family, tmp_path / f"{family}-pipeline")
    from_folder = run(family, name=str(folder), weights="pretrained")
    from_arch = run(family)
    assert from_folder["status"] == from_arch["status"] == "ok"
    assert from_folder["phases"] == from_arch["phases"]


def _save_pipeline(arch: dict, family: str, folder):
    """A diffusers pipeline folder as the Hub holds one, built here with the libraries' own classes."""
    import torch

    from fitfinder.models._weights import _construct, part_class

    for part, config in arch["parts"].items():
        torch.manual_seed(1)
        model = _construct(part_class(family, part), config)  # LTX-2's connectors: in diffusers.pipelines
        model.save_pretrained(folder / part)
    tokenizer = FAMILIES[family].tokenizer
    if tokenizer:  # the long-prompt tokenizer's length is the one setting a folder holds outside configs
        (folder / tokenizer).mkdir()
        (folder / tokenizer / "tokenizer_config.json").write_text(
            json.dumps({"model_max_length": arch["text_seq_len"]}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "pipeline", "_diffusers_version": "0.42"}))
    return folder
