"""A knob as a trainer declares it, and the probe's phases a knob's memory is judged in.

Every trainer's module (aitoolkit, sd_scripts, musubi_tuner) declares its knobs as `KnobSpec`s in its
own names; space.Knob takes these fields (space is the layer above: it orders them and walks them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Phases of a probe, in the order they run (see probe/recipe.py).
PHASES = ("load", "text_encoder", "latents", "sample", "train", "last_sample")
ALL = frozenset(PHASES)
DATA = frozenset({"latents", "train"})
PREVIEW = frozenset({"sample", "last_sample"})


@dataclass(frozen=True)
class KnobSpec:
    """A knob as a trainer declares it; space.Knob takes these fields (the layer above builds it)."""

    name: str  # fitfinder's name for what it does (the planner's: buckets, rank, batch, ...)
    role: str
    candidates: tuple
    desired: Any
    paths: tuple[str, ...]  # the trainer's own option or dataset keys it writes
    phases: frozenset
    title: str  # the trainer's own name for it, in tables and trial lines
    labeler: Callable[[Any], str]
    writer: Callable  # (job, value, space) -> None
    unordered: frozenset = frozenset()
    host: str = ""  # how it weighs on the host (space.HOST_ORDERS; "" for space.HOST_ORDER's by its name)
