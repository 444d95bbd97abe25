"""The plan, step by step, against a stand-in probe whose memory is a known function of the knobs.

The stand-in (tests/standin.py) is the one place a probe is simulated: these tests are about
which points the search asks for, not about measuring memory.
"""

import pytest

from fitfinder import search
from fitfinder.search import planner
from tests.standin import (DEMO_SHARES, JOB, MiB, failing_step, first_step_peak, make_space, outcome, probe_time,
                           run_plan, simulate_workers, true_optimum)


def _changed(space, before, after):
    """The knobs that differ between two points, as name -> (old, new)."""
    return {k: (before[k], after[k]) for k in space.names if before[k] != after[k]}


@pytest.mark.parametrize("budget_mib", list(range(11, 101, 3)))
def test_the_plan_finds_the_brute_force_optimum_with_few_probes(budget_mib):
    space = make_space()
    steps, known, decided, proven = run_plan(space, budget_mib * MiB)
    optimum = true_optimum(space, budget_mib * MiB)
    winner = search.best(space, known)
    assert proven
    assert (winner.point if winner else None) == optimum
    assert len(steps) <= 20  # of 10,368 points
    if winner is not None:
        assert known.confirmed(winner.point) and steps[-1] == ("confirm", winner.point)


def test_a_fitting_base_is_confirmed_and_nothing_else_probed():
    space = make_space()
    steps, _, _, _ = run_plan(space, 100 * MiB)
    assert steps == [("base", space.desired()), ("confirm", space.desired())]


def test_train_oom_rolls_back_checkpointing_and_batch_then_escalates_one_step_at_a_time():
    space = make_space()
    steps, known, _, _ = run_plan(space, 45 * MiB)
    desired = space.desired()
    purposes = [purpose for purpose, _ in steps]
    assert purposes == ["base", "rollback"] + ["speed"] * 7 + ["confirm"]
    assert known.results[0].phase == "train"
    assert _changed(space, desired, steps[1][1]) == {"gradient_checkpointing": (False, True), "batch": (4, 1)}
    # Escalation from the lightest speed setting: the batch first, one step at a time, then
    # checkpointing off, then offload off, each on its own before any two together.
    escalations = [_changed(space, steps[1][1], point) for _, point in steps[2:9]]
    assert escalations == [
        {"batch": (1, 2), "low_vram": (False, True)},
        {"batch": (1, 4), "low_vram": (False, True)},
        {"gradient_checkpointing": (True, False), "low_vram": (False, True)},
        {"gradient_checkpointing": (True, False), "batch": (1, 2), "low_vram": (False, True)},
        {"batch": (1, 2)},
        {"batch": (1, 4)},
        {"gradient_checkpointing": (True, False)},
    ]
    winner = search.best(space, known)
    assert winner.point == true_optimum(space, 45 * MiB)


def test_load_oom_rolls_back_offload_and_encoders_then_quantization():
    space = make_space()
    steps, known, _, _ = run_plan(space, 20 * MiB)
    desired = space.desired()
    assert known.results[0].phase == "load" and known.results[1].phase == "load"
    assert _changed(space, desired, steps[1][1]) == {"text_encoder": ("keep", "cache"), "low_vram": (False, True)}
    assert _changed(space, steps[1][1], steps[2][1]) == {"quantize": ("none", "4bit")}
    # the quantization rollback then failed in train: checkpointing on and batch 1 come next
    assert known.results[2].phase == "train"
    assert _changed(space, steps[2][1], steps[3][1]) == {"gradient_checkpointing": (False, True), "batch": (4, 1)}


def test_sample_oom_turns_sampling_off_first():
    job = JOB.replace("batch_size: 4", "batch_size: 1").replace("gradient_checkpointing: false",
                                                                 "gradient_checkpointing: true")
    space = make_space(job)
    budget = 38 * MiB
    assert outcome(space.desired(), budget)["phase"] == "sample"
    steps, known, _, _ = run_plan(space, budget)
    assert _changed(space, space.desired(), steps[1][1]) == {"sampling": (True, False)}
    assert search.best(space, known).point == true_optimum(space, budget)


