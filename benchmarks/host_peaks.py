"""Host memory, the second wall (issue 32 item 5): docs/estimate.md's two tables.

1. The estimate's host peak per phase of AI Toolkit's Wan 2.2 14B and FLUX.1-dev examples, as
   written, with `model.low_vram` switched, and with 100% layer offloading (`model.layer_offloading`,
   every transformer and text-encoder layer), each `fitfinder estimate FILE --vram 24GiB --json`
   in a fresh process, beside the device peak.
2. The sim meter against the measured resident memory of the same tiny probe on this machine: the
   sim meter's device is this CPU, so the process's resident peak in a phase (VmHWM after a reset,
   `host_rss`) should be what it held at the start plus both sides' tensors at their joint peak
   (`both_tensors`); the table prints both and their difference, per phase, for the tests' tiny
   Wan 2.2 job as written, with low_vram and with layer offloading.
3. How far apart a budget must set two points (tests/test_host.py): the load's host peak of the same
   tiny probe with all its layers offloaded and with none, each probed several times by
   `fitfinder probe` in its own process, for the tiny FLUX.2 and the tiny Wan 2.2, started as
   `python -m fitfinder` and as the `fitfinder` command: the spread of one point's peak from one
   process to the next, and between launchers, against the gap between the two points.

    python benchmarks/host_peaks.py [--only estimates|sim|spread] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from fitfinder.trainers import aitoolkit_job  # noqa: E402

PHASES = ("load", "text_encoder", "latents", "sample", "train", "last_sample")
GIB, MIB = 1024 ** 3, 1024 ** 2
EXAMPLES = ("train_lora_wan22_14b_24gb.yaml", "train_lora_flux_24gb.yaml")
OFFLOADED = {"model.layer_offloading": True, "model.layer_offloading_transformer_percent": 1.0,
             "model.layer_offloading_text_encoder_percent": 1.0}


def variants(job) -> list[tuple[str, dict]]:
    low_vram = bool(job.get("model.low_vram", False))
    return [("as written", {}), (f"low_vram {'off' if low_vram else 'on'}", {"model.low_vram": not low_vram}),
            ("100% layer offloading", OFFLOADED)]


def estimate(job, changes: dict, folder: Path) -> dict:
    """One `fitfinder estimate --json` of the job with `changes`, in a fresh process."""
    changed = job.copy()
    for path, value in changes.items():
        changed.set(path, value)
    path = changed.write(folder / f"job{len(list(folder.iterdir()))}.yaml")
    done = subprocess.run([sys.executable, "-m", "fitfinder", "estimate", str(path), "--vram", "24GiB", "--json"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise SystemExit(f"{path.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def estimates() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in EXAMPLES:
            job = aitoolkit_job.load(ROOT / "examples" / "aitk" / name)
            for label, changes in variants(job):
                answer = estimate(job, changes, Path(folder))
                stats = answer["phase_stats"]
                rows.append({"job": Path(name).stem, "variant": label,
                             "device": {p: stats[p]["peak_reserved"] for p in PHASES if p in stats},
                             "host": {p: stats[p].get("peak_host") for p in PHASES if p in stats},
                             "pinned": {p: stats[p].get("host_pinned", 0) for p in PHASES if p in stats}})
    return rows


def print_estimates(rows: list[dict]) -> None:
    print("| job | variant | " + " | ".join(PHASES) + " | host peak |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    for row in rows:
        cells = []
        for phase in PHASES:
            device, host = row["device"].get(phase), row["host"].get(phase)
            cells.append("-" if device is None else f"{device / GIB:.1f} / {host / GIB:.1f}")
        top = max(row["host"], key=lambda p: row["host"][p] or 0)
        pinned = row["pinned"].get(top) or 0
        note = f" ({pinned / GIB:.1f} pinned)" if pinned else ""
        print(f"| `{row['job']}` | {row['variant']} | {' | '.join(cells)} | "
              f"{row['host'][top] / GIB:.1f} GiB in {top}{note} |")
    print("\ncells: device / host GiB per phase (host: the process before its first model, as this one "
          "holds it, plus host tensors)")


def sim_against_rss() -> list[dict]:
    from fitfinder import probe
    from tests.conftest import tiny_job  # the tests' tiny Wan 2.2 job: two experts, low_vram and offloading act

    runner = probe.ProbeRunner(timeout_s=300)
    rows = []
    for label, changes in (("as written", {}), ("low_vram", {"model.low_vram": True}),
                           ("layer offloading", OFFLOADED)):
        result = runner.run(probe.request_for(tiny_job("wan22", changes), 4, "sim", None))
        if result["status"] != "ok":
            raise SystemExit(f"demo {label}: {result['status']} {result.get('error')}")
        outside = result["phase_stats"]["load"]["peak_host"] - result["phase_stats"]["load"]["host_tensors"]
        for phase, stats in result["phase_stats"].items():
            rows.append({"variant": label, "phase": phase, "start": outside, "both_tensors": stats["both_tensors"],
                         "counted": outside + stats["both_tensors"], "measured": stats.get("host_rss")})
    return rows


def print_sim(rows: list[dict]) -> None:
    print("| tiny Wan 2.2 | phase | process at start | tensors (both sides) | counted | measured RSS peak "
          "| measured - counted |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        measured = row["measured"]
        gap = "-" if measured is None else f"{(measured - row['counted']) / MIB:+.1f}"
        print(f"| {row['variant']} | {row['phase']} | {row['start'] / MIB:.1f} | {row['both_tensors'] / MIB:.2f} | "
              f"{row['counted'] / MIB:.1f} | {'-' if measured is None else f'{measured / MIB:.1f}'} | {gap} |")
    print("\nMiB. counted: what the process held when its meter started plus both sides' tensors at their "
          "joint peak; measured: VmHWM in the phase (after clear_refs), children included")


LAUNCHERS = {"python -m fitfinder": [sys.executable, "-m", "fitfinder"], "fitfinder": ["fitfinder"]}


def spread(repeats: int) -> list[dict]:
    """`fitfinder probe FILE --json` of each point `repeats` times, each its own process, by each launcher."""
    from tests.conftest import tiny_job

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for family in ("flux2", "wan22"):
            for launcher, command in LAUNCHERS.items():
                peaks = {}
                for share, changes in ((1.0, OFFLOADED), (0.0, {"model.layer_offloading": False})):
                    path = Path(folder) / f"{family}_{share:.0f}.yaml"
                    path.write_text(tiny_job(family, changes).dumps() + "fitfinder: {weights: random}\n")
                    peaks[share] = [_probe_load_peak(command, path) for _ in range(repeats)]
                rows.append({"family": family, "launcher": launcher, "offloaded": peaks[1.0],
                             "not_offloaded": peaks[0.0]})
    return rows


def _probe_load_peak(command: list[str], path: Path) -> int:
    done = subprocess.run([*command, "probe", str(path), "--json", "--steps", "1"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if done.returncode != 0:
        raise SystemExit(f"{path.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)["host_phases"]["load"]


def print_spread(rows: list[dict]) -> None:
    print("| tiny model | launcher | load peak, 100% offloaded (min - max) | no offloading (min - max) "
          "| spread (larger) | gap (min offloaded - max not) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        on, off = row["offloaded"], row["not_offloaded"]
        wide = max(max(on) - min(on), max(off) - min(off))
        print(f"| {row['family']} | `{row['launcher']}` | {min(on):,} - {max(on):,} | {min(off):,} - {max(off):,} "
              f"| {wide:,} | {min(on) - max(off):,} |")
    print(f"\nbytes; each point probed {len(rows[0]['offloaded'])} times by `fitfinder probe FILE --json --steps 1`, "
          "each its own process (the load phase's host peak: the process at its start plus host tensors)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("estimates", "sim", "spread"))
    parser.add_argument("--repeats", type=int, default=3, help="probes of each point for the spread table")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    options = parser.parse_args()
    out = {}
    if options.only in (None, "estimates"):
        out["estimates"] = estimates()
        print_estimates(out["estimates"])
        print()
    if options.only in (None, "sim"):
        out["sim"] = sim_against_rss()
        print_sim(out["sim"])
        print()
    if options.only in (None, "spread"):
        out["spread"] = spread(options.repeats)
        print_spread(out["spread"])
    if options.json:
        options.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
