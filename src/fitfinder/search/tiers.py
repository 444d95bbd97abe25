"""fitfinder tiers: the best configuration predicted to fit each card size, as a table.

What OneTrainer and kohya ship as static preset tables for a few cards, computed for the
user's own job: for each card size (GiB of memory as sold: a "24 GB" card has 24 GiB) the
search's planner runs on estimates (search.estimated.search), as `fitfinder estimate --search` does
for one budget. One estimate.Estimator serves every card: an estimate does not depend on the
budget, and each phase is estimated once for the knobs it depends on, so the larger cards'
searches mostly recall what the smaller ones' estimated.

Each tier says which knobs differ from the desired point (the job file), the predicted peak,
and what was given up (quality knobs below their desired value); a card nothing fits says where
the wall is (the phase that stops even the lightest point). `results/NAME/tiers.json` holds the
table; `--write` exports one job file per tier beside it (tiers/NAMEgib.yaml).

The same machinery says what it would take when nothing fits a budget (`nothing_fits`): the
smallest card of verdict.CARD_SIZES_GB on which the planner finds a point, that point and its
peak, and the wall at the budget (`fitfinder estimate --search`, and `tiers` when no card given fits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitfinder import files, models
from fitfinder.errors import UserError
from fitfinder.files import write_atomic
from fitfinder.probe.estimate import Estimator, margin_fitting, request_for as estimate_request
from fitfinder.search import estimated, planner
from fitfinder.units import MAX_BUDGET, MIN_BUDGET, format_bytes
from fitfinder.verdict import CARD_SIZES_GB, FITS, NO_FIT, Verdict, Wall, WouldTake, limit_of

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
    wall: Wall | None = None  # nothing fits: the phase that stops even the lightest point
    host_peak_bytes: int | None = None  # the point's host peak (the process and its host tensors)
    ram_bytes: int | None = None  # the host's budget (--ram), or None
    # Nothing fits within --ram, something would with more: the host peak of the best such point.
    needs_ram_bytes: int | None = None

    @property
    def given_up(self) -> list[dict[str, Any]]:
        return [row for row in self.changed if row["verdict"] == "given up" and row["role"] == "quality"]

    @property
    def label(self) -> str:
        return f"{self.card_gib:g} GiB"

    def as_json(self) -> dict[str, Any]:
        return {"card_gib": self.card_gib, "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                "verdict": FITS if self.point is not None else NO_FIT,
                "fits": self.point is not None, "point": self.point, "peak_bytes": self.peak_bytes,
                "changed": self.changed, "differs": self.differs,
                "given_up": [row["knob"] for row in self.given_up], "proven": self.proven,
                "wall": self.wall.as_json() if self.wall else None, "host_peak_bytes": self.host_peak_bytes,
                "ram_bytes": self.ram_bytes, "needs_ram_bytes": self.needs_ram_bytes,
                "reason": "host memory" if self.needs_ram_bytes else None}


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
    estimator: Estimator | None = None  # what was estimated, for a search at another card (nothing_fits)

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
    started = time.perf_counter()
    tiers = []
    for card in cards:
        tiers.append(tier_at(job, runner, overhead, estimator, card))
        if on_tier is not None:
            on_tier(estimator.space, tiers[-1])
    return TierTable(job_source=str(job.source), arch_name=estimator.arch_name, overhead=overhead.describe(),
                     tiers=tiers, estimates_run=estimator.runs, recalled=estimator.recalled,
                     seconds=round(time.perf_counter() - started, 1), space=estimator.space, estimator=estimator)


def tier_at(job, runner, overhead, estimator: Estimator, card: float, on_estimate=None) -> Tier:
    """The best point predicted to fit a card of `card` GiB (the planner on `estimator`'s estimates)."""
    space, budget, ram = estimator.space, int(card * GiB), job.settings.ram_bytes
    found = estimated.search(job, runner, overhead, on_estimate, estimator=estimator, budget_bytes=budget)
    best = found.best
    needs_ram = None
    if best is None and ram is not None:  # would the card take it with more RAM? (estimates mostly recalled)
        unbounded = estimated.search(job, runner, overhead, on_estimate, estimator=estimator, budget_bytes=budget,
                                     judge_host=False)
        needs_ram = unbounded.best.host_peak_bytes if unbounded.best else None
    changed = [] if best is None else [row for row in planner.explain(space, found.known, best.point)
                                       if row["verdict"] != "kept"]
    differs = " ".join(f"{space.by_name[row['knob']].short}={space.by_name[row['knob']].label(row['chosen'])}"
                       for row in changed)
    return Tier(card_gib=card, budget_bytes=budget, limit_bytes=found.limit_bytes,
                point=best.point if best else None, peak_bytes=best.peak_bytes if best else None,
                changed=[{k: row[k] for k in ("knob", "role", "desired", "chosen", "verdict")} for row in changed],
                differs=differs, proven=found.proven,
                wall=None if best or needs_ram else wall_of(job, overhead, estimator, found.limit_bytes),
                host_peak_bytes=best.host_peak_bytes if best else None, ram_bytes=ram, needs_ram_bytes=needs_ram)


def wall_of(job, overhead, estimator: Estimator, limit_bytes: int) -> Wall | None:
    """The first phase in which even the space's lightest point passes `limit_bytes`, with what
    the load holds when it is the load; None when the lightest point is not over it (or its
    estimate fails). Memory grows with every knob, so no point is lighter there: this phase stops
    every point."""
    space = estimator.space
    lightest = space.lightest()
    found = estimator.of_or_none(lightest)
    phase = None if found is None else found.first_phase_over(limit_bytes)
    if phase is None:
        return None
    why = models.load_note(estimate_request(space.apply(job, lightest), overhead)) if phase == "load" else ""
    return Wall(phase, found.phases[phase], why, point=f"even at the lightest point ({space.describe(lightest)})",
                owners=found.owners_at(phase), limit_bytes=limit_bytes)


def host_wall_of(estimator: Estimator, known, ram_bytes: int) -> Wall | None:
    """Where the host stops the point it stops least: of the points ruled out by host memory alone,
    the one with the lowest host peak, its host peak's phase and what holds the host there."""
    stopped = [r for r in known.results if r.host_failed_phases and not r.failed_phases and r.host_peak_bytes]
    closest = min(stopped, key=lambda r: r.host_peak_bytes, default=None)
    found = None if closest is None else estimator.of_or_none(closest.point)
    host = None if found is None else found.host_wall()
    if host is None:
        return None
    owners = {item["tag"]: item["bytes"] for item in host["owners"]}
    owners["the process (Python, torch, libraries)"] = host["outside_bytes"]  # not a tag: its name reads as is
    return Wall(host["phase"], host["peak_bytes"], f"host memory: past the RAM budget of {format_bytes(ram_bytes)}",
                point=f"in host memory at the point it stops least ({estimator.space.describe(closest.point)})",
                owners=owners, limit_bytes=ram_bytes)


def smallest_card(job, runner, overhead, estimator: Estimator, above_bytes: int, cards=CARD_SIZES_GB,
                  on_estimate=None) -> Tier | None:
    """The tier of the smallest card of `cards` larger than `above_bytes` on which the planner
    finds a point, or None when none does. The lightest point is at most as heavy as every other
    in every phase, so a card whose limit is under its peak holds nothing: it is passed over
    without a search."""
    lightest = estimator.phases_or_none(estimator.space.lightest())
    if not lightest:
        return None
    for card in cards:
        budget = int(card * GiB)
        if budget <= above_bytes or max(lightest.values()) > limit_of(budget, job.settings.margin):
            continue
        tier = tier_at(job, runner, overhead, estimator, card, on_estimate)
        if tier.point is not None:
            return tier
    return None


def nothing_fits(job, runner, overhead, estimator: Estimator, budget_bytes: int, known=None, estimates: int = 0,
                 cards=CARD_SIZES_GB, on_estimate=None) -> Verdict:
    """Why nothing is predicted to fit `budget_bytes`, and what would take it: the wall (the phase
    that stops even the lightest point), the best point that is tight there (`known`: a search's
    results), and the smallest card of `cards` on which something fits, with its best point."""
    space, margin = estimator.space, job.settings.margin
    limit = limit_of(budget_bytes, margin)
    closest = planner.best_tight(space, known, budget_bytes) if known is not None else None
    tier = smallest_card(job, runner, overhead, estimator, budget_bytes, cards, on_estimate)
    would = WouldTake(card_gb=tier.card_gib if tier else None, peak_bytes=tier.peak_bytes if tier else None,
                      point=tier.point if tier else None, differs=tier.differs if tier else "",
                      margin_at_most=margin_fitting(closest.peak_bytes, budget_bytes) if closest else None,
                      tight=space.describe(closest.point) if closest else "",
                      tight_peak_bytes=closest.peak_bytes if closest else None, largest_gb=cards[-1])
    wall = wall_of(job, overhead, estimator, limit)
    counted = f"; {estimates} estimates" if estimates else ""
    stopped = sum(1 for r in known.results if r.host_failed_phases) if known is not None else 0
    would.ram_bytes = job.settings.ram_bytes if stopped else None
    if wall is None and stopped:
        wall = host_wall_of(estimator, known, job.settings.ram_bytes)
    host = (f"; host memory stopped {stopped} of them, past the RAM budget of {format_bytes(job.settings.ram_bytes)}"
            if stopped and job.settings.ram_bytes else "")
    summary = (f"nothing is predicted to fit under the limit of {format_bytes(limit)} "
               f"({format_bytes(budget_bytes)} less the {margin:.0%} margin{counted}{host})")
    return Verdict(NO_FIT, wall.peak_bytes if wall else None, budget_bytes, margin, phase=wall.phase if wall else None,
                   summary=summary, wall=wall, would_take=would)


ROW_HEADER = ("card", "peak", "host peak", "differs from the job file", "given up")


def header(tiers: list[dict[str, Any]]) -> list[str]:
    """The columns of `rows`: the host peak's only when the tiers were held to a RAM budget (--ram)."""
    return [name for name in ROW_HEADER if name != "host peak" or _judged_host(tiers)]


def _judged_host(tiers: list[dict[str, Any]]) -> bool:
    return any(tier.get("ram_bytes") for tier in tiers)


def rows(tiers: list[dict[str, Any]]) -> list[list[str]]:
    """One line per card (from tiers.json's `tiers`): size, peak, host peak (with --ram), what
    differs from the job file, what was given up (`header`). The CLI and report.html show the same."""
    host = _judged_host(tiers)
    return [row if host else row[:2] + row[3:] for row in _rows(tiers)]


def _rows(tiers: list[dict[str, Any]]) -> list[list[str]]:
    lines = []
    for tier in tiers:
        label = f"{tier['card_gib']:g} GiB"
        if not tier["fits"]:
            wall, needs = tier.get("wall"), tier.get("needs_ram_bytes")
            if needs:
                found = (f"does not fit: host memory, it needs {format_bytes(needs)} of RAM "
                         f"({format_bytes(tier.get('ram_bytes'))} given)")
            elif not tier["proven"]:
                found = "none found before the estimate cap"
            elif wall:
                found = f"does not fit: {wall['phase']} needs {format_bytes(wall['peak_bytes'])} at the lightest point"
            else:
                found = "does not fit"
            lines.append([label, "-", format_bytes(needs) if needs else "-", found, ""])
            continue
        unproven = "" if tier["proven"] else " (estimate cap reached)"
        lines.append([label, format_bytes(tier["peak_bytes"]), format_bytes(tier.get("host_peak_bytes")),
                      (tier["differs"] or "the job as written") + unproven, ", ".join(tier["given_up"]) or "nothing"])
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