def test_points_heavier_than_an_oom_in_a_phase_are_decided_not_probed():
    space = make_space()
    steps, known, decided, _ = run_plan(space, 20 * MiB)
    probed = {space.key(p) for _, p in steps}
    assert decided
    for point, trial in decided:
        assert space.key(point) not in probed
        failed = known.results[trial]
        assert failed.verdict == search.NOFIT
        assert any(space.heavier_or_equal(point, failed.point, phase) for phase in failed.failed_phases)


def test_an_oom_in_one_phase_says_nothing_about_knobs_that_phase_does_not_use():
    space = make_space()
    known = search.Knowledge(space, 30 * MiB)
    base = space.desired()
    known.add(search.Result(trial=0, point=base, status="oom", phase="load", phases={"load": 40 * MiB}))
    heavier_train = {**base, "batch": 4, "gradient_checkpointing": False}
    lighter_load = {**base, "low_vram": True}
    assert known.state(heavier_train) == search.NOFIT  # same load knobs: same load
    assert known.state({**base, "gradient_checkpointing": True, "batch": 1}) == search.NOFIT
    assert known.state(lighter_load) is None  # offload changes the load phase: unknown


def test_bisection_bounds_lean_on_what_is_known():
    space = make_space()
    rank = space.by_name["rank"]
    known = search.Knowledge(space, 30 * MiB)
    light = space.lightest()
    known.add(search.Result(trial=0, point={**light, "rank": 8}, status="ok", peak_bytes=10 * MiB, phases={}))
    known.add(search.Result(trial=1, point={**light, "rank": 32}, status="oom", phase="train", phases={}))
    line = lambda level: {**light, "rank": rank.candidates[level]}  # noqa: E731
    assert planner._bounds(known, line, 3) == (1, 3)  # 8 fits (and 4 with it); 32 does not; 16 unknown


def test_a_failed_confirmation_confirms_the_next_best_instead():
    space = make_space()
    budget = 45 * MiB
    known = search.Knowledge(space, int(budget * 0.95))
    steps = []

    def probe_step(step):
        steps.append((step.purpose, dict(step.point)))
        result = outcome(step.point, budget)
        if step.purpose == "confirm" and sum(p == "confirm" for p, _ in steps) == 1:
            result = {**result, "status": "oom", "phase": "train"}  # the long run met a peak the short one missed
        return known.add(search.result_from_probe(len(steps) - 1, step, result))

    proven, _ = search.drive(space, known, probe_step, 0, 100)
    confirms = [point for purpose, point in steps if purpose == "confirm"]
    assert proven and len(confirms) == 2 and confirms[0] != confirms[1]
    winner = search.best(space, known)
    assert winner.point == confirms[1] and known.confirmed(winner.point)
    assert known.state(confirms[0]) == search.NOFIT


def test_nothing_fits_ends_without_a_winner():
    space = make_space()
    steps, known, _, proven = run_plan(space, 12 * MiB)
    assert proven and search.best(space, known) is None
    # The load phase fails even with every load knob at its lightest, and buckets do not change
    # the load: that one probe rules out the whole space, the lightest point included.
    assert [purpose for purpose, _ in steps] == ["base", "rollback", "rollback", "quality"]
    assert steps[-1][1] == {**space.lightest(), "buckets": space.by_name["buckets"].desired}
    state, decider = known.decider(space.lightest())
    assert state == search.NOFIT and decider.trial == 3 and decider.phase == "load"


def _run_with_a_point_failing_twice(space, budget: int, purpose: str):
    """The plan with the stand-in probe, where the first point probed for `purpose` fails twice
    (a crash: no memory fact), as a point that cannot be probed does."""
    known = search.Knowledge(space, int(budget * 0.95))
    steps, failing = [], []

    def probe_step(step):
        steps.append((step.purpose, dict(step.point)))
        if step.purpose == purpose and not failing:
            failing.append(space.key(step.point))
        if space.key(step.point) in failing and sum(space.key(p) == failing[0] for _, p in steps) <= 2:
            result = {"status": "error", "phase": None, "phases": {}, "peak_bytes": None, "error": "killed by SIGABRT"}
        else:
            result = outcome(step.point, budget)
        return known.add(search.result_from_probe(len(steps) - 1, step, result))

    finished, _ = search.drive(space, known, probe_step, 0, 200)
    return steps, known, finished


