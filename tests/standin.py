"""A stand-in probe whose memory is a known function of the knobs, for exact tests of the plan.

Each phase's peak depends only on the knobs that space.py says it depends on, and grows with
each of them, as the real probe's memory does -- but for quantization while loading, where the
full-precision weights arrive before they shrink (space.py marks that phase unordered); seconds
per step fall with a larger batch and rise with checkpointing and offload. Over the budget, a
phase "runs out of memory" and the later phases do not run, as in a real probe.
"""

from __future__ import annotations

from dataclasses import replace

from fitfinder import search, space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.search.planner import CONFIRM_FACTOR, _among, _open_speed, _with_guess

MiB = 2**20

JOB = """
job: extension
config:
  name: standin
  process:
    - network: {type: lora, linear: 32, linear_alpha: 16}
      datasets:
        - folder_path: /data
          resolution: [512, 768, 1024]
      train:
        batch_size: 4
        gradient_accumulation: 1
        gradient_checkpointing: false
        optimizer: adamw
        dtype: bf16
      model: {name_or_path: fitfinder/flux-tiny, is_flux: true}
      sample: {width: 1024, height: 1024, sample_steps: 20}
fitfinder: {weights: random}
"""


def make_space(text: str = JOB) -> spaces.Space:
    """The job's space, its low_vram claiming every phase: the stand-in's low_vram lightens the weights
    everywhere (as Wan 2.2's keeps one expert on the device), where FLUX.1's moves only the load."""
    space = spaces.build(aitoolkit_job.loads(text, "standin.yaml"))
    knobs = [replace(knob, phases=frozenset(spaces.PHASES)) if knob.name == "low_vram" else knob
             for knob in space.knobs]
    return spaces.Space(knobs, space.job)


def phase_peaks(point: dict) -> dict[str, int]:
    """Peak bytes of every phase that runs at `point` (MiB-scale numbers)."""
    weights = {"none": 24, "8bit": 13, "4bit": 7}[point.get("quantize", "none")]
    if point.get("low_vram", False):
        weights *= 0.6
    encoder = 9 if point.get("text_encoder", "keep") == "keep" else 0
    lora = point.get("rank", 32) / 32
    resident = weights + encoder + lora
    largest = max(int(r) for r in str(point.get("buckets", "1024")).split(","))
    pixels = (largest / 1024) ** 2
    batch = point.get("batch", 1)
    activations = pixels * batch * (2.5 if point.get("gradient_checkpointing", True) else 12)
    optimizer = lora * (2 if point.get("optimizer", "adamw") == "adamw" else 0.5)
    sample_side = int(str(point.get("sample_size", "1024x1024")).split("x")[0]) / 1024
    # Quantizing on the device means the full-precision weights arrive first: no lighter to load
    # (with low_vram they are quantized on the host).
    quantized_on_device = point.get("quantize", "none") != "none" and not point.get("low_vram", False)
    arriving = 24 if quantized_on_device else 0
    peaks = {
        # encoders load even when cached later
        "load": max(resident, arriving + encoder + lora) + (9 if encoder == 0 else 0),
        "text_encoder": resident + 9 * (encoder == 0) + 0.5 * batch,
        "latents": resident + 1.5 * pixels * batch,
        "train": resident + activations + optimizer + lora,
    }
    if point.get("sampling", True):
        peaks["sample"] = resident + 6 * sample_side**2
        peaks["last_sample"] = resident + optimizer + 6 * sample_side**2
    order = ("load", "text_encoder", "latents", "sample", "train", "last_sample")
    return {p: int(peaks[p] * MiB) for p in order if p in peaks}


def optimizer_state(point: dict) -> float:
    """The optimizer's state for the LoRA, in MiB (part of the train peak above)."""
    return point.get("rank", 32) / 32 * (2 if point.get("optimizer", "adamw") == "adamw" else 0.5)


def first_step_peak(point: dict) -> int:
    """The train phase's peak at its first step: the heaviest shape before the optimizer has any
    state (recipe.py `_train`: the optimizer first steps at the end of step 0)."""
    return phase_peaks(point)["train"] - int(optimizer_state(point) * MiB)


# The share of a probe's time each phase takes: the demo's own probe, `fitfinder probe
# configs/demo.yaml --vram 1GiB --json` (phase_stats seconds, 20 steps, sim meter, 2026-12-01):
# load 0.76 s, text encoders 0.15, latents 0.18, first preview 0.17, train 11.43, last preview 0.10.
DEMO_SHARES = {"load": 0.060, "text_encoder": 0.012, "latents": 0.014, "sample": 0.013, "train": 0.893,
               "last_sample": 0.008}
# A card loading a large model from disk: loading as long as the 20 training steps (a FLUX.1-dev
# probe on a card is "a model load plus a short training", issue 17).
CARD_SHARES = {"load": 0.40, "text_encoder": 0.04, "latents": 0.04, "sample": 0.06, "train": 0.40,
               "last_sample": 0.06}
