"""What a GPU holds beyond the tensors: the estimate's overhead model, and its calibration.

An estimate counts tensor storages. A card shows more (the cuda meter reports it all):

- the CUDA context and the libraries' own memory (kernels, cuBLAS/cuDNN handles), outside
  PyTorch's allocator: `context_bytes`;
- the cuBLAS workspace, which PyTorch allocates through its caching allocator at the first
  matrix product and keeps for the life of the process: `workspace_bytes`;
- the caching allocator's fragmentation: reserved segments it cannot hand out in one piece,
  as a share of the peak allocated bytes: `fragmentation`.

The defaults are documented guesses for a recent card; the probes, like AI Toolkit, run under
the user's PYTORCH_CUDA_ALLOC_CONF (the default allocator unless they set one).
`fitfinder calibrate --gpu N` measures the three on a real card under that same setting and
stores them under the cache folder, keyed by the card's name, for later estimates.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fitfinder.errors import RunFailed, UserError
from fitfinder.files import write_atomic
from fitfinder.models import cache_dir
from fitfinder.probe import preflight
from fitfinder.units import format_bytes

MiB = 2**20
SIM_CARD = "cpu (sim meter)"  # the card a sim meter's probes are recorded on
# CUDA context with lazily loaded modules plus cuBLAS/cuDNN handles after the first matmul and
# attention call: about 0.4-0.6 GiB on Ampere/Ada/Hopper cards with CUDA 12.
DEFAULT_CONTEXT_BYTES = 512 * MiB
# PyTorch's default cuBLAS workspace on Hopper (CUBLAS_WORKSPACE_CONFIG=:4096:8, 32 MiB); older
# cards default to less (:4096:2:16:8, about 8 MiB), so this errs on the heavy side.
DEFAULT_WORKSPACE_BYTES = 32 * MiB
# Reserved over allocated at a phase's peak: a few percent. Measured with expandable segments;
# the default allocator (what AI Toolkit runs under) is not yet calibrated on a card (docs/fidelity.md).
DEFAULT_FRAGMENTATION = 0.03


@dataclass(frozen=True)
class GpuOverhead:
    """The memory a card holds beyond the tensor storages, and where the numbers come from."""

    context_bytes: int = DEFAULT_CONTEXT_BYTES
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    fragmentation: float = DEFAULT_FRAGMENTATION
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name in ("context_bytes", "workspace_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} cannot be negative but got {getattr(self, name)}")
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"fragmentation must be in [0, 1) but got {self.fragmentation}")

    def device_peaks(self, allocated_bytes: int) -> tuple[int, int]:
        """(allocated, reserved) as the cuda meter reports a phase: the allocator's blocks plus the
        workspace, then the fragmentation on top, each plus the context."""
        allocated = allocated_bytes + self.workspace_bytes
        reserved = allocated + math.ceil(allocated * self.fragmentation)
        return allocated + self.context_bytes, reserved + self.context_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "GpuOverhead":
        if not values:
            return cls()
        known = {k: values[k] for k in ("context_bytes", "workspace_bytes", "fragmentation", "source") if k in values}
        return cls(**known)

    def describe(self) -> str:
        if self.source == "none":
            return "no GPU overhead: tensor bytes only, as the sim meter counts them"
        return (f"GPU overhead ({self.source}): context {format_bytes(self.context_bytes)}, "
                f"cuBLAS workspace {format_bytes(self.workspace_bytes)}, fragmentation {self.fragmentation:.1%}")

    @classmethod
    def none(cls) -> "GpuOverhead":
        """No device at all: estimates are then the tensor bytes alone, as the sim meter counts
        them (no allocator rounding either)."""
        return cls(0, 0, 0.0, "none")


# -- calibration: measured on a card, stored by its name -------------------------------------------
def calibration_dir() -> Path:
    return cache_dir() / "calibration"


def card_key(gpu_name: str) -> str:
    """A file name for a card: 'NVIDIA GeForce RTX 4090' -> 'nvidia-geforce-rtx-4090'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"


