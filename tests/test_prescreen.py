"""The search's pre-screen: points estimated well over the budget are decided without a probe."""

import json

import optuna
import pytest

from fitfinder import probe, space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.search import estimated, study as studies
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import DEMO, run_cli

MiB = 2**20


class Replay:
    """A runner that answers with results it was given, counting the requests (real results, once)."""

    def __init__(self, *results):
        self.results, self.requests = list(results), []

    def run(self, request, log_path=None):
        self.requests.append(request)
        return self.results.pop(0)


@pytest.fixture(scope="module")
def demo_estimate():
    """The demo's desired point, estimated once (tensor bytes, as the sim meter counts them)."""
    job = aitoolkit_job.load(DEMO)
    request = probe.request_for(job, 20, "sim", job.settings.vram_bytes)
    result = probe.ProbeRunner(300).run(estimate.as_estimate(request, GpuOverhead.none()))
    assert result["status"] == "ok", result.get("error")
    return request, result


def test_on_by_default_with_the_cuda_meter_only():
    assert estimated.prescreen_for(None, Replay(), 24 * 2**30, "sim") is None
    on_card = estimated.prescreen_for(None, Replay(), 24 * 2**30, "cuda")
    assert on_card.factor == estimated.PRESCREEN_FACTOR == 1.25 and on_card.meter == "cuda"
    assert estimated.prescreen_for(True, Replay(), 13 * MiB, "sim").overhead == GpuOverhead.none()
    assert estimated.prescreen_for(False, Replay(), 24 * 2**30, "cuda") is None


def test_a_point_well_over_the_budget_is_an_estimated_out_of_memory(demo_estimate):
    request, result = demo_estimate
    peaks = {name: stats["peak_live"] for name, stats in result["phase_stats"].items()}
    budget = int(peaks["train"] / 1.3)  # train is well over; every other phase is far under
    assert max(p for name, p in peaks.items() if name != "train") < budget
    screen = estimated.Prescreen(Replay(result), budget, "sim", GpuOverhead.none())
    outcome = screen.outcome(request, "base")
    assert (outcome["status"], outcome["phase"], outcome["estimated"]) == ("oom", "train", True)
    assert outcome["phases"] == peaks and outcome["peak_bytes"] == peaks["train"]
    assert outcome["error"].endswith("1.30 x the budget: decided without a probe (pre-screen at 1.25 x)")
    estimated_request = screen.runner.requests[0]
    assert estimated_request["meter"] == "estimate" and estimated_request["prime_optimizer"] is True


def test_a_point_near_the_budget_is_left_to_a_probe(demo_estimate):
    request, result = demo_estimate
    train = result["phase_stats"]["train"]["peak_live"]
    screen = estimated.Prescreen(Replay(result), int(train / 1.2), "sim", GpuOverhead.none())
    assert screen.outcome(request, "quality") is None


def test_a_confirmation_or_a_failed_estimate_decides_nothing(demo_estimate):
    request, _ = demo_estimate
    never = Replay()
    assert estimated.Prescreen(never, MiB, "sim", GpuOverhead.none()).outcome(request, "confirm") is None
    assert never.requests == []  # not even estimated
    failed = Replay({"status": "error", "error": "RuntimeError: boom", "phase_stats": {}})
    assert estimated.Prescreen(failed, MiB, "sim", GpuOverhead.none()).outcome(request, "base") is None


@pytest.mark.slow
def test_a_prescreened_search_records_estimates_that_resume_reads_back(workdir):
    done = run_cli("search", "configs/demo.yaml", "--vram", "10MiB", "--prescreen", "--json", cwd=workdir)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "fit" and summary["proven"]
    job = aitoolkit_job.load(workdir / "configs" / "demo.yaml")
    space = spaces.build(job)
    url = studies.storage_url("demo_flux_lora", workdir / "studies", None)
    study = optuna.load_study(study_name="demo_flux_lora", storage=url)
    estimated = [t for t in study.trials if t.user_attrs.get("estimated")]
    probed = [t for t in study.trials if t.user_attrs.get("status") in ("ok", "oom") and not t.user_attrs["estimated"]]
    assert estimated and probed  # the base is far over 10 MiB; the points near it were probed
    for trial in estimated:
        attrs = trial.user_attrs
        assert trial.state == optuna.trial.TrialState.PRUNED and attrs["status"] == "oom"
        assert attrs["phases"][attrs["phase"]] >= 1.25 * 10 * MiB and "decided without a probe" in attrs["error"]
    assert done.stderr.count("(estimated, not probed)") == len(estimated)

    # A real probe agrees with the first decision: out of memory, in the predicted phase.
    first = estimated[0].user_attrs
    real = probe.ProbeRunner(300).run(probe.request_for(space.apply(job, first["point"]), 4, "sim", 10 * MiB))
    assert (real["status"], real["phase"]) == ("oom", first["phase"])

    # Resuming reads the estimates back as the out-of-memory results they stand for.
    known = studies.load_knowledge(study, space, int(10 * MiB * 0.95))
    from_study = [r for r in known.results if r.extra["estimated"]]
    assert [r.trial for r in from_study] == [t.number for t in estimated]
    assert all(r.status == "oom" and r.verdict == "nofit" for r in from_study)
    again = run_cli("search", "configs/demo.yaml", "--vram", "10MiB", "--prescreen", "--json", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["best"] == summary["best"]
    assert len(optuna.load_study(study_name="demo_flux_lora", storage=url).trials) == len(study.trials)
