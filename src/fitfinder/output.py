"""One output object for every command: rich on a terminal, plain lines when piped, JSON for machines.

With `--json`, stdout carries exactly one JSON object at the end and every progress line goes to
stderr, so `fitfinder search x.yaml --json | jq` works.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from fitfinder.units import format_bytes


class Output:
    def __init__(self, json_mode: bool = False, stream=None):
        self.json_mode = json_mode
        self.stream = stream or (sys.stderr if json_mode else sys.stdout)
        self.fancy = (not json_mode and hasattr(self.stream, "isatty") and self.stream.isatty()
                      and not os.environ.get("CI") and os.environ.get("TERM") != "dumb")
        self._progress = None
        self._task = None

    # -- lines ---------------------------------------------------------------------------------
    def line(self, text: str = "") -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        self.line(f"fitfinder: {text}")

    def result(self, payload: dict[str, Any]) -> None:
        """The machine-readable answer: one JSON object on stdout (only with --json)."""
        if self.json_mode:
            print(json.dumps(payload, default=str), file=sys.stdout, flush=True)

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
                  for i, h in enumerate(headers)]
        self.line("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip())
        for row in rows:
            self.line("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())

    # -- progress ------------------------------------------------------------------------------
    @contextmanager
    def progress(self, total: int, description: str) -> Iterator[None]:
        """A progress bar on a terminal; nothing extra when piped (the per-item lines suffice)."""
        if not self.fancy:
            yield
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(file=self.stream)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            self._progress, self._task = progress, progress.add_task(description, total=total)
            try:
                yield
            finally:
                self._progress = self._task = None

    def advance(self, description: str | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, description=description)


def usage_bar(peak_bytes: int | None, budget_bytes: int | None, width: int = 10) -> str:
    """'5.31 MiB / 5.80 MiB [#########-] 92%' -- the peak against the budget."""
    if peak_bytes is None:
        return "-"
    if not budget_bytes:
        return format_bytes(peak_bytes)
    share = peak_bytes / budget_bytes
    filled = min(width, round(share * width))
    return f"{format_bytes(peak_bytes)} / {format_bytes(budget_bytes)} [{'#' * filled}{'-' * (width - filled)}] {share:.0%}"