CLOCKS = {"flat": None, "demo": DEMO_SHARES, "card": CARD_SHARES}


def probe_time(point: dict, budget: int, steps_factor: int = 1, shares: dict | None = DEMO_SHARES) -> float:
    """How long the probe of `point` runs, a short probe that runs to its end taking 1: what the
    recipe runs before it ends (recipe.py `_recipe`, `_train`, `shape_schedule`).

    The phases before training take what they take whatever the steps; training takes its steps
    (`steps_factor` times a short probe's). An OOM ends the probe where it happens: in a phase
    before training, at its end (charged whole); in training, at `failing_step`. So a
    confirmation that runs out of memory costs what the short probe of its point costs when
    that runs out. shares=None is the flat clock: 1 a probe, 3 a confirmation, whatever happens.
    """
    if shares is None:
        return float(steps_factor)
    ran = outcome(point, budget)
    elapsed = 0.0
    for phase in ran["phases"]:
        if phase != "train":
            elapsed += shares[phase]
            continue
        if ran["phase"] != "train":
            elapsed += shares["train"] * steps_factor
            continue
        steps = 20 * steps_factor  # the probe's steps: settings.probe_steps, 20 by default
        elapsed += shares["train"] * steps_factor * (failing_step(point, budget, steps) + 1) / steps
    return round(elapsed, 6)


EFFECTIVE_BATCH = 4  # JOB's batch_size x gradient_accumulation: space.apply keeps it (accumulation = 4 / batch)


