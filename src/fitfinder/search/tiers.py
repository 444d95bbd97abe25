"""fitfinder tiers: the best configuration predicted to fit each card size, as a table.

What OneTrainer and kohya ship as static preset tables for a few cards, computed for the
user's own job: for each card size (GiB of memory as sold: a "24 GB" card has 24 GiB) the
search's planner runs on estimates (search.estimated.search), as `fitfinder estimate --search` does
for one budget. One estimate.Estimator serves every card: an estimate does not depend on the
budget, and each phase is estimated once for the knobs it depends on, so the larger cards'
searches mostly recall what the smaller ones' estimated.

Each tier says which knobs differ from the desired point (the job file), the predicted peak,
and what was given up (quality knobs below their desired value). `results/NAME/tiers.json`
holds the table; `--write` exports one job file per tier beside it (tiers/NAMEgib.yaml).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitfinder import files
from fitfinder.errors import UserError
from fitfinder.jobconfig import write_atomic
from fitfinder.probe.estimate import Estimator
from fitfinder.search import estimated, planner
from fitfinder.units import MAX_BUDGET, MIN_BUDGET, format_bytes

GiB = 2**30
DEFAULT_CARDS = (8, 12, 16, 24, 32, 48, 80, 96)


@dataclass
class Tier:
    """The best point predicted to fit one card size, or none."""

    card_gib: float
    budget_bytes: int
    limit_bytes: int
    point: dict[str, Any] | None
    peak_bytes: int | None
    changed: list[dict[str, Any]] = field(default_factory=list)  # knob, role, desired, chosen, verdict
    differs: str = ""  # the changed knobs as the trial lines write them: `rank=8 gc=on`
    proven: bool = True

    @property
    def given_up(self) -> list[dict[str, Any]]:
        return [row for row in self.changed if row["verdict"] == "given up" and row["role"] == "quality"]

    @property
    def label(self) -> str:
        return f"{self.card_gib:g} GiB"

    def as_json(self) -> dict[str, Any]:
        return {"card_gib": self.card_gib, "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                "fits": self.point is not None, "point": self.point, "peak_bytes": self.peak_bytes,
                "changed": self.changed, "differs": self.differs,
                "given_up": [row["knob"] for row in self.given_up], "proven": self.proven}


@dataclass
class TierTable:
    job_source: str
    arch_name: str | None
    overhead: str
    tiers: list[Tier]
    estimates_run: int
    recalled: int
    seconds: float | None = None
    space: Any = None  # the space the tiers were searched over

    def as_json(self) -> dict[str, Any]:
        return {"job": self.job_source, "arch": self.arch_name, "overhead": self.overhead,
                "estimates": self.estimates_run, "recalled": self.recalled, "seconds": self.seconds,
                "tiers": [tier.as_json() for tier in self.tiers]}


def parse_cards(text: str) -> tuple[float, ...]:
    """`8,12,24` -> (8, 12, 24): card sizes in GiB, each positive, no repeats, sorted."""
    cards = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            size = float(item.removesuffix("GiB").removesuffix("GB"))
        except ValueError:
            raise UserError(f"--cards: {item[:40]!r} is not a size in GiB (e.g. --cards 8,12,24)") from None
        # The budgets --vram takes: nan and inf were tracebacks, 1e-300 a card of 0 bytes.
        if not MIN_BUDGET <= size * GiB <= MAX_BUDGET:  # false for nan too
            raise UserError(f"--cards: sizes in GiB must be between 1/1024 (1 MiB) and 1048576 (1 PiB), "
                            f"got {item[:40]}")
        cards.append(size)
    if not cards:
        raise UserError("--cards: give at least one card size in GiB (e.g. --cards 8,12,24)")
    return tuple(sorted(set(cards)))


def compute(job, runner, overhead, cards=DEFAULT_CARDS, on_tier=None) -> TierTable:
    """The planner on estimates at each card size, smallest first, sharing one Estimator."""
    import time

    estimator = Estimator(job, runner, overhead)
    space = estimator.space
    started = time.perf_counter()
    tiers = []
    for card in cards:
        budget = int(card * GiB)
        found = estimated.search(job, runner, overhead, estimator=estimator, budget_bytes=budget)
        best = found.best
        changed = [] if best is None else [row for row in planner.explain(space, found.known, best.point)
                                           if row["verdict"] != "kept"]
        differs = " ".join(f"{space.by_name[row['knob']].short}={space.by_name[row['knob']].label(row['chosen'])}"
                           for row in changed)
        tiers.append(Tier(card_gib=card, budget_bytes=budget, limit_bytes=found.limit_bytes,
                          point=best.point if best else None, peak_bytes=best.peak_bytes if best else None,
                          changed=[{k: row[k] for k in ("knob", "role", "desired", "chosen", "verdict")}
                                   for row in changed], differs=differs, proven=found.proven))
        if on_tier is not None:
            on_tier(space, tiers[-1])
    return TierTable(job_source=str(job.source), arch_name=estimator.arch_name, overhead=overhead.describe(),
                     tiers=tiers, estimates_run=estimator.runs, recalled=estimator.recalled,
                     seconds=round(time.perf_counter() - started, 1), space=space)


def rows(tiers: list[dict[str, Any]]) -> list[list[str]]:
    """One line per card (from tiers.json's `tiers`): size, peak, what differs from the job
    file, what was given up. The CLI and report.html show the same."""
    lines = []
    for tier in tiers:
        label = f"{tier['card_gib']:g} GiB"
        if not tier["fits"]:
            found = "nothing is predicted to fit" if tier["proven"] else "none found before the estimate cap"
            lines.append([label, "-", found, ""])
            continue
        unproven = "" if tier["proven"] else " (estimate cap reached)"
        lines.append([label, format_bytes(tier["peak_bytes"]), (tier["differs"] or "the job as written") + unproven,
                      ", ".join(tier["given_up"]) or "nothing"])
    return lines


def write_json(table: TierTable, out_dir: Path) -> Path:
    path = Path(out_dir) / "tiers.json"
    write_atomic(path, json.dumps(table.as_json(), indent=2, default=str) + "\n")
    return path


def write_jobs(job, table: TierTable, out_dir: Path) -> list[Path]:
    """One job file per tier that fits (tiers/24gib.yaml), comments kept, a header saying what
    changed; written atomically, never over the input file (JobFile.write refuses)."""
    space, written = table.space, []
    for tier in table.tiers:
        if tier.point is None:
            continue
        header = [f"fitfinder tiers: the best configuration predicted to fit a {tier.label} card "
                  f"(estimated peak {format_bytes(tier.peak_bytes)}; confirm it with `fitfinder search` on the card)."]
        changes = space.changes(tier.point)
        if changes:
            header.append("Changed from the base file (key under config.process[0]: old -> new):")
            header += [f"  {path}: {json.dumps(old)} -> {json.dumps(new)}" for path, old, new in changes]
        else:
            header.append("Nothing changed: the base file is predicted to fit as written.")
        path = Path(out_dir) / "tiers" / f"{tier.card_gib:g}gib.yaml"
        written.append(space.apply(job, tier.point).write(path, header))
    return written


def read_json(out_dir: Path) -> dict[str, Any] | None:
    """tiers.json, or None when it is missing or unreadable (a FIFO there would block the read)."""
    try:
        return json.loads(files.read_bounded(Path(out_dir) / "tiers.json", 16 << 20))
    except (UserError, ValueError):
        return None
