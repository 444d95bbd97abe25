"""Errors that reach the user as one line (exit code 2 for bad input, 1 for a failed run, 3 for a
card that is not clean)."""

from __future__ import annotations


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
