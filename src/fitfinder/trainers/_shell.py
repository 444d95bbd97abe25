"""A shell file holding a trainer's command line: its words with where each lies in the text.

kohya's trainers are run from a shell (`accelerate launch [options] flux_train_network.py --flag value
...`, continued over lines with a backslash). Each word keeps its span in the file's text, so a
flag fitfinder changes is rewritten where it stands and every other byte of the file (comments, the
other commands, the layout) stays as the user wrote it.

The words follow POSIX shell quoting: single quotes, double quotes with backslash escapes, a
backslash before any character, a backslash-newline joining lines, `#` starting a comment where a
word could start. `;`, `&&` and `||` end a command; `$VAR` is kept as written (never expanded).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from fitfinder.errors import UserError


@dataclass(frozen=True)
class Word:
    text: str  # the word as the shell reads it (quotes removed)
    start: int  # its span in the file's text, quotes included
    end: int


@dataclass(frozen=True)
class Command:
    words: tuple[Word, ...]
    multiline: bool  # continued over lines with backslashes: new flags go on lines of their own


_OPERATORS = (";", "&&", "||", "|", "&")


def commands(text: str, source: str) -> list[Command]:
    """Every simple command of a shell text, in order."""
    found, words, joined, i, n = [], [], False, 0, len(text)

    def end_command() -> None:
        nonlocal words, joined
        if words:
            found.append(Command(tuple(words), joined))
        words, joined = [], False

    while i < n:
        ch = text[i]
        if ch == "\\" and text.startswith("\\\n", i):
            joined, i = True, i + 2
        elif ch in " \t\r":
            i += 1
        elif ch == "\n":
            end_command()
            i += 1
        elif ch == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif any(text.startswith(op, i) for op in _OPERATORS):
            end_command()
            i += 2 if text[i:i + 2] in ("&&", "||") else 1
        else:
            word, i = _word(text, i, source)
            words.append(word)
    end_command()
    return found


def _word(text: str, start: int, source: str) -> tuple[Word, int]:
    out, i, n = [], start, len(text)
    while i < n and text[i] not in " \t\r\n;&|":
        ch = text[i]
        if ch == "\\":
            if text.startswith("\\\n", i):  # a continuation inside a word joins it
                i += 2
                continue
            out.append(text[i + 1:i + 2])
            i += 2
        elif ch == "'":
            close = text.find("'", i + 1)
            if close < 0:
                raise UserError(f"{source}: a single quote opened on line {text.count(chr(10), 0, i) + 1} "
                                "is never closed")
            out.append(text[i + 1:close])
            i = close + 1
        elif ch == '"':
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n and text[i + 1] in '"\\$`\n':
                    out.append("" if text[i + 1] == "\n" else text[i + 1])
                    i += 2
                else:
                    out.append(text[i])
                    i += 1
            if i >= n:
                raise UserError(f"{source}: a double quote opened on line {text.count(chr(10), 0, start) + 1} "
                                "is never closed")
            i += 1
        else:
            out.append(ch)
            i += 1
    return Word("".join(out), start, i), i


def quoted(value: str) -> str:
    """A value as a shell word: bare when it is safe, else single-quoted (shlex), `$VAR` kept bare."""
    if re.fullmatch(r"[\w@%+=:,./-]+", value) or re.fullmatch(r"\$\{?\w+\}?", value):
        return value
    if re.fullmatch(r"[\w@%+=:,./\-$\"{}]+", value) and value.count('"') == 0 and "$" in value:
        return f'"{value}"'  # a path built from a variable stays expandable
    return shlex.quote(value)


def edited(text: str, edits: list[tuple[int, int, str]]) -> str:
    """`text` with each (start, end, replacement) applied; spans must not overlap."""
    out, last = [], 0
    for start, end, new in sorted(edits):
        if start < last:
            raise ValueError("overlapping edits")
        out.append(text[last:start])
        out.append(new)
        last = end
    out.append(text[last:])
    return "".join(out)
