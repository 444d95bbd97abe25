"""Byte sizes as people write them: '24GiB', '300MiB', '16GB', '1.5 TiB'."""

from __future__ import annotations

import math
import re

from fitfinder.errors import UserError

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # GPU memory is sold in GiB while labelled "GB"; a bare letter means the binary unit.
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]{0,3})\s*$")
# A budget below 1 MiB is a typo (`--vram 0.5` meant GiB; it would be 0 bytes), one above 1 PiB too.
MIN_BUDGET, MAX_BUDGET = 2**20, 2**50


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'24GiB' -> 25769803776. A plain number is bytes. Raises UserError naming `what`."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UserError(f"{what}: expected a size such as 24GiB, got {_shown(text)}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS and unit != "":
            raise UserError(
                f"{what}: {_shown(text)} is not a size; write a number and a unit such as 24GiB, 300MiB or 16GB"
            )
        value = float(match.group(1)) * _UNITS.get(unit, 1)
    if not math.isfinite(value):
        raise UserError(f"{what}: must be a finite size, got {_shown(text)}")
    if value <= 0:
        raise UserError(f"{what}: must be positive, got {_shown(text)}")
    return int(value)


def parse_budget(text: str | int | float, what: str) -> int:
    """A memory budget (--vram, `fitfinder: vram`): a size between 1 MiB and 1 PiB."""
    value = parse_bytes(text, what)
    if not MIN_BUDGET <= value <= MAX_BUDGET:
        raise UserError(f"{what}: must be between 1 MiB and 1 PiB, got {_shown(text)}")
    return value


def _shown(value) -> str:
    """The value as given, in one short line (a 400-digit number is not worth printing whole)."""
    text = repr(value) if isinstance(value, (str, float)) else str(value)
    text = text if text.isprintable() else ascii(text)
    return text if len(text) <= 40 else text[:37] + "..."


def format_bytes(n: int | float | None) -> str:
    """Binary units, three significant figures: 25769803776 -> '24.0 GiB'."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"
