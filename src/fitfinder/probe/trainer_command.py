"""`--trainer-command`: the user's trainer as a probe runs it, checked before any probe.

The command is split as a shell splits words (shlex) but never run through a shell; `{job}` is
replaced by the point's job file inside the one word that holds it (`--config_file={job}` works,
and a path with spaces stays one argument). Refused in one line, before anything runs: no `{job}`,
a program that is not there, a script of another trainer than the job's (dialects.DIALECTS), a
launcher that would put the trainer in a process of its own (the meter goes into the first Python
process that imports torch), and `fitfinder: {weights: random}`, which a trainer cannot load.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from fitfinder.errors import UserError
from fitfinder.probe import dialects

JOB = "{job}"
# Launchers that start the training script in a child process: the meter would claim the launcher.
_LAUNCHERS = (("accelerate", "launch"), ("torchrun",), ("deepspeed",))


def split(text: str) -> list[str]:
    """The command's words, or one line saying what is wrong with it."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise UserError(f"--trainer-command: cannot split it into words ({exc}); quote as a shell would") from None
    if not words:
        raise UserError("--trainer-command: empty; give the trainer's command line with {job} for its job file, "
                        "e.g. \"python /opt/ai-toolkit/run.py {job}\"")
    if not any(JOB in word for word in words):
        raise UserError(f"--trainer-command: no {JOB} in {text!r}; put {JOB} where the trainer takes its job file, "
                        "e.g. \"python /opt/ai-toolkit/run.py {job}\"")
    return words


def check(job) -> list[str] | None:
    """The job's trainer command as words, checked (None when the job has none)."""
    text = job.settings.trainer_command
    if text is None:
        return None
    words = split(text)
    dialect = dialects.dialect_of(job)
    _check_script(words, dialect, getattr(getattr(job, "script", None), "name", None))
    _check_program(words[0])
    if job.settings.weights == "random":
        raise UserError("--trainer-command with `fitfinder: {weights: random}`: the trainer loads "
                        "model.name_or_path itself; point it at the model's folder and drop `weights: random`")
    return words


def request_fields(job) -> dict[str, Any]:
    """What a probe request carries to run the job's trainer (none without a trainer command): the
    trainer (its dialect and command words, request.RUN_FIELDS: how the probe runs) and the point's
    job as that dialect's plain document. The program is looked for only by `check`, where probes
    run: an estimate of the job needs no trainer installed."""
    if job.settings.trainer_command is None:
        return {}
    words = split(job.settings.trainer_command)
    dialect = dialects.dialect_of(job)
    return {"trainer_run": {"dialect": dialect.key, "command": words}, "trainer_job": dialect.document(job)}


def _check_program(program: str) -> None:
    if os.sep in program or (os.altsep and os.altsep in program):
        found = Path(program).expanduser()
        if not found.is_file() or not os.access(found, os.X_OK):
            raise UserError(f"--trainer-command: {program}: no such program (not an executable file)")
    elif shutil.which(program) is None:
        raise UserError(f"--trainer-command: {program}: not found on PATH")


def _check_script(words: list[str], dialect, job_script: str | None) -> None:
    """Refuse a launcher, another trainer's script, and (for a kohya job, `job_script`) another script
    of the same trainer: its parser would not take the job's options."""
    names = [Path(word).name for word in words]
    for launcher in _LAUNCHERS:
        if _find(names, launcher) is not None:
            raise UserError(f"--trainer-command: {' '.join(launcher)} starts the training script in a process of "
                            "its own, where fitfinder's meter cannot follow; run the script with python directly "
                            "(one GPU needs no launcher)")
    scripts = names + [name.rsplit(".", 1)[-1] + ".py" for name in names if "." in name and not name.endswith(".py")]
    for script in scripts:
        trainer = dialects.trainer_of_script(script)
        own = job_script or ", ".join(dialect.scripts)
        if trainer == dialect.key and job_script is not None and script != job_script:
            raise UserError(f"--trainer-command: {script} is not this job's script; the job is for {job_script} "
                            f"({dialect.name}): give {job_script} --config_file {JOB}")
        if trainer is None or trainer == dialect.key:
            continue
        raise UserError(f"--trainer-command: {script} belongs to {dialects.DIALECTS[trainer].name}, which cannot "
                        f"read this {dialect.name} job; give {dialect.name}'s own command ({own})")


def _find(names: list[str], sequence: tuple[str, ...]) -> int | None:
    for index in range(len(names) - len(sequence) + 1):
        if tuple(names[index:index + len(sequence)]) == sequence:
            return index
    return None