def from_measurement(measured: dict[str, Any]) -> GpuOverhead:
    """The overhead model from one calibration run's raw numbers (see _calibrate_gpu.py).

    context: what the card lost to this process beyond PyTorch's reserved segments, with the
    memory other processes held before it started taken off; workspace: what the first matrix
    product left allocated beyond its output; fragmentation: reserved over allocated at the peak
    of a training-like workload, less one (never below zero).
    """
    context = measured["used_after_bytes"] - measured["used_before_bytes"] - measured["reserved_bytes"]
    workspace = measured["allocated_after_matmul_bytes"] - measured["allocated_before_matmul_bytes"] \
        - measured["matmul_output_bytes"]
    fragmentation = measured["workload_peak_reserved_bytes"] / measured["workload_peak_allocated_bytes"] - 1
    return GpuOverhead(context_bytes=max(int(context), 0), workspace_bytes=max(int(workspace), 0),
                       fragmentation=round(min(max(fragmentation, 0.0), 0.5), 4),
                       source=f"calibrated on {measured['gpu_name']}")


def save(model: GpuOverhead, measured: dict[str, Any], folder: Path | None = None) -> Path:
    """Store a calibration under the cache folder, one file per card name."""
    folder = folder or calibration_dir()
    path = folder / f"{card_key(measured['gpu_name'])}.json"
    write_atomic(path, json.dumps({"gpu_name": measured["gpu_name"], "overhead": model.as_dict(),
                                   "measured": measured}, indent=2) + "\n")
    return path


def stored(folder: Path | None = None) -> dict[str, GpuOverhead]:
    """Every stored calibration, by card name; a file that cannot be read is named in the error."""
    folder = folder or calibration_dir()
    found = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            found[str(data["gpu_name"])] = GpuOverhead.from_dict(data["overhead"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path}: not a fitfinder calibration ({type(exc).__name__}: {exc}); "
                            "delete it and run `fitfinder calibrate --gpu N` again") from None
    return found


def for_card(text: str, folder: Path | None = None) -> GpuOverhead:
    """The stored calibration of the card whose name contains `text` (any case); exactly one must."""
    calibrations = stored(folder)
    wanted = text.strip().lower()
    exact = [name for name in calibrations if name.lower() == wanted or card_key(name) == card_key(text)]
    matching = exact or [name for name in calibrations if wanted and wanted in name.lower()]
    if len(matching) == 1:
        return calibrations[matching[0]]
    known = ", ".join(calibrations) or "none yet; run `fitfinder calibrate --gpu N` on that card"
    what = "matches more than one" if matching else "matches no"
    raise UserError(f"--card: {text!r} {what} stored calibration (stored: {known})")


def for_gpu(index: int, folder: Path | None = None) -> GpuOverhead:
    """The stored calibration of CUDA device `index` (read through NVML), or the defaults."""
    name = gpu_name(index)
    if name is None:
        return GpuOverhead()
    return stored(folder).get(name, GpuOverhead())


def gpu_name(index: int) -> str | None:
    """The name of CUDA device `index` through NVML (no CUDA context here), or None without one."""
    try:
        return preflight.read_card(index).name
    except Exception:  # noqa: BLE001 - no driver, no card: no name
        return None


# -- fitfinder calibrate --gpu N ---------------------------------------------------------------------
CALIBRATE_TIMEOUT_S = 300.0


def calibrate(index: int, folder: Path | None = None) -> tuple[GpuOverhead, Path, dict[str, Any]]:
    """Measure the card at `index` in a short subprocess, store and return its overhead model.

    The measurement runs in its own process (`_calibrate_gpu.py`) so that its context is all the
    CUDA this process ever makes, and is gone when it ends.
    """
    import subprocess
    import sys

    script = Path(__file__).with_name("_calibrate_gpu.py")
    env = dict(os.environ)  # measured under the user's allocator setting, as the probes and AI Toolkit run
    try:
        done = subprocess.run([sys.executable, str(script), str(index)], capture_output=True, text=True,
                              timeout=CALIBRATE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"calibrating GPU {index} took more than {CALIBRATE_TIMEOUT_S:g} s; "
                        "is the card hung?") from None
    measured = parse_measurement(done.stdout, done.stderr)
    model = from_measurement(measured)
    return model, save(model, measured, folder), measured


