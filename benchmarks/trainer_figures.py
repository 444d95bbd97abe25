"""The published kohya configurations estimated, each beside its published figure: docs/trainers.md's table.

    python benchmarks/trainer_figures.py            # every row (about 3 minutes an estimate on 2 busy cores)
    python benchmarks/trainer_figures.py --from DIR  # the table from DIR/NAME.json (`fitfinder estimate --json`)

Each row is a job file under examples/ (the trainers' own form, and the same settings through AI
Toolkit's recipe under examples/*/as_aitk/), estimated with `fitfinder estimate FILE --json` (the
full-size architecture on fake tensors, the default GPU overhead). The published figures are the
trainers' own words; nothing here is fitted to them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30  # a card sold as "24 GB" has 24 GiB (search/tiers.py)
# (job file under examples/, AI Toolkit's equivalent or None, published GB, the trainer's words)
ROWS = [
    ("sd_scripts/flux_lora_24gb.sh", "sd_scripts/as_aitk/flux_lora_24gb.yaml", 24,
     "sd-scripts README: the sample command \"will work with 24GB VRAM GPUs\" (batch 2)"),
    ("sd_scripts/flux_lora_16gb.sh", "sd_scripts/as_aitk/flux_lora_16gb.yaml", 16,
     "\"can be done with 16GB VRAM GPUs with the batch size of 1\""),
    ("sd_scripts/flux_lora_12gb.sh", None, 12, "\"12GB VRAM GPUs with --blocks_to_swap 16 with 8bit AdamW\""),
    ("sd_scripts/flux_lora_10gb.sh", None, 10, "\"10GB VRAM GPUs will work with 22 blocks swapped\" (fp8 T5XXL)"),
    ("sd_scripts/flux_lora_8gb.sh", None, 8, "\"8GB VRAM GPUs will work with 28 blocks swapped\" (fp8 T5XXL)"),
    ("musubi_tuner/qwen_image_lora_42gb.sh", "musubi_tuner/as_aitk/qwen_image_lora_42gb.yaml", 42,
     "musubi-tuner docs/qwen_image.md: no option, 42GB"),
    ("musubi_tuner/qwen_image_lora_30gb.sh", "musubi_tuner/as_aitk/qwen_image_lora_30gb.yaml", 30,
     "--fp8_base --fp8_scaled: 30GB"),
    ("musubi_tuner/qwen_image_lora_24gb.sh", "musubi_tuner/as_aitk/qwen_image_lora_24gb.yaml", 24,
     "+ --blocks_to_swap 16: 24GB"),
    ("musubi_tuner/qwen_image_lora_12gb.sh", "musubi_tuner/as_aitk/qwen_image_lora_12gb.yaml", 12,
     "+ --blocks_to_swap 45: 12GB"),
]


def estimate(job: str, cache: Path | None) -> dict | None:
    name = ("aitk_" if job.endswith(".yaml") else "") + Path(job).stem
    if cache is not None:
        found = cache / f"{name}.json"
        try:
            return json.loads(found.read_text())
        except (OSError, ValueError):  # not there, or still being written
            return None
    result = subprocess.run([sys.executable, "-m", "fitfinder", "estimate", str(ROOT / "examples" / job), "--json",
                             "--timeout", "3600"], capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout) if result.stdout.strip() else None


def _cell(found: dict | None) -> tuple[str, float | None]:
    if not found:
        return "-", None
    phases = found["phases"]
    top = max(phases, key=phases.get)
    return f"{phases[top] / GiB:.1f} GiB ({top})", phases[top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="cache", type=Path, help="read NAME.json files instead of estimating")
    args = parser.parse_args()
    print("| job | published | the trainer's recipe (its highest phase) | ratio | AI Toolkit's recipe | ratio | "
          "train phase |")
    print("|---|---|---|---|---|---|---|")
    for job, aitk, published, words in ROWS:
        found = estimate(job, args.cache)  # once: a full-size estimate takes minutes
        own, own_peak = _cell(found)
        theirs, theirs_peak = _cell(estimate(aitk, args.cache)) if aitk else ("no equivalent", None)
        card = published * GiB
        ratio = f"{own_peak / card:.2f}" if own_peak else "-"
        their_ratio = f"{theirs_peak / card:.2f}" if theirs_peak else "-"
        train = f"{found['phases']['train'] / GiB:.1f} GiB" if found else "-"
        print(f"| `{job}`: {words} | {published} GB | {own} | {ratio} | {theirs} | {their_ratio} | {train} |")


if __name__ == "__main__":
    main()
