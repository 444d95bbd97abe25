"""The search: what is known, what to probe next, and the loop that probes it through an Optuna study.

- planner.py: the pure planner (`plan`, `plan_around`, `plan_guided`, `best`, `explain`,
  `Knowledge`): no I/O, a function of what is known
- study.py: the Optuna study (trials, claims shared by workers, heartbeats, resume)
- worker.py: one worker's loop (read, plan around the pending points, claim, probe, record)
- sampler.py: `FitSampler`, the plan as the study's Optuna sampler (imports optuna: not re-exported here)
- loop.py: `run` (open the study, let the workers probe) and `summarize` (what a study says)
- estimated.py: the planner on estimates (`fitfinder estimate --search`, the pre-screen, the guide)
- tiers.py: the planner on estimates for each card size (`fitfinder tiers`)

It imports probe/ and below, never results/: the CLI writes the results from the summary.
"""

from fitfinder.search.planner import (ATTEMPTS, CONFIRM_FACTOR, EXCLUDED, FIT, NOFIT, ROLLBACK, Guide, Knowledge,
                                      Result, Step, best, drive, explain, next_step, plan, plan_around,
                                      plan_guided, result_from_probe)
from fitfinder.search.loop import SearchOptions, SearchSummary, run, summarize  # loop imports the planner
from fitfinder.search.worker import probe_objective

__all__ = ["ATTEMPTS", "CONFIRM_FACTOR", "EXCLUDED", "FIT", "NOFIT", "ROLLBACK", "Guide", "Knowledge", "Result",
           "SearchOptions", "SearchSummary", "Step", "best", "drive", "explain", "next_step", "plan", "plan_around",
           "plan_guided", "probe_objective", "result_from_probe", "run", "summarize"]
