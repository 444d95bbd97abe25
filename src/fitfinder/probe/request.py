"""A probe's request, built in the parent from a job file by its trainer's rules (trainers/; no torch
here), with how the probe is run.

See protocol.py for every field.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from fitfinder import trainers
from fitfinder.probe import trainer_command
from fitfinder.probe.protocol import ProbeRequest

# Denoising steps of a preview in a probe: each step costs the same memory, so two show the
# peak (and that it holds from one step to the next) at a tenth of the time of 20 or 30.
SAMPLE_STEPS = 2


def request_for(job, steps: int, meter: str, budget_bytes: int | None, gpu: int = 0,
                spec: dict | None = None, fault: str | None = None, ram_bytes: int | None = None) -> ProbeRequest:
    """Everything a probe needs, read from the job file by its trainer's rules (`spec`: the
    model, when the caller has it another way, such as an estimate's weightless architecture;
    `fault`: a test hook's injected failure, see probe.faults; `ram_bytes`: the host's budget,
    which the sim meter enforces). The one place a request is built."""
    request = _request(job, steps, meter, budget_bytes, gpu, spec, fault)
    if ram_bytes is not None:
        request["ram_bytes"] = int(ram_bytes)
    return request


def _request(job, steps: int, meter: str, budget_bytes: int | None, gpu: int, spec: dict | None,
             fault: str | None) -> ProbeRequest:
    return {**trainers.probe_request(job, steps=steps, meter=meter, budget_bytes=budget_bytes, gpu=gpu, spec=spec,
                                     fault=fault, sample_steps=SAMPLE_STEPS),
            **trainer_command.request_fields(job)}  # the user's trainer runs it, when the job names one


# How a probe is run, not what it trains: the same job on another card, meter or machine puts the
# same tensors in each phase (a study compares everything else, search.study.job_signature). The
# user's trainer that runs it (probe/trainer.py) is recorded beside, as the study's `trainer_command`;
# the point's job it carries says again what the request says.
RUN_FIELDS = ("steps", "meter", "budget_bytes", "ram_bytes", "gpu", "seed", "fault", "overhead", "prime_optimizer",
              "trainer_run", "trainer_job")


@functools.cache
def recipe_digest() -> str:
    """A digest of the code and data that decide what a probe holds (probe/, models/, the
    architectures, the optimizers): a study made by another recipe may not answer for this one."""
    root = Path(__file__).resolve().parent.parent
    # The export writes a search's winner as a kohya job after it; no probe reads it.
    export = root / "trainers" / "aitoolkit_to_kohya.py"
    files = sorted([*root.glob("probe/*.py"), *root.glob("models/*.py"), *root.glob("archs/*.json"),
                    *(path for path in root.glob("trainers/*.py") if path != export), root / "optimizers.py"])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
