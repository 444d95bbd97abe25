"""Before a search on a real GPU: is the card clean?

A search on a card that something else holds learns the wrong limit: probes run out of memory
early and good configurations are pruned for good. So before the first probe fitfinder reads the
card through NVML (no CUDA context in the search process) and runs a small allocation test in a
short subprocess (`_alloc_check.py`: a context, 256 MiB, one cuBLAS product).

The card is not clean when
- another compute process is on it (it holds memory, and may take more in the middle of the search);
- more of it is in use than a display and the driver take (5% of the card, at least 1 GiB), when
  the whole card is the budget; or less is free than the budget (`--vram`) when that is smaller;
- the allocation test fails (an OOM or CUBLAS_STATUS_ALLOC_FAILED on a nearly empty card) or hangs.

Then the search stops with one line and exit code 3 (`CardNotClean`): not bad input (2), not a
search that found nothing (1), but a worker to fix or replace, which a scheduler can tell apart.
`fitfinder search --force` goes on anyway and prints the same line as a warning.

Everything here works on a `CardReading`, a small data object: NVML fills it on a GPU machine,
tests build it by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fitfinder.errors import CardNotClean
from fitfinder.units import format_bytes

TEST_ALLOCATION_BYTES = 256 * 2**20
TEST_TIMEOUT_S = 120.0  # a CUDA context takes seconds; minutes means a hung driver
USED_SHARE = 0.05  # what a display and the driver may hold on a clean card...
USED_FLOOR_BYTES = 2**30  # ...and at least this much


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None where the driver does not say (Windows WDDM)
    name: str = ""
    compute: bool = True  # a CUDA process, not a display (graphics) one


@dataclass(frozen=True)
class CardReading:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    processes: tuple[GpuProcess, ...] | None = ()  # None: NVML could not list them (MIG, permissions)

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


@dataclass(frozen=True)
class AllocationTest:
    ok: bool
    seconds: float
    error: str | None = None


@dataclass(frozen=True)
class Report:
    reading: CardReading | None
    allocation: AllocationTest | None
    problems: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """One line: what is wrong and what to do, or what was checked."""
        card = f"GPU {self.reading.index} ({self.reading.name})" if self.reading else "the GPU"
        if self.problems:
            return (f"{card} is not clean: {'; '.join(self.problems)}. Stop what holds it (see nvidia-smi) or "
                    "use another card; `fitfinder search --force` searches anyway")
        checked = (f"{format_bytes(self.reading.free_bytes)} free of {format_bytes(self.reading.total_bytes)}, "
                   "no other process")
        if self.allocation:
            checked += f", {format_bytes(TEST_ALLOCATION_BYTES)} and cuBLAS ok in {self.allocation.seconds:.1f} s"
        return f"preflight: {card} is clean: {checked}"


def problems(reading: CardReading, allocation: AllocationTest | None, budget_bytes: int | None = None,
             own_pid: int | None = None) -> list[str]:
    """What makes the card unfit for a search (empty when it is clean)."""
    found = []
    others = [p for p in (reading.processes or ()) if p.compute and p.pid != own_pid]
    if others:
        found.append(f"{len(others)} other process{'es' if len(others) > 1 else ''} on it ("
                     + ", ".join(_describe(p) for p in others) + ")")
    if budget_bytes is not None and budget_bytes < reading.total_bytes:
        if reading.free_bytes < budget_bytes:
            found.append(f"only {format_bytes(reading.free_bytes)} free for a {format_bytes(budget_bytes)} budget")
    elif reading.used_bytes > max(USED_FLOOR_BYTES, USED_SHARE * reading.total_bytes):
        found.append(f"{format_bytes(reading.used_bytes)} of {format_bytes(reading.total_bytes)} already in use")
    if allocation is not None and not allocation.ok:
        found.append(f"a {format_bytes(TEST_ALLOCATION_BYTES)} test allocation failed ({allocation.error})")
    return found


def check(index: int, budget_bytes: int | None = None,
          read: Callable[[int], CardReading] | None = None,
          test: Callable[[int], AllocationTest] | None = None) -> Report:
    """Read the card, run the allocation test, and say what is wrong."""
    try:
        reading = (read or read_card)(index)
    except Exception as exc:  # noqa: BLE001 - an unreadable card is a finding, not a crash
        return Report(None, None, (f"NVML could not read GPU {index} ({type(exc).__name__}: {exc})",))
    allocation = (test or allocation_test)(index)
    return Report(reading, allocation, tuple(problems(reading, allocation, budget_bytes, os.getpid())))


def ensure_clean(index: int, budget_bytes: int | None, out, force: bool = False,
                 read: Callable[[int], CardReading] | None = None,
                 test: Callable[[int], AllocationTest] | None = None) -> Report:
    """Check the card before a search: one line either way; stop unless clean or `force`."""
    report = check(index, budget_bytes, read, test)
    if report.clean:
        out.note(report.line())
    elif force:
        out.note(f"warning: {report.line()}; going on (--force)")
    else:
        raise CardNotClean(report.line())
    return report


# -- the two readings ------------------------------------------------------------------------------
def read_card(index: int) -> CardReading:
    """The card's memory and processes through NVML, which makes no CUDA context."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = _nvml_handle(pynvml, index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return CardReading(index, _text(pynvml.nvmlDeviceGetName(handle)), int(memory.total), int(memory.free),
                           _processes(pynvml, handle))
    finally:
        pynvml.nvmlShutdown()


def ram_available(meminfo: str = "/proc/meminfo") -> int | None:
    """What the machine can give a new process without swapping, now (MemAvailable, which the
    kernel estimates from free memory and the page cache it can drop); None where it cannot be read."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def allocation_test(index: int, nbytes: int = TEST_ALLOCATION_BYTES, timeout: float = TEST_TIMEOUT_S) -> AllocationTest:
    """Allocate `nbytes` and run one cuBLAS product on the card, in a subprocess that then exits."""
    script = Path(__file__).with_name("_alloc_check.py")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script), str(index), str(nbytes)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return AllocationTest(False, time.monotonic() - start,
                              f"no answer in {timeout:.0f} s: a hung driver or a card in exclusive use")
    seconds = time.monotonic() - start
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return AllocationTest(False, seconds, f"the test process died: {tail}")
    return AllocationTest(bool(answer.get("ok")), seconds, answer.get("error"))


def _nvml_handle(pynvml, index: int):
    """NVML numbers all cards; CUDA numbers the ones CUDA_VISIBLE_DEVICES lists, in that order."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        chosen = visible[index]
        if chosen.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(chosen))
        return pynvml.nvmlDeviceGetHandleByUUID(chosen)
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _processes(pynvml, handle) -> tuple[GpuProcess, ...] | None:
    try:
        found = [(p, True) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        found += [(p, False) for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)]
    except pynvml.NVMLError:
        return None
    return tuple(GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                            _process_name(pynvml, p.pid), compute) for p, compute in found)


def _process_name(pynvml, pid: int) -> str:
    try:
        return Path(_text(pynvml.nvmlSystemGetProcessName(pid))).name
    except pynvml.NVMLError:
        return ""  # a process of another container


def _describe(process: GpuProcess) -> str:
    held = format_bytes(process.used_bytes) if process.used_bytes is not None else "memory not reported"
    return f"pid {process.pid}{' ' + process.name if process.name else ''}: {held}"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
