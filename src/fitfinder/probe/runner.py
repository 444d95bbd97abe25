"""The parent's side of a probe: fresh processes forked from a preloaded forkserver, each with a
timeout; a crash, a hang or a garbled line becomes a result that says why."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from fitfinder.probe.protocol import RESULT_STATUSES, ProbeRequest, ProbeResult, Status
from fitfinder.probe.recipe import child_main


class ProbeRunner:
    """Runs probes in fresh processes forked from a preloaded forkserver, each with a timeout."""

    def __init__(self, timeout_s: float = 600.0):
        import multiprocessing

        self.timeout_s = timeout_s
        self._server_ready = False
        # Children inherit the user's environment, PYTORCH_CUDA_ALLOC_CONF included: AI Toolkit sets
        # no allocator option of its own, so the probe measures the allocator the training will have.
        _children_import_this_fitfinder()
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["fitfinder.probe._preload"])

    def run(self, request: ProbeRequest, log_path: str | Path | None = None) -> ProbeResult:
        self._wait_for_the_server()
        reader, writer = self.context.Pipe(duplex=False)
        started = time.perf_counter()
        process = self.context.Process(target=child_main, daemon=True,
                                       args=(json.dumps(request), writer, str(log_path) if log_path else None))
        process.start()
        writer.close()
        try:
            line = self._read_line(reader, process)
        finally:
            reader.close()
            if process.is_alive():
                process.kill()
            process.join(5)
        result = _parse(line, process, self.timeout_s, log_path)
        result["wall_seconds"] = round(time.perf_counter() - started, 3)
        return result

    def _wait_for_the_server(self) -> None:
        """Fork one empty child first: the forkserver answers only once its imports are done
        (~10 s on a busy machine), which must not count against the first probe's timeout."""
        if self._server_ready:
            return
        child = self.context.Process(target=_nothing, daemon=True)
        child.start()
        child.join()
        self._server_ready = True

    def _read_line(self, reader, process) -> bytes | None:
        if not reader.poll(self.timeout_s):
            return b"timeout"
        try:
            return reader.recv_bytes()
        except EOFError:  # the child ended without a result line
            process.join(5)
            return None


def _nothing() -> None:
    pass


def _children_import_this_fitfinder() -> None:
    """Put this fitfinder's folder first on the children's import path.

    Python before 3.13 starts the forkserver with the environment's path, not the parent's
    sys.path; without this a probe could run another installed copy of fitfinder.
    """
    package_root = str(Path(__file__).resolve().parents[2])  # src/, above fitfinder/
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not paths or paths[0] != package_root:
        os.environ["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in paths if p != package_root])


def _parse(line: bytes | None, process, timeout_s: float, log_path) -> ProbeResult:
    """The child's result, or a result that says why there is none."""
    if line == b"timeout":
        return _no_result("timeout", f"probe passed its {timeout_s:g} s timeout and was killed", log_path)
    if line is None:
        code = process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return _no_result("error", f"probe process was killed by {name}", log_path)
        return _no_result("error", f"probe process exited with code {code} without a result line", log_path)
    try:
        result = json.loads(line)
    except ValueError:
        result = None
    if not _well_formed(result):
        return _no_result("error", f"probe printed no JSON result: {line[:200]!r}", log_path)
    return result


def _well_formed(result: Any) -> bool:
    """A result the search can read: a known status, and numbers where it reads numbers (a line
    that parses as JSON can still be garbage)."""
    def count(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0)

    if not isinstance(result, dict) or result.get("status") not in RESULT_STATUSES:
        return False
    phases = result.get("phases") or {}
    return (count(result.get("peak_bytes")) and count(result.get("seconds_per_step")) and isinstance(phases, dict)
            and all(isinstance(name, str) and count(peak) for name, peak in phases.items())
            and (result["status"] != "ok" or result.get("peak_bytes") is not None))


def _no_result(status: Status, reason: str, log_path) -> ProbeResult:
    tail = _log_tail(log_path)
    return {"status": status, "phase": None, "error": reason + (f"; last output: {tail}" if tail else ""),
            "oom_kind": None, "peak_bytes": None, "phases": {}, "phase_stats": {},
            "seconds_per_step": None, "steps_run": None}


def _log_tail(log_path, lines: int = 3) -> str:
    try:
        text = Path(log_path).read_text(errors="replace").strip().splitlines()
    except (OSError, TypeError):
        return ""
    return " | ".join(text[-lines:])[-500:]
