"""How close `fitfinder estimate` is to the sim meter, and what a full-size estimate costs.

1. Accuracy. Tiny jobs of every family (flux, sdxl, wan21, wan22) in 35 configurations, each
   run twice in fresh processes: probed with the sim meter (real tensors, real computation,
   SIM_STEPS training steps and two denoising steps per preview, as a probe runs) and estimated
   (fake tensors, the estimate's one primed step and one denoising step). The table gives each
   phase's peak tensor bytes from both and the estimate's relative error. The estimate's own
   device model (allocator rounding, GPU overhead) is left out here: the sim meter has none.
2. Speed. Full-size FLUX.1-dev estimates (512 px, checkpointing, bf16 with and without 8-bit
   quantization) and the Wan 2.2 14B example: peak, fit against 24 GiB, wall seconds of the
   estimating process and its max RSS; and one cold `fitfinder estimate` command, start to end.

    python benchmarks/estimate_accuracy.py [--json PATH] [--only FAMILY] [--skip-full-size] [--skip-accuracy]

tests/test_estimate.py runs the accuracy part (ACCURACY_CONFIGS, measure_accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from fitfinder import probe  # noqa: E402
from fitfinder.trainers import aitoolkit_job  # noqa: E402
from fitfinder.probe import estimate  # noqa: E402
from fitfinder.probe.overhead import GpuOverhead  # noqa: E402
from fitfinder.units import format_bytes  # noqa: E402

# Eight training steps: with the heaviest shape at the first, middle and last step, the last one
# meets the optimizer state (of both Wan 2.2 experts) and, with accumulation, carried gradients.
SIM_STEPS = 8
MAX_ERROR = 0.02
GiB = 2**30

ACCURACY_CONFIGS: list[tuple[str, dict]] = [
    ("flux", {}),
    ("flux", {"train.dtype": "bf16"}),
    ("flux", {"model.quantize": True}),
    ("flux", {"model.quantize": True, "model.qtype": "uint4", "train.dtype": "bf16"}),
    ("flux", {"train.optimizer": "adamw8bit", "network.linear": 32, "network.linear_alpha": 32}),
    ("flux", {"train.gradient_checkpointing": False, "train.batch_size": 2}),
    ("flux", {"model.low_vram": True, "train.cache_text_embeddings": True}),
    ("flux", {"train.unload_text_encoder": True, "datasets[0].cache_latents_to_disk": False,
              "train.gradient_accumulation": 4}),
    ("sdxl", {}),
    ("sdxl", {"train.dtype": "bf16", "network.linear": 64, "network.linear_alpha": 64}),
    ("sdxl", {"model.quantize": True, "train.dtype": "bf16"}),
    ("sdxl", {"model.quantize": True, "model.qtype": "nf4", "model.quantize_te": False}),
    ("sdxl", {"train.gradient_checkpointing": False, "train.batch_size": 2, "train.gradient_accumulation": 2}),
    ("sdxl", {"model.low_vram": True, "train.optimizer": "adamw8bit"}),
    ("sdxl", {"train.disable_sampling": True, "datasets[0].resolution": [128, 256]}),
    ("sdxl", {"sample.guidance_scale": 1, "train.skip_first_sample": True, "datasets[0].cache_latents_to_disk": False}),
    ("wan21", {}),
    ("wan21", {"train.dtype": "bf16"}),
    ("wan21", {"datasets[0].num_frames": 17, "train.gradient_checkpointing": False}),
    ("wan21", {"model.quantize": True, "model.qtype": "uint4"}),
    ("wan21", {"model.low_vram": True, "train.cache_text_embeddings": True}),
    ("wan21", {"train.batch_size": 2, "train.optimizer": "adamw8bit"}),
    ("wan21", {"datasets[0].cache_latents_to_disk": False, "train.gradient_accumulation": 2}),
    ("wan21", {"sample.num_frames": 9, "network.linear": 16, "datasets[0].resolution": [48, 64]}),
    ("wan22", {}),
    ("wan22", {"model.low_vram": True}),
    ("wan22", {"model.quantize": True, "model.qtype": "uint4", "model.low_vram": True,
               "train.cache_text_embeddings": True}),
    ("wan22", {"model.model_kwargs.train_low_noise": False}),
    ("wan22", {"train.switch_boundary_every": 2, "train.gradient_accumulation": 2}),
    ("wan22", {"train.dtype": "bf16", "train.optimizer": "adamw8bit"}),
    ("wan22", {"train.gradient_checkpointing": False, "train.unload_text_encoder": True}),
    ("wan22", {"model.quantize": True, "train.batch_size": 2}),
    # AI Toolkit's block swap (model.layer_offloading): every layer, then a share of them, 8-bit.
    ("wan21", {"model.layer_offloading": True}),
    ("wan21", {"model.layer_offloading": True, "model.layer_offloading_transformer_percent": 0.5,
               "model.layer_offloading_text_encoder_percent": 0.25, "model.quantize": True,
               "train.gradient_accumulation": 2}),
    ("wan22", {"model.layer_offloading": True, "train.gradient_checkpointing": False,
               "train.unload_text_encoder": True}),
]


# -- 1. accuracy -----------------------------------------------------------------------------------
def measure_accuracy(configs, runner=None, workers: int = 2) -> list[dict]:
    """One row per configuration and phase: sim bytes, estimated bytes, relative error.

    Each run is its own process; `workers` of them at a time (they wait on their children, so
    threads suffice).
    """
    from concurrent.futures import ThreadPoolExecutor

    runner = runner or probe.ProbeRunner(timeout_s=300)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pairs = list(pool.map(lambda config: _sim_and_estimate(runner, *config), configs))
    rows = []
    for index, ((family, changes), (sim, fake)) in enumerate(zip(configs, pairs)):
        for result, meter in ((sim, "sim"), (fake, "estimate")):
            if result["status"] != "ok":
                raise RuntimeError(f"config {index} ({family} {changes}): the {meter} run failed: "
                                   f"{result.get('error')}")
        if list(sim["phase_stats"]) != list(fake["phase_stats"]):
            raise RuntimeError(f"config {index}: phases differ: {list(sim['phase_stats'])} "
                               f"vs {list(fake['phase_stats'])}")
        for phase, stats in sim["phase_stats"].items():
            measured, estimated = stats["peak_allocated"], fake["phase_stats"][phase]["peak_live"]
            error = (estimated - measured) / measured if measured else float(estimated != 0)
            rows.append({"config": index, "family": family, "changes": changes, "phase": phase,
                         "sim_bytes": measured, "estimate_bytes": estimated, "error": error + 0.0})
    return rows


def _sim_and_estimate(runner, family: str, changes: dict) -> tuple[dict, dict]:
    """The tiny job probed on the sim meter, and the same request estimated."""
    from tests.conftest import tiny_job

    request = probe.request_for(tiny_job(family, changes), SIM_STEPS, "sim", None)
    return runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))


def print_accuracy(rows: list[dict]) -> None:
    print(f"{'#':>2}  {'family':6}  {'phase':12}  {'sim':>11}  {'estimate':>11}  {'error':>9}  changes")
    for row in rows:
        changes = ", ".join(f"{k}={v}" for k, v in row["changes"].items()) or "(the tiny job as written)"
        print(f"{row['config']:>2}  {row['family']:6}  {row['phase']:12}  {row['sim_bytes']:>11,}  "
              f"{row['estimate_bytes']:>11,}  {row['error']:>+9.4%}  {changes}")
    worst = max(rows, key=lambda r: abs(r["error"]))
    configs = len({r["config"] for r in rows})
    print(f"\n{configs} configurations, {len(rows)} phase peaks; largest error {worst['error']:+.4%} "
          f"(config {worst['config']}, {worst['family']}, {worst['phase']}); limit {MAX_ERROR:.0%}")


# -- 2. full size -----------------------------------------------------------------------------------
EXAMPLES = ROOT / "examples" / "aitk"  # the project's job files with AI Toolkit's examples' settings


def flux_dev_job(quantize: bool, resolution: int = 512):
    """AI Toolkit's FLUX.1-dev 24 GB example at one bucket and previews of the same size."""
    job = aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")
    job.set("datasets[0].resolution", [resolution])
    job.set("sample.width", resolution)
    job.set("sample.height", resolution)
    job.set("model.quantize", quantize)
    job.settings.vram_bytes = 24 * GiB
    return job


