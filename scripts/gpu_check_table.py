"""The closing table of scripts/gpu_check.sh: per point and phase, the cuda meter against the estimate.

    python scripts/gpu_check_table.py JOBS_DIR [TESTS_LINE]

JOBS_DIR holds, per point NAME (their order is the file names' order):
  NAME.point.json     {"label", "budget_bytes" (the emulated card, or null for the whole card)}
  NAME.probe.json     `fitfinder probe --json` on the card (missing if it did not run)
  NAME.estimate.json  `fitfinder estimate --json` with the card's calibration (missing likewise)
  NAME.probe.seconds, NAME.estimate.seconds   each command's wall time (optional)

A phase the probe ran out in holds the memory at the failed allocation, not the phase's peak: it
is shown as "ran out" and left out of the error. Standard library only: it runs wherever the
check does, and tests/test_standalone.py runs it on made-up results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _seconds(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"


def _probe_verdict(probed: dict | None, budget: int | None) -> str:
    if probed is None:
        return "no probe result"
    if not str(probed.get("meter") or "").startswith("cuda"):
        return f"not measured on a card ({probed.get('meter')})"
    where = f"{budget / GIB:g} GiB" if budget else "the card"
    if probed.get("status") == "ok":  # fits, or tight: under the budget, past the margin's limit
        word = "tight on" if probed.get("verdict") == "tight" else "fits"
        return f"{word} {where} (peak {_gib(probed.get('peak_bytes'))})"
    if probed.get("status") == "oom":
        return f"does not fit {where}: ran out in {probed.get('phase')}"
    error = (probed.get("error") or "no detail").splitlines() or ["no detail"]
    return f"{probed.get('status')}: {error[0][:160]}"


def _estimate_verdict(estimated: dict | None, budget: int | None) -> str:
    if estimated is None:
        return "no estimate"
    if not budget:
        return f"peak {_gib(estimated.get('peak_bytes'))}"
    if estimated.get("fits"):  # `verdict` says fits or tight (older estimates had only `fits`)
        return f"{estimated.get('verdict') or 'fits'} (peak {_gib(estimated.get('peak_bytes'))})"
    return f"does not fit: over in {estimated.get('phase')} (peak {_gib(estimated.get('peak_bytes'))})"


def rows_for(name: str, point: dict, probed: dict | None,
             estimated: dict | None) -> tuple[list[list[str]], list[float]]:
    """One row per phase that either side has, and the relative errors of the phases both measured."""
    measured = (probed or {}).get("phases") or {}
    predicted = (estimated or {}).get("phases") or {}
    ran_out = probed.get("phase") if probed and probed.get("status") == "oom" else None
    rows, errors = [], []
    for phase in list(measured) + [p for p in predicted if p not in measured]:
        meter_peak, estimate_peak = measured.get(phase), predicted.get(phase)
        if phase == ran_out:
            error = "ran out"
        elif meter_peak and estimate_peak is not None:
            relative = (estimate_peak - meter_peak) / meter_peak
            errors.append(relative)
            error = f"{relative:+.1%}"
        else:
            error = "-"
        rows.append([point.get("label", name), phase, _gib(meter_peak), _gib(estimate_peak), error])
    return rows, errors


def render(jobs: Path, tests_line: str | None = None) -> str:
    lines, table, errors = [], [], []
    verdicts = []
    for point_file in sorted(jobs.glob("*.point.json")):
        name = point_file.name[: -len(".point.json")]
        point = _read(point_file) or {}
        probed, estimated = _read(jobs / f"{name}.probe.json"), _read(jobs / f"{name}.estimate.json")
        seconds = {what: _seconds(jobs / f"{name}.{what}.seconds") for what in ("probe", "estimate")}
        rows, point_errors = rows_for(name, point, probed, estimated)
        table += rows
        errors += point_errors
        budget = point.get("budget_bytes")
        took = ", ".join(f"{what} {s:.0f} s" for what, s in seconds.items() if s is not None)
        verdicts.append(f"{point.get('label', name)}: probe {_probe_verdict(probed, budget)}; "
                        f"estimate {_estimate_verdict(estimated, budget)}" + (f" [{took}]" if took else ""))
    header = ["point", "phase", "cuda meter", "estimate", "error"]
    widths = [max(len(str(row[i])) for row in [header] + table) for i in range(len(header))]
    for row in [header] + table:
        lines.append("  ".join(str(cell).ljust(width) if i < 2 else str(cell).rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths))).rstrip())
    lines += verdicts
    if errors:
        worst = max(errors, key=abs)
        lines.append(f"largest relative error {worst:+.1%} over {len(errors)} phases (estimate - meter) / meter; "
                     "peaks include memory outside PyTorch, the estimate with this card's calibration")
    else:
        lines.append("no phase was measured by both the card and the estimate")
    if tests_line is not None:
        lines.append(f"GPU-marked tests: {tests_line or 'no result'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
