"""What `fitfinder estimate`, its `--search` and `fitfinder tiers` cost, beside what importing their
libraries costs, in the same run; this checkout's code and, with --baseline, another's back to back.

The issue's yardstick is the time of `import torch, diffusers, transformers, peft` in a fresh
interpreter: a command that must import them cannot take less. Each round measures, one after
the other in fresh processes so that a busy machine slows all of them alike:

- imports:   `python -c "import torch, diffusers, transformers, peft"`;
- estimate:  the whole command, `fitfinder estimate JOB --vram 24GiB` (the estimate in its own
             process, estimate.InProcess), for each code;
- search:    `fitfinder estimate JOB --vram 24GiB --search` (the first --search-rounds rounds);
- tiers:     `fitfinder tiers JOB` (with --tiers, the first round; its results go to a
             temporary folder), target 2 minutes;
- before:    with --probe-server, the estimate through the probe server, as the command ran it
             before estimate.InProcess (a forkserver that imports the libraries, then a child).

`--baseline SRC` runs every command of a round also with PYTHONPATH=SRC (another checkout's
`src`, e.g. /work/main/src), right before this checkout's: the side-by-side of a change.
Wall and CPU seconds of each process and its children, and the largest max RSS among them (the
probe server of "before" is never waited for, so its CPU time is not counted: n/a).
The figures are medians over the rounds; the ratios are the medians' ratios. The load average
is printed beside them: on a shared machine every wall time is inflated, CPU seconds less so.

    python benchmarks/estimate_speed.py [--job examples/aitk/train_lora_flux_24gb.yaml] [--rounds 3]
                                        [--search-rounds 1] [--tiers] [--baseline ../src]
                                        [--probe-server] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
JOB = ROOT / "examples" / "aitk" / "train_lora_flux_24gb.yaml"
BEFORE = """
import sys
from pathlib import Path
from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
job = aitoolkit_job.load(Path(sys.argv[1]))
job.settings.vram_bytes = 24 * 2**30
estimate.run(job, probe.ProbeRunner(600), GpuOverhead())
"""


def timed(command: list[str], src: Path) -> dict:
    """Wall and CPU seconds of a command and its children, and the largest max RSS among them."""
    env = dict(os.environ, PYTHONPATH=str(src))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "max_rss": after.ru_maxrss * 1024, "stdout": done.stdout,
            "load": os.getloadavg()[0]}


def round_of(job: Path, codes: dict[str, Path], with_search: bool, with_tiers: bool, probe_server: bool) -> dict:
    python, fitfinder = sys.executable, [sys.executable, "-m", "fitfinder"]
    row = {"imports": timed([python, "-c", "import torch, diffusers, transformers, peft"], SRC)}
    for code, src in codes.items():
        row[f"estimate {code}"] = timed([*fitfinder, "estimate", str(job), "--vram", "24GiB"], src)
    if probe_server:
        row["before"] = timed([python, "-c", BEFORE, str(job)], SRC)
    for code, src in codes.items():
        if with_search:
            found = timed([*fitfinder, "estimate", str(job), "--vram", "24GiB", "--search"], src)
            row[f"search {code}"] = {**found, "estimates": _estimates_run(found["stdout"])}
    for code, src in codes.items():
        if with_tiers:
            with tempfile.TemporaryDirectory() as results:
                found = timed([*fitfinder, "tiers", str(job), "--results-dir", results], src)
            row[f"tiers {code}"] = {**found, "estimates": _tier_estimates(found["stdout"])}
    return row


def _estimates_run(stdout: str) -> int | None:
    line = next((x for x in stdout.splitlines() if x.startswith("best predicted:")), "")
    marker = line.rpartition("(")[2].split()
    return int(marker[0]) if marker and marker[0].isdigit() else None


def _tier_estimates(stdout: str) -> str | None:
    line = next((x for x in stdout.splitlines() if " estimates, " in x), "")
    return line.strip().lstrip("(").partition(";")[0] or None


def median(rows: list[dict], name: str, key: str) -> float:
    return statistics.median(row[name][key] for row in rows if name in row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=JOB)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--search-rounds", type=int, default=1, help="rounds that also time --search")
    parser.add_argument("--tiers", action="store_true", help="time `fitfinder tiers` in the first round")
    parser.add_argument("--baseline", type=Path, help="another checkout's src/, timed beside this one")
    parser.add_argument("--probe-server", action="store_true", help="also the estimate through the probe server")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    codes = {"baseline": args.baseline.resolve(), "now": SRC} if args.baseline else {"now": SRC}
    rows = []
    for index in range(args.rounds):
        rows.append(round_of(args.job, codes, index < args.search_rounds, args.tiers and index == 0,
                             args.probe_server))
        print(f"  round {index + 1}/{args.rounds}: " + ", ".join(
            f"{name} {row['wall']:.1f} s" for name, row in rows[-1].items()), file=sys.stderr, flush=True)
    loads = [entry["load"] for row in rows for entry in row.values()]
    imports = median(rows, "imports", "wall")
    print(f"{args.job.name}, --vram 24GiB, {args.rounds} rounds (medians), load average {min(loads):.1f}-"
          f"{max(loads):.1f} (1 min, at each command's end) on {os.cpu_count()} CPUs")
    print(f"{'':40}{'wall':>8}{'CPU':>8}{'max RSS':>10}{'x imports':>11}")
    names = ["imports", "before", *(f"{kind} {code}" for kind in ("estimate", "search", "tiers") for code in codes)]
    summary = {}
    for name in names:
        if not any(name in row for row in rows):
            continue
        wall, cpu, rss = (median(rows, name, k) for k in ("wall", "cpu", "max_rss"))
        summary[name] = {"wall": round(wall, 2), "cpu": round(cpu, 2), "max_rss_bytes": int(rss),
                         "x_imports": round(wall / imports, 2)}
        shown_cpu = f"{cpu:>7.1f}s" if name != "before" else "     n/a"  # the probe server is not waited for
        print(f"{LABELS.get(name, 'fitfinder ' + name):<40}{wall:>7.1f}s{shown_cpu}{rss / 2**20:>7.0f}MiB"
              f"{wall / imports:>10.2f}x")
    print()
    for code in codes:
        estimate = summary[f"estimate {code}"]
        line = (f"{code:>8}: the command {estimate['wall'] / imports:.2f}x the imports (target 1.5x), "
                f"{estimate['cpu'] / median(rows, 'imports', 'cpu'):.2f}x their CPU")
        if f"search {code}" in summary:
            search = [row[f"search {code}"] for row in rows if f"search {code}" in row]
            line += (f"; --search {summary[f'search {code}']['wall'] / estimate['wall']:.2f}x one estimate command "
                     f"(target 5x), {search[0]['estimates']} estimates")
        if f"tiers {code}" in summary:
            tiers = rows[0][f"tiers {code}"]
            line += f"; tiers {tiers['wall']:.0f} s (target 120 s), {tiers['estimates']}"
        print(line)
    if "before" in summary:
        print(f"  before (probe server): {summary['before']['wall'] / imports:.2f}x the imports")
    if args.json:
        args.json.write_text(json.dumps({"job": str(args.job), "rounds": args.rounds, "load_average": loads,
                                         **summary}, indent=2) + "\n")


LABELS = {"imports": "import torch+diffusers+transformers+peft", "before": "estimate before (probe server)"}


if __name__ == "__main__":
    main()