def failing_step(point: dict, budget: int, steps: int) -> int:
    """The training step a probe of `steps` steps runs out of memory at (recipe.py `_train`, over
    `shape_schedule`): the first, if the heaviest shape alone does not fit; else the first step
    after the optimizer's first update (every `accumulation` micro-steps, and before the middle
    step) that meets the heaviest shape again -- the schedule cycles through every shape, the
    heaviest included, between its first, middle and last step. The same step in a short probe
    and in its confirmation, as long as it comes before the short probe's middle step."""
    from fitfinder.probe.recipe import shape_schedule

    if first_step_peak(point) > budget:
        return 0
    accumulation = max(1, EFFECTIVE_BATCH // point.get("batch", 1))
    first_update = min(accumulation - 1, steps // 2 - 1)
    schedule = shape_schedule([[int(side), 1] for side in str(point.get("buckets", "1024")).split(",")], steps)
    return next(step for step in range(first_update + 1, steps) if schedule[step] == schedule[0])


def seconds_per_step(point: dict) -> float:
    batch = point.get("batch", 1)
    slow = (1.35 if point.get("gradient_checkpointing", True) else 1.0) * (1.5 if point.get("low_vram") else 1.0)
    return round(0.1 * batch**0.6 * slow, 6)


def outcome(point: dict, budget: int) -> dict:
    """What the real probe would answer at this budget."""
    peaks = {}
    for phase, peak in phase_peaks(point).items():
        peaks[phase] = peak
        if peak > budget:
            return {"status": "oom", "phase": phase, "phases": peaks, "peak_bytes": peak,
                    "seconds_per_step": None}
    return {"status": "ok", "phase": None, "phases": peaks, "peak_bytes": max(peaks.values()),
            "seconds_per_step": seconds_per_step(point)}


def run_plan(space: spaces.Space, budget: int, margin: float = 0.05, max_probes: int = 200):
    """Drive the real plan with the stand-in probe; return (steps taken, knowledge, decided, proven)."""
    known = search.Knowledge(space, int(budget * (1 - margin)))
    steps, decided = [], []

    def probe_step(step):
        steps.append((step.purpose, dict(step.point)))
        return known.add(search.result_from_probe(len(steps) - 1, step, outcome(step.point, budget)))

    proven, _ = search.drive(space, known, probe_step, 0, max_probes, lambda p, r: decided.append((p, r.trial)))
    return steps, known, decided, proven


def true_optimum(space: spaces.Space, budget: int, margin: float = 0.05):
    """Brute force: the best quality that fits, then the fewest seconds per sample; speeds within
    the search's noise floor of the fastest are a tie, won by the lowest peak."""
    from fitfinder.search.planner import SPEED_NOISE_FLOOR

    limit = int(budget * (1 - margin))
    feasible = [p for p in space.points() if outcome(p, budget)["status"] == "ok"
                and outcome(p, budget)["peak_bytes"] <= limit]
    if not feasible:
        return None
    top = max(space.quality_key(p) for p in feasible)
    best_quality = [p for p in feasible if space.quality_key(p) == top]
    fastest = min(seconds_per_step(p) / p.get("batch", 1) for p in best_quality)
    ties = [p for p in best_quality if seconds_per_step(p) / p.get("batch", 1) <= fastest * (1 + SPEED_NOISE_FLOOR)]
    return min(ties, key=lambda p: (outcome(p, budget)["peak_bytes"], seconds_per_step(p) / p.get("batch", 1)))


# -- the speculations measured against the search's (benchmarks/scaleout.py, docs/scaleout.md) ----
def _plan_around_halving(space: spaces.Space, known: search.Knowledge, pending: list, depth: int = 3) -> search.Step:
    """The earlier speculation: plan as if the pending point the plan asks for fit, then as if it
    failed (in every phase), `depth` outcomes deep, and take the first answer nobody probes yet."""
    step = search.plan(space, known)
    if step.point is None or not _among(space, step.point, pending):
        return step
    if depth == 0 or step.purpose == "confirm":
        return search.Step(None)  # confirmations rarely fail: waiting beats speculating on one
    guess = pending[[space.key(p) for p in pending].index(space.key(step.point))]
    rest = [p for p in pending if p is not guess]
    for verdict in ("ok", "oom"):
        branch = _with_guess(space, known, guess, verdict)
        nested = _plan_around_halving(space, branch, rest, depth - 1)
        if nested.point is not None and not _among(space, nested.point, pending):
            return search.Step(nested.point, nested.purpose, nested.steps_factor)
    return search.Step(None)


def _speed_step(point: dict, confirm: bool) -> search.Step:
    """A speed setting to probe beside others; with `confirm` (the heaviest one still open, the
    likeliest winner) as a confirmation at once, so that if it fits and wins the search need not
    wait for a confirmation after it."""
    return search.Step(point, "confirm", CONFIRM_FACTOR) if confirm else search.Step(point, "speed")


def _winner_confirming_choices(space: spaces.Space, known: search.Knowledge, step: search.Step):
    """planner._choices, but a confirmation a branch of the guesses asks for is taken too, and the
    heaviest open speed setting is probed as a confirmation ("confirm-winner")."""
    if step.point is None:
        return
    if step.purpose != "speed":
        yield search.Step(step.point, step.purpose, step.steps_factor)
        return
    open_speed = _open_speed(space, known)
    yield _speed_step(step.point, open_speed[:1] == [step.point])
    for rank, point in enumerate(open_speed):
        yield _speed_step(point, rank == 0)


def _plan_around_confirming_winner(space: spaces.Space, known: search.Knowledge, pending: list,
                                   depth: int = 3) -> search.Step:
    return search.plan_around(space, known, pending, depth, choices=_winner_confirming_choices)


def _plan_around_confirming_base(space: spaces.Space, known: search.Knowledge, pending: list,
                                 depth: int = 3) -> search.Step:
    """plan_around, but the desired point's confirmation starts beside its base probe
    ("confirm-base"): if the job fits as written the search ends with it. A point pending twice is
    the base and its confirmation (pending points carry no purpose): then there is nothing to add."""
    step = search.plan(space, known)
    if step.point is None or step.purpose != "base" or not _among(space, step.point, pending):
        return search.plan_around(space, known, pending, depth)
    if sum(space.key(point) == space.key(step.point) for point in pending) > 1:
        return search.Step(None)
    return search.Step(step.point, "confirm", CONFIRM_FACTOR)


# The search's plan_around ("kary"), and the speculations kept to measure against it: "halving",
# the one before it, and two that start confirmations on guesses (docs/scaleout.md has the figures).
SPECULATIONS = {"kary": search.plan_around, "halving": _plan_around_halving,
                "confirm-winner": _plan_around_confirming_winner, "confirm-base": _plan_around_confirming_base}


def simulate_workers(space: spaces.Space, budget: int, workers: int, speculation: str = "kary",
                     clock: str = "flat"):
    """Workers sharing one plan: each free worker asks the `speculation` (SPECULATIONS: plan_around,
    or one measured against it) for a point nobody probes yet. On the "flat" clock a probe takes 1
    and a confirmation 3 whatever happens; on "demo" and "card" each takes what its recipe runs
    before it ends (probe_time).
    Returns (time to the end, the probed (purpose, point) list, the winner)."""
    import heapq

    if speculation not in SPECULATIONS:
        raise ValueError(f"speculation must be one of {tuple(SPECULATIONS)} but got {speculation!r}")
    plan_around = SPECULATIONS[speculation]
    known = search.Knowledge(space, int(budget * 0.95))
    now, events, pending, probed, idle, number = 0.0, [], [], [], list(range(workers)), 0
    while True:
        while idle:
            step = plan_around(space, known, [point for _, point in pending])
            if step.point is None:
                break
            idle.pop()
            number += 1
            duration = probe_time(step.point, budget, step.steps_factor, CLOCKS[clock])
            heapq.heappush(events, (now + duration, number, step))
            pending.append((number, step.point))
            probed.append((step.purpose, step.point))
        if not events:
            return now, probed, search.best(space, known)
        now, done, step = heapq.heappop(events)
        pending = [(n, p) for n, p in pending if n != done]
        known.add(search.result_from_probe(done, step, outcome(step.point, budget)))
        idle.append(done)
