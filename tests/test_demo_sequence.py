"""The demo's probe sequence and winner, byte for byte as recorded (tests/fixtures/demo_sequence.json).

The sim meter is exact and the plan is deterministic, so a refactor that changes neither the probe
nor the planner gives the same trials in the same order, with the same peaks, and the same winner.
If a change is meant to alter them, rerun with FITFINDER_RECORD_DEMO=1 and say why in the commit.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "demo_sequence.json"
# What the study keeps of each trial and does not depend on timing, the host or the process id.
KEPT = ("purpose", "status", "phase", "verdict", "oom_kind", "failed_phases", "phases", "peak_bytes", "error",
        "limit_bytes", "meter", "point")


def kept(attrs: dict) -> dict:
    """A trial's KEPT attributes; the meter's description without the RAM budget, which a search
    takes by default from what this machine has available (--ram)."""
    found = {key: attrs.get(key) for key in KEPT}
    if isinstance(found["meter"], str):
        found["meter"] = re.sub(r", RAM [^,]+$", "", found["meter"])
    return found


def sequence(folder: Path, summary: dict) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=summary["study"],
                              storage=f"sqlite:///{folder / 'studies' / (summary['study'] + '.db')}")
    trials = [{"number": t.number, "state": t.state.name, "params": t.params,
               "quality": None if t.values is None else t.values[0], **kept(t.user_attrs)} for t in study.trials]
    winner = {key: summary[key] for key in ("status", "trials", "probes_run", "proven", "best", "best_file",
                                              "peak_bytes", "budget_bytes", "limit_bytes", "explanation",
                                              "excluded")}
    # Which of two probes of the winning point the header names (the quality probe or the confirmation)
    # goes by their timings; the point, its peak and every other byte do not.
    best_yaml = re.sub(r"trial \d+:", "trial N:", (folder / summary["best_file"]).read_text(), count=1)
    return {"trials": trials, "winner": winner, "best_yaml": best_yaml}


def test_demo_probes_the_same_points_in_the_same_order_and_finds_the_same_winner(demo_run):
    folder, summary = demo_run
    found = json.loads(json.dumps(sequence(folder, summary)))  # tuples and lists alike, as JSON has them
    if os.environ.get("FITFINDER_RECORD_DEMO"):
        FIXTURE.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    expected = json.loads(FIXTURE.read_text())
    assert found["trials"] == expected["trials"]
    assert found["winner"] == expected["winner"]
    assert found["best_yaml"] == expected["best_yaml"]
