"""fitfinder estimate: a job's peak memory per phase, predicted on a CPU, with no GPU and no weights.

The probe's own recipe (recipe.py) runs on the estimate meter (meters.EstimateMeter): the job's
full-size architecture as fake tensors (models._fake), every phase as a probe runs it, the
storage tracker counting the bytes a card would hold. Two differences from a probe, both about
time and neither about memory:

- one training step, after the optimizer's state has been made with zero gradients
  (`prime_optimizer`), instead of the probe's 20: the heaviest shape meets the state (and, with
  accumulation, the gradients) as the probe's later steps meet them;
- one denoising step per preview instead of two: every denoising step holds the same memory.

Each phase's estimate is what the cuda meter would report: the storages rounded as the CUDA
caching allocator rounds them, the cuBLAS workspace, the fragmentation allowance and the CUDA
context (overhead.GpuOverhead: documented defaults, or what `fitfinder calibrate` measured).

A job's verdict (verdict.py) is its highest phase peak against the budget and the search's
limit (the budget less the safety margin): fits under the limit, tight between the two, does not
fit over the budget. The search's uses of estimates (the pre-screen, the guide, `fitfinder
estimate --search`) are in search/estimated.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from fitfinder import models, space as spaces, trainers
from fitfinder.errors import RunFailed
from fitfinder.probe import recipe
from fitfinder.probe.overhead import GpuOverhead
from fitfinder.probe.protocol import ProbeRequest, ProbeResult
from fitfinder.probe.request import request_for as probe_request
from fitfinder.verdict import NO_FIT, TIGHT, Verdict, Wall, WouldTake, owners_json, smallest_card

def as_estimate(request: ProbeRequest, overhead: GpuOverhead) -> ProbeRequest:
    """A probe request as the estimate runs it: the estimate meter, one primed step, one denoising step."""
    estimate = {key: value for key, value in request.items() if key not in ("fault", "trainer_run", "trainer_job")}
    estimate.update(meter="estimate", steps=1, prime_optimizer=True, overhead=overhead.as_dict(),
                    sample={**request["sample"], "steps": 1},
                    **({"first_sample": {**request["first_sample"], "steps": 1}} if "first_sample" in request else {}))
    return estimate


def request_for(job, overhead: GpuOverhead) -> ProbeRequest:
    """The estimate request of a job file: its architecture, never its weights."""
    request = probe_request(job, 1, "estimate", job.settings.vram_bytes, spec=trainers.architecture_spec(job))
    return as_estimate(request, overhead)


@dataclass
class Estimate:
    """One job's predicted peaks, phase by phase, against a budget."""

    arch_name: str
    phase_stats: dict[str, dict[str, Any]]  # phase -> peak_live, peak_allocated, peak_reserved, seconds
    budget_bytes: int | None
    margin: float
    overhead: GpuOverhead
    seconds: float | None = None  # the estimating process, start to result
    cpu_seconds: float | None = None  # its CPU time (on a busy machine, less than `seconds`)
    max_rss_bytes: int | None = None  # its host memory at the highest
    replayed: dict[str, int] | None = None  # blocks and updates replayed rather than run, by kind of replay

    @property
    def phases(self) -> dict[str, int]:
        """Phase -> predicted peak: on the card (what the cuda meter would report), or with no
        overhead model the tensor bytes alone (what the sim meter would report)."""
        key = "peak_live" if self.overhead.source == "none" else "peak_reserved"
        return {name: int(stats[key]) for name, stats in self.phase_stats.items()}

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def limit_bytes(self) -> int | None:
        return int(self.budget_bytes * (1 - self.margin)) if self.budget_bytes else None

    @property
    def fits(self) -> bool | None:
        return None if not self.budget_bytes else self.peak_bytes <= self.budget_bytes

    @property
    def fits_with_margin(self) -> bool | None:
        return None if not self.budget_bytes else self.peak_bytes <= self.limit_bytes

    @property
    def verdict(self) -> str | None:
        """fits, tight or does not fit (verdict.judge); None without a budget."""
        return Verdict.of(self.peak_bytes, self.budget_bytes, self.margin).verdict

    def first_phase_over(self, threshold_bytes: float) -> str | None:
        """The first phase (in the order they run) whose peak passes `threshold_bytes`."""
        return next((name for name, peak in self.phases.items() if peak > threshold_bytes), None)

    @property
    def highest_phase(self) -> str:
        """The phase of the peak (the first, where two phases peak alike)."""
        return max(self.phases, key=lambda name: self.phases[name])

    def owners_at(self, phase: str) -> dict[str, int]:
        """What holds the phase's peak, {owner tag: bytes}, largest first: summing to the card's
        peak (the GPU's overhead and the allocator's rounding among them); with no overhead model,
        the tensors alone, as the sim meter counts them (no rounding either)."""
        owners = dict(self.phase_stats[phase].get("owners") or {})
        if self.overhead.source == "none":
            owners.pop("allocator rounding", None)
        return owners

    def wall(self, phase: str | None = None, why: str = "", point: str = "") -> Wall:
        """`phase` (by default the highest) as a verdict's wall, with its owners; one that does not
        pass the budget's limit is only the highest phase (`stops` False)."""
        phase = phase or self.highest_phase
        stops = self.limit_bytes is not None and self.phases[phase] > self.limit_bytes
        return Wall(phase, self.phases[phase], why, point, owners=self.owners_at(phase), stops=stops,
                    limit_bytes=self.limit_bytes)

    @property
    def host_phases(self) -> dict[str, int]:
        """Phase -> the host's predicted peak: the process's own memory plus the host tensors."""
        return {name: int(stats["peak_host"]) for name, stats in self.phase_stats.items() if "peak_host" in stats}

    def host_wall(self) -> dict[str, Any] | None:
        """The phase of the host's peak, its bytes, the process's own share (`outside_bytes`: what
        the estimating process held before its tensors, standing in for the trainer's libraries)
        and the host tensors by owner, largest first; None without host figures."""
        hosts = self.host_phases
        if not hosts:
            return None
        phase = max(hosts, key=lambda name: hosts[name])
        stats = self.phase_stats[phase]
        return {"phase": phase, "peak_bytes": hosts[phase], "outside_bytes": hosts[phase] - int(stats["host_tensors"]),
                "pinned_bytes": int(stats.get("host_pinned") or 0),
                "owners": owners_json(stats.get("host_owners") or {})}

    def as_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict, "fits": self.fits, "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "limit_bytes": self.limit_bytes, "fits_with_margin": self.fits_with_margin,
            "headroom_bytes": self.budget_bytes - self.peak_bytes if self.budget_bytes else None,
            "phase": self.first_phase_over(self.budget_bytes) if self.budget_bytes else None,
            "phases": self.phases, "phase_stats": self.phase_stats, "arch": self.arch_name,
            "overhead": self.overhead.as_dict(), "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
            "max_rss_bytes": self.max_rss_bytes, "replayed": self.replayed,
            "host_phases": self.host_phases, "host_wall": self.host_wall(),
        }


