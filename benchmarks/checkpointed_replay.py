"""Full-size estimates with the checkpointed blocks of the training step replayed and run: the same
phases to the byte, and what the replay saves (meters.CheckpointedBlocks).

Each job is estimated by `fitfinder estimate JOB --vram 24GiB --json` in a fresh process, with
FITFINDER_REPLAY_CHECKPOINTED=1 (the default) and =0, one after the other; every phase's
peak_live, peak_allocated and peak_reserved must be equal.

With --tiny, the 35 configurations of benchmarks/estimate_accuracy.py instead, each transformer
widened to BLOCKS blocks a stack (the tiny models have one or two, too few to replay): estimated
with the replay on and off (each in a fresh process) and probed with the sim meter; every phase
must be the same on and off, and off the same as the sim meter.

With --examples, every job in examples/aitk instead of the four (those fitfinder can estimate).

    python benchmarks/checkpointed_replay.py [--only NAME] [--examples] [--tiny [--blocks 6]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "aitk"
PEAKS = ("peak_live", "peak_allocated", "peak_reserved")
SIM_STEPS = 8  # as benchmarks/estimate_accuracy.py probes

# AI Toolkit ships no SDXL example: its Flux example's training, on the shipped SDXL architecture.
SDXL_JOB = """\
job: extension
config:
  name: sdxl_lora_24gb
  process:
    - type: sd_trainer
      network: {type: lora, linear: 16, linear_alpha: 16}
      datasets:
        - folder_path: /data/images
          resolution: [1024]
          cache_latents_to_disk: true
      train: {batch_size: 1, gradient_checkpointing: true, optimizer: adamw8bit, lr: 0.0001, dtype: bf16}
      model: {name_or_path: "sdxl-base", arch: sdxl}
      sample: {width: 1024, height: 1024, sample_steps: 20, guidance_scale: 5}
