"""TOML files of kohya's trainers: read, flattened as the trainers flatten them, edited in place.

Reading is tomllib's. Writing back edits the text line by line: a key fitfinder changes gets its
new value on its own line (the comment after it kept), a new key goes at the end of the table it
belongs to, and every other line stays as written: comments, order and keys fitfinder does not
know. The result is parsed again, so an edit that would not read back is never written.
"""

from __future__ import annotations

import re
try:
    import tomllib
except ImportError:  # Python 3.10: the same module as tomli (pyproject.toml)
    import tomli as tomllib
from typing import Any

import tomli_w

from fitfinder.errors import UserError
from fitfinder.errors import one_line

MAX_TOML_BYTES = 1 << 20


def parse(text: str, source: str) -> dict[str, Any]:
    if len(text) > MAX_TOML_BYTES:
        raise UserError(f"{source}: larger than 1 MiB; a kohya TOML file is a few KiB")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: not valid TOML: {one_line(exc, 200)}") from None
    except RecursionError:
        raise UserError(f"{source}: not valid TOML: nested too deeply") from None


def flattened(data: dict[str, Any]) -> dict[str, Any]:
    """The `--config_file` TOML as the trainers read it: every table's keys in one namespace, a
    top-level key as it is (sd-scripts library/train_util.py read_config_from_file, "combine all
    sections into one"; musubi-tuner training/parser_common.py read_config_from_file, the same). A
    later table's key wins over an earlier one's."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[name] = value
    return flat


_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


def _tables(lines: list[str]) -> list[tuple[str, bool, int, int]]:
    """(name, array table, first line, end line) of each table; "" for the top level."""
    found, name, array, start = [], "", False, 0
    for index, line in enumerate(lines):
        match = _HEADER.match(line)
        if match and not _in_multiline(lines, index):
            found.append((name, array, start, index))
            name, array, start = match.group(2).strip(), match.group(1) == "[[", index + 1
    found.append((name, array, start, len(lines)))
    return found


def _in_multiline(lines: list[str], index: int) -> bool:
    """A line inside a multi-line string or array is no header (counted crudely: an odd number of
    triple quotes, or more `[` than `]` opened by the lines before)."""
    before = "\n".join(lines[:index])
    return before.count('"""') % 2 == 1 or before.count("'''") % 2 == 1


def set_key(text: str, table: str, occurrence: int, key: str, value: Any, source: str) -> str:
    """`text` with `key = value` in the `occurrence`-th table named `table` ("" the top level;
    "datasets" with occurrence 1 the second [[datasets]]), in place if the key is there, else at the
    end of that table (a missing table is added at the end of the file)."""
    lines = text.split("\n")
    rendered = _rendered(key, value)
    matching = [t for t in _tables(lines) if t[0] == table]
    if occurrence >= len(matching):
        if table and occurrence == len(matching) and not any(t[1] for t in matching):
            lines += ["", f"[{table}]", rendered]
            return _checked("\n".join(lines), source)
        raise UserError(f"{source}: no table [{table}] number {occurrence + 1} to write {key} into")
    _, _, start, end = matching[occurrence]
    pattern = re.compile(rf"^(\s*){re.escape(key)}\s*=")
    for index in range(start, end):
        match = pattern.match(lines[index])
        if match:
            comment = _trailing_comment(lines[index])
            span = _value_lines(lines, index, end)
            lines[index:index + span] = [match.group(1) + rendered + (f"  {comment}" if comment else "")]
            return _checked("\n".join(lines), source)
    insert = end
    while insert > start and not lines[insert - 1].strip():
        insert -= 1  # after the table's last line, before the blank lines that end it
    lines.insert(insert, rendered)
    return _checked("\n".join(lines), source)


def delete_key(text: str, table: str, occurrence: int, key: str, source: str) -> str:
    lines = text.split("\n")
    matching = [t for t in _tables(lines) if t[0] == table]
    if occurrence < len(matching):
        _, _, start, end = matching[occurrence]
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
        for index in range(start, end):
            if pattern.match(lines[index]):
                del lines[index:index + _value_lines(lines, index, end)]
                break
    return _checked("\n".join(lines), source)


def _rendered(key: str, value: Any) -> str:
    """`key = value` on one line: an array of numbers or strings inline (`target_frames = [1, 41]`), as
    people write them; anything else as tomli_w writes it."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) and not isinstance(v, bool)
                                                for v in value):
        items = [tomli_w.dumps({"v": v}).strip()[len("v = "):] for v in value]
        return tomli_w.dumps({key: 0}).strip()[:-1] + "[" + ", ".join(items) + "]"
    return tomli_w.dumps({key: value}).strip()


def _value_lines(lines: list[str], index: int, end: int) -> int:
    """How many lines the value starting on `index` spans (a multi-line array or string)."""
    for count in range(1, end - index + 1):
        chunk = "\n".join(lines[index:index + count])
        try:
            tomllib.loads(chunk)
            return count
        except tomllib.TOMLDecodeError:
            continue
    return 1


def _trailing_comment(line: str) -> str:
    """The `# comment` after a value, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[i:].strip()
    return ""


def _checked(text: str, source: str) -> str:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # never write a file the trainer could not read
        raise UserError(f"{source}: fitfinder's edit would not read back as TOML ({one_line(exc, 120)}); "
                        "the file is left as it was") from None
    return text
