"""The process's host memory as Linux reports it: resident bytes now, the peak since a reset, and
its children's (a trainer's data-loader workers).

`/proc/self/status` holds VmRSS (resident now) and VmHWM (the high-water mark); writing 5 to
`/proc/self/clear_refs` resets the mark to the present (proc(5)), so each phase has its own peak.
Elsewhere (not Linux) each reads None and the meters leave the measured host peak out.
"""

from __future__ import annotations

import os
from pathlib import Path

KIB = 1024


def _status_bytes(field: str, pid: int | str = "self") -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * KIB
    return None


def resident_bytes() -> int | None:
    """What the process holds in RAM now (VmRSS)."""
    return _status_bytes("VmRSS")


def reset_peak() -> bool:
    """Start a new high-water mark at the present resident size; False where that cannot be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_bytes() -> int | None:
    """The process's resident peak since the last `reset_peak` (VmHWM), with its children's resident bytes."""
    own = _status_bytes("VmHWM")
    if own is None:
        return None
    return own + sum(_status_bytes("VmRSS", pid) or 0 for pid in _descendants(os.getpid()))


def _descendants(pid: int) -> list[int]:
    """Child processes, theirs included (/proc/PID/task/TID/children)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


_process_bytes: int | None = None


def process_bytes() -> int:
    """What a trainer's process holds before its first model (Python, torch and the libraries):
    this process's resident bytes the first time it is asked, the same for every later estimate in
    it, so estimates repeat (0 where it cannot be read)."""
    global _process_bytes
    if _process_bytes is None:
        _process_bytes = resident_bytes() or 0
    return _process_bytes
