"""fitfinder's own settings: a job file's `fitfinder:` section, then the command line's options on top.

Every trainer's job carries them: an AI Toolkit job file may hold the section (trainers/aitoolkit_job.py
reads it with `read_settings`); a kohya job's files have no place for it, so its settings are the
command line's alone.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from fitfinder.errors import UserError, brief, one_line
from fitfinder.units import parse_budget

# The knobs the search may turn, by name; `fitfinder: candidates:` overrides their values.
KNOB_NAMES = (
    "buckets", "frames", "rank", "batch", "gradient_checkpointing", "quantize", "low_vram",
    "text_encoder", "optimizer", "ema", "sample_size", "sample_frames", "sampling", "layer_offloading",
)

@dataclass
class Settings:
    """fitfinder's own settings: the `fitfinder:` section, then command-line options on top."""

    vram_bytes: int | None = None
    # The host's budget (--ram, `fitfinder: ram`): a point whose host peak passes it does not fit.
    # None: no host budget (estimate, tiers), or the machine's available memory (search, probe: cli).
    ram_bytes: int | None = None
    margin: float = 0.05
    probe_steps: int = 20
    probe_timeout: float = 600.0
    trials: int = 40
    weights: str = "pretrained"
    candidates: dict[str, list] = field(default_factory=dict)
    priorities: list[str] = field(default_factory=list)
    trainer_command: str | None = None  # the user's trainer runs the probes (probe/trainer.py)

    def with_options(self, **options: Any) -> "Settings":
        """Command-line options win over the file; None means 'not given'."""
        merged = copy.deepcopy(self)
        for key, value in options.items():
            if value is not None:
                setattr(merged, key, value)
        return merged

def read_settings(section: Any) -> tuple[Settings, list[str]]:
    """The `fitfinder:` section (plain data) as Settings, with a problem for each unknown or bad key."""
    settings = Settings()
    if section is None:
        return settings, []
    if not isinstance(section, dict):
        return settings, [f"fitfinder: expected a mapping, got {brief(section)}"]
    problems: list[str] = []
    readers = {
        "vram": ("vram_bytes", lambda v: parse_budget(v, "fitfinder.vram")),
        "ram": ("ram_bytes", lambda v: parse_budget(v, "fitfinder.ram")),
        "margin": ("margin", lambda v: _in_range(v, 0.0, 0.9, "fitfinder.margin", float)),
        "probe_steps": ("probe_steps", lambda v: _in_range(v, 1, 100000, "fitfinder.probe_steps", int)),
        "probe_timeout": ("probe_timeout",
                          lambda v: _in_range(v, 1, 86400, "fitfinder.probe_timeout", float)),
        "trials": ("trials", lambda v: _in_range(v, 1, 100000, "fitfinder.trials", int)),
        "weights": ("weights", _weights),
        "candidates": ("candidates", _candidates),
        "priorities": ("priorities", _priorities),
        "trainer_command": ("trainer_command", _trainer_command),
    }
    for key, value in section.items():
        if key not in readers:
            problems.append(f"fitfinder.{one_line(key, 60)}: unknown key; known keys are {', '.join(readers)}")
            continue
        attribute, read = readers[key]
        try:
            setattr(settings, attribute, read(value))
        except UserError as exc:
            problems.append(str(exc))
    return settings, problems


def _in_range(value: Any, low: float, high: float, what: str, kind: type) -> Any:
    expected = f"{what}: expected {'an integer' if kind is int else 'a number'}, got {brief(value)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(expected)
    if not (math.isfinite(value) and low <= value <= high):  # NaN compares false with both
        raise UserError(f"{what}: must be between {low} and {high}, got {brief(value)}")
    if kind is int and value != int(value):
        raise UserError(expected)
    return kind(value)


def _trainer_command(value: Any) -> str:
    """The words are checked where the command is used (probe.trainer_command), with --trainer-command's."""
    if not isinstance(value, str) or not value.strip():
        raise UserError("fitfinder.trainer_command: expected the trainer's command line with {job}, "
                        f"got {brief(value)}")
    return value


def _weights(value: Any) -> str:
    if value not in ("random", "pretrained"):
        raise UserError(f"fitfinder.weights: expected `random` or `pretrained`, got {brief(value)}")
    return str(value)


def _candidates(value: Any) -> dict[str, list]:
    if not isinstance(value, dict):
        raise UserError(f"fitfinder.candidates: expected a mapping of knob name to a list, got {brief(value)}")
    out = {}
    for name, values in value.items():
        if name not in KNOB_NAMES:
            raise UserError(f"fitfinder.candidates.{one_line(name, 60)}: unknown knob; "
                            f"known knobs are {', '.join(KNOB_NAMES)}")
        if not isinstance(values, list) or not values:
            raise UserError(f"fitfinder.candidates.{name}: expected a non-empty list, got {brief(values)}")
        out[str(name)] = list(values)
    return out


def _priorities(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"fitfinder.priorities: expected a list of knob names, got {brief(value)}")
    unknown = [v for v in value if v not in KNOB_NAMES]
    if unknown:
        raise UserError(f"fitfinder.priorities: unknown knob {brief(unknown[0])}; "
                        f"known knobs are {', '.join(KNOB_NAMES)}")
    return list(value)
