"""Does one probe's speed survive a busy machine? The old timing against the new, side by side.

The search ranks points of equal quality by one probe's seconds per sample. The old timing was
the mean wall time of every step after the first; the new one (`probe.step_timing`) times steps
with the meter's step clock (on the CPU meters the probe thread's own CPU time; on a GPU the wall
time to the step's last kernel), takes each shape's median and reports the timing's own noise,
and `search.best` calls speeds within that noise (at least 3%, at most 10%) a tie, won by the
point with the most memory to spare.

Four points of one tiny job share their quality and differ in speed knobs (checkpointing and
batch). Each is probed R times on a quiet machine and R times while CPU-bound processes (one per
core, in bursts of 0.05-0.5 s on and off, seeded) run beside it. Each probe records both clocks
per step, so the two timings are compared on identical runs:

- error: the ratio of two points' speeds in one busy round against the ratio of their quiet
  medians (a busy machine slows everything; what misleads a ranking is how far apart it pulls two);
- order: for the pairs whose quiet speeds differ by more than 10%, the share of busy probe pairs
  that rank them the quiet way;
- verdict: in each busy round (one probe per point), the point each rule picks, counted as right
  when its quiet speed is within 10% of the quiet fastest (search_efficiency's SPEED_TIE).

    python benchmarks/timing_noise.py [--runs 3] [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fitfinder import probe, search, space as spaces  # noqa: E402
from fitfinder.trainers import aitoolkit_job  # noqa: E402

SPEED_TIE = 0.10
JOB = """
job: extension
config:
  name: timing
  process:
    - type: sd_trainer
      network: {type: lora, linear: 16, linear_alpha: 16}
      datasets:
        - folder_path: /data
          resolution: [128, 256]
          cache_latents_to_disk: true
      train: {batch_size: 2, gradient_accumulation: 1, gradient_checkpointing: false, optimizer: adamw,
              lr: 0.0001, dtype: fp32}
      model: {name_or_path: "fitfinder/sdxl-tiny", arch: sdxl}
      sample: {width: 128, height: 128, sample_steps: 4, guidance_scale: 5}
fitfinder:
  weights: random
  candidates: {rank: [16], quantize: [none], low_vram: [false], sample_size: [128x128], text_encoder: [keep]}
"""


def old_timing(steps: list[float]) -> float:
    """The timing before: the mean of every step after the first, in wall seconds."""
    steady = steps[1:] or steps
    return sum(steady) / len(steady)


def new_timing(schedule, steps: list[float]) -> tuple[float, float]:
    return probe.step_timing(schedule, steps)


def burn(seed: int) -> None:
    """CPU-bound work in bursts: on and off for random spells of 0.05-0.5 s, as other jobs come and go."""
    rng = random.Random(seed)
    while True:
        until = time.perf_counter() + rng.uniform(0.05, 0.5)
        while time.perf_counter() < until:
            pass
        time.sleep(rng.uniform(0.05, 0.5))


def points_of(space) -> list[dict]:
    desired = space.desired()
    return [{**desired, "gradient_checkpointing": gc, "batch": batch}
            for gc, batch in itertools.product((True, False), (1, 2))]


def measure(job, space, points, runs: int, steps: int, runner) -> list[list[dict]]:
    """runs x points probe results (one round probes every point once)."""
    rounds = []
    for _ in range(runs):
        row = []
        for point in points:
            request = probe.request_for(space.apply(job, point), steps, "sim", None)
            result = runner.run(request)
            assert result["status"] == "ok", result.get("error")
            result["shapes"] = request["shapes"]
            row.append(result)
        rounds.append(row)
    return rounds


def per_sample(result: dict, point: dict, timing: str) -> tuple[float, float]:
    schedule = probe.shape_schedule(result["shapes"], len(result["step_seconds"]))
    if timing == "old":
        return old_timing(result["step_wall_seconds"]) / point["batch"], 0.0
    seconds, noise = new_timing(schedule, result["step_seconds"])
    return seconds / point["batch"], noise


def pick(space, points, rows: list[dict], timing: str) -> int:
    """The point a search would choose from one probe of each: old = the fastest; new = search.best."""
    known = search.Knowledge(space, 1 << 60)
    for index, (point, result) in enumerate(zip(points, rows)):
        seconds, noise = per_sample(result, point, timing)
        known.add(search.Result(trial=index, point=point, status="ok", peak_bytes=result["peak_bytes"],
                                seconds_per_sample=seconds, phases=result["phases"],
                                extra={"timing_noise": noise}))
    if timing == "old":
        fastest = min(known.fits(), key=lambda r: r.seconds_per_sample)
    else:
        fastest = search.best(space, known)
    return fastest.trial


def summarise(space, points, quiet, busy) -> dict:
    table = {}
    for timing in ("old", "new"):
        truth = [statistics.median(per_sample(row[i], points[i], timing)[0] for row in quiet)
                 for i in range(len(points))]
        # A busy machine slows every point; what misleads a ranking is how far apart it pulls two.
        errors = [abs(per_sample(row[a], points[a], timing)[0] / per_sample(row[b], points[b], timing)[0]
                      / (truth[a] / truth[b]) - 1)
                  for row in busy for a, b in itertools.combinations(range(len(points)), 2)]
        clear = [(a, b) for a, b in itertools.combinations(range(len(points)), 2)
                 if abs(truth[a] / truth[b] - 1) > SPEED_TIE]
        right = total = 0
        for a, b in clear:
            for row_a, row_b in itertools.product(busy, busy):
                total += 1
                busy_order = per_sample(row_a[a], points[a], timing)[0] < per_sample(row_b[b], points[b], timing)[0]
                right += busy_order == (truth[a] < truth[b])
        verdicts = [truth[pick(space, points, row, timing)] <= min(truth) * (1 + SPEED_TIE) for row in busy]
        table[timing] = {"median_error": statistics.median(errors), "max_error": max(errors),
                         "order_right": right, "order_pairs": total,
                         "verdict_right": sum(verdicts), "rounds": len(verdicts)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="probes per point in each condition")
    parser.add_argument("--steps", type=int, default=20, help="steps per probe")
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()
    job = aitoolkit_job.loads(JOB, "timing.yaml")
    space = spaces.build(job)
    points = points_of(space)
    runner = probe.ProbeRunner(timeout_s=600)
    print(f"quiet: {len(points)} points x {args.runs} probes of {args.steps} steps", file=sys.stderr, flush=True)
    quiet = measure(job, space, points, args.runs, args.steps, runner)
    burners = [multiprocessing.Process(target=burn, args=(seed,), daemon=True) for seed in range(os.cpu_count() or 1)]
    for process in burners:
        process.start()
    try:
        print(f"busy: the same beside {len(burners)} CPU-bound processes", file=sys.stderr, flush=True)
        busy = measure(job, space, points, args.runs, args.steps, runner)
    finally:
        for process in burners:
            process.kill()
    table = summarise(space, points, quiet, busy)
    print(f"{'timing':8} {'ratio err':>11} {'max err':>8} {'order right':>12} {'verdict right':>14}")
    for timing, row in table.items():
        print(f"{timing:8} {row['median_error']:>10.1%} {row['max_error']:>8.1%} "
              f"{row['order_right']:>5}/{row['order_pairs']:<6} {row['verdict_right']:>7}/{row['rounds']}")
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "steps": args.steps, "cpus": len(burners),
                                         "timings": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
