"""Errors that reach the user as one line (exit code 2 for bad input, 1 for a failed run, 3 for a
card that is not clean), and how a message quotes what the user wrote (`brief`, `one_line`)."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do. Exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """Every problem found in a job file at once, each with its key path."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        super().__init__(f"{source}: {count}: " + "; ".join(problems))


class RunFailed(Exception):
    """The run worked as designed but has no answer to give (nothing fits). Exit code 1."""

    exit_code = 1


class CardNotClean(RunFailed):
    """The GPU was not clean before a search (another process, memory in use, a failed test
    allocation). Exit code 3: neither bad input nor a search without an answer, but a card or
    worker to fix or replace, which a scheduler can tell apart."""

    exit_code = 3


# -- quoting user values in a message ----------------------------------------------------------
def brief(value: Any, room: int = 60) -> str:
    """A value as an error message shows it: one line, at most `room` characters, and never
    the work of printing all of a large value (an alias bomb prints as gigabytes)."""
    text = _brief(value, 2)
    return text if len(text) <= room else text[:room - 3] + "..."


def _brief(value: Any, depth: int) -> str:
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))  # YAML refuses integers past 4300 digits
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, str):
        return repr(str(value)[:80])
    if isinstance(value, (list, tuple)):
        if depth == 0:
            return f"[{len(value)} items]"
        inner = ", ".join(_brief(v, depth - 1) for v in list(value[:4]))
        return f"[{inner}{', ...' if len(value) > 4 else ''}]"
    if isinstance(value, dict):
        if depth == 0:
            return f"{{{len(value)} keys}}"
        items = list(value.items())[:3]
        inner = ", ".join(f"{_brief(k, 0)}: {_brief(v, depth - 1)}" for k, v in items)
        return f"{{{inner}{', ...' if len(value) > 3 else ''}}}"
    return f"a {type(value).__name__}"


def one_line(text: Any, room: int = 200) -> str:
    """User text as one line of a comment or message: control characters (newlines, NUL, escape
    sequences) shown escaped, at most `room` characters."""
    text = str(text)[:room * 2]
    shown = "".join(ch if ch.isprintable() or ch == " " else ascii(ch)[1:-1] for ch in text)
    return shown if len(shown) <= room else shown[:room - 3] + "..."