def explain(job, found: Estimate, overhead: GpuOverhead) -> Verdict:
    """The verdict of an estimate of `job`, with its wall by owner: for one that fits (or has no
    budget) its highest phase; else the first phase past the budget (for a tight one past the
    limit), with what the load holds when the wall is the load, and what would take it (the
    smallest card whose limit holds its peak; a tight one also fits this card with a smaller
    margin)."""
    verdict = Verdict.of(found.peak_bytes, found.budget_bytes, found.margin)
    if verdict.verdict not in (TIGHT, NO_FIT):
        verdict.wall = found.wall()
        return verdict
    threshold = found.budget_bytes if verdict.verdict == NO_FIT else verdict.limit_bytes
    phase = found.first_phase_over(threshold)
    verdict.phase = phase if verdict.verdict == NO_FIT else None
    why = models.load_note(request_for(job, overhead)) if phase == "load" else ""
    verdict.wall = found.wall(phase, why)
    card = smallest_card(found.peak_bytes, found.margin)
    verdict.would_take = WouldTake(card, found.peak_bytes if card else None,
                                   margin_at_most=margin_fitting(found.peak_bytes, found.budget_bytes)
                                   if verdict.verdict == TIGHT else None)
    return verdict


def margin_fitting(peak_bytes: int, budget_bytes: int) -> float:
    """The largest margin, in whole hundredths, under which `peak_bytes` fits `budget_bytes`."""
    return max(0.0, int((1 - peak_bytes / budget_bytes) * 100) / 100)