fitfinder: {weights: random}
"""


def jobs(folder: Path) -> dict[str, Path]:
    sdxl = folder / "sdxl_lora_24gb.yaml"
    sdxl.write_text(SDXL_JOB)
    return {"FLUX.1-dev (train_lora_flux_24gb)": EXAMPLES / "train_lora_flux_24gb.yaml",
            "Wan 2.2 14B (train_lora_wan22_14b_24gb)": EXAMPLES / "train_lora_wan22_14b_24gb.yaml",
            "SDXL 1024 (AI Toolkit's Flux example's training)": sdxl,
            "Qwen-Image (train_lora_qwen_image_24gb)": EXAMPLES / "train_lora_qwen_image_24gb.yaml"}


def every_example() -> dict[str, Path]:
    return {path.stem: path for path in sorted(EXAMPLES.glob("*.yaml"))}


def estimated(job: Path, replay: bool) -> dict | None:
    """The command's JSON; None for a job fitfinder refuses (exit 2: an adapter, a family it cannot probe)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FITFINDER_REPLAY_CHECKPOINTED": "1" if replay else "0"}
    done = subprocess.run([sys.executable, "-m", "fitfinder", "estimate", str(job), "--vram", "24GiB", "--json"],
                          env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode == 2:
        return None
    if done.returncode not in (0, 1):  # 1: does not fit, still an estimate
        raise RuntimeError(f"{job.name}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def widened(family: str, changes: dict, blocks: int) -> dict:
    """The tiny job's sim request with `blocks` blocks in each transformer stack."""
    from fitfinder import probe
    from tests.conftest import tiny_job

    request = probe.request_for(tiny_job(family, changes), SIM_STEPS, "sim", None)
    for name, part in request["model"]["arch"]["parts"].items():
        if name.startswith("transformer"):
            part.update({key: blocks for key in ("num_layers", "num_single_layers") if key in part})
    return request


def tiny_run(path: str, blocks: int, with_sim: bool) -> None:
    """Every accuracy configuration estimated (and probed) in fresh processes; rows to `path`."""
    from fitfinder import probe
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    runner, rows = probe.ProbeRunner(600), []
    for index, (family, changes) in enumerate(accuracy_configs()):
        request = widened(family, changes, blocks)
        found = runner.run(estimate.as_estimate(request, GpuOverhead.none()))
        row = {"index": index, "family": family, "changes": changes, "status": found["status"],
               "error": found.get("error"), "replayed": (found.get("replayed") or {}).get("CheckpointedBlocks", 0),
               "stats": {phase: {key: stats[key] for key in PEAKS} for phase, stats in found["phase_stats"].items()}}
        if with_sim:
            row["sim"] = {phase: stats["peak_allocated"] for phase, stats in runner.run(request)["phase_stats"].items()}
        rows.append(row)
    Path(path).write_text(json.dumps(rows))


def accuracy_configs() -> list:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from estimate_accuracy import ACCURACY_CONFIGS

    return ACCURACY_CONFIGS


def tiny(blocks: int) -> bool:
    with tempfile.TemporaryDirectory() as folder:
        runs = {}
        for replay in (True, False):
            path = Path(folder) / f"{replay}.json"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
                   "FITFINDER_REPLAY_CHECKPOINTED": "1" if replay else "0"}
            command = [sys.executable, __file__, "--tiny-run", str(path), "--blocks", str(blocks)]
            subprocess.run(command + ([] if replay else ["--sim"]), env=env, check=True)
            runs[replay] = json.loads(path.read_text())
    print(f"{'#':>2} {'family':6} {'replayed':>8} {'on = off':>8} {'off = sim':>9}  changes")
    good = True
    for on, off in zip(runs[True], runs[False]):
        same = on["status"] == off["status"] == "ok" and on["stats"] == off["stats"]
        simulated = off["status"] == "ok" and all(off["stats"][phase]["peak_live"] == peak
                                                  for phase, peak in off["sim"].items())
        good &= same and simulated
        changes = ", ".join(f"{k}={v}" for k, v in on["changes"].items()) or "(the tiny job)"
        print(f"{on['index']:>2} {on['family']:6} {on['replayed']:>8} {'yes' if same else 'NO':>8} "
              f"{'yes' if simulated else 'NO':>9}  {changes} {on['error'] or ''}")
    print(f"{blocks} blocks a stack: " + ("every phase the same on and off, and as the sim meter's" if good
                                          else "SOME PHASES DIFFER"))
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="jobs whose name contains this")
    parser.add_argument("--examples", action="store_true", help="every job in examples/aitk instead of the four")
    parser.add_argument("--tiny", action="store_true", help="the accuracy configurations, widened")
    parser.add_argument("--blocks", type=int, default=6, help="blocks a stack with --tiny")
    parser.add_argument("--tiny-run", help=argparse.SUPPRESS)
    parser.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny_run:
        tiny_run(args.tiny_run, args.blocks, args.sim)
        return
    if args.tiny:
        print(f"load average {os.getloadavg()[0]:.2f} at the start")
        sys.exit(0 if tiny(args.blocks) else 1)
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'job':50} {'phase':12} {'peak_reserved':>16} {'same':>5}   estimate CPU s: replayed / run")
    all_same = True
    with tempfile.TemporaryDirectory() as folder:
        for name, job in (every_example() if args.examples else jobs(Path(folder))).items():
            if args.only and args.only.lower() not in name.lower():
                continue
            on, off = estimated(job, True), estimated(job, False)
            if on is None or off is None:
                print(f"{name:50} (fitfinder cannot estimate this job)")
                continue
            for phase, stats in off["phase_stats"].items():
                same = all(on["phase_stats"][phase][key] == stats[key] for key in PEAKS)
                all_same &= same and list(on["phase_stats"]) == list(off["phase_stats"])
                print(f"{name:50} {phase:12} {stats['peak_reserved']:>16,} {'yes' if same else 'NO':>5}")
            print(f"{name:50} {'(all)':12} {'':>16} {'':>5}   {on.get('cpu_seconds')} / {off.get('cpu_seconds')}"
                  f"   checkpointed blocks replayed: {(on.get('replayed') or {}).get('CheckpointedBlocks')}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print("every phase the same to the byte" if all_same else "SOME PHASES DIFFER")
    sys.exit(0 if all_same else 1)


if __name__ == "__main__":
    main()