def full_size(runner) -> list[dict]:
    cases = [("FLUX.1-dev 512 GC bf16, no quantization", flux_dev_job(False)),
             ("FLUX.1-dev 512 GC bf16, 8-bit base (the 24 GB example)", flux_dev_job(True)),
             ("FLUX.1-dev 1024 GC bf16, 8-bit base", flux_dev_job(True, 1024))]
    wan = aitoolkit_job.load(EXAMPLES / "train_lora_wan22_14b_24gb.yaml")
    wan.settings.vram_bytes = 24 * GiB
    cases.append(("Wan 2.2 14B example (4-bit, low_vram, cached text)", wan))
    rows = []
    for name, job in cases:
        found = estimate.run(job, runner, GpuOverhead())
        rows.append({"case": name, **found.as_json()})
    return rows


def print_full_size(rows: list[dict]) -> None:
    for row in rows:
        verdict = "fits" if row["fits"] else f"does not fit (runs out in {row['phase']})"
        print(f"\n{row['case']}: peak {format_bytes(row['peak_bytes'])} -> {verdict} in 24 GiB; "
              f"{row['seconds']:.1f} s wall ({row['cpu_seconds']:.1f} s CPU), "
              f"max RSS {format_bytes(row['max_rss_bytes'])}")
        for phase, stats in row["phase_stats"].items():
            print(f"  {phase:12}  tensors {format_bytes(stats['peak_live']):>9}  "
                  f"peak {format_bytes(stats['peak_reserved']):>9}  {stats['seconds']:6.1f} s")


def cold_command_seconds() -> float:
    """`fitfinder estimate` on the FLUX.1-dev example at 512 without quantization, start to end
    (imports, the forkserver, the estimate)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "flux.yaml"
        flux_dev_job(False).write(path)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fitfinder", "estimate", str(path), "--vram", "24GiB"],
                       env=env, capture_output=True, text=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--only", help="accuracy for one family only")
    parser.add_argument("--skip-full-size", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("FITFINDER_CACHE", str(Path(tempfile.gettempdir()) / "fitfinder-bench-cache"))
    runner = probe.ProbeRunner(timeout_s=600)
    report = {}
    if not args.skip_accuracy:
        configs = [c for c in ACCURACY_CONFIGS if args.only in (None, c[0])]
        started = time.perf_counter()
        report["accuracy"] = measure_accuracy(configs, runner)
        print_accuracy(report["accuracy"])
        print(f"({time.perf_counter() - started:.0f} s for the accuracy part)")
    if not args.skip_full_size:
        report["full_size"] = full_size(runner)
        print_full_size(report["full_size"])
        report["cold_command_seconds"] = cold_command_seconds()
        print(f"\ncold `fitfinder estimate` (imports, forkserver, estimate): {report['cold_command_seconds']:.1f} s")
    load = os.getloadavg()
    print(f"(load average {load[0]:.2f} on {os.cpu_count()} CPUs while measuring)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
