#!/usr/bin/env bash
# The GPU check: what no CPU test can show, in under 8 minutes on one H100/H200-class card.
#
#   scripts/gpu_check.sh                  # card 0, with the Python that has the project installed
#   scripts/gpu_check.sh --wheels DIR     # a bare offline machine: the missing packages from DIR
#                                         # (made by scripts/wheelhouse.sh where the index is reachable)
#   scripts/gpu_check.sh --full           # three more points, 20 steps (about 20 minutes)
#   scripts/gpu_check.sh --dry-run [--wheels DIR]   # no GPU needed: install, jobs, estimates,
#                                         # table; the GPU commands are printed, not run
#   GPU=1, STEPS=N, LOG=FILE, PYTHON=python3, BUDGET_S=SECONDS change the defaults.
#
# 0. --wheels: `pip install --no-index --no-deps --target` the wheels into a private folder: no
#    network, no root, the machine's site-packages untouched; that folder and src/ go on PYTHONPATH.
# 1. `fitfinder calibrate` measures this card's overhead (context, cuBLAS workspace, fragmentation).
# 2. Every point is estimated on the CPU (CUDA hidden) with that calibration, in the background.
# 3. The GPU-marked tests (each tests/test_*.py that marks one): the cuda meter, the emulated
#    smaller card, tiny probes of every family with quantization, low_vram and 8-bit Adam, the
#    card's calibration and preflight.
# 4. FLUX.1-dev with random weights (nothing downloaded) as examples/aitk/train_lora_flux_24gb.yaml
#    trains it (8-bit base and text encoders, bf16, AdamW8bit, checkpointing, cached latents), at
#    one bucket with previews of the same size (as docs/estimate.md and the benchmark), probed with
#    the cuda meter, STEPS training steps (6; the peak holds from the second step on):
#      512 px, and the example as written (buckets to 1024), under --vram 24GiB: the process is
#        capped to emulate a 24 GiB card;
#      512 px without quantization on the whole card: the estimate without the 8-bit layers.
#    --full adds 1024 px 8-bit, 512 px without checkpointing and 1024 px unquantized, whole card.
# 5. One table: per point and phase the cuda meter's peak, the estimate and the relative error;
#    per point whether it fit, by the probe and by the estimate, and how long each took; the
#    GPU-marked tests' pass/fail line.
# 6. With AITK_PATH=/path/to/ai-toolkit (a checkout, its Python AITK_PYTHON, default PYTHON): the
#    first point through AI Toolkit itself (`fitfinder probe --trainer-command "AITK_PYTHON
#    AITK_PATH/run.py {job}"`, docs/trainer-probe.md), beside the built-in probe of the same point,
#    both on AITK_MODEL (a local FLUX.1-dev folder or one in the Hugging Face cache, default
#    black-forest-labs/FLUX.1-dev; AI Toolkit loads real weights), and the estimate: one table.
#    BUDGET_S grows by 600 s for it. Skipped without AITK_PATH.
#
# Each step's timeout is cut to what is left of BUDGET_S (450 s, 1800 with --full), so the check
# ends in time with what it has; a step with too little time left says that it was skipped.
# Needs: a CUDA torch, transformers, peft, accelerate, pandas, rich, typer, nvidia-ml-py and pytest
# in PYTHON, the rest from --wheels or `pip install -e ".[test]"`; a card of more than 40 GiB (the
# unquantized point peaks at about 34 GiB); about 40 GB of host memory.
# The output is also written to docs/gpu-check-YYYY-MM-DD.txt (LOG=FILE elsewhere): commit it.
set -euo pipefail
called_from="$PWD"
cd "$(dirname "$0")/.."

