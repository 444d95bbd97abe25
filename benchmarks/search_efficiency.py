"""How many probes each search strategy spends, and whether it finds the true optimum.

Every scenario is a tiny-model AI Toolkit job (flux, sdxl, wan21) and a simulated budget. Its
whole space is probed once with the real probe on the sim meter (the exhaustive grid, cached in
benchmarks/cache/), without a budget: the sim meter is exact and deterministic, so what a probe
would answer under any budget follows from the unbudgeted peaks -- the first phase whose peak
passes the budget is where it runs out of memory. `--verify N` re-runs N random points under
their budget for real and checks that claim.

Every strategy then searches the same grid, paying for each point it asks for with the probe
seconds the grid measured (an OOM pays up to its failing phase):

- grid:      probe everything (the ground truth).
- tpe:       plain Optuna TPE (OOM pruned, margin as a constraint), capped at fitfinder's 40 trials.
- binsearch: one knob at a time from the lightest point, doubling then bisecting each knob's
             level, like Lightning's batch-size `binsearch`.
- seeds:     the seeds' manual walk: roll back one move at a time in their order until it fits,
             then re-add one heavier setting at a time (bucket, sampling, batch / clips).
- fitfinder: fitfinder's own plan (search.plan), confirmation included.
- guided:    the plan on estimates (search.plan_guided), the estimate's error modelled
             (ModelledEstimates), confirmation included.

The true optimum is the best quality that fits, and among its points the one fitfinder's own
tie rule (search.best) picks from the medians of three timings; a strategy found it when its
winner has that quality and is within SPEED_TIE of the fastest of it.

    python benchmarks/search_efficiency.py [--json PATH] [--only flux] [--verify 5]
        [--strategies fitfinder,guided] [--estimate-error 0.05] [--estimate-bias 0.03]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fitfinder import probe, search, space as spaces  # noqa: E402
from fitfinder.trainers import aitoolkit_job  # noqa: E402

CACHE = ROOT / "benchmarks" / "cache"
# The ground truth's speeds are medians of three timings (Speeds), and on the CPU offloading
# costs no time at all: a winner of the optimum's quality counts as the optimum when its seconds
# per sample are within this share of the fastest. Exact matches are counted too.
SPEED_TIE = 0.10
GRID_STEPS = 4  # probe steps per grid point: peaks do not depend on it past 3 (largest shape at 0, mid, end)
MARGIN = 0.05
TRIAL_CAP = 40  # fitfinder's default --trials, also TPE's cap


# -- scenarios -------------------------------------------------------------------------------------
JOB = """
job: extension
config:
  name: bench
  process:
    - type: sd_trainer
      network: {{type: lora, linear: {rank}, linear_alpha: {rank}}}
      datasets:
        - folder_path: /data
          resolution: {resolution}
          num_frames: {frames}
          cache_latents_to_disk: true
      train:
        batch_size: {batch}
        gradient_accumulation: 1
        gradient_checkpointing: false
        optimizer: adamw
        lr: 0.0001
        dtype: fp32
      model: {{name_or_path: "fitfinder/{family}-tiny", arch: {arch}}}
      sample: {{width: {sample}, height: {sample}, num_frames: {sample_frames}, sample_steps: 20, guidance_scale: 5}}
fitfinder:
  weights: random
  candidates: {candidates}
