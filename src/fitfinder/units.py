"""Byte sizes as people write them: '24GiB', '300MiB', '16GB', '1.5 TiB'."""

from __future__ import annotations

import re

from fitfinder.errors import UserError

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # GPU memory is sold in GiB while labelled "GB"; a bare letter means the binary unit.
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'24GiB' -> 25769803776. A plain number is bytes. Raises UserError naming `what`."""
    if isinstance(text, bool):
        raise UserError(f"{what}: expected a size such as 24GiB, got {text!r}")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise UserError(f"{what}: must be positive, got {text}")
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS and unit != "":
        raise UserError(
            f"{what}: {text!r} is not a size; write a number and a unit such as 24GiB, 300MiB or 16GB"
        )
    value = float(match.group(1)) * _UNITS.get(unit, 1)
    if value <= 0:
        raise UserError(f"{what}: must be positive, got {text!r}")
    return int(value)


def format_bytes(n: int | float | None) -> str:
    """Binary units, three significant figures: 25769803776 -> '24.0 GiB'."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"