wheels=""; full=0; dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="${2:?--wheels needs a folder}"; shift 2 ;;
    --full) full=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -z "$wheels" ] || [[ "$wheels" = /* ]] || wheels="$called_from/$wheels"
if [ -n "$wheels" ] && ! compgen -G "$wheels/*.whl" >/dev/null; then
  echo "gpu_check.sh: no wheels in $wheels (make them with scripts/wheelhouse.sh $wheels)" >&2
  exit 2
fi
PY="${PYTHON:-python3}"
GPU="${GPU:-0}"
trainer_s=0; [ -z "${AITK_PATH:-}" ] || trainer_s=600
if [ "$full" -eq 1 ]; then STEPS="${STEPS:-20}"; BUDGET_S="${BUDGET_S:-$((1800 + trainer_s))}"; PROBE_S=400
else STEPS="${STEPS:-6}"; BUDGET_S="${BUDGET_S:-$((450 + trainer_s))}"; PROBE_S=150; fi
started=$(date +%s)
deadline=$((started + BUDGET_S))
scratch="$(mktemp -d)"
jobs="$scratch/jobs"
mkdir -p "$jobs"
estimates=()
cleanup() {
  for pid in "${estimates[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$scratch"
}
trap cleanup EXIT
if [ "$dry" -eq 1 ]; then LOG="${LOG:-${TMPDIR:-/tmp}/gpu-check-dry-run.txt}"; else LOG="${LOG:-docs/gpu-check-$(date +%F).txt}"; fi
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

# -- time: every step gets what it asks for, or what is left less 20 s for the table --------------
left() { echo $(( deadline - $(date +%s) )); }
within() {  # the timeout for a step that wants $1 seconds; 0 when under 30 s are left for it
  local want=$1 room
  room=$(( $(left) - 20 ))
  [ "$room" -ge "$want" ] || want=$room
  if [ "$want" -ge 30 ]; then echo "$want"; else echo 0; fi
}
bounded() {  # bounded LIMIT CMD...: CMD under LIMIT seconds (0: skipped); says how it ended, on stderr
  local limit=$1 rc=0
  shift
  if [ "$limit" -eq 0 ]; then echo "(skipped: $(left) s left of ${BUDGET_S} s)" >&2; return 124; fi
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "(timed out after $limit s)" >&2; fi
  return "$rc"
}
on_gpu() {  # on_gpu LIMIT CMD...: bounded, or only printed in a dry run
  if [ "$dry" -eq 1 ]; then shift; echo "(dry run, not run: $*)" >&2; return 0; fi
  bounded "$@"
}

# -- 0. the packages --------------------------------------------------------------------------------
if [ -n "$wheels" ]; then
  site="$scratch/site"
  "$PY" -m pip install --isolated --no-index --no-deps --no-compile --no-cache-dir --quiet --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  echo "== 0. $(find "$wheels" -name '*.whl' | wc -l) wheels from $wheels installed into a private folder in $(( $(date +%s) - started )) s"
else
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export FITFINDER_CACHE="${FITFINDER_CACHE:-$scratch/cache}"  # random weights and the calibration: this run's own
card="$(nvidia-smi --query-gpu=name --format=csv,noheader -i "$GPU" 2>/dev/null || true)"
echo "== $(date -u +%FT%TZ) $(hostname): GPU $GPU ${card:-(none seen by nvidia-smi)}; STEPS=$STEPS, budget ${BUDGET_S} s"
"$PY" - "$dry" "$GPU" <<'PY'
import importlib.metadata as metadata, sys
import torch
import bitsandbytes, diffusers  # noqa: F401 - what the probes import: fail here, not in every probe
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"
names = ["diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "optimum-quanto", "torchao", "optuna", "ruamel.yaml"]
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      + ", ".join(f"{name} {version(name)}" for name in names))
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: torch sees no CUDA device (GPU {sys.argv[2]}); this check needs one (--dry-run runs without)")
PY

# -- 1. the card's overhead --------------------------------------------------------------------------
echo "== 1. fitfinder calibrate --gpu $GPU"
card_option=()
if on_gpu "$(within 120)" "$PY" -m fitfinder calibrate --gpu "$GPU" --json > "$scratch/calibration.json" \
   && [ "$dry" -eq 0 ]; then
  calibrated="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["gpu_name"])' "$scratch/calibration.json" || true)"
  [ -z "$calibrated" ] || card_option=(--card "$calibrated")
fi

# -- 2. the points, and their estimates on the CPU in the background --------------------------------
# name|label|resolution|quantize|checkpointing|vram ("-": the whole card). "example": the 24 GB
# example as written (buckets 512/768/1024, EMA, previews at 1024): every phase should stay under
# 24 GiB (docs/fidelity.md).
points=("1-flux-512-q8|FLUX.1-dev 512 8-bit, 24 GiB cap|512|true|true|24GiB"
        "2-flux-1024-q8|FLUX.1-dev 1024 8-bit, 24 GiB cap|example|true|true|24GiB"
        "3-flux-512-bf16|FLUX.1-dev 512 bf16, whole card|512|false|true|-")
if [ "$full" -eq 1 ]; then
  points+=("4-flux-1024-q8-card|FLUX.1-dev 1024 8-bit, whole card|1024|true|true|-"
           "5-flux-512-bf16-nogc|FLUX.1-dev 512 bf16 no checkpointing, whole card|512|false|false|-"
           "6-flux-1024-bf16|FLUX.1-dev 1024 bf16, whole card|1024|false|true|-")
fi
"$PY" - "$jobs" "${points[@]}" <<'PY'
import json, sys
from pathlib import Path
from fitfinder.trainers import aitoolkit_job
from fitfinder.units import parse_bytes
jobs = Path(sys.argv[1])
for spec in sys.argv[2:]:
    name, label, resolution, quantize, checkpointing, vram = spec.split("|")
    job = aitoolkit_job.load("examples/aitk/train_lora_flux_24gb.yaml")
    if resolution != "example":
        job.set("datasets[0].resolution", [int(resolution)])
        job.set("sample.width", int(resolution))
        job.set("sample.height", int(resolution))
    job.set("model.quantize", quantize == "true")
    job.set("train.gradient_checkpointing", checkpointing == "true")
    header = [f"scripts/gpu_check.sh: {label}",
              "examples/aitk/train_lora_flux_24gb.yaml" + (" as written" if resolution == "example" else
                                                           " at one bucket, previews of that size") + ", random weights"]
    (jobs / f"{name}.yaml").write_text(job.dumps(header) + "fitfinder:\n  weights: random\n")
    budget = None if vram == "-" else parse_bytes(vram)
    (jobs / f"{name}.point.json").write_text(json.dumps({"label": label, "budget_bytes": budget}))
PY
echo "== 2. estimating ${#points[@]} points on the CPU in the background, ${card_option[*]:-with the default overhead (no calibration)}"
estimate_limit=$(within 300)
for spec in "${points[@]}"; do
  IFS='|' read -r name _ _ _ _ vram <<<"$spec"
  vram_option=(); [ "$vram" = "-" ] || vram_option=(--vram "$vram")
  (
    begun=$(date +%s)
    # Exit code 1 says "does not fit": the JSON on stdout is the result either way.
    CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2 bounded "$estimate_limit" "$PY" -m fitfinder estimate \
      "$jobs/$name.yaml" "${card_option[@]}" "${vram_option[@]}" --json \
      > "$jobs/$name.estimate.json" 2> "$jobs/$name.estimate.log" || true
    echo $(( $(date +%s) - begun )) > "$jobs/$name.estimate.seconds"
  ) &
  estimates+=("$!")
done

# -- 3. the GPU-marked tests ------------------------------------------------------------------------
mapfile -t gpu_tests < <(grep -l "pytest.mark.gpu" tests/test_*.py)
echo "== 3. GPU-marked tests: ${gpu_tests[*]}"
CUDA_VISIBLE_DEVICES="$GPU" on_gpu "$(within 240)" "$PY" -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}" \
  | tee "$scratch/tests.txt" || true
tests_line="$(grep -E "[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran" "$scratch/tests.txt" | tail -1 || true)"
[ "$dry" -eq 0 ] || tests_line="(dry run: not run)"

# -- 4. FLUX.1-dev on the card, one point after the other ------------------------------------------
for spec in "${points[@]}"; do
  IFS='|' read -r name label _ _ _ vram <<<"$spec"
  vram_option=(); [ "$vram" = "-" ] || vram_option=(--vram "$vram")
  echo "== 4. $label: fitfinder probe, $STEPS steps"
  limit=$(within "$PROBE_S")
  begun=$(date +%s)
  # The probe's own timeout ends it with a result line before the outer one strikes.
  on_gpu "$limit" "$PY" -m fitfinder probe "$jobs/$name.yaml" --gpu "$GPU" "${vram_option[@]}" --steps "$STEPS" \
    --timeout $(( limit > 40 ? limit - 20 : limit )) --json > "$jobs/$name.probe.json" || true
  [ "$dry" -eq 1 ] || echo $(( $(date +%s) - begun )) > "$jobs/$name.probe.seconds"
done

# -- 5. the table ------------------------------------------------------------------------------------
echo "== 5. waiting for the estimates ($(left) s left)"
for pid in "${estimates[@]}"; do wait "$pid" || true; done
estimates=()
for log in "$jobs"/*.estimate.log; do  # an estimate that failed says why
  if [ -s "$log" ] && ! [ -s "${log%.log}.json" ]; then echo "$(basename "$log"): $(tail -3 "$log")"; fi
done
echo "== FLUX.1-dev, random weights: the cuda meter against the estimate"
"$PY" scripts/gpu_check_table.py "$jobs" "$tests_line"

# -- 6. AI Toolkit itself on the first point, beside the built-in probe -----------------------------
if [ -n "${AITK_PATH:-}" ]; then
  AITK_PY="${AITK_PYTHON:-$PY}"
  model="${AITK_MODEL:-black-forest-labs/FLUX.1-dev}"
  IFS='|' read -r name label _ _ _ vram <<<"${points[0]}"
  "$PY" - "$jobs/$name.yaml" "$jobs/aitk.yaml" "$model" "$scratch/images" <<'PY'
import sys
from pathlib import Path
from PIL import Image
from fitfinder.trainers import aitoolkit_job
source, target, model, images = sys.argv[1:]
Path(images).mkdir(parents=True, exist_ok=True)
for i in range(4):  # a dataset AI Toolkit can read: four noise images and their captions
    Image.effect_noise((768, 768), 40 + 10 * i).convert("RGB").save(f"{images}/{i}.png")
    Path(f"{images}/{i}.txt").write_text(f"a photo of noise number {i}")
job = aitoolkit_job.load(source)
job.set("model.name_or_path", model)
job.set("datasets[0].folder_path", images)
Path(target).write_text(job.dumps(["scripts/gpu_check.sh: the first point, on real weights, for AI Toolkit"]))
PY
  trainer_command="$(printf '%q %q {job}' "$AITK_PY" "$AITK_PATH/run.py")"  # split as shell words, never run by one
  echo "== 6. $label through AI Toolkit ($AITK_PATH, $model): fitfinder probe --trainer-command \"$trainer_command\""
  on_gpu "$(within 420)" "$PY" -m fitfinder probe "$jobs/aitk.yaml" --gpu "$GPU" --vram "$vram" --steps "$STEPS" \
    --trainer-command "$trainer_command" --timeout 400 --json > "$jobs/aitk.trainer.json" || true
  echo "== 6. the same point, the built-in probe on the same weights"
  on_gpu "$(within 150)" "$PY" -m fitfinder probe "$jobs/aitk.yaml" --gpu "$GPU" --vram "$vram" --steps "$STEPS" \
    --timeout 130 --json > "$jobs/aitk.builtin.json" || true
  "$PY" - "$jobs/aitk.trainer.json" "$jobs/aitk.builtin.json" <<'PY'
import json, sys
from fitfinder.units import format_bytes
def read(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return {}
trainer, builtin = read(sys.argv[1]), read(sys.argv[2])
if not trainer:
    print("(no trainer probe result: dry run, skipped or failed; see above)")
    raise SystemExit(0)
estimate = (trainer.get("estimate") or {}).get("phase_stats") or {}
print(f"{'phase':<13} {'AI Toolkit':>12} {'built-in':>12} {'estimate*':>12}")
for phase in ("load", "text_encoder", "latents", "sample", "train", "last_sample"):
    cells = [trainer.get("phases", {}).get(phase), builtin.get("phases", {}).get(phase),
             estimate.get(phase, {}).get("peak_allocated")]
    if any(cells):
        print(f"{phase:<13} " + " ".join(f"{format_bytes(c) if c else '-':>12}" for c in cells))
for name, result in (("AI Toolkit", trainer), ("built-in", builtin)):
    print(f"{name}: {result.get('status')}{' in ' + result['phase'] if result.get('phase') else ''}, "
          f"peak {format_bytes(result.get('peak_bytes'))}; {(result.get('error') or '')[:300]}")
print("* the estimate's allocator blocks, no overhead model; the trainer's phases are those its log marked"
      f" ({(trainer.get('trainer') or {}).get('phases_from')})")
PY
fi
echo "== done in $(( $(date +%s) - started )) s; output in $LOG"
