"""The meter inside a trainer's process: the child's side of a trainer probe.

The start-up hook (probe/_hook/sitecustomize.py) calls `start(config)` in the trainer's main
process once torch is imported. From then on, in that process:

- The probe's meter runs: on a card the cuda meter (`torch.cuda.max_memory_reserved` plus the
  memory outside PyTorch, per phase; `--vram` caps the process as a built-in probe's is capped),
  on the CPU the sim meter, whose tracker counts every tensor the trainer makes and raises
  `torch.OutOfMemoryError` past the budget, so any PyTorch trainer runs out of memory as it would
  on the smaller card. Weights read from files are made outside the tracker's sight: a module's
  tensors are counted when it is moved (`Module._apply`: `.to()`, `.cuda()`, `.half()`) and when
  it runs (a forward pre-hook), as a card would hold them by then.
- Phases come from what the trainer prints: `sys.stdout` and `sys.stderr` are read as they are
  written, each line through the dialect's phase rules (dialects.TrainerDialect.log_follower), and
  a line that starts a phase ends the last one. Before the first such line the run counts in the
  first phase marked; a log that marks none gives one peak for the whole run, said so.
- Every out-of-memory error is seen, caught by the trainer or not: the sim meter's own, and on a
  card the allocator's count (`memory_stats()["num_ooms"]`), read at each phase's end. AI Toolkit
  skips a step that runs out and stops after three in a row (BaseSDTrainProcess.run): the probe
  reads either as out of memory.
- The facts so far go to the result file at every phase mark and every OOM, and finally at exit,
  so a trainer killed by the timeout or the kernel still leaves what it had measured.

Data-loader workers forked from this process are disarmed at the fork: they neither count nor
raise. Nothing here decides the probe's status: the parent (probe/trainer.py) does, from these
facts, the trainer's exit code and its log.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

from fitfinder import oom
from fitfinder.probe import dialects
from fitfinder.probe.meters import CudaMeter, SimMeter

START = dialects.UNMARKED  # the segment before the log marks a phase

_meter: "TrainerMeter | None" = None


def start(config: dict[str, Any]) -> "TrainerMeter":
    """Meter this process from now on (the hook calls it once, right after torch is imported)."""
    global _meter
    _meter = TrainerMeter(config)
    _meter.arm()
    return _meter


class TrainerMeter:
    """One trainer process metered: its phases, its OOMs, its steps, written to `config["result"]`."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.pid = os.getpid()
        self.follow = dialects.DIALECTS[config["dialect"]].log_follower()
        self.meter = make_meter(config)
        self.phase = START
        self.segment = None  # the meter's phase context now open
        self.marked: list[str] = []  # phases the log marked, in order
        self.ooms: list[dict[str, Any]] = []
        self.uncaught: dict[str, Any] | None = None
        self.steps: list[tuple[float, int]] = []  # (step clock, steps done) at each bar redraw
        self.cuda_ooms = 0
        self.done = False

    # -- arming ------------------------------------------------------------------------------------
    def arm(self) -> None:
        self.meter.__enter__()
        self._open(START)
        if isinstance(self.meter, SimMeter):
            _count_modules(self.meter)
            _note_sim_ooms(self.meter, self)
        sys.stdout = _Tee(sys.stdout, self)
        sys.stderr = _Tee(sys.stderr, self)
        previous_hook = sys.excepthook

        def excepthook(kind, value, tb):
            self.note_uncaught(value)
            previous_hook(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(self.finish)
        os.register_at_fork(after_in_child=self.disarm)
        self.write()

    def disarm(self) -> None:
        """In a forked child (a data-loader worker): no budget, no phases, no result of its own."""
        if os.getpid() == self.pid:
            return
        self.done = True
        if isinstance(self.meter, SimMeter):
            self.meter.tracker.budget_bytes = None
            try:
                self.meter.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a worker must run whatever the mode stack holds
                pass

    # -- what the trainer prints ---------------------------------------------------------------------
    def line(self, text: str) -> None:
        if self.done or os.getpid() != self.pid:
            return
        mark = self.follow(text)
        if mark.steps_done is not None and (not self.steps or mark.steps_done > self.steps[-1][1]):
            self.steps.append((self.meter.step_clock(), mark.steps_done))
        if mark.phase is not None and mark.phase != self.phase:
            self._switch(mark.phase)

    def _switch(self, phase: str) -> None:
        self._close()
        self.phase = phase
        if phase not in self.marked:
            self.marked.append(phase)
        self._open(phase)
        self.write()

    def _open(self, phase: str) -> None:
        self.segment = self.meter.phase(phase)
        self.segment.__enter__()

    def _close(self) -> None:
        if self.segment is None:
            return
        segment, self.segment = self.segment, None
        segment.__exit__(None, None, None)
        self._count_cuda_ooms()

    # -- out of memory --------------------------------------------------------------------------------
    def note_oom(self, message: str) -> None:
        self.ooms.append({"phase": self.phase, "message": message[:600], "steps_done": self._steps_done()})
        self.write()

    def note_uncaught(self, error: BaseException) -> None:
        verdict = oom.classify(error)
        self.uncaught = {"error": f"{type(error).__name__}: {error}".strip()[:2000], "is_oom": verdict.is_oom,
                         "oom_kind": verdict.kind if verdict.is_oom else None, "phase": self.phase,
                         "traceback": "".join(traceback.format_exception(error, limit=40))[-4000:]}

    def _count_cuda_ooms(self) -> None:
        """The caching allocator counts every OOM it raised, caught or not; new ones are this phase's."""
        if not isinstance(self.meter, CudaMeter):
            return
        count = self.meter.oom_count()
        for _ in range(count - self.cuda_ooms):
            self.ooms.append({"phase": self.phase, "message": "CUDA out of memory (counted by the caching "
                              "allocator; the trainer caught it)", "steps_done": self._steps_done()})
        self.cuda_ooms = count

    # -- the result file ------------------------------------------------------------------------------
    def finish(self) -> None:
        if self.done or os.getpid() != self.pid:
            return
        self._close()
        self.done = True
        self.write(final=True)

    def write(self, final: bool = False) -> None:
        facts = self.facts(final)
        path = self.config["result"]
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump(facts, handle)
        os.replace(temporary, path)

    def facts(self, final: bool) -> dict[str, Any]:
        phases = {name: dict(stats) for name, stats in self.meter.phases.items()}
        if self.segment is not None:  # the phase still running: its peak so far (a kill may come)
            entry = phases.setdefault(self.phase, {"peak_allocated": 0, "peak_reserved": 0, "seconds": 0.0})
            for key in ("peak_allocated", "peak_reserved"):
                entry[key] = max(entry[key], self._peak_so_far())
        return {"final": final, "pid": self.pid, "meter": self.meter.describe(),
                "budget_bytes": self.config.get("budget_bytes"), "phase_stats": _folded(phases, self.marked),
                "marked": list(self.marked), "phase_now": self.phase, "ooms": self.ooms, "uncaught": self.uncaught,
                "steps_done": self._steps_done(), "step_clock": self.steps,
                "outside_bytes": getattr(self.meter, "outside_bytes", None), "nvml_bytes": _nvml_bytes(self.meter),
                **_host_usage()}

    def _peak_so_far(self) -> int:
        if isinstance(self.meter, CudaMeter):
            return torch.cuda.max_memory_reserved(self.meter.device) + self.meter.outside_bytes
        return self.meter.tracker.peak_bytes

    def _steps_done(self) -> int | None:
        return self.steps[-1][1] if self.steps else None


def make_meter(config: dict[str, Any]):
    """The probe's meter, as a built-in probe of the same request would have it."""
    if config["meter"] == "cuda":
        return CudaMeter(config.get("budget_bytes"), int(config.get("gpu", 0)))
    return SimMeter(config.get("budget_bytes"))


def _folded(phases: dict[str, dict], marked: list[str]) -> dict[str, dict]:
    """The segment before the first mark counted in the first phase marked (its imports and set-up
    belong to the work that line announces); with no mark at all, the one segment stays START."""
    if not marked or START not in phases:
        return phases
    start = phases.pop(START)
    first = phases.setdefault(marked[0], {"peak_allocated": 0, "peak_reserved": 0, "seconds": 0.0})
    for key in ("peak_allocated", "peak_reserved"):
        first[key] = max(first[key], start[key])
    first["seconds"] = round(first["seconds"] + start["seconds"], 4)
    return {name: phases[name] for name in marked if name in phases}


def _count_modules(meter: SimMeter) -> None:
    """Weights read from files (safetensors) are made where the tracker cannot see: count a module's
    tensors once it is moved or converted, and each module's own when it runs."""
    apply = torch.nn.Module._apply

    def counted_apply(module, *args, **kwargs):
        out = apply(module, *args, **kwargs)
        if os.getpid() == _meter.pid and not _meter.done:
            meter.register(out)
        return out

    def before_forward(module, args):
        if os.getpid() == _meter.pid and not _meter.done:
            meter.register(*module._parameters.values(), *module._buffers.values())

    torch.nn.Module._apply = counted_apply
    torch.nn.modules.module.register_module_forward_pre_hook(before_forward)


def _note_sim_ooms(meter: SimMeter, watcher: TrainerMeter) -> None:
    """Record every simulated device OOM as it is raised (the trainer may catch it)."""
    def note(error: BaseException) -> None:
        if isinstance(error, torch.OutOfMemoryError):
            watcher.note_oom(str(error))

    meter.tracker.on_out_of_memory = note


def _nvml_bytes(meter) -> int | None:
    """This process's memory on the card as NVML counts it (context and libraries included), or
    None: not a card, no pynvml, or a driver that does not list processes (containers, MIG)."""
    if not isinstance(meter, CudaMeter):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(meter.device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid():
                return int(process.usedGpuMemory)
    except Exception:  # noqa: BLE001 - a reading, not a requirement
        return None
    return None


def _host_usage() -> dict[str, Any]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"max_rss_bytes": usage.ru_maxrss * 1024, "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
            "wall_clock": time.time()}


class _Tee(io.TextIOBase):
    """The trainer's stdout or stderr, read line by line as it is written. A progress bar redraws
    its line after a `\r` and flushes, with no newline until it closes: what is pending at a flush
    is read then (else a training bar's first line would be read only at its second, and the
    first step would count in the phase before)."""

    def __init__(self, stream, watcher: TrainerMeter):
        self._stream, self._watcher, self._pending = stream, watcher, ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.replace("\r", "\n").split("\n")
        for line in lines:
            if line.strip():
                self._watcher.line(line)
        if len(self._pending) > 10_000:  # a bar redrawn without end: read what is there
            self._watcher.line(self._pending)
            self._pending = ""
        return self._stream.write(text)

    def flush(self) -> None:
        if self._pending.strip():
            self._watcher.line(self._pending)
        self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return self._stream.encoding
