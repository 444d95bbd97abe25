"""Memory by owner at the wall (issue 33 item 1) and the host's bytes (issue 32 item 1), as the
meters count them and as `fitfinder estimate` shows them."""

import json

import pytest

from fitfinder import models, probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import DEMO, run_cli, tiny_job

GPU_OWNERS = {"allocator rounding", "cuBLAS workspace", "fragmentation", "CUDA context"}


@pytest.fixture(scope="module")
def demo_sim():
    """The demo probed on the sim meter, no budget: every phase's peak and owners."""
    result = probe.ProbeRunner(300).run(probe.request_for(aitoolkit_job.load(DEMO), 4, "sim", None))
    assert result["status"] == "ok", result.get("error")
    return result


@pytest.fixture(scope="module")
def demo_estimate():
    """The demo estimated with the default GPU overhead: what `fitfinder estimate` shows."""
    return estimate.run(aitoolkit_job.load(DEMO), estimate.InProcess(600), GpuOverhead())


def test_the_owners_at_each_phase_sum_to_its_peak_on_both_meters(demo_sim, demo_estimate):
    for phase, stats in demo_sim["phase_stats"].items():
        assert sum(stats["owners"].values()) == stats["peak_reserved"], phase
    for phase, stats in demo_estimate.phase_stats.items():
        assert sum(stats["owners"].values()) == stats["peak_reserved"], phase
        assert GPU_OWNERS <= set(stats["owners"]), phase  # the card's own overhead is named, not lumped
    wall = demo_estimate.wall()
    assert (wall.phase, wall.peak_bytes) == ("train", demo_estimate.peak_bytes)
    assert sum(wall.owners.values()) == demo_estimate.phase_stats["train"]["peak_reserved"]


def test_activations_hold_the_training_step_and_the_transformer_the_load(demo_sim):
    def largest(phase):
        return next(iter(demo_sim["phase_stats"][phase]["owners"]))  # largest first

    assert largest("train") == "activations" and largest("load") == "weights:transformer"
    # the estimate without a card's overhead is the sim meter's split, owner by owner
    found = estimate.run(aitoolkit_job.load(DEMO), estimate.InProcess(600), GpuOverhead.none())
    for phase in ("load", "train"):
        assert found.owners_at(phase) == demo_sim["phase_stats"][phase]["owners"], phase


def test_the_loras_bytes_are_its_parameters_bytes(demo_sim):
    from fitfinder.probe import meters

    request = probe.request_for(aitoolkit_job.load(DEMO), 1, "sim", None)
    pipe = models.load_pipeline(request["model"], request, meters.SimMeter(None))
    lora = sum(p.numel() * p.element_size() for p in pipe.trainable_parameters(pipe.family.denoisers))
    assert lora > 0
    for phase, stats in demo_sim["phase_stats"].items():
        assert stats["owners"].get("lora") == lora, phase


def test_estimate_prints_the_wall_by_owner_and_each_phases_host_peak(tmp_path):
    done = run_cli("estimate", str(DEMO), "--no-overhead", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # the demo's 13.2 MiB budget: train does not fit
    found = json.loads(done.stdout)
    owners = found["wall"]["owners"]
    assert found["wall"]["phase"] == "train" and found["wall"]["stops"] is True
    assert owners[0] == {"owner": "activations and transients", "tag": "activations", "bytes": owners[0]["bytes"]}
    assert [o["bytes"] for o in owners] == sorted((o["bytes"] for o in owners), reverse=True)
    assert {"LoRA", "LoRA gradients", "optimizer state", "transformer weights"} <= {o["owner"] for o in owners}
    assert sum(o["bytes"] for o in owners) == found["peak_bytes"]  # tensors only: nothing rounded, no overhead
    assert found["host_phases"] == {p: s["peak_host"] for p, s in found["phase_stats"].items()}
    assert found["host_wall"]["peak_bytes"] == max(found["host_phases"].values())

    lines = done.stderr.splitlines()  # with --json the lines go to stderr
    start = lines.index(next(line for line in lines if line.startswith("the wall: train, ")))
    assert lines[start + 1] == "  by owner, at the phase's peak:"
    shown = lines[start + 2:start + 8]  # the five largest, then the rest in one line
    assert shown[0].split()[:3] == ["activations", "and", "transients"] and shown[0].endswith("%")
    assert shown[-1].startswith(f"    other ({len(owners) - 5} owners)")
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("phase"))]
    assert table.split()[-1] == "host"
    assert any(line.startswith("host peak: ") and "the process " in line for line in lines)


