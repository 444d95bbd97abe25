"""The estimate in the command's own process (estimate.InProcess): the same peaks as in a probe
process, a timeout that ends it, and nothing printed by the libraries on stdout; and the
preloaded imports, which run without the collector."""

import json
import subprocess
import sys

import pytest

from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import DEMO


@pytest.fixture(scope="module")
def demo_request():
    return estimate.request_for(aitoolkit_job.load(DEMO), GpuOverhead())


def test_in_process_gives_the_probe_process_peaks_to_the_byte(demo_request):
    here = estimate.InProcess(300).run(demo_request)
    there = probe.ProbeRunner(300).run(demo_request)
    assert here["status"] == there["status"] == "ok"
    assert here["phase_stats"].keys() == there["phase_stats"].keys()
    for phase, stats in here["phase_stats"].items():
        for key in ("peak_live", "peak_allocated", "peak_reserved"):
            assert stats[key] == there["phase_stats"][phase][key], (phase, key)
    assert 0 < here["cpu_seconds"] and 0 < here["wall_seconds"]


def test_a_second_estimate_in_the_same_process_gives_the_same_peaks(demo_request):
    runner = estimate.InProcess(300)
    first, second = runner.run(demo_request), runner.run(demo_request)
    assert first["phases"] == second["phases"]


def test_an_estimate_past_its_timeout_is_a_timeout_result(demo_request):
    result = estimate.InProcess(0.001).run(demo_request)
    assert result["status"] == "timeout"
    assert result["error"] == "the estimate passed its 0.001 s timeout"


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError) as raised:
        estimate.InProcess(0)
    assert str(raised.value) == "the estimate's timeout must be positive but got 0"


PRELOAD_IN_A_FRESH_PROCESS = """
import gc, json, sys
if sys.argv[1] == "off":
    gc.disable()
full_collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full_collections.append(1))
import fitfinder.probe._preload
print(json.dumps({"collections": len(full_collections), "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count()}))
"""


@pytest.mark.parametrize("collector", ["on", "off"])
def test_the_preload_imports_without_collecting_freezes_what_it_made_and_leaves_the_collector_as_it_was(collector):
    done = subprocess.run([sys.executable, "-c", PRELOAD_IN_A_FRESH_PROCESS, collector],
                          capture_output=True, text=True, check=True)
    after = json.loads(done.stdout.strip().splitlines()[-1])
    # Before, with the collector on, these imports ran eight full collections (benchmarks/import_gc.py).
    assert after["collections"] == 0
    assert after["enabled"] is (collector == "on")
    assert after["frozen"] > 500_000  # the libraries' objects, never scanned again
