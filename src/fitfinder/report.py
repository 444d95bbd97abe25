"""What a search leaves behind in results/NAME/: the winning job file and the trials table."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from fitfinder.jobconfig import JobFile, write_atomic
from fitfinder.space import Point, Space
from fitfinder.units import format_bytes


def export_best(job: JobFile, space: Space, point: Point, out_dir: Path, facts: list[str]) -> Path:
    """results/NAME/best.yaml: the job file with the winner's values, comments kept, and a header
    saying what changed (old -> new) and why it fits. The `fitfinder:` section is left out."""
    changes = space.changes(point)
    header = ["fitfinder: the best configuration found that fits."] + [f"  {line}" for line in facts]
    if changes:
        header.append("Changed from the base file (key under config.process[0]: old -> new):")
        header += [f"  {path}: {_yaml_scalar(old)} -> {_yaml_scalar(new)}" for path, old, new in changes]
    else:
        header.append("Nothing changed: the base file fits as written.")
    best_job = space.apply(job, point)
    return best_job.write(out_dir / "best.yaml", header)


def write_trials_csv(study, space: Space, path: Path) -> Path:
    """One row per trial: its knobs, what the probe found, and how the search read it."""
    columns = ["trial", "state", "status", *space.names, "peak_bytes", "limit_bytes", "phase",
               "seconds_per_step", "seconds_per_sample", "verdict", "wall_seconds", "error"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        point = attrs.get("point") or trial.params
        writer.writerow([
            trial.number, trial.state.name, attrs.get("status", ""),
            *(point.get(name, "") for name in space.names),
            *(_blank(attrs.get(key)) for key in ("peak_bytes", "limit_bytes", "phase", "seconds_per_step",
                                                 "seconds_per_sample", "verdict", "wall_seconds", "error")),
        ])
    write_atomic(path, buffer.getvalue())
    return path


def fit_facts(result, budget_bytes: int | None, margin: float, meter: str, study_name: str) -> list[str]:
    peak = format_bytes(result.peak_bytes)
    budget = format_bytes(budget_bytes) if budget_bytes else "the whole card"
    return [f"Study {study_name}, trial {result.trial}: peak {peak} of {budget} "
            f"(margin {margin:.0%}, {meter} meter)."]


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "(unset)" if value is None else str(value)


def _blank(value: Any) -> Any:
    return "" if value is None else value
