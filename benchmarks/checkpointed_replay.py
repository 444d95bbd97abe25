"""Full-size estimates with the checkpointed blocks of the training step replayed and run: the same
phases to the byte, and what the replay saves (meter.CheckpointedBlocks).

Each job is estimated by `fitfinder estimate JOB --vram 24GiB --json` in a fresh process, with
FITFINDER_REPLAY_CHECKPOINTED=1 (the default) and =0, one after the other; every phase's
peak_live, peak_allocated and peak_reserved must be equal.

    python benchmarks/checkpointed_replay.py [--only NAME]
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


def estimated(job: Path, replay: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FITFINDER_REPLAY_CHECKPOINTED": "1" if replay else "0"}
    done = subprocess.run([sys.executable, "-m", "fitfinder", "estimate", str(job), "--vram", "24GiB", "--json"],
                          env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode not in (0, 1):  # 1: does not fit, still an estimate
        raise RuntimeError(f"{job.name}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="jobs whose name contains this")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'job':50} {'phase':12} {'peak_reserved':>16} {'same':>5}   estimate CPU s: replayed / run")
    all_same = True
    with tempfile.TemporaryDirectory() as folder:
        for name, job in jobs(Path(folder)).items():
            if args.only and args.only.lower() not in name.lower():
                continue
            on, off = estimated(job, True), estimated(job, False)
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
