"""The estimate-guided plan (search.plan_guided) on the stand-in probe: it finds what the plan
without estimates finds, probes only where the estimate cannot decide, proves the winner with
probes, and widens its band when a probe disagrees with an estimate."""

import random

import pytest

from fitfinder import search
from fitfinder.search import planner
from tests.standin import MiB, make_space, outcome, phase_peaks, true_optimum


def estimates(error: float = 0.0, scale: float = 1.0, seed: int = 0):
    """The stand-in's peaks, each phase times a seeded factor within +-error, times scale."""
    def phases(point):
        key = tuple(sorted(point.items()))
        return {phase: int(peak * scale * (1 + random.Random(f"{seed}:{key}:{phase}").uniform(-error, error)))
                for phase, peak in phase_peaks(point).items()}
    return phases


def run_guided(space, budget: int, guide: search.Guide, max_probes: int = 60):
    known = search.Knowledge(space, int(budget * 0.95))
    steps = []

    def probe_step(step):
        steps.append((step.purpose, dict(step.point)))
        return known.add(search.result_from_probe(len(steps) - 1, step, outcome(step.point, budget)))

    proven, _ = search.drive(space, known, probe_step, 0, max_probes,
                             planner=lambda s, k: search.plan_guided(s, k, guide))
    return steps, known, proven


def _proven_by_probes(space, known, winner):
    """Every quality knob given up: its next level up (later knobs lightest) ruled out by a probe."""
    for row in search.explain(space, known, winner.point):
        knob = space.by_name[row["knob"]]
        if knob.role == "quality" and row["verdict"] == "given up":
            assert known.state(planner._next_up(space, winner.point, knob)) == search.NOFIT, row


@pytest.mark.parametrize("budget_mib", list(range(11, 101, 6)))
def test_guided_by_estimates_with_their_error_it_finds_the_optimum_with_few_probes(budget_mib):
    space, budget = make_space(), budget_mib * MiB
    steps, known, proven = run_guided(space, budget, search.Guide(estimates(error=0.05, seed=budget_mib), 0.06))
    winner = search.best(space, known)
    assert proven and (winner.point if winner else None) == true_optimum(space, budget)
    if winner is not None:
        assert known.confirmed(winner.point)
        _proven_by_probes(space, known, winner)
    assert len(steps) <= 8  # the plan without estimates: up to 20


@pytest.mark.parametrize("budget_mib", list(range(17, 101, 6)))
def test_where_the_band_cannot_decide_the_likely_winner_is_probed_and_proven_not_each_level(budget_mib):
    """A band wide enough to leave most points undecided (20%, the estimate within 2%): the plan
    does not bisect through them one probe a level; it probes the proof of the point the estimate
    names as the winner, then confirms that winner, and the answer is still the optimum."""
    space, budget = make_space(), budget_mib * MiB
    steps, known, proven = run_guided(space, budget, search.Guide(estimates(error=0.02, seed=budget_mib), 0.2))
    winner = search.best(space, known)
    assert proven and winner.point == true_optimum(space, budget)
    assert known.confirmed(winner.point)
    _proven_by_probes(space, known, winner)
    assert steps[0][0] in ("proof", "confirm") and "quality" not in [purpose for purpose, _ in steps]
    assert len(steps) <= 6  # one probe a level, as before: up to 7


def test_nothing_fits_is_proven_by_a_probe_of_the_lightest_point():
    space = make_space()
    steps, known, proven = run_guided(space, 5 * MiB, search.Guide(estimates(), 0.05))
    assert proven and search.best(space, known) is None
    assert steps == [("proof", space.lightest())]


def test_a_fitting_job_is_one_probe_its_confirmation():
    space = make_space()
    steps, _, _ = run_guided(space, 100 * MiB, search.Guide(estimates(), 0.05))
    assert steps == [("confirm", space.desired())]


def test_only_points_inside_the_band_and_the_proof_are_probed():
    space, budget = make_space(), 40 * MiB
    guide = search.Guide(estimates(), 0.05)
    steps, known, _ = run_guided(space, budget, guide)
    limit = known.limit_bytes
    for purpose, point in steps:
        peak = max(guide.phases(point).values())
        near = limit / 1.05 < peak < limit / 0.95
        assert near or purpose in ("confirm", "proof"), (purpose, space.describe(point), peak / limit)


def test_a_probe_that_disagrees_with_its_estimate_widens_the_band():
    space, budget = make_space(), 40 * MiB
    guide = search.Guide(estimates(scale=0.8), 0.05)  # every estimate 20% low: past the band
    steps, known, proven = run_guided(space, budget, guide)
    assert guide.band_for(known) == pytest.approx(1.5 * 0.25, rel=0.01)  # real/estimate - 1 = 1/0.8 - 1
    winner = search.best(space, known)
    assert proven and winner.point == true_optimum(space, budget)


def test_the_band_must_be_below_one():
    with pytest.raises(ValueError) as raised:
        search.Guide(estimates(), 1.0)
    assert str(raised.value) == "the estimate's error band must be in [0, 1) but got 1.0"


@pytest.mark.slow
def test_the_guided_demo_search_probes_the_winner_and_its_proof_only(tmp_path):
    import optuna

    from tests.conftest import DEMO, run_cli

    done = run_cli("search", str(DEMO), "--guided", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = [line.split("  fits")[0].split("  oom")[0]
              for line in done.stdout.splitlines() if line.startswith("trial")]
    assert trials == ["trial   0  confirm   buckets=[256,384,512] rank=16 gc=on batch=1",
                      "trial   1  proof     buckets=[256,384,512] rank=32 gc=on batch=1"]
    assert "  oom in train  " in done.stdout.splitlines()[2]
    assert "best: buckets=[256,384,512] rank=16 gc=on batch=1  peak 12.3 MiB of 13.2 MiB  (2 probes)" in done.stdout
    study = optuna.load_study(study_name="demo_flux_lora", storage=f"sqlite:///{tmp_path}/studies/demo_flux_lora.db")
    for trial in study.trials:  # the estimate matches the sim meter: no disagreement, recorded as such
        assert trial.user_attrs["estimate_error"] == 0.0 and trial.user_attrs["estimate_disagrees"] is False
        assert set(trial.user_attrs["estimated_phases"]) == {"load", "text_encoder", "latents", "sample", "train",
                                                            "last_sample"}
