"""Peak memory per phase of a probe: on a real GPU (cuda), simulated on the CPU (sim), or on fake tensors (estimate).

The meters have the same small surface, so the probe reads the same on any of them:

    with meter:                      # starts measuring
        with meter.phase("load"):    # peak of this phase, and its seconds
            with meter.host():       # made here, a tensor lives in host memory, not on the device
                part = build()
            part = meter.to_device(part)   # onto the device: it counts from now on
            meter.to_host(part)            # off the device (low_vram, unloaded encoders)
        meter.register(module)       # tensors made outside the meter's sight (safetensors loads)
    meter.phases                     # name -> {"peak_allocated", "peak_reserved", "seconds",
                                     #          "owners", "peak_host", "host_tensors", "host_pinned", ...}
        with meter.owning("lora"):   # what is made inside belongs to the LoRA (memory by owner)
            add_lora()

        with meter.concrete():       # code that reads tensor values (code books) sees real ones
            optimizer = make_optimizer()

The sim meter counts the bytes of every live tensor storage through a TorchDispatchMode and
raises `torch.OutOfMemoryError` when they pass the budget, so a CPU behaves like a small GPU:
the probe fails at the same place, with the same exception, as it would on the card.

The estimate meter runs the same tracker under FakeTensorMode on the full-size architecture:
no tensor holds data, so a 12-billion-parameter job runs in seconds in well under a GiB, and
each storage is also counted as the CUDA caching allocator hands it out; a GPU overhead model
(`overhead.py`) turns that into what the card would show.

One module each:

- sim.py, estimate.py, cuda.py: the three meters, one a kind (`make` picks one by its name);
- _clock.py: what they keep alike (each phase's peaks and seconds, the step clock);
- _tracker.py: the trackers, live storage bytes as tensors are made and die, on the device and
  the host, by owner, and `PeakWindow`;
- _host.py: the process's resident memory as Linux reports it (each phase's measured host peak);
- _tensors.py: where the meters find tensors (an op's outputs, a model's members, subclasses' insides);
- _fake_mode.py: the estimate's counting FakeTensorMode and the shortcuts that keep it fast;
- _replay.py: the estimate's replays of repeated blocks, checkpointed blocks and updates.
"""

from __future__ import annotations

from fitfinder.probe.meters._replay import CheckpointedBlocks, RepeatedBlocks, RepeatedUpdates
from fitfinder.probe.meters._tensors import inner_tensors, members, submodules, tensors_of
from fitfinder.probe.meters._tracker import AllocatorTracker, StorageTracker
from fitfinder.probe.meters.cuda import CudaMeter
from fitfinder.probe.meters.estimate import EstimateMeter
from fitfinder.probe.meters.sim import SimMeter

__all__ = ["AllocatorTracker", "CheckpointedBlocks", "CudaMeter", "EstimateMeter", "RepeatedBlocks",
           "RepeatedUpdates", "SimMeter", "StorageTracker", "inner_tensors", "make", "members", "submodules",
           "tensors_of"]


def make(kind: str, budget_bytes: int | None, gpu: int = 0, overhead: dict | None = None,
         ram_bytes: int | None = None):
    """The meter a probe request names (`overhead`: the estimate's GPU overhead model; `ram_bytes`:
    the host's budget, which the sim meter enforces and the others judge)."""
    if kind == "estimate":
        return EstimateMeter(budget_bytes, overhead, ram_bytes)
    if kind == "cuda":
        # Under the user's PYTORCH_CUDA_ALLOC_CONF, if any: AI Toolkit sets none (its run.py and
        # toolkit/ at commit 27a03a91 never write it), so neither does the probe.
        return CudaMeter(budget_bytes, gpu, ram_bytes)
    if kind == "sim":
        return SimMeter(budget_bytes, ram_bytes)
    raise ValueError(f"unknown meter {kind!r}; known: sim, cuda, estimate")
