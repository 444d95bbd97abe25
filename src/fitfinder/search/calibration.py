"""`fitfinder calibrate --study NAME`: a study's trainer probes against their estimates, fitted.

Every trainer probe (probe/trainer.py) keeps the estimate of its point beside what the trainer held,
phase by phase; the study records both (study.write_facts: `phase_stats`, `trainer`, `estimate`).
Each phase measured by both is a pair; a phase the probe ran out of memory in is not (it holds the
allocation that failed, not a peak), nor is a run whose log marked no phase against anything but
the estimate's highest phase. The pairs fit the estimate's overhead model for that trainer on that
card (probe.overhead.fit_pairs), stored for the estimate-guided search of later trainer probes
(search.estimated.guide_for), whose error band then starts from the pairs' spread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitfinder.errors import UserError
from fitfinder.probe import overhead as overheads
from fitfinder.probe.overhead import GpuOverhead, Pair, TrainerFit
from fitfinder.search import study as studies


def pairs_of(trials: list[tuple[int, dict[str, Any]]]) -> list[Pair]:
    """The pairs in a study's trials, given as (trial number, user attributes)."""
    pairs = []
    for number, attrs in trials:
        trainer, estimate = attrs.get("trainer_run"), attrs.get("estimate") or {}
        estimated = estimate.get("phase_stats") or {}
        if not trainer or not estimated or attrs.get("status") not in ("ok", "oom"):
            continue
        ran_out = attrs.get("phase") if attrs.get("status") == "oom" else None
        for phase, stats in (attrs.get("phase_stats") or {}).items():
            if phase != ran_out and phase in estimated:
                pairs.append(Pair(number, phase, int(stats["peak_reserved"]), int(estimated[phase]["peak_allocated"])))
        whole = trainer.get("whole_run")
        if whole and not attrs.get("phase_stats") and attrs.get("status") == "ok":
            highest = max(int(stats["peak_allocated"]) for stats in estimated.values())
            pairs.append(Pair(number, "whole run", int(whole["peak_reserved"]), highest))
    return pairs


def calibrate(name: str, studies_dir: Path, storage: str | None) -> tuple[TrainerFit, Path, list[Pair], str, str]:
    """Fit the pairs of study `name` and store the fit under its card and trainer; returns the fit,
    where it is stored, the pairs, the card and the trainer's dialect."""
    study = _load(name, studies_dir, storage)
    trials = [(trial.number, trial.user_attrs) for trial in study.get_trials(deepcopy=False)]
    probed = [(number, attrs) for number, attrs in trials if attrs.get("trainer_run")]
    if not probed:
        raise UserError(f"study {name!r} has no trainer probe: search with --trainer-command first "
                        "(docs/trainer-probe.md)")
    pairs = pairs_of(probed)
    card = str(probed[-1][1].get("card") or overheads.SIM_CARD)
    dialect = str(probed[-1][1]["trainer_run"].get("dialect") or "aitoolkit")
    # The workspace is not told apart from the context by the pairs: the card's own calibration's
    # (or the default); the sim meter has none.
    workspace = 0 if card == overheads.SIM_CARD else overheads.stored().get(card, GpuOverhead()).workspace_bytes
    fit = overheads.fit_pairs(pairs, f"fitted on study {name} ({len(pairs)} phases of {len(probed)} trainer probes)",
                              workspace)
    path = overheads.save_trainer_fit(fit, card, dialect, pairs, name)
    return fit, path, pairs, card, dialect


def _load(name: str, studies_dir: Path, storage: str | None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is None:
        db = Path(studies_dir) / f"{name}.db"
        if not db.exists():
            raise UserError(f"no study {name!r} in {studies_dir}/; run `fitfinder search JOB --trainer-command ...` "
                            "first, or give --storage URL")
    url = studies.storage_url(name, Path(studies_dir), storage)
    try:
        return optuna.load_study(study_name=name, storage=url)
    except KeyError:
        raise UserError(f"no study {name!r} in {url}") from None