@pytest.mark.parametrize("budget_mib", list(range(11, 101, 3)))
def test_a_quality_point_that_cannot_be_probed_is_unknown_not_infeasible(budget_mib):
    """Issue 35: the first quality point fails twice. Nothing heavier is ruled out by it: its
    level is settled through a point with a later knob one step up (planner._level_stand_in),
    whose fit shows the failed point fits too, so the plan finds the brute-force optimum. Only
    where every such point fails (32 MiB here) does the level stay unknown: then the failed trial
    is named as what gave it up, and the answer is proven only around it. (Before, the level was
    given up: 6 of these 30 budgets ended on a worse winner, 12 proven only around the point.)"""
    space = make_space()
    steps, known, finished = _run_with_a_point_failing_twice(space, budget_mib * MiB, "quality")
    optimum = true_optimum(space, budget_mib * MiB)
    winner = search.best(space, known)
    assert finished and (winner.point if winner else None) == optimum
    failed = next((point for purpose, point in steps if purpose == "quality"), None)
    assert [r.point for r in known.excluded()] == ([failed] if budget_mib == 32 else [])
    if known.excluded():
        rows = search.explain(space, known, winner.point)
        assert known.excluded()[0].trial in [row["forced_by"] for row in rows]


def test_a_speed_step_that_cannot_be_probed_is_stepped_over_and_named():
    """The first speed point (batch 2 at 17 MiB) fails twice: the climb goes on to batch 4, which
    runs out of memory; batch 2, the true optimum, stays unknown, so the winner is batch 1 and the
    explanation names the failed trial as what gave up batch, not a trial that ran out of memory."""
    space = make_space()
    steps, known, finished = _run_with_a_point_failing_twice(space, 17 * MiB, "speed")
    excluded = known.excluded()
    winner = search.best(space, known)
    assert finished and [r.point["batch"] for r in excluded] == [2]
    assert true_optimum(space, 17 * MiB) == excluded[0].point
    assert [p["batch"] for purpose, p in steps if purpose == "speed"][:3] == [2, 2, 4]
    row = next(r for r in search.explain(space, known, winner.point) if r["knob"] == "batch")
    assert (row["chosen"], row["verdict"], row["forced_by"]) == (1, "given up", excluded[0].trial)


def test_the_trial_cap_stops_the_plan_unproven():
    space = make_space()
    steps, known, _, proven = run_plan(space, 20 * MiB, max_probes=3)
    assert not proven and len(steps) == 3


def test_explanation_names_the_trial_that_forced_each_loss():
    space = make_space()
    steps, known, _, _ = run_plan(space, 20 * MiB)
    winner = search.best(space, known)
    rows = {row["knob"]: row for row in search.explain(space, known, winner.point)}
    assert rows["buckets"]["verdict"] == "kept" and rows["buckets"]["forced_by"] is None
    assert rows["quantize"]["verdict"] == "given up"
    forced = known.results[rows["quantize"]["forced_by"]]
    assert forced.verdict == search.NOFIT and forced.point["quantize"] == "none"
    assert rows["text_encoder"]["verdict"] == "given up" and rows["text_encoder"]["forced_by"] is not None


@pytest.mark.parametrize("budget_mib", [16, 20, 28, 45])
def test_parallel_workers_probe_no_point_twice_and_find_the_same_winner_sooner(budget_mib):
    space = make_space()
    budget = budget_mib * MiB
    alone, _, winner_alone = simulate_workers(space, budget, 1)
    together, probed, winner = simulate_workers(space, budget, 2)
    keys = [(purpose == "confirm", space.key(point)) for purpose, point in probed]
    assert len(keys) == len(set(keys))
    assert winner.point == winner_alone.point == true_optimum(space, budget)
    assert together < alone