class InProcess:
    """Runs estimate requests in this process, with the ProbeRunner's `run(request)` surface.

    An estimate holds no memory worth isolating (fake tensors) and cannot run out of it, so the
    process boundary a probe needs buys it nothing but a second import of torch, diffusers,
    transformers, peft and bitsandbytes in the probe server: 6-8 s, as long as the estimate
    itself (benchmarks/estimate_speed.py). `fitfinder estimate` runs here; the search's
    pre-screen keeps using its own warm probe server. What the libraries print goes to
    /dev/null, as a probe's goes to its log, so --json's stdout stays one object.
    """

    def __init__(self, timeout_s: float = 600.0, progress_after_s: float | None = None):
        if timeout_s <= 0:
            raise ValueError(f"the estimate's timeout must be positive but got {timeout_s}")
        self.timeout_s = timeout_s
        self.progress_after_s = progress_after_s  # None: silent; else the phase on stderr past this

    def run(self, request: ProbeRequest, log_path=None) -> ProbeResult:
        with _quiet_fds():
            import fitfinder.probe._preload  # noqa: F401 - the libraries, once, before the clock starts
        from fitfinder.probe.meters import EstimateMeter

        # The last estimate's garbage, before probe.run freezes what is alive, and before the
        # timeout starts: an alarm that rang while the collector ran a finalizer would be lost.
        EstimateMeter.thaw()
        gc.collect()
        started, cpu = time.perf_counter(), time.process_time()
        progress = _Progress(self.progress_after_s)
        try:
            with progress, _quiet_fds(), _alarm(self.timeout_s):
                result = recipe.run(request, progress.watch)  # turns an exception inside the recipe into a result
        except EstimateTimeout:  # raised outside the recipe
            result = {"status": "timeout", "phase": None, "phases": {}, "phase_stats": {}}
        if result["status"] == "timeout" or "EstimateTimeout" in (result.get("error") or ""):
            result.update(status="timeout", error=f"the estimate passed its {self.timeout_s:g} s timeout")
        result["wall_seconds"] = round(time.perf_counter() - started, 3)
        result["cpu_seconds"] = round(time.process_time() - cpu, 3)  # this estimate's, not the imports'
        return result


