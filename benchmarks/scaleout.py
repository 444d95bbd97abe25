"""Scale-out: wall time to the winner with 1, 2 and 4 sim workers, and SQLite under several writers.

1. The demo search (configs/demo.yaml, sim meter) from an empty study with `--workers N`, each
   run in a fresh folder: wall seconds to the exported winner, probes run, and the winner.
   On this machine the workers share 2 CPU cores, so probes running side by side slow each
   other down: the speed-up is bounded by the cores, not by the plan. On N GPUs each worker has
   its own card.
2. The plan's own parallelism, with no cores to share: the stand-in probe of tests/standin.py
   (memory a known function of 12 knobs, 10,368 points) at 30 budgets, as N GPUs would run it,
   on three clocks (tests.standin.probe_time): "flat", a probe takes 1 and a confirmation 3
   whatever happens (the clock before); "demo" and "card", what the recipe runs before the
   probe ends (an OOM ends it in its phase, in training at the first or middle step), with the
   phases' shares of the demo's own probe, or of a card whose load is as long as the training.
   Time to the end and probes, summed, for today's speculation ("kary": best-first over the
   pending outcomes, the speed climb's open levels at once, the likely winner confirmed while
   the last speed probes run) and the two that start confirmations on guesses
   ("confirm-winner", "confirm-base"; these live in tests/standin.py, not in the product), each
   winner checked against the brute-force optimum;
   then the time per scenario, and with --bound N the time N workers take (what the plan's
   chain allows however many workers there are).
3. The storage: N processes each claiming and recording trials as fast as they can (no probe in
   between) on one SQLite study with heartbeats -- far more writes per second than a search ever
   makes -- counting errors, to back the choice of SQLite as the default for several workers.

    python benchmarks/scaleout.py [--workers 1 2 4] [--repeat 1] [--plan-only] [--bound 16]
                                  [--speculations kary confirm-winner confirm-base] [--clocks flat demo card]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.standin, for the plan's parallelism


def search_once(workers: int, probe_steps: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="fitfinder-scaleout-"))
    try:
        (folder / "configs").mkdir()
        shutil.copy(ROOT / "configs" / "demo.yaml", folder / "configs" / "demo.yaml")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fitfinder", "search", "configs/demo.yaml", "--json",
                               "--workers", str(workers), "--force", "--probe-steps", str(probe_steps)],
                              cwd=folder, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        summary = json.loads(done.stdout)
        return {"workers": workers, "seconds": seconds, "probes": summary["probes_run"], "best": summary["best"]}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _hammer(url: str, count: int, queue) -> None:
    """One writer: enqueue, claim and record `count` trials as fast as possible."""
    import warnings

    warnings.filterwarnings("ignore")
    from fitfinder import search, space as spaces
    from fitfinder.trainers import aitoolkit_job
    from fitfinder.search import study as studies

    job = aitoolkit_job.load(ROOT / "configs" / "demo.yaml")
    space = spaces.build(job)
    study = studies.open_study(url, "stress", space, {"budget_bytes": None})
    points = list(space.points())
    errors, started = 0, time.perf_counter()
    for index in range(count):
        try:
            trial = studies.claim(study, space, points[(index * 7 + os.getpid()) % len(points)], "quality")
            if trial is None:
                continue
            step = search.Step(dict(trial.params), "quality")
            outcome = {"status": "ok", "peak_bytes": 1, "phases": {"train": 1}, "seconds_per_step": 0.1}
            result = search.Knowledge(space, None).add(search.result_from_probe(trial.number, step, outcome))
            studies.record(study, trial, space, result, outcome, None, "quality")
        except Exception as exc:  # noqa: BLE001 - what we count
            errors += 1
            if os.environ.get("FITFINDER_SQLITE_CLAIM_LOCK") != "0":
                print(f"  writer {os.getpid()}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    queue.put((errors, time.perf_counter() - started))


def stress_sqlite(writers: int, per_writer: int, lock: bool = True) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="fitfinder-sqlite-"))
    os.environ["FITFINDER_SQLITE_CLAIM_LOCK"] = "1" if lock else "0"  # the spawned writers inherit it
    try:
        url = f"sqlite:///{folder / 'stress.db'}"
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        # the study exists before the writers start, as `fitfinder search` creates it first
        _hammer(url, 0, queue)
        queue.get()
        processes = [context.Process(target=_hammer, args=(url, per_writer, queue)) for _ in range(writers)]
        started = time.perf_counter()
        for process in processes:
            process.start()
        results = [queue.get() for _ in processes]
        for process in processes:
            process.join()
        seconds = time.perf_counter() - started
        return {"writers": writers, "lock": lock, "trials": writers * per_writer,
                "errors": sum(e for e, _ in results), "seconds": seconds}
    finally:
        os.environ.pop("FITFINDER_SQLITE_CLAIM_LOCK", None)
        shutil.rmtree(folder, ignore_errors=True)


SPECULATIONS = ("kary", "confirm-winner", "confirm-base")  # today's plan_around, and two of tests.standin.SPECULATIONS
CLOCKS = ("flat", "demo", "card")  # tests.standin.CLOCKS: before (1 a probe, 3 a confirmation), and the recipe's


def plan_parallelism(counts: list[int], speculation: str = "kary", clock: str = "flat") -> list[dict]:
    """Per worker count: total time and probes over the 30 budgets, the time per budget, and
    whether every winner is the brute-force optimum and no point was probed twice."""
    from tests.standin import MiB, make_space, simulate_workers, true_optimum

    space = make_space()
    rows = []
    for workers in sorted(set(counts)):
        runs, right, once = [], True, True
        for budget in BUDGETS:
            seconds, probed, winner = simulate_workers(space, budget * MiB, workers, speculation, clock)
            runs.append((seconds, len(probed)))
            right &= (winner.point if winner else None) == true_optimum(space, budget * MiB)
            keys = [(purpose == "confirm", space.key(point)) for purpose, point in probed]
            once &= len(keys) == len(set(keys))
        rows.append({"workers": workers, "speculation": speculation, "clock": clock,
                     "time": round(sum(t for t, _ in runs), 4), "probes": sum(n for _, n in runs),
                     "per_budget": [round(t, 4) for t, _ in runs], "optimum_every_time": right, "no_point_twice": once})
    return rows


BUDGETS = range(11, 101, 3)  # MiB: tests/test_plan.py's


def print_plan(counts: list[int], bound: list[int], speculations=SPECULATIONS, clocks=CLOCKS) -> dict:
    """Per clock, each speculation's time and probes against one worker's (the plan itself, the
    same for every speculation: measured once); then the time per budget of today's plan."""
    print("\nthe plan alone (stand-in probe, 30 budgets); clocks: flat = a probe takes 1, a confirmation 3;"
          "\ndemo, card = what the recipe runs before the probe ends, a short probe to its end taking 1")
    print(f"{'clock':>6}{'speculation':>16}{'workers':>8}{'time':>9}{'speed-up':>10}{'probes':>8}{'probes/1':>10}"
          "  winners")
    plans = {}
    for clock in clocks:
        alone = plan_parallelism([1], "kary", clock)[0]  # one worker: plan_around is plan
        for speculation in speculations:
            rows = [{**alone, "speculation": speculation}]
            rows += plan_parallelism([c for c in counts if c > 1], speculation, clock)
            rows += [{**row, "bound": True} for row in plan_parallelism(bound, speculation, clock)
                     if speculation == "kary"]
            plans[f"{clock}/{speculation}"] = rows
            for row in rows:
                verdict = "optimum, none twice" if row["optimum_every_time"] and row["no_point_twice"] else "WRONG"
                print(f"{clock:>6}{speculation:>16}{row['workers']:>8}{row['time']:>9.2f}"
                      f"{alone['time'] / row['time']:>9.2f}x{row['probes']:>8}"
                      f"{row['probes'] / alone['probes']:>9.2f}x  {verdict}"
                      + ("  (the bound: many workers)" if row.get("bound") else ""))
    for clock in clocks if "kary" in speculations else ():  # the per-budget table is the search's own plan
        print(f"\ntime per budget (MiB), kary speculation, {clock} clock; the first row is one worker")
        print(f"{'workers':>8}  " + " ".join(f"{b:>4}" for b in BUDGETS))
        for row in plans[f"{clock}/kary"]:
            print(f"{row['workers']:>8}  " + " ".join(f"{t:>4.1f}" for t in row["per_budget"]))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=1, help="runs per worker count (the best is kept)")
    parser.add_argument("--probe-steps", type=int, nargs="+", default=[20, 200],
                        help="probe lengths to compare: the demo's, and probes long enough to outweigh start-up")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--plan-only", action="store_true",
                        help="only the plan's own parallelism (seconds, no probes, no SQLite)")
    parser.add_argument("--bound", type=int, nargs="*", default=[],
                        help="also these worker counts for the plan, to show what its chain allows")
    parser.add_argument("--speculations", nargs="+", default=list(SPECULATIONS),
                        help="tests.standin.SPECULATIONS to compare (also: halving, the one before kary)")
    parser.add_argument("--clocks", nargs="+", default=list(CLOCKS),
                        help="the stand-in's clocks (tests.standin.CLOCKS)")
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (the plan's figures are a simulated clock:"
          " load moves only part 1 and 3)")
    if args.plan_only:
        plan = print_plan(args.workers + [8], args.bound, args.speculations, args.clocks)
        if args.json:  # the other parts' figures, from their last full run, are kept
            figures = json.loads(args.json.read_text()) if args.json.exists() else {}
            args.json.write_text(json.dumps({**figures, "plan": plan}, indent=2) + "\n")
        return

    rows = []
    print(f"demo search on {os.cpu_count()} CPU cores (sim meter)")
    print(f"{'steps':>6}{'workers':>8}{'wall s':>9}{'speed-up':>10}{'probes':>8}  winner")
    for steps in args.probe_steps:
        group = []
        for workers in args.workers:
            runs = [search_once(workers, steps) for _ in range(args.repeat)]
            group.append({**min(runs, key=lambda r: r["seconds"]), "probe_steps": steps})
        for row in group:
            winner = " ".join(f"{k}={v}" for k, v in row["best"].items())
            print(f"{steps:>6}{row['workers']:>8}{row['seconds']:>9.1f}{group[0]['seconds'] / row['seconds']:>9.2f}x"
                  f"{row['probes']:>8}  {winner}")
        rows += group
    same = all(row["best"] == rows[0]["best"] for row in rows)
    print(f"same winner for every run: {'yes' if same else 'NO'}")

    plan = print_plan(args.workers + [8], args.bound, args.speculations, args.clocks)

    stress = [stress_sqlite(n, 60, lock) for lock in (False, True) for n in (1, 4, 8)]
    print("\nSQLite with heartbeats, writers claiming and recording trials back to back")
    print("(errors: a trial taken by two writers, so the second cannot record it)")
    print(f"{'claim lock':>11}{'writers':>8}{'trials':>8}{'errors':>8}{'trials/s':>10}")
    for row in stress:
        print(f"{'on' if row['lock'] else 'off':>11}{row['writers']:>8}{row['trials']:>8}{row['errors']:>8}"
              f"{row['trials'] / row['seconds']:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps({"search": rows, "plan": plan, "sqlite": stress}, indent=2) + "\n")


if __name__ == "__main__":
    main()