def test_quantization_is_not_ordered_while_loading():
    """A quantized base arrives in full precision first: an OOM while loading an 8-bit base says
    nothing about loading it unquantized, only about other points quantized the same way."""
    space = make_space()
    known = search.Knowledge(space, 30 * MiB)
    eight_bit = {**space.desired(), "quantize": "8bit", "low_vram": False}
    known.add(search.Result(trial=0, point=eight_bit, status="oom", phase="load", phases={"load": 40 * MiB}))
    assert known.state({**eight_bit, "rank": 4}) is None  # rank changes the load: unknown
    assert known.state({**eight_bit, "batch": 1, "gradient_checkpointing": True}) == search.NOFIT
    assert known.state({**eight_bit, "quantize": "none"}) is None  # heavier in the chain, not while loading
    assert known.state({**eight_bit, "quantize": "4bit"}) is None


def test_probes_that_each_fit_one_phase_prove_a_point_they_never_ran():
    """Each phase depends only on its own knobs: a probe light on previews and heavy on training,
    and one the other way round, together prove the point heavy on both -- if each phase of it
    has a witness."""
    space = make_space()
    known = search.Knowledge(space, 100 * MiB)
    light = {**space.lightest(), "sampling": True}
    trains_big = {**light, "buckets": space.by_name["buckets"].desired, "batch": 4}
    samples_big = {**light, "sample_size": "1024x1024"}
    both = {**light, "buckets": trains_big["buckets"], "batch": 4, "sample_size": "1024x1024"}
    peaks = {phase: 10 * MiB for phase in ("load", "text_encoder", "latents", "train")}
    known.add(search.Result(trial=0, point=trains_big, status="ok", peak_bytes=10 * MiB, phases=peaks))
    assert known.state(both) is None  # nobody has sampled large previews yet
    known.add(search.Result(trial=1, point=samples_big, status="ok", peak_bytes=10 * MiB,
                            phases={**peaks, "sample": 10 * MiB, "last_sample": 10 * MiB}))
    state, witness = known.decider(both)
    assert state == search.FIT and witness.trial == 1
    assert known.state({**both, "gradient_checkpointing": False}) is None  # no witness for that training


def test_speeds_within_the_timing_noise_are_a_tie_won_by_the_most_memory_to_spare():
    space = make_space()
    known = search.Knowledge(space, 100 * MiB)
    light = {**space.desired(), "gradient_checkpointing": True}
    heavy = {**space.desired(), "gradient_checkpointing": False}

    def add(trial, point, seconds, peak, noise):
        result = search.Result(trial=trial, point=point, status="ok", peak_bytes=peak, seconds_per_sample=seconds,
                               phases={"train": peak}, extra={"timing_noise": noise})
        known.add(result)

    add(0, heavy, 1.00, 90 * MiB, 0.0)
    add(1, light, 1.02, 60 * MiB, 0.0)  # 2% slower: within the 3% floor
    assert search.best(space, known).point == light
    known = search.Knowledge(space, 100 * MiB)
    add(0, heavy, 1.00, 90 * MiB, 0.0)
    add(1, light, 1.10, 60 * MiB, 0.0)  # 10% slower, and the timings were steady: speed wins
    assert search.best(space, known).point == heavy
    known = search.Knowledge(space, 100 * MiB)
    add(0, heavy, 1.00, 90 * MiB, 0.08)
    add(1, light, 1.07, 60 * MiB, 0.0)  # the fast probe's timing was noisy by 8%: a tie
    assert search.best(space, known).point == light
    known = search.Knowledge(space, 100 * MiB)
    add(0, heavy, 1.00, 90 * MiB, 0.40)
    add(1, light, 1.20, 60 * MiB, 0.0)  # however noisy, a tie never gives up more than 10% of speed
    assert search.best(space, known).point == heavy