"""


def _job(family: str, arch: str, resolution: str, rank: int, batch: int, sample: int, candidates: str,
         frames: int = 1, sample_frames: int = 1) -> str:
    return JOB.format(family=family, arch=arch, resolution=resolution, rank=rank, batch=batch, sample=sample,
                      candidates=candidates, frames=frames, sample_frames=sample_frames)


# Each desired point keeps six to eight knobs free, so its whole space can be probed (96-256
# points); the Wan jobs pin layer offloading off, so their spaces and the published figures stay
# those of before it was a knob. 8-bit quantization is left out: on toy widths bitsandbytes' int8 path keeps fp16
# copies of the activations that outweigh the weights it saves (it trains heavier than no
# quantization), which real widths do not; 4-bit is monotone here and stays in.
JOBS = {
    "flux-a": _job("flux", "flux", "[256, 384, 512]", 32, 4, 256,
                   "{rank: [8, 32], sampling: [true], sample_size: [128x128, 256x256], text_encoder: [keep], "
                   "low_vram: [false], quantize: [none]}"),
    "flux-b": _job("flux", "flux", "[256, 512]", 16, 2, 256,
                   "{rank: [4, 16], quantize: [4bit, none], optimizer: [adamw], sample_size: [256x256]}"),
    "sdxl-a": _job("sdxl", "sdxl", "[128, 256, 384]", 32, 2, 256,
                   "{rank: [8, 32], sample_size: [128x128, 256x256], optimizer: [adamw], text_encoder: [keep], "
                   "low_vram: [false], quantize: [none]}"),
    "sdxl-b": _job("sdxl", "sdxl", "[256, 384]", 16, 4, 256,
                   "{rank: [8, 16], sampling: [true], sample_size: [256x256], quantize: [none]}"),
    "wan21-a": _job("wan21", "wan21", "[48, 64]", 16, 2, 64,
                    "{rank: [8, 16], sampling: [true], text_encoder: [keep], optimizer: [adamw], "
                    "low_vram: [false], quantize: [none], layer_offloading: [0.0]}", frames=17, sample_frames=5),
    "wan22-a": _job("wan22", "wan22_14b", "[64]", 8, 1, 64,
                    "{optimizer: [adamw], quantize: [none], sample_size: [64x64], layer_offloading: [0.0]}",
                    frames=9, sample_frames=9),
}
BUDGET_FRACTIONS = (0.1, 0.3, 0.5, 0.75, 1.05)  # 1.05: the desired point fits


def scenarios(only: str | None):
    for name, text in JOBS.items():
        if only and not name.startswith(only):
            continue
        job = aitoolkit_job.loads(text, f"{name}.yaml")
        yield name, job, spaces.build(job)


# -- the exhaustive grid -----------------------------------------------------------------------------
def code_version() -> str:
    """Grids are remeasured when the probe's code changes."""
    digest = hashlib.sha256()
    package = ROOT / "src" / "fitfinder"
    for path in [*sorted((package / "probe").glob("*.py")), *sorted((package / "models").glob("*.py")),
                 *sorted((package / "archs").glob("*.json"))]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def measure_grid(name: str, job, space, runner) -> dict[tuple, dict]:
    """Every point's unbudgeted probe result, from the cache when the job and the code match."""
    key = hashlib.sha256((job_text(job) + code_version()).encode()).hexdigest()[:12]
    path = CACHE / f"grid-{name}-{key}.json"
    if path.exists():
        rows = json.loads(path.read_text())
        return {tuple(json.loads(k)): v for k, v in rows.items()}
    grid, started = {}, time.perf_counter()
    for index, point in enumerate(space.points()):
        request = probe.request_for(space.apply(job, point), GRID_STEPS, "sim", None)
        grid[space.key(point)] = runner.run(request)
        if index % 25 == 0:
            print(f"  grid {name}: {index + 1}/{space.size()} points, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({json.dumps(list(k)): v for k, v in grid.items()}))
    return grid


def job_text(job) -> str:
    return job.dumps() + json.dumps(job.settings.candidates, sort_keys=True)


def at_budget(record: dict, budget: int) -> dict:
    """What the probe answers under `budget`: it fails in the first phase whose peak passes it."""
    if record["status"] != "ok":
        return record
    phases, stats = {}, record.get("phase_stats", {})
    for phase, peak in record["phases"].items():
        phases[phase] = peak
        if peak > budget:
            spent = sum(stats.get(p, {}).get("seconds", 0.0) for p in phases)
            return {"status": "oom", "phase": phase, "phases": phases, "peak_bytes": peak,
                    "seconds_per_step": None, "wall_seconds": overhead(record) + spent}
    return record


def overhead(record: dict) -> float:
    """Probe seconds outside the phases (process start, model build)."""
    phases = sum(p.get("seconds", 0.0) for p in record.get("phase_stats", {}).values())
    return max(0.0, record.get("wall_seconds", phases) - phases)


class Lookup:
    """A strategy's window on the grid: answers points, counts probes and probe-seconds."""

    def __init__(self, space, grid: dict, budget: int, scenario: str = ""):
        self.space, self.grid, self.budget, self.scenario = space, grid, budget, scenario
        self.limit = int(budget * (1 - MARGIN))
        self.probes, self.seconds, self.seen = 0, 0.0, {}

    def outcome(self, point: dict, factor: int = 1, fresh: bool = False) -> dict:
        key = self.space.key(point)
        if key in self.seen and not fresh:
            return self.seen[key]  # a strategy never pays twice for the same point
        answer = at_budget(self.grid[key], self.budget)
        self.probes += 1
        self.seconds += answer.get("wall_seconds", 0.0) * factor
        self.seen[key] = answer
        return answer

    def fits(self, point: dict) -> bool:
        answer = self.outcome(point)
        return answer["status"] == "ok" and answer["peak_bytes"] <= self.limit

    def speed(self, point: dict) -> float:
        return self.grid[self.space.key(point)]["seconds_per_step"] / point.get("batch", 1)


class Speeds:
    """Seconds per sample for the ground truth: the median of the grid's timing and two more runs
    of the same probe (cached), since one timing on a shared machine can be off by half."""

    RUNS = 3

    def __init__(self, name: str, job, space, grid, runner):
        self.job, self.space, self.grid, self.runner = job, space, grid, runner
        key = hashlib.sha256((job_text(job) + code_version()).encode()).hexdigest()[:12]
        self.path = CACHE / f"speeds-{name}-{key}.json"
        self.timings = json.loads(self.path.read_text()) if self.path.exists() else {}

    def of(self, point: dict) -> float:
        key = json.dumps(list(self.space.key(point)))
        timings = self.timings.setdefault(key, [self.grid[self.space.key(point)]["seconds_per_step"]])
        while len(timings) < self.RUNS:
            request = probe.request_for(self.space.apply(self.job, point), GRID_STEPS, "sim", None)
            timings.append(self.runner.run(request)["seconds_per_step"])
            self.path.write_text(json.dumps(self.timings))
        return sorted(timings)[len(timings) // 2] / point.get("batch", 1)


def true_optimum(space, grid, budget, speeds: Speeds) -> dict | None:
    """The best quality that fits; among its points, the one fitfinder's own rule picks
    (search.best) from the medians of three timings: the fastest, except that speeds within the
    timing's noise of it (at least 3%, at most 10%) are a tie won by the most memory to spare."""
    top = _top_quality(space, grid, budget)
    if not top:
        return None
    known = search.Knowledge(space, int(budget * (1 - MARGIN)))
    for trial, point in enumerate(top):
        record = grid[space.key(point)]
        known.add(search.Result(trial=trial, point=point, status="ok", peak_bytes=record["peak_bytes"],
                                phases=record["phases"], seconds_per_sample=speeds.of(point),
                                extra={"timing_noise": record.get("timing_noise")}))
    return search.best(space, known).point


def _top_quality(space, grid, budget) -> list[dict]:
    """The points that fit under `budget` and have the best quality of those."""
    limit = int(budget * (1 - MARGIN))
    feasible = [p for p in space.points() if _fits(at_budget(grid[space.key(p)], budget), limit)]
    top = max((space.quality_key(p) for p in feasible), default=None)
    return [p for p in feasible if space.quality_key(p) == top]


def is_optimum(space, winner: dict | None, optimum: dict | None, speeds: Speeds, fastest: float | None) -> bool:
    """The optimum's quality, and within SPEED_TIE of the fastest point of that quality (or both
    are 'nothing fits')."""
    if winner is None or optimum is None:
        return winner is None and optimum is None
    if space.quality_key(winner) != space.quality_key(optimum):
        return False
    return speeds.of(winner) <= fastest * (1 + SPEED_TIE)


def _fits(answer: dict, limit: int) -> bool:
    return answer["status"] == "ok" and answer["peak_bytes"] <= limit


def _best_of(space, lookup: Lookup, points) -> dict | None:
    fits = [p for p in points if lookup.fits(p)]
    return max(fits, key=lambda p: (space.quality_key(p), -lookup.speed(p)), default=None)


# -- strategies --------------------------------------------------------------------------------------
def run_grid(space, lookup: Lookup) -> dict | None:
    points = list(space.points())
    for point in points:
        lookup.outcome(point)
    return _best_of(space, lookup, points)


def run_fitfinder(space, lookup: Lookup) -> dict | None:
    known = search.Knowledge(space, lookup.limit)

    def probe_step(step):
        answer = lookup.outcome(step.point, step.steps_factor, fresh=step.purpose == "confirm")
        return known.add(search.result_from_probe(lookup.probes, step, answer))

    search.drive(space, known, probe_step, 0, TRIAL_CAP)
    winner = search.best(space, known)
    return winner.point if winner else None


def run_tpe(space, lookup: Lookup, seed: int = 0) -> dict | None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    tried = []
    for _ in range(TRIAL_CAP):
        trial = study.ask()
        point = {k.name: trial.suggest_categorical(k.name, list(k.candidates)) for k in space.knobs}
        answer = lookup.outcome(point)
        tried.append(point)
        if answer["status"] != "ok":
            trial.set_constraint("peak_over_limit", 1.0)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        trial.set_constraint("peak_over_limit", answer["peak_bytes"] / lookup.limit - 1.0)
        # Quality first; the speed only orders points of equal quality (its share stays under 1).
        study.tell(trial, space.quality_rank(point) + 1.0 / (1.0 + lookup.speed(point)))
    return _best_of(space, lookup, tried)


def run_binsearch(space, lookup: Lookup) -> dict | None:
    """Lightning's binsearch, one knob at a time in priority order, from the lightest point."""
    point = space.lightest()
    if not lookup.fits(point):
        return None
    for knob in space.knobs:
        top = knob.level(knob.desired) if knob.role == "quality" else len(knob.candidates) - 1
        low, high, step = 0, None, 1
        while high is None:  # double the level until it fails or reaches the top
            level = min(low + step, top)
            if level == low:
                break
            if lookup.fits({**point, knob.name: knob.candidates[level]}):
                low, step = level, step * 2
            else:
                high = level
        while high is not None and high - low > 1:  # then bisect between the last fit and the failure
            middle = (low + high) // 2
            if lookup.fits({**point, knob.name: knob.candidates[middle]}):
                low = middle
            else:
                high = middle
        point[knob.name] = knob.candidates[low]
    return point


def run_seeds(space, lookup: Lookup) -> dict | None:
    """The seeds' walk: roll back one move at a time until it fits, then re-add one at a time."""
    point = space.desired()
    moves = iter(_seed_moves(space))
    while not lookup.fits(point):
        point = next((m(point) for m in moves if m(point) != point), None)
        if point is None:
            return None
    for raise_ in _seed_escalations(space):
        while True:
            heavier = raise_(point)
            if heavier == point or not lookup.fits(heavier):
                break
            point = heavier
    return point


def _step(space, name: str, direction: int):
    """A move of one knob by one level (down: -1, up: +1), never past the desired quality."""
    knob = space.by_name.get(name)

    def move(point: dict) -> dict:
        if knob is None:
            return point
        level = knob.level(point[name]) + direction
        top = knob.level(knob.desired) if knob.role == "quality" else len(knob.candidates) - 1
        if not 0 <= level <= top:
            return point
        return {**point, name: knob.candidates[level]}

    return move


def _to_lightest(space, name: str):
    knob = space.by_name.get(name)
    return lambda point: point if knob is None else {**point, name: knob.candidates[0]}


def _seed_moves(space):
    """The seeds' rollback order (image; video starts with frames), then what the guides add."""
    video = "frames" in space.by_name
    moves = [_step(space, "frames", -1)] * 4 if video else []
    moves += [_to_lightest(space, "gradient_checkpointing"), _to_lightest(space, "batch"),
              _step(space, "buckets", -1), _step(space, "sample_frames", -1), _step(space, "sample_size", -1),
              _step(space, "sample_size", -1), _to_lightest(space, "sampling"), _to_lightest(space, "low_vram"),
              _to_lightest(space, "text_encoder"), _step(space, "quantize", -1), _step(space, "quantize", -1),
              _to_lightest(space, "optimizer"), _step(space, "rank", -1), _step(space, "rank", -1),
              _step(space, "buckets", -1), _step(space, "frames", -1)]
    return moves


def _seed_escalations(space):
    """Scale back up one heavier setting at a time: bucket, richer sampling, larger batch or clips."""
    return [_step(space, "buckets", +1), _step(space, "sampling", +1), _step(space, "sample_size", +1),
            _step(space, "sample_frames", +1), _step(space, "batch", +1), _step(space, "frames", +1)]


# -- fitfinder guided by estimates, their error modelled ----------------------------------------------
# Each phase's estimate is its true peak times a random factor within +-ESTIMATE_ERROR, times a
# per-scenario bias within +-ESTIMATE_BIAS, both seeded. The guide's band starts at the bound of
# that error (what a calibration would have measured): a true peak lies within it of its estimate.
# The factor is drawn per phase and the values of the knobs that phase depends on, as the estimate
# itself is made (probe.estimate.Estimator._phase_key): two points alike on those knobs get the same
# estimate of that phase, so the same error.
ESTIMATE_ERROR, ESTIMATE_BIAS = 0.05, 0.03
BAND = 1 / ((1 - ESTIMATE_ERROR) * (1 - ESTIMATE_BIAS)) - 1  # 8.5%


class ModelledEstimates:
    """A scenario's estimates: the grid's unbudgeted peaks with the modelled error."""

    def __init__(self, space, grid: dict, scenario: str):
        self.space, self.grid, self.scenario = space, grid, scenario
        self.bias = random.Random(f"bias:{scenario}").uniform(-ESTIMATE_BIAS, ESTIMATE_BIAS)
        self.asked: set[tuple] = set()  # the points estimated: on a card, seconds of CPU each

    def __call__(self, point: dict) -> dict[str, int] | None:
        self.asked.add(self.space.key(point))
        record = self.grid[self.space.key(point)]
        if record["status"] != "ok":
            return None
        return {phase: int(peak * (1 + self._factor(point, phase)) * (1 + self.bias))
                for phase, peak in record["phases"].items()}

    def _factor(self, point: dict, phase: str) -> float:
        knobs = tuple(point[k.name] for k in self.space.knobs if phase in k.phases)
        return random.Random(f"{self.scenario}:{phase}:{knobs}").uniform(-ESTIMATE_ERROR, ESTIMATE_ERROR)


def run_guided(space, lookup: Lookup) -> dict | None:
    """fitfinder's plan on estimates (search.plan_guided): probes only where they cannot decide."""
    known = search.Knowledge(space, lookup.limit)
    estimates = ModelledEstimates(space, lookup.grid, lookup.scenario)
    guide = search.Guide(estimates, BAND)

    def probe_step(step):
        answer = lookup.outcome(step.point, step.steps_factor, fresh=step.purpose == "confirm")
        return known.add(search.result_from_probe(lookup.probes, step, answer))

    search.drive(space, known, probe_step, 0, TRIAL_CAP, planner=lambda s, k: search.plan_guided(s, k, guide))
    lookup.estimates = len(estimates.asked)
    winner = search.best(space, known)
    return winner.point if winner else None


STRATEGIES = {"grid": run_grid, "tpe": run_tpe, "binsearch": run_binsearch, "seeds": run_seeds,
              "fitfinder": run_fitfinder, "guided": run_guided}


# -- the run -------------------------------------------------------------------------------------------
def budgets_for(space, grid) -> list[int]:
    """Budgets from tight to loose, between the lightest point's peak and the desired point's."""
    low = grid[space.key(space.lightest())]["peak_bytes"]
    high = grid[space.key(space.desired())]["peak_bytes"]
    return [int((low + (high - low) * f) / (1 - MARGIN)) for f in BUDGET_FRACTIONS]


def verify(space, job, grid, budget, runner, count: int, rng) -> int:
    """Re-run random points under the budget for real; count mismatches with the grid's claim."""
    wrong = 0
    for point in rng.sample(list(space.points()), min(count, space.size())):
        real = runner.run(probe.request_for(space.apply(job, point), GRID_STEPS, "sim", budget))
        claim = at_budget(grid[space.key(point)], budget)
        if (real["status"], real.get("phase")) != (claim["status"], claim.get("phase")):
            wrong += 1
            print(f"  verify: {space.describe(point)}: real {real['status']}/{real.get('phase')} "
                  f"vs grid {claim['status']}/{claim.get('phase')}", file=sys.stderr)
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--only", help="only scenarios whose job name starts with this")
    parser.add_argument("--verify", type=int, default=0, help="re-run N random points per job under a budget")
    parser.add_argument("--strategies", help="comma-separated, of: " + ", ".join(STRATEGIES) + " [all]")
    parser.add_argument("--estimate-error", type=float, default=ESTIMATE_ERROR,
                        help="guided: each phase's modelled estimate error, +- this share (the band stays "
                             f"at {BAND:.1%}, what calibration measured: a larger error is past the band)")
    parser.add_argument("--estimate-bias", type=float, default=ESTIMATE_BIAS,
                        help="guided: the per-scenario bias of the modelled estimates, +- this share")
    args = parser.parse_args()
    globals().update(ESTIMATE_ERROR=args.estimate_error, ESTIMATE_BIAS=args.estimate_bias)  # ModelledEstimates
    if args.strategies:
        chosen = {"grid", *args.strategies.split(",")}  # the grid is the yardstick of the % column
        for name in [n for n in STRATEGIES if n not in chosen]:
            del STRATEGIES[name]

    load_before = os.getloadavg()
    runner = probe.ProbeRunner(timeout_s=300)
    totals = {name: {"optimum_found": 0, "exact": 0, "probes": 0, "probe_seconds": 0.0, "per_scenario": []}
              for name in STRATEGIES}
    rows, count, mismatches = [], 0, 0
    rng = random.Random(0)
    for name, job, space in scenarios(args.only):
        grid = measure_grid(name, job, space, runner)
        speeds = Speeds(name, job, space, grid, runner)
        for budget in budgets_for(space, grid):
            if args.verify:
                mismatches += verify(space, job, grid, budget, runner, args.verify, rng)
            optimum = true_optimum(space, grid, budget, speeds)
            fastest = min(map(speeds.of, _top_quality(space, grid, budget)), default=None)
            count += 1
            row = {"scenario": f"{name}@{budget / 2**20:.1f}MiB", "points": space.size()}
            row["bias"] = ModelledEstimates(space, grid, row["scenario"]).bias
            for strategy, run in STRATEGIES.items():
                lookup = Lookup(space, grid, budget, row["scenario"])
                winner = run(space, lookup)
                found = is_optimum(space, winner, optimum, speeds, fastest)
                totals[strategy]["optimum_found"] += found
                totals[strategy]["exact"] += winner == optimum
                totals[strategy]["probes"] += lookup.probes
                totals[strategy]["probe_seconds"] += lookup.seconds
                totals[strategy]["per_scenario"].append(lookup.probes)
                totals[strategy]["estimates"] = totals[strategy].get("estimates", 0) + getattr(lookup, "estimates", 0)
                row[strategy] = f"{lookup.probes}{'' if found else '*'}"
            rows.append(row)
    _print(rows, totals, count, mismatches, args.verify)
    load = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    print("load average (1, 5, 15 min): {} {} {} at the start, {} {} {} at the end".format(*load))
    if args.json:
        payload = {"scenarios": count, "load_average": load,
                   "strategies": {k: {**v, "probe_seconds": round(v["probe_seconds"], 1)} for k, v in totals.items()}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


def _print(rows, totals, count, mismatches, verified) -> None:
    names = list(STRATEGIES)
    print(f"{'scenario':<24}{'points':>7}" + "".join(f"{n:>11}" for n in names))
    for row in rows:
        print(f"{row['scenario']:<24}{row['points']:>7}" + "".join(f"{row[n]:>11}" for n in names))
    print("(probes per scenario; * = missed the true optimum)\n")
    grid_probes = totals["grid"]["probes"]
    print(f"{'strategy':<12}{'optimum found':>15}{'exact':>7}{'probes':>9}{'% of grid':>11}{'probe-seconds':>15}")
    for name in names:
        t = totals[name]
        print(f"{name:<12}{t['optimum_found']:>8}/{count:<6}{t['exact']:>7}{t['probes']:>9}"
              f"{100 * t['probes'] / grid_probes:>10.1f}%{t['probe_seconds']:>15.1f}")
    print(f"(optimum found: the best quality, and seconds per sample within {SPEED_TIE:.0%} of the fastest; "
          "exact: the very point fitfinder's tie rule picks from the grid's medians)")
    if "tpe" in totals and "fitfinder" in totals:
        ff, tpe = totals["fitfinder"]["probes"], totals["tpe"]["probes"]
        print(f"\nfitfinder: {ff / grid_probes:.1%} of the grid's probes, {ff / tpe:.0%} of TPE's")
    for name, label in (("fitfinder", "without estimates"), ("guided", "guided by estimates")):
        if name in totals:
            counts = sorted(totals[name]["per_scenario"])
            middle = len(counts) // 2
            median = counts[middle] if len(counts) % 2 else (counts[middle - 1] + counts[middle]) / 2
            print(f"{name} {label}: optimum {totals[name]['optimum_found']}/{count}, {totals[name]['probes']} probes, "
                  f"median {median:g} "
                  f"per scenario, at most {counts[-1]}")
    if "guided" in totals:
        print(f"(guided: {totals['guided']['estimates']} points estimated in all; "
              f"each phase's estimate = true peak x a seeded factor within +-{ESTIMATE_ERROR:.0%} "
              f"x a per-scenario bias within +-{ESTIMATE_BIAS:.0%}; band starts at {BAND:.1%}; biases: "
              + ", ".join(f"{row['bias']:+.1%}" for row in rows) + ")")
    if verified:
        print(f"grid claims re-checked under real budgets: {mismatches} mismatches")


if __name__ == "__main__":
    main()
