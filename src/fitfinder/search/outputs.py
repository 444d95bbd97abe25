"""What fitfinder writes for a study, and the check, made before anything runs, that writing it
can neither overwrite the input nor go anywhere else (issue 35).

`fitfinder search` writes results/NAME/ (best.yaml, trials.csv, summary.json, report.html and
probes/trial-NNNN.log) and, with SQLite, studies/NAME.db and the lock beside it; `fitfinder report`
rewrites three of those files, `fitfinder tiers` writes tiers.json and tiers/*.yaml. Before, only
best.yaml was guarded: a job file kept at results/NAME/summary.json was replaced by the summary,
one at probes/trial-0000.log emptied by the first probe, and a link planted at a probe's log or
at studies/NAME.db.lock emptied or created a file outside.
"""

from __future__ import annotations

import os
from pathlib import Path

from fitfinder import files
from fitfinder.errors import UserError

# What each command writes in results/NAME/ (a name ending in / is a folder of files it writes).
SEARCH = ("best.yaml", "trials.csv", "summary.json", "report.html", "probes/")
REPORT = ("trials.csv", "summary.json", "report.html")
TIERS = ("tiers.json", "tiers/")
SQLITE_SUFFIXES = ("", ".lock", "-journal", "-wal", "-shm")  # the database, the lock beside it, SQLite's own


def check(job_source: str | Path, results_dir: str | Path, name: str, sqlite_file: Path | None,
          writes: tuple[str, ...] = SEARCH) -> None:
    """Refuse in one line, before anything is probed or written: the job file as one of the files
    the command `writes` (by path or by inode), a link or a file where results/NAME/ or one of its
    folders goes, and a link, a FIFO or a folder where it writes a file, the study's SQLite file
    and its lock included (`sqlite_file`: studies/NAME.db, None for a storage that is no file)."""
    results_dir = Path(results_dir)
    out_dir = results_dir / name
    files.check_own_folder(results_dir, out_dir, "--results-dir")
    written = []
    for item in writes:
        if item.endswith("/"):
            files.check_own_folder(results_dir, out_dir / item, "--results-dir")
            written += _entries(out_dir / item)
        else:
            written.append(out_dir / item)
    for path in written:
        files.refuse_special(path, "--results-dir")
    study_files = [Path(f"{sqlite_file}{suffix}") for suffix in SQLITE_SUFFIXES] if sqlite_file else []
    for path in study_files:
        files.refuse_special(path, "--studies-dir")
    for path in [*written, *study_files]:
        if files.same_file(job_source, path):  # the same path, or another name of the same file
            raise UserError(_as_output(Path(job_source), path))


def _as_output(job: Path, path: Path) -> str:
    if path.name == "best.yaml":  # the common case, said plainly
        return (f"{job} is where this search writes its winner; copy it elsewhere (or give --study NEW) "
                "to search from it")
    link = "" if job.resolve() == path.resolve() else f" (a hard link to {path})"
    return (f"{job} is {path}{link}, which this command writes; copy the job file elsewhere (or give --study "
            "NEW) to search from it")


def _entries(folder: Path) -> list[Path]:
    """What lies in `folder` (the probes' logs, the tiers' job files), [] when it does not exist."""
    try:
        with os.scandir(folder) as entries:
            return [Path(entry.path) for entry in entries]
    except OSError:
        return []
