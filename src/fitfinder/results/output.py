"""One output object for every command: rich on a terminal, plain lines when piped, JSON for machines.

With `--json`, stdout carries exactly one JSON object at the end and every progress line goes to
stderr, so `fitfinder search x.yaml --json | jq` works.

During a search, each finished probe is one `trial()` call: on a terminal it becomes a row of a
live table (knobs, status, a peak/budget bar, s/step) under which the probe count and elapsed
time tick; when piped it is one plain `trial N ...` line, the format scripts and tests read.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from fitfinder.errors import UserError
from fitfinder.units import format_bytes
from fitfinder.verdict import FITS, NO_FIT, TIGHT, of_probe


@dataclass
class TrialRow:
    """One finished probe as the terminal shows it."""

    number: int
    knobs: dict[str, str]  # knob name -> its label (`[256,384]`, `on`, `16`)
    status: str  # fits | tight | does not fit (ran, over the budget) | oom | error | timeout
    phase: str | None
    peak_bytes: int | None
    budget_bytes: int | None
    seconds_per_step: float | None
    error: str | None
    purpose: str = ""  # the plan's stage: base, rollback, quality, speed, confirm
    estimated: bool = False  # decided by the search's pre-screen, not probed
    reason: str = ""  # why it does not fit where the card is not the wall: "host memory"

    @classmethod
    def of(cls, space, result, budget_bytes: int | None, purpose: str = "") -> "TrialRow":
        """From a search result: a probe that ran reads as its verdict (verdict.py): `fits` under
        the limit, `tight` under the budget but past the limit; one that did not, as its status
        (`oom` in its phase, `error`, `timeout`)."""
        status, phase = result.status, result.phase if result.status != "ok" else None
        reason = getattr(result, "wall_reason", "")
        if status == "ok" and reason:  # in the card, over the RAM budget
            status, phase = NO_FIT, next(iter(result.host_failed_phases), None)
        elif status == "ok":
            status = of_probe(status, result.verdict == "fit", result.peak_bytes, budget_bytes)
        return cls(number=result.trial, knobs={k.short: k.label(result.point[k.name]) for k in space.knobs},
                   status=status, phase=phase, reason=reason,
                   peak_bytes=result.peak_bytes, budget_bytes=budget_bytes,
                   seconds_per_step=result.extra.get("seconds_per_step"), error=result.error, purpose=purpose,
                   estimated=bool(result.extra.get("estimated")))

    def plain(self) -> str:
        """`trial   3  buckets=[256,384,512] rank=16 ...  fits  5.31 MiB / 5.8 MiB [#########-] 92%  0.078 s/step`"""
        knobs = " ".join(f"{name}={label}" for name, label in self.knobs.items())
        where = (f" in {self.phase}" if self.phase else "") + (f": {self.reason}" if self.reason else "") \
            + (" (estimated, not probed)" if self.estimated else "")
        speed = f"{self.seconds_per_step:.3f} s/step" if self.seconds_per_step else ""
        stage = f"{self.purpose:<9} " if self.purpose else ""
        text = (f"trial {self.number:3d}  {stage}{knobs}  {self.status}{where}  "
                f"{usage_bar(self.peak_bytes, self.budget_bytes)}  {speed}").rstrip()
        if self.status in ("error", "timeout") and self.error:
            text += f"\n           {self.error[:300]}"
        return text


def _print(text: str, stream) -> None:
    """One line, or one error line when the stream cannot take it: `| head -1` closed the pipe
    (that was reported as the study failing to write), `> /dev/full` has no room (a traceback)."""
    try:
        print(text, file=stream, flush=True)
    except OSError as exc:
        name = {sys.stdout: "stdout", sys.stderr: "stderr"}.get(stream, getattr(stream, "name", "the output"))
        try:  # the interpreter flushes the stream once more at exit: let that find a sink, not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        raise UserError(f"{name}: cannot write it ({exc.strerror or type(exc).__name__}); what a search measured "
                        "is kept in its study: run the same command again to see it") from None


class Output:
    def __init__(self, json_mode: bool = False, stream=None, fancy: bool | None = None):
        self.json_mode = json_mode
        self.stream = stream or (sys.stderr if json_mode else sys.stdout)
        if fancy is None:
            fancy = (not json_mode and hasattr(self.stream, "isatty") and self.stream.isatty()
                     and not os.environ.get("CI") and os.environ.get("TERM") != "dumb")
        self.fancy = fancy
        self._board: _Board | None = None

    # -- lines ---------------------------------------------------------------------------------
    def line(self, text: str = "") -> None:
        if self._board is not None:
            self._board.live.console.print(text, markup=False, highlight=False)
        else:
            _print(text, self.stream)

    def note(self, text: str) -> None:
        self.line(f"fitfinder: {text}")

    def result(self, payload: dict[str, Any]) -> None:
        """The machine-readable answer: one JSON object on stdout (only with --json)."""
        if self.json_mode:
            _print(json.dumps(payload, default=str), sys.stdout)

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
                  for i, h in enumerate(headers)]
        self.line("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip())
        for row in rows:
            self.line("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())

    def trial(self, space, result, budget_bytes: int | None, purpose: str = "") -> None:
        """One finished probe: a row of the live table on a terminal, one plain line otherwise."""
        row = TrialRow.of(space, result, budget_bytes, purpose)
        if self._board is not None:
            self._board.rows.append(row)
            self._board.live.refresh()
        else:
            self.line(row.plain())

    # -- progress ------------------------------------------------------------------------------
    @contextmanager
    def progress(self, total: int, description: str) -> Iterator[None]:
        """On a terminal, the live table of trials with a count and a clock under it; when it
        ends, the whole table stays printed. Nothing extra when piped (the per-trial lines suffice)."""
        if not self.fancy:
            yield
            return
        from rich.console import Console
        from rich.live import Live

        board = _Board(total, description)
        console = Console(file=self.stream, force_terminal=True)
        with Live(board, console=console, refresh_per_second=4, transient=True,
                  vertical_overflow="crop") as live:
            board.live, self._board = live, board
            try:
                yield
            finally:
                self._board = None
        if board.rows:
            console.print(board.table(board.rows))

    def advance(self, description: str | None = None) -> None:
        if self._board is not None:
            self._board.done += 1
            if description:
                self._board.description = description


def usage_bar(peak_bytes: int | None, budget_bytes: int | None, width: int = 10) -> str:
    """'5.31 MiB / 5.80 MiB [#########-] 92%' -- the peak against the budget."""
    if peak_bytes is None:
        return "-"
    if not budget_bytes:
        return format_bytes(peak_bytes)
    share = peak_bytes / budget_bytes
    filled = min(width, round(share * width))
    return (f"{format_bytes(peak_bytes)} / {format_bytes(budget_bytes)} "
            f"[{'#' * filled}{'-' * (width - filled)}] {share:.0%}")


# -- the live table -----------------------------------------------------------------------------
_STATUS_STYLE = {FITS: "green", TIGHT: "yellow", NO_FIT: "red", "oom": "red", "error": "magenta",
                 "timeout": "magenta"}


class _Board:
    """What the live display renders: the trials so far (the latest that fit the screen) and a
    footer with the probe count and the elapsed time. Rendered afresh on every refresh."""

    def __init__(self, total: int, description: str):
        self.total, self.description = total, description
        self.rows: list[TrialRow] = []
        self.done = 0
        self.started = time.monotonic()
        self.live = None

    def __rich_console__(self, console, options):
        from rich.text import Text

        room = max(3, (options.height or console.height) - 7)  # header, borders, footer
        shown = self.rows[-room:]
        if shown:
            yield self.table(shown, skipped=len(self.rows) - len(shown))
        elapsed = int(time.monotonic() - self.started)
        yield Text(f"{self.description}: {self.done} of at most {self.total} probes, "
                   f"{elapsed // 60}:{elapsed % 60:02d} elapsed", style="dim")

    def table(self, rows: list[TrialRow], skipped: int = 0):
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, header_style="bold",
                      caption=f"({skipped} earlier trials above)" if skipped else None)
        table.add_column("trial", justify="right")
        table.add_column("stage")
        for name in rows[0].knobs:
            table.add_column(name)
        table.add_column("status")
        table.add_column("peak / budget")
        table.add_column("s/step", justify="right")
        for row in rows:
            style = _STATUS_STYLE.get(row.status, "")
            status = (row.status + (f" in {row.phase}" if row.phase else "") + (f": {row.reason}" if row.reason else "")
                      + (" (estimated)" if row.estimated else ""))
            table.add_row(str(row.number), row.purpose, *(Text(label) for label in row.knobs.values()),
                          Text(status, style=style or None), _bar(row, style),
                          f"{row.seconds_per_step:.3f}" if row.seconds_per_step else "")
        return table


def _bar(row: TrialRow, style: str, width: int = 12):
    """A block bar of the peak against the budget, then the numbers."""
    from rich.text import Text

    if row.peak_bytes is None:
        return Text("-")
    if not row.budget_bytes:
        return Text(format_bytes(row.peak_bytes))
    share = row.peak_bytes / row.budget_bytes
    filled = min(width, round(share * width))
    text = Text("█" * filled, style=style or None)
    text.append("░" * (width - filled), style="dim")
    text.append(f" {format_bytes(row.peak_bytes)} / {format_bytes(row.budget_bytes)} {share:.0%}")
    return text
