"""Faults injected on purpose, so tests can prove what the search does when things break.

FITFINDER_PROBE_FAULT="1:abort,2:hang" makes those trials' probes crash (abort), hang (hang),
exit without a result (silent) or print a malformed result line (garbage); `*:KIND` does it to the
first attempt at every point (the retry then runs clean).

FITFINDER_KILL_AT="claimed:2" makes the search SIGKILL itself at that step of trial 2 (see
KILL_STEPS): the steps of the claim-probe-record protocol, so a test can stop the process at every
one of them and prove that a rerun finishes.
"""

from __future__ import annotations

import os
import signal

from fitfinder.errors import UserError

PROBE_FAULTS = ("abort", "hang", "silent", "garbage")
# The worker's steps for one trial, in order (worker.work and study.record):
KILL_STEPS = (
    "planned",    # the plan chose a point; nothing written yet
    "claimed",    # the trial exists, RUNNING, with its point, purpose and owner (one transaction)
    "beating",    # its first heartbeat is written; the probe has not started
    "probing",    # the probe's process is running
    "probed",     # the probe's result is in hand, nothing of it written
    "recording",  # half of the result's attributes written, the trial still RUNNING
    "recorded",   # the trial finished in its state; its line not printed yet
)
EVERY_FIRST_ATTEMPT = "*"


def probe_faults() -> dict[int | str, str]:
    """FITFINDER_PROBE_FAULT as {trial number or "*": fault}; a malformed value is bad input."""
    faults: dict[int | str, str] = {}
    for item in filter(None, os.environ.get("FITFINDER_PROBE_FAULT", "").split(",")):
        which, _, fault = item.strip().partition(":")
        if fault not in PROBE_FAULTS or not (which.isdigit() or which == EVERY_FIRST_ATTEMPT):
            raise UserError(f"FITFINDER_PROBE_FAULT: {item[:40]!r} is not TRIAL:FAULT (TRIAL a number or *, "
                            f"FAULT one of {', '.join(PROBE_FAULTS)}), e.g. 1:abort,2:hang")
        faults[EVERY_FIRST_ATTEMPT if which == EVERY_FIRST_ATTEMPT else int(which)] = fault
    return faults


def probe_fault(faults: dict, trial_number: int, first_attempt: bool) -> str | None:
    """The fault this trial's probe is to suffer, if any."""
    if trial_number in faults:
        return faults[trial_number]
    return faults.get(EVERY_FIRST_ATTEMPT) if first_attempt else None


def kill_point() -> tuple[str, int] | None:
    """FITFINDER_KILL_AT as (step, trial number), or None; a malformed value is bad input."""
    value = os.environ.get("FITFINDER_KILL_AT", "")
    if not value:
        return None
    step, _, number = value.partition(":")
    if step not in KILL_STEPS or not number.isdigit():
        raise UserError(f"FITFINDER_KILL_AT: {value[:40]!r} is not STEP:TRIAL (STEP one of "
                        f"{', '.join(KILL_STEPS)}), e.g. claimed:2")
    return step, int(number)


def kill_if_at(step: str, trial_number: int) -> None:
    """SIGKILL this process if FITFINDER_KILL_AT names this step of this trial: no cleanup runs,
    as when the machine loses power or the OOM killer strikes."""
    if kill_point() == (step, trial_number):
        os.kill(os.getpid(), signal.SIGKILL)
