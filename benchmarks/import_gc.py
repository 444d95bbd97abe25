"""What the garbage collector cost the libraries' imports, before fitfinder turned it off for them.

`fitfinder.probe._preload` imports torch, diffusers, transformers, peft, bitsandbytes, quanto and
fitfinder's models once per process (`fitfinder estimate`'s own process, the probe forkserver).
The imports make close to a million long-lived objects and little garbage, yet the automatic
collector ran full collections over them as they grew. The preload now turns the collector off
while importing and freezes what is left. This imports the preload in a fresh process per run,
the collector on (the preload's `gc.disable` made a no-op, as before) and off (as now)
alternately, and prints the medians: the import's wall time, its full collections and their
time (gc.callbacks), the objects frozen, the process's max RSS. After the clock stops, each run
also collects once over everything (unfrozen) to show what garbage the imports leave: what a
collection before the freeze would have freed, and what it would have cost.

    python benchmarks/import_gc.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_IMPORT = """
import gc, json, resource, sys, time

if sys.argv[1] == "on":  # as before: the preload's gc.disable does nothing
    gc.disable = lambda: None
full = []
started = [0.0]

def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    elif info["generation"] == 2:
        full.append(time.perf_counter() - started[0])

gc.callbacks.append(timed)
began = time.perf_counter()
import fitfinder.probe._preload
seconds = time.perf_counter() - began
gc.callbacks.remove(timed)
frozen = gc.get_freeze_count()
max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
gc.unfreeze()
began = time.perf_counter()
freed = gc.collect()
print(json.dumps({"seconds": seconds, "collections": len(full), "collecting": sum(full),
                  "frozen": frozen, "max_rss": max_rss, "garbage": freed,
                  "one_collection": time.perf_counter() - began}))
"""
COLUMNS = [("seconds", "import s", "{:.2f}"), ("collections", "full GCs", "{:.0f}"),
           ("collecting", "in GC s", "{:.2f}"), ("frozen", "frozen", "{:,.0f}"),
           ("max_rss", "max RSS MiB", "{:.0f}"), ("garbage", "garbage left", "{:,.0f}"),
           ("one_collection", "1 GC s", "{:.2f}")]


def one(collector: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", ONE_IMPORT, collector], env=env, capture_output=True,
                          text=True, check=True, cwd=ROOT)
    run = json.loads(done.stdout.strip().splitlines()[-1])
    run["max_rss"] /= 2**20
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for number in range(args.rounds):
        for collector in ("on", "off") if number % 2 == 0 else ("off", "on"):
            runs[collector].append(one(collector))
            print(f"  round {number + 1}/{args.rounds}, collector {collector}: "
                  f"{runs[collector][-1]['seconds']:.2f} s", flush=True)
    print(f"\nimport fitfinder.probe._preload in a fresh process, medians of {args.rounds} runs each")
    print(f"{'collector':<22}" + "".join(f"{title:>14}" for _, title, _ in COLUMNS))
    for collector, name in (("on", "on (before)"), ("off", "off, then frozen (now)")):
        medians = [statistics.median(run[key] for run in runs[collector]) for key, _, _ in COLUMNS]
        print(f"{name:<22}" + "".join(f"{form.format(value):>14}" for value, (_, _, form) in zip(medians, COLUMNS)))
    ratio = statistics.median(r["seconds"] for r in runs["off"]) / statistics.median(r["seconds"] for r in runs["on"])
    print(f"import time now / before: {ratio:.2f}x")


if __name__ == "__main__":
    main()
