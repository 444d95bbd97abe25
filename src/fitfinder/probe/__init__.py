"""One probe of a job: its request, the recipe its process runs, the runner, and what it measures with.

- request.py: the request, built in the parent from a job file (no torch)
- protocol.py: the request and result, the process boundary's two halves
- recipe.py: the child's recipe, phase by phase (`python -m fitfinder.probe` runs one)
- runner.py: the parent's side, probes in fresh processes with a timeout
- meters/: peak memory per phase (sim, cuda, estimate), a module per meter, the trackers and
  the estimate's replays; overhead.py: what a card holds beyond the tensors (`fitfinder
  calibrate`); estimate.py: a probe on fake tensors (`fitfinder estimate`)
- preflight.py: is the card clean; faults.py: the test hooks that break a probe on purpose
- trainer.py: the trainer probe, the user's own trainer run on a point (--trainer-command, checked in
  trainer_command.py, its job written by dialects.py), metered from inside its process by
  trainer_meter.py, which the start-up hook _hook/sitecustomize.py starts there

Nothing here knows about the search: the layers above (search/, results/) import this, never
the other way.
"""

from fitfinder.probe.protocol import RESULT_STATUSES
from fitfinder.probe.recipe import resident, run, shape_schedule, step_timing
from fitfinder.probe.request import SAMPLE_STEPS, request_for
from fitfinder.probe.runner import ProbeRunner

__all__ = ["RESULT_STATUSES", "SAMPLE_STEPS", "ProbeRunner", "request_for", "resident", "run", "shape_schedule",
           "step_timing"]
