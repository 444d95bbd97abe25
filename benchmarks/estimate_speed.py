"""What `fitfinder estimate` costs, beside what importing its libraries costs, in the same run.

The issue's yardstick is the time of `import torch, diffusers, transformers, peft` in a fresh
interpreter: a command that must import them cannot take less. Each round measures, one after
the other in fresh processes so that a busy machine slows all of them alike:

- imports:   `python -c "import torch, diffusers, transformers, peft"`;
- estimate:  the whole command, `fitfinder estimate JOB --vram 24GiB` (the estimate in its own
             process, estimate.InProcess);
- before:    the same estimate through the probe server, as the command ran it before
             (estimate.run with a probe.ProbeRunner: a forkserver that imports the libraries,
             then a child that estimates);
- search:    `fitfinder estimate JOB --vram 24GiB --search` (every round with --search-rounds).

Wall and CPU seconds of each process and its children, and the largest max RSS among them (the
probe server of "before" is never waited for, so its CPU time is not counted: n/a).
The figures are medians over the rounds; the ratios are the medians' ratios.

    python benchmarks/estimate_speed.py [--job examples/aitk/train_lora_flux_24gb.yaml] [--rounds 3]
                                        [--search-rounds 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "aitk" / "train_lora_flux_24gb.yaml"
BEFORE = """
import sys
from pathlib import Path
from fitfinder import jobconfig, probe
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
job = jobconfig.load(Path(sys.argv[1]))
job.settings.vram_bytes = 24 * 2**30
estimate.run(job, probe.ProbeRunner(600), GpuOverhead())
"""


def timed(command: list[str]) -> dict:
    """Wall and CPU seconds of a command and its children, and the largest max RSS among them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "max_rss": after.ru_maxrss * 1024, "stdout": done.stdout}


def round_of(job: Path, with_search: bool) -> dict:
    python = sys.executable
    row = {"imports": timed([python, "-c", "import torch, diffusers, transformers, peft"]),
           "estimate": timed([python, "-m", "fitfinder", "estimate", str(job), "--vram", "24GiB"]),
           "before": timed([python, "-c", BEFORE, str(job)])}
    if with_search:
        row["search"] = timed([python, "-m", "fitfinder", "estimate", str(job), "--vram", "24GiB", "--search"])
        row["search"]["estimates"] = _estimates_run(row["search"]["stdout"])
    return row


def _estimates_run(stdout: str) -> int | None:
    line = next((x for x in stdout.splitlines() if x.startswith("best predicted:")), "")
    marker = line.rpartition("(")[2].split()
    return int(marker[0]) if marker and marker[0].isdigit() else None


def median(rows: list[dict], name: str, key: str) -> float:
    return statistics.median(row[name][key] for row in rows if name in row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=JOB)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--search-rounds", type=int, default=1, help="rounds that also time --search")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for index in range(args.rounds):
        rows.append(round_of(args.job, index < args.search_rounds))
        print(f"  round {index + 1}/{args.rounds}: " + ", ".join(
            f"{name} {row['wall']:.1f} s" for name, row in rows[-1].items() if isinstance(row, dict)),
            file=sys.stderr, flush=True)
    imports = median(rows, "imports", "wall")
    print(f"{args.job.name}, --vram 24GiB, {args.rounds} rounds (medians), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':34}{'wall':>8}{'CPU':>8}{'max RSS':>10}{'x imports':>11}")
    names = {"imports": "import torch+diffusers+transformers+peft", "before": "estimate before (probe server)",
             "estimate": "fitfinder estimate (now)", "search": "fitfinder estimate --search"}
    summary = {}
    for name, label in names.items():
        if not any(name in row for row in rows):
            continue
        wall, cpu, rss = (median(rows, name, k) for k in ("wall", "cpu", "max_rss"))
        summary[name] = {"wall": round(wall, 2), "cpu": round(cpu, 2), "max_rss_bytes": int(rss),
                         "x_imports": round(wall / imports, 2)}
        shown_cpu = f"{cpu:>7.1f}s" if name != "before" else "     n/a"  # the probe server is not waited for
        print(f"{label[:33]:<34}{wall:>7.1f}s{shown_cpu}{rss / 2**20:>7.0f}MiB{wall / imports:>10.2f}x")
    estimate = summary["estimate"]["wall"]
    print(f"\nthe command: {estimate / imports:.2f}x the imports (target 1.5x), before: "
          f"{summary['before']['wall'] / imports:.2f}x")
    if "search" in summary:
        search = [row["search"] for row in rows if "search" in row]
        print(f"--search: {summary['search']['wall'] / estimate:.2f}x one estimate command (target 5x), "
              f"{search[0]['estimates']} estimates")
    if args.json:
        args.json.write_text(json.dumps({"job": str(args.job), "rounds": args.rounds, **summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