def parse_measurement(stdout: str, stderr: str = "") -> dict[str, Any]:
    """The calibration child's one JSON line, or RunFailed saying why there is none."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = " | ".join(stderr.strip().splitlines()[-3:])[-400:]
        raise RunFailed(f"the calibration printed no result{': ' + tail if tail else ''}") from None
    if not answer.get("ok"):
        raise RunFailed(f"calibration failed: {answer.get('error', 'no reason given')}")
    return answer


# -- fitfinder calibrate --study NAME: the estimate fitted to a trainer's own probes ----------------
@dataclass(frozen=True)
class Pair:
    """One phase of one trainer probe: what the trainer held, and the estimate of the same point."""

    trial: int
    phase: str
    measured_bytes: int  # the trainer's peak (cuda: reserved plus outside PyTorch; sim: tensor bytes)
    estimated_bytes: int  # the estimate's allocator blocks (cuda) or tensor bytes (sim), no overhead


@dataclass(frozen=True)
class TrainerFit:
    """The overhead model that turns the estimate into what a trainer held, and how far the pairs
    still lie from it: the estimate-guided search's error band for that trainer on that card."""

    overhead: GpuOverhead
    band: float  # the largest relative distance of a pair from the fitted model
    pairs: int


def fit_pairs(pairs: list[Pair], source: str, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> TrainerFit:
    """Least squares of measured = context + (1 + fragmentation) x (estimated + workspace), the
    overhead model's own form (GpuOverhead.device_peaks), over every pair.

    Fragmentation is the slope less one (kept within 0-50%, as a card's calibration keeps it), the
    context what remains of the intercept once the workspace (not told apart from it by the pairs)
    is taken off (never below zero). One size alone gives no slope: then the default fragmentation
    stands and the context is the mean rest. The band: the largest |measured / predicted - 1|.
    """
    if not pairs:
        raise UserError("no pairs to fit: the study has no trainer probe that ran a phase with its estimate")
    xs = [p.estimated_bytes for p in pairs]
    ys = [p.measured_bytes for p in pairs]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread > 0 else \
        1 + DEFAULT_FRAGMENTATION
    fragmentation = round(min(max(slope - 1, 0.0), 0.5), 4)
    factor = 1 + fragmentation
    context = max(0, round(sum(y - factor * (x + workspace_bytes) for x, y in zip(xs, ys)) / len(xs)))
    model = GpuOverhead(context_bytes=int(context), workspace_bytes=workspace_bytes, fragmentation=fragmentation,
                        source=source)
    band = max(abs(y / model.device_peaks(x)[1] - 1) for x, y in zip(xs, ys))
    return TrainerFit(model, round(min(band, 0.9), 4), len(pairs))


def trainer_fit_path(card: str, dialect: str, folder: Path | None = None) -> Path:
    return (folder or calibration_dir()) / "trainers" / f"{card_key(card)}--{dialect}.json"


def save_trainer_fit(fit: TrainerFit, card: str, dialect: str, pairs: list[Pair], study: str,
                     folder: Path | None = None) -> Path:
    """Store a trainer's fit on a card, apart from the card's own calibration (`calibrate --gpu`
    measures fitfinder's recipe on the card; this, a trainer's recipe against the estimate)."""
    path = trainer_fit_path(card, dialect, folder)
    write_atomic(path, json.dumps({"card": card, "dialect": dialect, "study": study, "overhead": fit.overhead.as_dict(),
                                   "band": fit.band, "pairs": [asdict(p) for p in pairs]}, indent=2) + "\n")
    return path


def trainer_fit(card: str, dialect: str, folder: Path | None = None) -> TrainerFit | None:
    """The stored fit of a trainer on a card, or None (none made yet, or a file that cannot be read)."""
    try:
        data = json.loads(trainer_fit_path(card, dialect, folder).read_text())
        return TrainerFit(GpuOverhead.from_dict(data["overhead"]), float(data["band"]), len(data.get("pairs", [])))
    except (OSError, ValueError, KeyError, TypeError):
        return None
