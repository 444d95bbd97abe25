"""The GPU overhead model: its arithmetic, calibration's numbers, storage by card name (and, on a GPU, a real card)."""

import json
import math

import pytest

from fitfinder.probe import overhead
from fitfinder.errors import RunFailed, UserError
from fitfinder.probe.overhead import GpuOverhead

MiB = 2**20

# What _calibrate_gpu.py printed on one card (numbers in the range of an RTX 4090 with CUDA 12).
MEASURED = {
    "ok": True, "gpu_name": "NVIDIA GeForce RTX 4090", "total_bytes": 25_386_352_640,
    "used_before_bytes": 300 * MiB, "used_after_bytes": 300 * MiB + 430 * MiB + 4_400 * MiB,
    "reserved_bytes": 4_400 * MiB,
    "allocated_before_matmul_bytes": 262_144, "allocated_after_matmul_bytes": 262_144 + 131_072 + 8_519_680,
    "matmul_output_bytes": 131_072,
    "workload_peak_allocated_bytes": 4_000 * MiB, "workload_peak_reserved_bytes": 4_120 * MiB,
    "torch": "2.13.0", "cuda": "12.8",
}


def test_device_peaks_add_the_workspace_then_fragmentation_then_the_context():
    model = GpuOverhead(context_bytes=400 * MiB, workspace_bytes=32 * MiB, fragmentation=0.05)
    allocated, reserved = model.device_peaks(1000 * MiB)
    assert allocated == 1032 * MiB + 400 * MiB
    assert reserved == 1032 * MiB + math.ceil(1032 * MiB * 0.05) + 400 * MiB
    assert GpuOverhead.none().device_peaks(12345) == (12345, 12345)


def test_the_defaults_are_the_documented_ones():
    model = GpuOverhead()
    assert (model.context_bytes, model.workspace_bytes, model.fragmentation) == (512 * MiB, 32 * MiB, 0.03)
    assert model.source == "defaults"


@pytest.mark.parametrize("values, message", [
    ({"context_bytes": -1}, "context_bytes cannot be negative but got -1"),
    ({"workspace_bytes": -5}, "workspace_bytes cannot be negative but got -5"),
    ({"fragmentation": 1.0}, "fragmentation must be in [0, 1) but got 1.0"),
])
def test_impossible_models_are_refused(values, message):
    with pytest.raises(ValueError) as caught:
        GpuOverhead(**values)
    assert str(caught.value) == message


def test_a_measurement_becomes_the_model():
    model = overhead.from_measurement(MEASURED)
    assert model.context_bytes == 430 * MiB  # what the card lost beyond the reserved segments and the others
    assert model.workspace_bytes == 8_519_680  # what the first product kept beyond its output
    assert model.fragmentation == 0.03  # 4120 / 4000 - 1
    assert model.source == "calibrated on NVIDIA GeForce RTX 4090"


def test_a_stored_calibration_round_trips_and_is_found_by_any_part_of_its_name(tmp_path):
    model = overhead.from_measurement(MEASURED)
    path = overhead.save(model, MEASURED, tmp_path)
    assert path == tmp_path / "nvidia-geforce-rtx-4090.json"
    assert json.loads(path.read_text())["measured"] == MEASURED
    assert overhead.stored(tmp_path) == {"NVIDIA GeForce RTX 4090": model}
    assert overhead.for_card("rtx 4090", tmp_path) == model
    assert overhead.for_card("NVIDIA GeForce RTX 4090", tmp_path) == model


def test_an_unknown_or_ambiguous_card_is_bad_input(tmp_path):
    for name in ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3090"):
        overhead.save(GpuOverhead(source=f"calibrated on {name}"), {**MEASURED, "gpu_name": name}, tmp_path)
    with pytest.raises(UserError) as unknown:
        overhead.for_card("H100", tmp_path)
    with pytest.raises(UserError) as ambiguous:
        overhead.for_card("geforce", tmp_path)
    assert str(unknown.value) == ("--card: 'H100' matches no stored calibration (stored: NVIDIA GeForce RTX 3090, "
                                  "NVIDIA GeForce RTX 4090)")
    assert str(ambiguous.value).startswith("--card: 'geforce' matches more than one stored calibration")


def test_a_damaged_calibration_file_is_named(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UserError) as caught:
        overhead.stored(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'broken.json'}: not a fitfinder calibration")


def test_the_calibration_child_says_why_it_has_no_answer():
    with pytest.raises(RunFailed) as silent:
        overhead.parse_measurement("", "CUDA error: no kernel image\n")
    with pytest.raises(RunFailed) as failed:
        overhead.parse_measurement('{"ok": false, "error": "OutOfMemoryError: CUDA out of memory"}\n')
    assert str(silent.value) == "the calibration printed no result: CUDA error: no kernel image"
    assert str(failed.value) == "calibration failed: OutOfMemoryError: CUDA out of memory"
    assert overhead.parse_measurement("banner\n" + json.dumps(MEASURED)) == MEASURED


def test_without_nvml_a_search_uses_the_defaults(tmp_path):
    overhead.save(overhead.from_measurement(MEASURED), MEASURED, tmp_path)
    if overhead.gpu_name(0) is None:  # no driver here: nothing to look up
        assert overhead.for_gpu(0, tmp_path) == GpuOverhead()


@pytest.mark.gpu
def test_calibrate_measures_a_real_card(tmp_path):
    model, path, measured = overhead.calibrate(0, tmp_path)
    assert path.exists() and overhead.for_gpu(0, tmp_path) == model
    assert 100 * MiB < model.context_bytes < 2048 * MiB  # a CUDA context with cuBLAS and cuDNN loaded
    assert 0 < model.workspace_bytes <= 64 * MiB
    assert 0 <= model.fragmentation < 0.5
    assert measured["gpu_name"] in model.source
