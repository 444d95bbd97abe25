#!/usr/bin/env bash
# The GPU check: what no CPU test can show, in about 15 minutes on a machine with an NVIDIA card.
#
#   scripts/gpu_check.sh            # card 0; GPU=1 scripts/gpu_check.sh for another
#
# 1. The GPU-marked tests (tests/test_gpu.py): the cuda meter, the emulated smaller card, tiny
#    probes of every family with quantization, low_vram and 8-bit Adam on the card.
# 2. FLUX.1-dev with random weights (nothing downloaded), as AI Toolkit's 24 GB example trains it
#    (8-bit base and text encoders, bf16, adamw8bit, checkpointing, cached latents, previews at the
#    training size), probed at 512 and at 1024 under --vram 24GiB: on a larger card the process is
#    capped to emulate a 24 GiB one. Each prints its per-phase table (peak allocated, peak
#    reserved, seconds; memory outside PyTorch included).
#
# 3. The estimate against the card: `fitfinder calibrate` stores this card's overhead, then
#    FLUX.1-dev (random weights) at several points is probed with the cuda meter on the whole
#    card (no --vram cap: every phase runs to its peak) and estimated on the CPU with this
#    card's calibration; a table prints both per phase and the estimate's relative error.
#
# Needs a card with more than 24 GiB (40/48/80 GB) for the emulation to mean anything, and more
# than 40 GiB for part 3's unquantized points; about 40 GB of host memory; the project installed
# (pip install -e ".[test]" with a CUDA torch). About 15 minutes.
# The output is also written to docs/gpu-check-YYYY-MM-DD.txt: commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
GPU="${GPU:-0}"
STEPS="${STEPS:-8}"            # heaviest shape at the first, middle and last step; 8 keeps it quick
LOG="${LOG:-docs/gpu-check-$(date +%F).txt}"
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
started=$(date +%s)

echo "== $(date -u +%FT%TZ) $(hostname): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i "$GPU")"
python -c "import torch, diffusers, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'diffusers', diffusers.__version__, 'bitsandbytes', bitsandbytes.__version__)"
python -c "import importlib.metadata as m; print('optimum-quanto', m.version('optimum-quanto'))"

echo "== 1. GPU-marked tests"
CUDA_VISIBLE_DEVICES="$GPU" timeout 180 python -m pytest -q -m gpu tests/test_gpu.py

jobs="$(mktemp -d)"
trap 'rm -rf "$jobs"' EXIT
# flux_job NAME RESOLUTION QUANTIZE CHECKPOINTING: FLUX.1-dev as AI Toolkit's 24 GB example trains
# it, random weights, one bucket and previews at that size; written to $jobs/NAME.yaml.
flux_job() {
  cat > "$jobs/$1.yaml" <<YAML
job: extension
config:
  name: "gpu_check_$1"
  process:
    - type: 'sd_trainer'
      network: {type: "lora", linear: 16, linear_alpha: 16}
      datasets:
        - folder_path: "/unused"
          cache_latents_to_disk: true
          resolution: [ $2 ]
      train: {batch_size: 1, gradient_checkpointing: $4, optimizer: "adamw8bit", lr: 1e-4, dtype: bf16}
      model: {name_or_path: "black-forest-labs/FLUX.1-dev", is_flux: true, quantize: $3}
      sample: {width: $2, height: $2, guidance_scale: 4, sample_steps: 20}
fitfinder:
  weights: random
YAML
}

for resolution in 512 1024; do
  flux_job "flux-dev-$resolution" "$resolution" true true
  echo "== 2. FLUX.1-dev, random weights, ${resolution}px, --vram 24GiB, $STEPS steps"
  timeout 230 python -m fitfinder probe "$jobs/flux-dev-$resolution.yaml" --gpu "$GPU" --vram 24GiB \
    --steps "$STEPS" --timeout 220 || echo "(probe exited with $?)"
done

echo "== 3. estimate against the cuda meter: FLUX.1-dev, random weights, $STEPS steps, the whole card"
timeout 300 python -m fitfinder calibrate --gpu "$GPU"
card="$(nvidia-smi --query-gpu=name --format=csv,noheader -i "$GPU")"
# resolution, base quantization (true/false), gradient checkpointing (true/false)
for point in "512 true true" "1024 true true" "512 false true" "512 false false"; do
  read -r resolution quantize checkpointing <<<"$point"
  name="flux-dev-$resolution-q$quantize-gc$checkpointing"
  flux_job "$name" "$resolution" "$quantize" "$checkpointing"
  timeout 400 python -m fitfinder probe "$jobs/$name.yaml" --gpu "$GPU" --steps "$STEPS" --timeout 390 --json \
    > "$jobs/$name.probe.json" || echo "(probe of $name exited with $?)"
  timeout 300 python -m fitfinder estimate "$jobs/$name.yaml" --card "$card" --json \
    > "$jobs/$name.estimate.json" || true  # exit 1 only says it does not fit a budget; none is given
done
# AI Toolkit's 24 GB Flux example itself (8-bit base and T5, buckets to 1024, EMA, previews at
# 1024), random weights, under --vram 24GiB: every phase should stay under the card (docs/fidelity.md).
{ cat examples/aitk/train_lora_flux_24gb.yaml; printf 'fitfinder:\n  weights: random\n'; } > "$jobs/flux-24gb-example.yaml"
timeout 400 python -m fitfinder probe "$jobs/flux-24gb-example.yaml" --gpu "$GPU" --vram 24GiB --steps "$STEPS" \
  --timeout 390 --json > "$jobs/flux-24gb-example.probe.json" || echo "(probe of the example exited with $?)"
timeout 300 python -m fitfinder estimate "$jobs/flux-24gb-example.yaml" --card "$card" --json \
  > "$jobs/flux-24gb-example.estimate.json" || true
python - "$jobs" <<'PY'
import json, pathlib, sys
jobs = pathlib.Path(sys.argv[1])
print(f"{'point':28} {'phase':12} {'cuda meter':>12} {'estimate':>12} {'error':>8}")
worst = 0.0
for probe_file in sorted(jobs.glob("*.probe.json")):
    name = probe_file.name[: -len(".probe.json")]
    try:
        probed = json.loads(probe_file.read_text())
        estimated = json.loads((jobs / f"{name}.estimate.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"{name:28} no result: {exc}")
        continue
    if probed.get("status") != "ok":
        print(f"{name:28} the probe ended {probed.get('status')}: {probed.get('error')}")
    for phase, measured in probed.get("phases", {}).items():
        predicted = estimated["phases"].get(phase)
        if not measured or predicted is None:
            continue
        error = (predicted - measured) / measured
        worst = max(worst, abs(error))
        print(f"{name:28} {phase:12} {measured / 2**30:9.2f} GiB {predicted / 2**30:9.2f} GiB {error:+8.1%}")
print(f"largest relative error {worst:.1%} (peaks include memory outside PyTorch; estimate with this card's calibration)")
PY

echo "== done in $(( $(date +%s) - started )) s; output in $LOG"