class _Progress:
    """The phase an estimate is in, on stderr, once it has run `after_s` seconds: a line that
    rewrites itself on a terminal, a line per phase otherwise. It writes to a copy of stderr taken
    before the estimate sends the libraries' output to /dev/null, from a thread that reads the
    meter's `current_phase`; stdout stays the command's (with --json, one object)."""

    def __init__(self, after_s: float | None):
        self.after_s, self.meter, self.fd = after_s, None, None
        self.done = threading.Event()
        self.shown = ""

    def watch(self, meter) -> None:
        self.meter = meter

    def __enter__(self) -> "_Progress":
        if self.after_s is not None:
            sys.stderr.flush()
            self.fd = os.dup(2)
            self.terminal = os.isatty(self.fd)
            self.started = time.perf_counter()
            self.thread = threading.Thread(target=self._loop, name="estimate-progress", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        self.done.set()
        self.thread.join()
        if self.terminal and self.shown:
            os.write(self.fd, b"\r\x1b[K")  # the line goes: the result follows
        os.close(self.fd)

    def _loop(self) -> None:
        if self.done.wait(self.after_s):
            return
        while True:
            phase = getattr(self.meter, "current_phase", None) or "start"
            if phase != self.shown or self.terminal:
                text = f"fitfinder: estimating: {phase} ({time.perf_counter() - self.started:.0f} s)"
                os.write(self.fd, (f"\r\x1b[K{text}" if self.terminal else f"{text}\n").encode())
                self.shown = phase
            if self.done.wait(1.0):
                return


class EstimateTimeout(Exception):
    """Raised in the estimating thread when its time is up; probe.run turns it into a result."""


@contextlib.contextmanager
def _alarm(seconds: float):
    def expire(signum, frame):
        raise EstimateTimeout(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _quiet_fds():
    """stdout and stderr at the file-descriptor level to /dev/null (C libraries print there too)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def run(job, runner, overhead: GpuOverhead) -> Estimate:
    """Estimate a job file with `runner`: InProcess, or a probe.ProbeRunner (a fresh process)."""
    request = request_for(job, overhead)
    result = runner.run(request)
    if result["status"] != "ok":
        raise RunFailed(f"the estimate of {job.source} failed in phase {result.get('phase') or '-'}: "
                        f"{(result.get('error') or 'no result').splitlines()[0][:300]}")
    return Estimate(arch_name=request["model"]["arch_name"], phase_stats=result["phase_stats"],
                    budget_bytes=job.settings.vram_bytes, margin=job.settings.margin, overhead=overhead,
                    seconds=result.get("wall_seconds"), cpu_seconds=result.get("cpu_seconds"),
                    max_rss_bytes=result.get("max_rss_bytes"), replayed=result.get("replayed"))


class Estimator:
    """One job's points estimated, each phase at most once for the knobs it depends on.

    A phase's peak depends only on the knobs that phase depends on (space.Knob.phases, which
    tests/test_space_truth.py holds to the real probe byte for byte), so a point whose every
    phase was already estimated at other points that agree on that phase's knobs is known
    without running: the planner's confirmation, a speed setting that changes only the training
    step once another point had it, a tier's search that walks what a smaller card's already
    walked. Estimates do not depend on the budget, so searches at several budgets share one.
    """

    def __init__(self, job, runner, overhead: GpuOverhead, space=None):
        self.job, self.runner, self.overhead = job, runner, overhead
        self.space = space or spaces.build(job)
        self.arch_name: str | None = None
        self.runs = 0  # estimates actually run
        self.recalled = 0  # points answered from the phases of others
        self._phases: dict[tuple, dict[str, Any]] = {}  # (phase, its knobs' values) -> phase stats
        self._failed: set[tuple] = set()

    def of(self, point) -> Estimate:
        stats = self._recall(point)
        if stats is not None:
            self.recalled += 1
            return Estimate(arch_name=self.arch_name, phase_stats=stats, budget_bytes=self.job.settings.vram_bytes,
                            margin=self.job.settings.margin, overhead=self.overhead, seconds=0.0)
        found = run(self.space.apply(self.job, point), self.runner, self.overhead)
        self.runs += 1
        self.arch_name = found.arch_name
        for phase, phase_stats in found.phase_stats.items():
            self._phases[self._phase_key(phase, point)] = phase_stats
        return found

    def phases_or_none(self, point) -> dict[str, int] | None:
        """A point's predicted peak per phase, or None when its estimate fails (asked once)."""
        found = self.of_or_none(point)
        return None if found is None else found.phases

    def of_or_none(self, point) -> Estimate | None:
        """A point's estimate, or None when it fails (asked once)."""
        key = self.space.key(point)
        if key in self._failed:
            return None
        try:
            return self.of(point)
        except RunFailed:
            self._failed.add(key)
            return None

    def _recall(self, point) -> dict[str, Any] | None:
        stats = {}
        for phase in self.space.phases_run(point):
            known = self._phases.get(self._phase_key(phase, point))
            if known is None:
                return None
            stats[phase] = known
        return stats

    def _phase_key(self, phase: str, point) -> tuple:
        return (phase, *(point[k.name] for k in self.space.knobs if phase in k.phases))
