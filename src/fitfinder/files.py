"""Files fitfinder reads from others and writes for itself, opened so that what lies there cannot
make it read without end, wait forever, or write somewhere else (issue 35).

- `read_bounded`: a regular file, at most so many bytes (a FIFO would block the read, /dev/zero
  never ends, a folder is not a file).
- `open_own`: a file of its own that it writes in place (a probe's log, a study's lock), never
  through a link (O_NOFOLLOW), never a FIFO (O_NONBLOCK: no waiting for a reader) or a device, and
  when truncated never a file with a second name (a hard link: its other name would be emptied).
- `check_own_folder`: the folders it makes below one the user chose (results/NAME/probes under
  --results-dir) are real folders, not links to elsewhere and not files.
- `same_file`: whether two paths name one file, by path or by inode (the input job file must be
  none of the outputs).

- `write_atomic`: every output (best.yaml, a report, a tier's job), written through a temporary file
  renamed into place, whose rename replaces a link planted at the name instead of following it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from fitfinder.errors import UserError


def read_bounded(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file `path`, or one line saying why not: missing, a folder, not a
    regular file, unreadable, or larger than `limit` bytes (read up to `limit` + 1, no further)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens without a writer
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({reason(exc)})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UserError(f"{path}: is a folder, not a {what}")
        if not stat.S_ISREG(mode):
            raise UserError(f"{path}: not a regular file (a FIFO or a device); give a {what}")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({reason(exc)})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise UserError(f"{path}: larger than {_size(limit)}; a {what} is far smaller")
    return data


def open_own(path: str | Path, truncate: bool = False) -> int:
    """A file descriptor, for writing, on the regular file `path` (created 0644 less the umask if
    missing); OSError naming the reason when a link, a FIFO, a device or a folder lies there, or,
    to be truncated, a file with more than one name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(f"{path}: not a regular file; fitfinder writes only files of its own here: remove it")
        if truncate:
            if found.st_nlink > 1:
                raise OSError(f"{path}: has {found.st_nlink} names (a hard link); emptying it would empty the "
                              "others: remove it")
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd  # O_NONBLOCK changes nothing for a regular file


def open_own_or_refuse(path: str | Path, truncate: bool = False) -> int:
    """`open_own`, with its failures as one line (ELOOP: a link; ENXIO: a FIFO nobody reads)."""
    try:
        return open_own(path, truncate)
    except OSError as exc:
        why = {"ELOOP": "a link", "ENXIO": "a FIFO", "EISDIR": "a folder"}.get(_errno_name(exc))
        if why is not None:
            raise UserError(f"{path}: {why}, where fitfinder keeps a file of its own; remove it") from None
        raise UserError(exc.args[0] if exc.errno is None else f"{path}: cannot open it ({reason(exc)})") from None


def check_own_folder(root: str | Path, folder: str | Path, option: str) -> None:
    """Every part of `folder` below `root` that exists is a real folder: a link there would take
    what fitfinder writes outside `root` (a link as `root` itself is the user's own choice)."""
    root, folder = Path(root), Path(folder)
    parts = folder.relative_to(root).parts
    for depth in range(1, len(parts) + 1):
        here = root.joinpath(*parts[:depth])
        if here.is_symlink():
            raise UserError(f"{option} {root}: {here} is a link (to {os.readlink(here)}); fitfinder writes only "
                            "into folders of its own there: remove the link")
        if os.path.lexists(here) and not here.is_dir():
            raise UserError(f"{option} {root}: {here} is a file, where fitfinder keeps a folder; move it")
        if not os.path.lexists(here):
            return


def refuse_special(path: str | Path, option: str) -> None:
    """A file fitfinder (re)writes or locks in place must be missing or a regular file: a link, a
    FIFO or a folder at its name is refused before anything runs."""
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"{option}: {path} is a link (to {os.readlink(path)}), where fitfinder keeps a file of "
                        "its own; remove it")
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a FIFO or a device)"
        raise UserError(f"{option}: {path} is {kind}, where fitfinder writes a file; move it")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether `a` and `b` name one file: the same path once links are resolved, or the same inode
    (a hard link). False when either does not exist."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _errno_name(exc: OSError) -> str:
    import errno

    return errno.errorcode.get(exc.errno or 0, "")


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and limit % (1 << 20) == 0 else f"{limit} bytes"


def write_atomic(path: str | Path, text: str, mode: int = 0o666) -> None:
    """Write through a temporary file in the same folder and rename it into place, with the mode
    `open` would give (`mode` less the umask: mkstemp's own 0600 would hide results from others).
    A folder or disk that refuses the write is one UserError naming the file and the reason."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise UserError(f"{path}: cannot write it ({reason(exc)}); give another output folder") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, mode & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, a folder in the way of the file
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"{path}: cannot write it ({reason(exc)})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise



def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (threads may be writing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