def test_probe_says_what_holds_the_phase_that_ran_out(tmp_path):
    done = run_cli("probe", str(DEMO), "--json", cwd=tmp_path)  # the demo's 13.2 MiB: train runs out
    assert done.returncode == 1, done.stderr
    found = json.loads(done.stdout)
    wall = found["wall"]
    assert (found["status"], wall["phase"], wall["stops"]) == ("oom", "train", True)
    assert wall["peak_bytes"] == found["phase_stats"]["train"]["peak_reserved"]
    assert sum(o["bytes"] for o in wall["owners"]) == wall["peak_bytes"]  # the sim meter: the tensors, all owned
    assert wall["owners"][0]["owner"] == "activations and transients"
    lines = done.stderr.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("the wall: train, ")))
    assert lines[start - 1].startswith("does not fit: it ran out of memory in train")
    assert lines[start + 2].split()[:3] == ["activations", "and", "transients"]


# -- the host, to the byte ----------------------------------------------------------------------
HOST_CASES = [
    ("flux", {}),
    ("flux", {"model.low_vram": True, "model.quantize": True}),
    ("sd15", {}),
    ("sd15", {"model.low_vram": True}),
    ("wan21", {}),
    ("wan21", {"model.low_vram": True}),
    ("wan21", {"model.layer_offloading": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, changes", HOST_CASES, ids=[f"{f}-{'-'.join(c) or 'base'}" for f, c in HOST_CASES])
def test_the_estimate_counts_the_host_as_the_sim_meter_does(run_tiny, family, changes):
    """Host tensors (every phase's peak: pinned among them, and their split by owner) to the byte
    between the sim meter and the estimate, in every phase but the load. The load differs by the
    libraries' file-read transients (safetensors and diffusers reading a weight file whole before
    the parameters take it), which the sim meter sees when it loads the tiny model's real files and
    the estimate models only for real weight files, never for an architecture of fake tensors."""
    measured = run_tiny(family, changes)
    assert measured["status"] == "ok", measured.get("error")
    request = estimate.as_estimate(probe.request_for(tiny_job(family, changes), 3, "sim", None), GpuOverhead.none())
    found = estimate.InProcess(600).run(request)
    assert found["status"] == "ok", found.get("error")
    assert set(found["phase_stats"]) == set(measured["phase_stats"])
    for phase, sim in measured["phase_stats"].items():
        if phase == "load":
            continue
        est = found["phase_stats"][phase]
        assert est["host_tensors"] == sim["host_tensors"], phase
        assert est["host_pinned"] == sim["host_pinned"], phase
        assert est.get("host_owners", {}) == sim.get("host_owners", {}), phase
    held = {phase: stats["host_tensors"] for phase, stats in measured["phase_stats"].items() if phase != "load"}
    assert min(held.values()) > 0  # the VAE or the cached embeddings wait there in every phase: not 0 == 0
    if changes.get("model.layer_offloading"):  # the offloaded blocks stay in pinned host memory
        assert measured["phase_stats"]["train"]["host_pinned"] > 0


# -- the search: its JSON and its report ----------------------------------------------------------
def test_the_search_json_and_the_report_show_the_winners_wall_by_owner(demo_run):
    folder, summary = demo_run
    wall = summary["wall"]  # the winner's highest phase: it fits, so nothing stops it
    assert wall["trial"] is not None and wall["stops"] is False and wall["phase"] == "train"
    assert wall["owners"][0]["owner"] == "activations and transients"
    assert sum(o["bytes"] for o in wall["owners"]) == wall["peak_bytes"]  # the sim meter's owners sum to its peak
    written = json.loads((folder / "results" / "demo_flux_lora" / "summary.json").read_text())
    assert written["wall"] == wall and written["phases"]["winner"]["wall"] == wall
    page = (folder / "results" / "demo_flux_lora" / "report.html").read_text(encoding="utf-8")
    section = page[page.index("<section id='owners'>"):]
    section = section[:section.index("</section>")]
    assert "What holds the memory at the wall" in section and "<h3>winner: train, " in section
    assert "<td>activations and transients</td>" in section and "<td>LoRA</td>" in section