def test_four_workers_finish_in_under_half_the_time_with_few_more_probes_and_the_same_winners():
    """The plan's own parallelism (benchmarks/scaleout.py, part 2): over the 30 budgets, one
    worker's plan is the plan's, and four workers speculating on each other's pending probes
    (plan_around) take 2.18x less time than one on the flat clock for at most 1.5x the probes, probing no point
    twice and finding the brute-force optimum every time."""
    space = make_space()
    budgets = [mib * MiB for mib in range(11, 101, 3)]
    alone = [simulate_workers(space, budget, 1) for budget in budgets]
    four = [simulate_workers(space, budget, 4) for budget in budgets]
    assert sum(t for t, _, _ in alone) == 356 and sum(len(p) for _, p, _ in alone) == 300
    assert sum(t for t, _, _ in four) * 2.18 <= 356  # 163: the earlier speculation took 174
    assert sum(len(p) for _, p, _ in four) <= 1.5 * 300  # 372: the earlier speculation probed 413
    for budget, (_, probed, winner) in zip(budgets, four):
        keys = [(purpose == "confirm", space.key(point)) for purpose, point in probed]
        assert len(keys) == len(set(keys))
        assert (winner.point if winner else None) == true_optimum(space, budget)


def test_the_recipe_meets_its_heaviest_shape_at_the_same_steps_in_a_probe_and_a_confirmation():
    """What the stand-in's clock (probe_time, failing_step) rests on: shape_schedule starts with
    the heaviest bucket and cycles through every bucket, the heaviest included, so a probe and
    its confirmation (3x the steps) meet it at the same steps until the short one's middle: one
    that runs out of memory does so at the same step in both."""
    from fitfinder.probe.recipe import shape_schedule

    shapes = [[512, 1], [1024, 1], [768, 1]]
    short, long = shape_schedule(shapes, 20), shape_schedule(shapes, 60)
    assert short[:10] == long[:10]
    assert [step for step in range(10) if short[step] == (1024, 1)] == [0, 3, 6, 9]
    assert short[10] == short[19] == long[30] == long[59] == (1024, 1)  # and at the middle and last step


def test_a_confirmation_that_runs_out_of_memory_costs_what_the_short_probe_of_its_point_costs():
    space = make_space()
    desired, budget = space.desired(), 30 * MiB
    assert outcome(desired, budget)["phase"] == "load"  # 24 + 9 + 1 MiB of weights and encoders
    assert probe_time(desired, budget, 3) == probe_time(desired, budget, 1) == DEMO_SHARES["load"]
    light = {**desired, "quantize": "4bit", "low_vram": True, "text_encoder": "cache", "sampling": False}
    at_first_step = {**light, "gradient_checkpointing": False, "batch": 4}
    budget = 40 * MiB
    assert outcome(at_first_step, budget)["phase"] == "train" and first_step_peak(at_first_step) > budget
    assert failing_step(at_first_step, budget, 20) == 0
    assert probe_time(at_first_step, budget, 3) == probe_time(at_first_step, budget, 1) < 0.2
    with_state = {**light, "batch": 1}  # accumulation 4: the optimizer's state exists from step 4
    budget = int((first_step_peak(with_state) + outcome(with_state, 100 * MiB)["phases"]["train"]) / 2)
    assert outcome(with_state, budget)["phase"] == "train" and first_step_peak(with_state) <= budget
    assert failing_step(with_state, budget, 20) == failing_step(with_state, budget, 60) == 6
    assert probe_time(with_state, budget, 3) == probe_time(with_state, budget, 1) < 0.5
    sampling = {**light, "sampling": True}  # every phase runs
    assert probe_time(sampling, 100 * MiB, 1) == pytest.approx(1) and 2.7 < probe_time(sampling, 100 * MiB, 3) < 2.9
    assert probe_time(desired, budget, 3, shares=None) == 3  # the flat clock: whatever happens


@pytest.mark.parametrize("speculation", ["confirm-winner", "confirm-base"])
@pytest.mark.parametrize("budget_mib", [20, 50, 95])
def test_workers_confirming_on_guesses_find_the_optimum_and_probe_no_point_twice(speculation, budget_mib):
    space = make_space()
    budget = budget_mib * MiB
    _, probed, winner = simulate_workers(space, budget, 4, speculation, clock="demo")
    keys = [(purpose == "confirm", space.key(point)) for purpose, point in probed]
    assert len(keys) == len(set(keys))
    assert winner.point == true_optimum(space, budget)
    if speculation == "confirm-base":
        assert ("confirm", space.desired()) in probed
