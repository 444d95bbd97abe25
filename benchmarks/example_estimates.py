"""The estimate of every AI Toolkit example fitfinder probes, phase by phase: docs/models.md's table.

Each job of examples/aitk/ is estimated as a user would, `fitfinder estimate FILE --vram 24GiB
--json`, one after the other in fresh processes; jobs fitfinder refuses (OmniGen2, the Redux
adapter) answer with exit code 2 and are listed as refused. The table prints each phase's peak in
GiB, where the peak is, and whether the job fits 24 GiB, with the machine's load average beside
it (an estimate's bytes do not depend on load; its seconds do).

    python benchmarks/example_estimates.py [--vram 24GiB] [--only NAME ...] [--json PATH]
    python benchmarks/example_estimates.py --compare BEFORE.json AFTER.json   # which phases moved
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("load", "text_encoder", "latents", "sample", "train", "last_sample")
GIB = 1024 ** 3


def estimate(path: Path, vram: str) -> dict:
    """One `fitfinder estimate --json` of the job: its JSON answer, or why there is none."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fitfinder", "estimate", str(path), "--vram", vram, "--json"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    seconds = round(time.monotonic() - started, 1)
    if done.returncode == 2:
        return {"job": path.stem, "refused": done.stderr.strip().splitlines()[-1], "seconds": seconds}
    if done.returncode not in (0, 1):  # 1: the job does not fit, still an answer
        raise SystemExit(f"{path.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    if done.returncode == 1 and not done.stdout.strip():  # 1 without an answer: the estimate itself failed
        return {"job": path.stem, "failed": done.stderr.strip().splitlines()[-1], "seconds": seconds}
    answer = json.loads(done.stdout)
    return {"job": path.stem, "fits": answer["fits"], "fits_with_margin": answer["fits_with_margin"],
            "peak_bytes": answer["peak_bytes"], "limit_bytes": answer["limit_bytes"],
            "phases": answer["phases"], "seconds": seconds}


def row(result: dict) -> str:
    if "refused" in result or "failed" in result:
        return f"| `{result['job']}` | {'refused' if 'refused' in result else 'failed'} | | | | | | |"
    phases = result["phases"]
    peak = max(phases, key=lambda phase: phases[phase] or 0)
    cells = [f"{phases[p] / GIB:.2f}" if phases.get(p) else "-" for p in PHASES]
    verdict = ("fits" if result["fits_with_margin"] else "tight" if result["fits"] else "does not fit")
    return f"| `{result['job']}` | {' | '.join(cells)} | {verdict}: {phases[peak] / GIB:.1f} GiB in {peak} |"


MIB = 1024 ** 2


def verdict(result: dict | None) -> str:
    if result is None:
        return "(no job)"
    if "refused" in result or "failed" in result:
        return "refused" if "refused" in result else "failed"
    return "fits" if result["fits_with_margin"] else "tight" if result["fits"] else "does not fit"


def compare(before_path: Path, after_path: Path) -> None:
    """Per job, the phases whose estimate moved between two --json runs (GiB, and the move in MiB), and
    the verdicts; jobs whose every phase is the same to the byte are counted, not listed."""
    before = {r["job"]: r for r in json.loads(before_path.read_text())["results"]}
    after = {r["job"]: r for r in json.loads(after_path.read_text())["results"]}
    print("| job | phases that moved: before -> after GiB (MiB) | verdict |")
    print("|---|---|---|")
    same = []
    for job in sorted(before.keys() | after.keys()):
        old, new = before.get(job), after.get(job)
        old_phases, new_phases = (old or {}).get("phases") or {}, (new or {}).get("phases") or {}
        moved = [f"{phase} {old_phases[phase] / GIB:.2f} -> {new_phases[phase] / GIB:.2f} "
                 f"({(new_phases[phase] - old_phases[phase]) / MIB:+,.0f})"
                 for phase in PHASES if old_phases.get(phase) != new_phases.get(phase)
                 and old_phases.get(phase) and new_phases.get(phase)]
        if not moved and verdict(old) == verdict(new) and old is not None and new is not None:
            same.append(job)
            continue
        change = verdict(new) if verdict(old) == verdict(new) else f"{verdict(old)} -> {verdict(new)}"
        print(f"| `{job}` | {'; '.join(moved) or 'none'} | {change} |")
    print(f"\n{len(same)} jobs the same to the byte in every phase: {', '.join(same) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vram", default="24GiB")
    parser.add_argument("--only", nargs="*", help="job names (file stems) to estimate; all by default")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="print which phases moved between two --json files, and estimate nothing")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    jobs = sorted((ROOT / "examples" / "aitk").glob("*.yaml"))
    if args.only:
        jobs = [job for job in jobs if job.stem in args.only]
    load_before = os.getloadavg()
    results = []
    for job in jobs:
        results.append(estimate(job, args.vram))
        print(f"{job.stem}: {results[-1]['seconds']} s", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    print(f"| job | {' | '.join(PHASES)} | at {args.vram} |")
    print("|---" * (len(PHASES) + 2) + "|")
    for result in results:
        print(row(result))
    print(f"\nload average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{sum(r['seconds'] for r in results):.0f} s for {len(results)} jobs")
    if args.json:
        args.json.write_text(json.dumps({"vram": args.vram, "load_average": [load_before, load_after],
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
