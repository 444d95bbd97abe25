"""What the garbage collector costs one estimate, with the estimate meter freezing what survives
each phase's collection (`meters.EstimateMeter.phase`) and without.

The estimate meter collects at the start of every phase, so that what the last phase left for
the collector does not count in the next. Each such collection scanned the whole pipeline (the
full-size model's modules and fake tensors: some 170,000 objects) again; frozen after the first,
the pipeline is skipped. This runs the estimate of a job (`estimate.InProcess`, as `fitfinder
estimate` runs it) in a fresh process per run, the freeze on and off alternately, and sums the
time of every collection of the oldest generation during it (gc.callbacks): the phases' own and
the collector's automatic ones. The bytes of every phase must be the same both ways.

    python benchmarks/estimate_collections.py [--job examples/aitk/train_lora_flux_24gb.yaml] [--rounds 3]
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
JOB = ROOT / "examples" / "aitk" / "train_lora_flux_24gb.yaml"
ONE_ESTIMATE = """
import gc, json, sys, time, types
from pathlib import Path
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.probe.meters import estimate as estimate_meter
from fitfinder.probe.overhead import GpuOverhead

if sys.argv[2] == "off":  # the meter's phases collect but freeze nothing
    estimate_meter.gc = types.SimpleNamespace(collect=gc.collect, freeze=lambda: None, unfreeze=gc.unfreeze)
job = aitoolkit_job.load(Path(sys.argv[1]))
job.settings.vram_bytes = 24 * 2**30
request = estimate.request_for(job, GpuOverhead())
collections = []
started = [0.0]

def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    elif info["generation"] == 2:
        collections.append(time.perf_counter() - started[0])

import fitfinder.probe._preload  # the libraries, as InProcess imports them before its clock starts
gc.callbacks.append(timed)
result = estimate.InProcess(600).run(request)
gc.callbacks.remove(timed)
print(json.dumps({"seconds": result["cpu_seconds"], "collections": len(collections),
                  "collecting": sum(collections),
                  "phases": {name: {key: value for key, value in stats.items() if key != "seconds"}
                             for name, stats in result["phase_stats"].items()}}))
"""


def one(job: Path, freeze: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", ONE_ESTIMATE, str(job), freeze], env=env, capture_output=True,
                          text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=JOB)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for number in range(args.rounds):
        for freeze in ("off", "on") if number % 2 == 0 else ("on", "off"):
            runs[freeze].append(one(args.job, freeze))
            print(f"  round {number + 1}/{args.rounds}, freeze {freeze}: "
                  f"{runs[freeze][-1]['collecting']:.3f} s collecting", flush=True)
    same = all(run["phases"] == runs["on"][0]["phases"] for run in runs["on"] + runs["off"])
    print(f"\n{args.job.name}: one estimate in a fresh process (as `fitfinder estimate`), medians of "
          f"{args.rounds} runs each")
    print(f"{'freeze':<8}{'collections':>13}{'collecting s':>14}{'estimate CPU s':>16}")
    for freeze in ("off", "on"):
        rows = runs[freeze]
        print(f"{freeze:<8}{statistics.median(r['collections'] for r in rows):>13.0f}"
              f"{statistics.median(r['collecting'] for r in rows):>14.3f}"
              f"{statistics.median(r['seconds'] for r in rows):>16.2f}")
    print(f"every phase's bytes the same both ways: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
