"""One verdict for a peak against a card: the same three words, JSON field and exit codes in
every command (estimate, probe, search, tiers, the report).

    fits          the peak is under the limit (the budget less the safety margin)
    tight         under the budget but over the limit: it may run out (the allocator's rounding,
                  another process, a shape the probe did not meet); a search never picks it,
                  unless `--margin 0` makes the limit the budget
    does not fit  over the budget, or it ran out of memory

Exit codes: 0 for fits and tight (tight with a warning in its line), 1 for does not fit. The
JSON field is `verdict`; `fits` stays beside it (true for fits and tight: under the budget, as
it always meant) for readers of the older output.

A `Verdict` says it in lines and JSON, with optional sections after the headline, each a small
class with `lines()` and `as_json()` under its own key: `Wall` (the phase that stops it, and what
the recipe holds there, and what holds its memory, largest first: `owners`) and `WouldTake` (the
smallest card that would take it). Sections to come slot in the same way: what another trainer
would need (issue 30) as a section of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fitfinder.units import format_bytes

FITS, TIGHT, NO_FIT = "fits", "tight", "does not fit"
VERDICTS = (FITS, TIGHT, NO_FIT)
GiB = 2**30
# Card sizes as sold, in GB: GPU memory is labelled GB and is GiB (units.py), so a "24 GB" card
# holds 24 GiB. Consumer cards (8-24), workstation and datacenter cards (32-96), H200 (141).
CARD_SIZES_GB = (8, 10, 12, 16, 20, 24, 32, 40, 48, 80, 96, 141)


def limit_of(budget_bytes: int, margin: float) -> int:
    """The budget less the safety margin: what a search holds every phase to."""
    return int(budget_bytes * (1 - margin))


def judge(peak_bytes: int | None, budget_bytes: int | None, margin: float) -> str | None:
    """fits, tight or does not fit; None without a budget or a peak to judge."""
    if not budget_bytes or peak_bytes is None:
        return None
    if peak_bytes > budget_bytes:
        return NO_FIT
    return FITS if peak_bytes <= limit_of(budget_bytes, margin) else TIGHT


def of_probe(status: str, under_limit: bool | None, peak_bytes: int | None, budget_bytes: int | None) -> str | None:
    """The verdict of one of a search's probes: fits when the search read it as under the limit
    (`under_limit`: the planner's fit), tight when it ran under the budget but not under the limit,
    does not fit when it ran out of memory or over the budget; None when it says nothing about
    memory (a crash, a hang)."""
    if under_limit:
        return FITS
    if status == "ok":
        return NO_FIT if budget_bytes and peak_bytes is not None and peak_bytes > budget_bytes else TIGHT
    return NO_FIT if status == "oom" else None


def exit_code(verdict: str | None) -> int:
    """0 for fits and tight (and no verdict: nothing to judge against), 1 for does not fit."""
    return 1 if verdict == NO_FIT else 0


def smallest_card(peak_bytes: int, margin: float, cards=CARD_SIZES_GB) -> float | None:
    """The smallest card of `cards` whose limit holds `peak_bytes`, or None if none does."""
    return next((card for card in cards if peak_bytes <= limit_of(int(card * GiB), margin)), None)


# -- memory by owner ------------------------------------------------------------------------------
# The meters' owner tags (probe/meters/_tracker.py OWNERS; the estimate adds the GPU's own overhead
# under readable names already) in the words the outputs use. `weights:<part>` is "<part> weights".
OWNER_NAMES = {"lora": "LoRA", "gradients": "LoRA gradients", "optimizer": "optimizer state", "ema": "EMA",
               "embeddings": "prompt embeddings", "latents": "latents",
               "activations": "activations and transients"}
SHOWN_OWNERS = 5  # the lines under a wall: the largest owners, then one line for the rest


def owner_name(tag: str) -> str:
    """'weights:text_encoder_2' -> 'text_encoder_2 weights', 'optimizer' -> 'optimizer state'."""
    if tag.startswith("weights:"):
        return f"{tag.split(':', 1)[1]} weights"
    return OWNER_NAMES.get(tag, tag)


def owner_lines(owners: dict[str, int], total_bytes: int, shown: int = SHOWN_OWNERS, indent: str = "  ") -> list[str]:
    """The largest `shown` owners one a line (name, bytes, share of `total_bytes`), then the rest as
    one "other" line; `owners` is {tag: bytes}, in any order."""
    ranked = sorted(owners.items(), key=lambda item: -item[1])
    rest = ranked[shown:]
    rows = [(owner_name(tag), size) for tag, size in ranked[:shown]]
    if len(rest) == 1:
        rows.append((owner_name(rest[0][0]), rest[0][1]))
    elif rest:
        rows.append((f"other ({len(rest)} owners)", sum(size for _, size in rest)))
    width = max((len(name) for name, _ in rows), default=0)
    share = (lambda size: f"  {share_of(size, total_bytes):>4}") if total_bytes else (lambda size: "")
    return [f"{indent}{name:<{width}}  {format_bytes(size):>9}{share(size)}" for name, size in rows]


def share_of(size: int, total_bytes: int) -> str:
    """'56%', or '<1%' for a share that rounds to nothing but is not nothing."""
    share = size / total_bytes
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"


def owners_json(owners: dict[str, int]) -> list[dict[str, Any]]:
    """Every owner, largest first: {owner (its readable name), tag (the meter's), bytes}."""
    return [{"owner": owner_name(tag), "tag": tag, "bytes": int(size)}
            for tag, size in sorted(owners.items(), key=lambda item: -item[1])]


# -- the sections ---------------------------------------------------------------------------------
@dataclass
class Wall:
    """The phase that stops a point (`stops`), or for a point that fits the phase with the highest
    peak: its peak, what the recipe holds there when it knows, and what holds the memory there by
    owner, largest first."""

    KEY = "wall"

    phase: str
    peak_bytes: int
    why: str = ""  # e.g. the part the loader quantizes on the card (models.load_note)
    point: str = ""  # which point, when it is not the job as written: "even at the lightest point (...)"
    owners: dict[str, int] | None = None  # {owner tag: bytes} at the phase's peak; None where the meter has none
    stops: bool = True  # False: the point fits, and this is only its highest phase
    limit_bytes: int | None = None  # the search's limit, to say how far past it the wall is

    def lines(self) -> list[str]:
        where = f" {self.point}" if self.point else ""
        # how far past: a peak 30 MiB over a 16 GiB budget reads "16 GiB" alone
        past = (f" ({format_bytes(self.peak_bytes - self.limit_bytes)} past the limit of "
                f"{format_bytes(self.limit_bytes)})" if self.stops and self.limit_bytes else "")
        lines = [f"{'the wall' if self.stops else 'the highest phase'}: {self.phase}, "
                 f"{format_bytes(self.peak_bytes)}{past}{where}"]
        if self.why:
            lines.append(f"  {self.why}")
        if self.owners:
            lines.append("  by owner, at the phase's peak:")
            lines += owner_lines(self.owners, self.peak_bytes, indent="    ")
        return lines

    @classmethod
    def of_probe(cls, phase_stats: dict[str, dict[str, Any]], phase: str | None = None,
                 limit_bytes: int | None = None) -> "Wall | None":
        """A probe's wall from its `phase_stats`: `phase` (where it ran out), else the phase of
        the highest peak, which stops it when it passes `limit_bytes`; its owners where the meter
        counts them (the sim meter's sum to the peak; the cuda meter has none). None without phases."""
        peaks = {name: int(stats["peak_reserved"]) for name, stats in phase_stats.items()}
        if phase not in peaks:
            if not peaks:
                return None
            phase = max(peaks, key=lambda name: peaks[name])
            stops = limit_bytes is not None and peaks[phase] > limit_bytes
        else:
            stops = True
        return cls(phase, peaks[phase], owners=phase_stats[phase].get("owners"), stops=stops, limit_bytes=limit_bytes)

    def as_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "peak_bytes": self.peak_bytes, "why": self.why or None,
                "point": self.point or None, "stops": self.stops,
                "owners": None if self.owners is None else owners_json(self.owners)}


@dataclass
class WouldTake:
    """What would take it: the smallest card of CARD_SIZES_GB that does (the best point predicted
    to fit there, its peak, the knobs that differ from the job file), and where a point is tight
    on this card, the margin under which it counts as fitting."""

    KEY = "would_take"

    card_gb: float | None  # None: not even the largest card
    peak_bytes: int | None = None
    point: dict[str, Any] | None = None
    differs: str = ""  # as the trial lines write them; '' for the job as written
    margin_at_most: float | None = None  # a tight point here: it fits with a margin this small
    tight: str = ""  # that point, when it is not the one the headline judged
    tight_peak_bytes: int | None = None
    largest_gb: float = CARD_SIZES_GB[-1]
    ram_bytes: int | None = None  # the host's budget, when host memory stopped points: no card helps past it

    def lines(self) -> list[str]:
        lines = []
        if self.margin_at_most is not None:
            which = f"{self.tight} (peak {format_bytes(self.tight_peak_bytes)}) is tight here: " if self.tight else ""
            lines.append(f"{which}with --margin {self.margin_at_most:.2f} or less it fits this card")
        if self.card_gb is None:
            within = f" within {format_bytes(self.ram_bytes)} of RAM (--ram)" if self.ram_bytes else ""
            lines.append(f"no card up to {self.largest_gb:g} GB is predicted to take it{within}")
        else:
            how = f", with {self.differs}" if self.differs else ", as written"
            lines.append(f"the smallest card that takes it: {self.card_gb:g} GB{how} "
                         f"(peak {format_bytes(self.peak_bytes)})")
        return lines

    def as_json(self) -> dict[str, Any]:
        return {"card_gb": self.card_gb, "peak_bytes": self.peak_bytes, "point": self.point,
                "differs": self.differs, "margin_at_most": self.margin_at_most,
                "tight": self.tight or None, "tight_peak_bytes": self.tight_peak_bytes}


# -- the verdict --------------------------------------------------------------------------------
@dataclass
class Verdict:
    """A peak against a budget: the headline, then the sections that explain it."""

    verdict: str | None
    peak_bytes: int | None
    budget_bytes: int | None
    margin: float
    phase: str | None = None  # where it ran out, or the first phase over the budget
    ran_out: bool = False  # measured: the probe ran out of memory (its peak is where it failed)
    summary: str = ""  # what follows the verdict word, where it judges a search rather than one point
    wall: Wall | None = None
    would_take: WouldTake | None = None

    @classmethod
    def of(cls, peak_bytes: int | None, budget_bytes: int | None, margin: float, **more) -> "Verdict":
        return cls(judge(peak_bytes, budget_bytes, margin), peak_bytes, budget_bytes, margin, **more)

    @property
    def limit_bytes(self) -> int | None:
        return limit_of(self.budget_bytes, self.margin) if self.budget_bytes else None

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    def sections(self) -> list:
        return [s for s in (self.wall, self.would_take) if s is not None]

    def headline(self) -> str:
        peak, budget, limit = (format_bytes(v) for v in (self.peak_bytes, self.budget_bytes, self.limit_bytes))
        limit_is = f"limit {limit}: the budget less the {self.margin:.0%} margin"
        if self.summary:
            return f"{self.verdict}: {self.summary}"
        if self.verdict is None:
            return f"peak {peak}; give --vram to judge it against a card"
        if self.verdict == FITS:
            return (f"fits: peak {peak} of {budget}, {format_bytes(self.budget_bytes - self.peak_bytes)} to spare "
                    f"(under the {limit_is})")
        if self.verdict == TIGHT:
            return (f"tight: peak {peak} of {budget}, {format_bytes(self.peak_bytes - self.limit_bytes)} past the "
                    f"{limit_is}; warning: it may run out, and a search picks it only with --margin 0")
        if self.ran_out:
            return f"does not fit: it ran out of memory in {self.phase} ({peak} in use or asked for, budget {budget})"
        where = f"; it would run out in {self.phase}" if self.phase else ""
        return (f"does not fit: peak {peak} of {budget}, "
                f"{format_bytes(self.peak_bytes - self.budget_bytes)} over{where}")

    def lines(self) -> list[str]:
        """The headline, then each section's lines; a bare wall (no why, no other point, no owners)
        whose phase the headline already names says nothing more and is left out."""
        sections = [s for s in self.sections()
                    if not (s is self.wall and not (s.why or s.point or s.owners) and s.phase == self.phase)]
        return [self.headline(), *(line for section in sections for line in section.lines())]

    def as_json(self) -> dict[str, Any]:
        """The fields every command's JSON carries: `verdict`, `fits` (under the budget: fits or
        tight), `limit_bytes`, and each section under its key (null when absent)."""
        found = {"verdict": self.verdict, "fits": None if self.verdict is None else self.verdict != NO_FIT,
                 "limit_bytes": self.limit_bytes}
        found.update({cls.KEY: None for cls in (Wall, WouldTake)})
        found.update({section.KEY: section.as_json() for section in self.sections()})
        return found


def of_host(host_phases: dict[str, int], ram_bytes: int | None, peak_bytes: int | None, budget_bytes: int | None,
            margin: float, ran_out_in: str | None | bool = False) -> Verdict | None:
    """Does not fit for host memory: the run ran out of it (`ran_out_in`: its phase, None where
    unknown; MemoryError, the OOM killer), or a phase's host peak passed the RAM budget (judged
    afterwards, as the estimate and the cuda meter leave it); None when the host is not the wall."""
    if ran_out_in is not False:
        ram = f" (RAM {format_bytes(ram_bytes)})" if ram_bytes else ""
        phase, summary = ran_out_in, f"host memory: it ran out of host memory in {ran_out_in or 'the probe'}{ram}"
    else:
        phase = next((name for name, peak in host_phases.items() if ram_bytes and peak > ram_bytes), None)
        if phase is None:
            return None
        summary = (f"host memory: {phase} holds {format_bytes(host_phases[phase])} of host memory, "
                   f"{format_bytes(host_phases[phase] - ram_bytes)} past the RAM budget of {format_bytes(ram_bytes)}")
    return Verdict(NO_FIT, peak_bytes, budget_bytes, margin, phase=phase, summary=summary)
