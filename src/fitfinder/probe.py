"""One probe: a short LoRA training of the job, in its own process, metered phase by phase.

The process boundary is a tiny protocol: the parent sends one JSON request, the child answers
with exactly one JSON result line. An OOM, a crash or a hang in the child cannot poison the
search; the parent turns each into a result with its reason.

Children are forked from a forkserver that has imported torch, diffusers and peft once (and
never touched a GPU), so each probe starts in a fresh process without paying ~8 s of imports.
`python -m fitfinder.probe < request.json` runs one probe the same way from a shell.

Result: {"status": "ok"|"oom"|"error"|"timeout", "phase": the phase that failed or None,
"peak_bytes", "phases": {name: peak bytes}, "phase_stats": {name: {peak_allocated,
peak_reserved, seconds}}, "seconds_per_step", "steps_run", "error", "oom_kind", "meter"}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fitfinder import jobconfig

RESULT_STATUSES = ("ok", "oom", "error", "timeout")


# -- the request, built by the parent from a job file (no torch here) ----------------------------
def request_for(job, steps: int, meter: str, budget_bytes: int | None, gpu: int = 0) -> dict[str, Any]:
    """Everything a probe needs, read from the job file with AI Toolkit's defaults."""
    from fitfinder import models, space

    rank = int(job.get("network.linear", None) or job.get("network.rank"))
    return {
        "model": models.model_spec(job),
        "dtype": jobconfig.DTYPES[str(job.get("train.dtype")).lower()],
        "buckets": space.resolutions(job),
        "batch_size": int(job.get("train.batch_size")),
        "accumulation": job.accumulation,
        "gradient_checkpointing": bool(job.get("train.gradient_checkpointing")),
        "rank": rank,
        "alpha": float(job.get("network.linear_alpha", None) or job.get("network.alpha", 1.0)),
        "optimizer": str(job.get("train.optimizer")).lower(),
        "lr": float(job.get("train.lr")),
        "steps": int(steps),
        "meter": meter,
        "budget_bytes": budget_bytes,
        "gpu": gpu,
        "seed": 0,
    }


# -- the recipe (child) ------------------------------------------------------------------------
def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load, train `steps` steps over the bucket schedule; report the peak of each phase."""
    import torch

    from fitfinder import meter as meters
    from fitfinder import oom

    meter = meters.make(request["meter"], request.get("budget_bytes"), request.get("gpu", 0))
    result: dict[str, Any] = {"status": "ok", "phase": None, "error": None, "oom_kind": None,
                              "seconds_per_step": None, "steps_run": 0, "meter": meter.describe()}
    failure = None
    try:
        with meter:
            with meter.phase("load"):
                model, optimizer = _load(request, meter)
            with meter.phase("train"):
                _train(model, optimizer, request, meter, result)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result line
        failure = exc
        verdict = oom.classify(exc)
        result.update(status="oom" if verdict.is_oom else "error", phase=meter.current_phase,
                      oom_kind=verdict.kind if verdict.is_oom else None,
                      error=f"{type(exc).__name__}: {exc}".strip()[:2000])
        if not verdict.is_oom:
            result["traceback"] = traceback.format_exc(limit=8)[-4000:]
    del failure  # the traceback pins tensors; drop it before reading the peaks
    result["phase_stats"] = meter.phases
    result["phases"] = {name: int(p["peak_reserved"]) for name, p in meter.phases.items()}
    result["peak_bytes"] = meter.peak_bytes
    result["budget_bytes"] = request.get("budget_bytes")
    return result


def _load(request: dict, meter) -> tuple[Any, Any]:
    """The frozen base model with a fresh peft LoRA on the family's targets, and the optimizer."""
    import torch
    from peft import LoraConfig

    from fitfinder import models

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[request["dtype"]]
    model = models.load_transformer(request["model"], dtype, meter)
    torch.manual_seed(request["seed"])
    model.add_adapter(LoraConfig(r=request["rank"], lora_alpha=request["alpha"], init_lora_weights="gaussian",
                                 target_modules=models.LORA_TARGETS[request["model"]["family"]]))
    if request["gradient_checkpointing"]:
        model.enable_gradient_checkpointing()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(request["optimizer"], trainable, request["lr"])
    return model, optimizer


def _optimizer(name: str, params: list, lr: float):
    import torch

    if name in ("adamw8bit", "adam8bit"):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def bucket_schedule(buckets: list[int], steps: int) -> list[int]:
    """One bucket per step; the largest at the first, the middle and the last step.

    The first step meets the worst shape before any optimizer state exists, the middle and last
    ones meet it with the state and the allocator's fragmentation present, as a long run would.
    """
    largest = max(buckets)
    others = sorted(buckets)
    schedule = [others[i % len(others)] for i in range(steps)]
    for index in {0, steps // 2, steps - 1}:
        schedule[index] = largest
    return schedule


def _train(model, optimizer, request: dict, meter, result: dict) -> None:
    """Flow-matching LoRA steps: noisy latents in, velocity (noise - latents) as the target."""
    import torch
    import torch.nn.functional as F

    from fitfinder import models

    _maybe_fault(request.get("fault"))
    device = meter.device
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(request["seed"])
    steps, accumulation = request["steps"], max(1, request["accumulation"])
    middle = steps // 2
    timings = []
    for step, resolution in enumerate(bucket_schedule(request["buckets"], steps)):
        start = time.perf_counter()
        kwargs, latents, noise = models.flux_inputs(request["model"]["arch"], resolution,
                                                    request["batch_size"], dtype, device, generator)
        t = torch.sigmoid(torch.randn(request["batch_size"], generator=generator)).to(device=device, dtype=dtype)
        noisy = (1 - t[:, None, None]) * latents + t[:, None, None] * noise
        prediction = model(hidden_states=noisy, timestep=t, **kwargs)[0]
        loss = F.mse_loss(prediction.float(), (noise - latents).float()) / accumulation
        loss.backward()
        del kwargs, latents, noise, noisy, prediction, loss
        # Step the optimizer every `accumulation` micro-steps, and once before the middle step so
        # its state exists when the largest bucket comes back.
        if (step + 1) % accumulation == 0 or step == middle - 1 or step == steps - 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meter.register(optimizer)
        timings.append(time.perf_counter() - start)
        result["steps_run"] = step + 1
    steady = timings[1:] or timings  # the first step pays one-time costs
    result["seconds_per_step"] = round(sum(steady) / len(steady), 5)


def _maybe_fault(fault: str | None) -> None:
    """Injected failures for testing the parent's handling (FITFINDER_PROBE_FAULT, see search.py)."""
    if fault == "abort":
        os.abort()
    elif fault == "hang":
        time.sleep(10**6)
    elif fault == "silent":
        os._exit(0)
    elif fault == "garbage":
        os._exit(3)


# -- the child process -------------------------------------------------------------------------
def child_main(request_json: str, result_conn, log_path: str | None) -> None:
    """Forkserver child: all output to the log, the one result line to the parent's pipe."""
    _die_with_parent()
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    result = run(json.loads(request_json))
    sys.stdout.flush()
    result_conn.send_bytes((json.dumps(result) + "\n").encode())
    result_conn.close()


def main() -> None:
    """`python -m fitfinder.probe`: one JSON request on stdin, exactly one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    stdout = os.dup(1)
    os.dup2(2, 1)  # whatever libraries print goes to stderr, never into the result line
    result = run(request)
    sys.stdout.flush()
    os.write(stdout, (json.dumps(result) + "\n").encode())


def _die_with_parent() -> None:
    """Ask Linux to kill this probe when the forkserver goes (it goes when the search dies)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


# -- the parent ----------------------------------------------------------------------------------
class ProbeRunner:
    """Runs probes in fresh processes forked from a preloaded forkserver, each with a timeout."""

    def __init__(self, timeout_s: float = 600.0):
        import multiprocessing

        self.timeout_s = timeout_s
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["fitfinder._preload"])

    def run(self, request: dict[str, Any], log_path: str | Path | None = None) -> dict[str, Any]:
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

    def _read_line(self, reader, process) -> bytes | None:
        if not reader.poll(self.timeout_s):
            return b"timeout"
        try:
            return reader.recv_bytes()
        except EOFError:  # the child ended without a result line
            process.join(5)
            return None


def _parse(line: bytes | None, process, timeout_s: float, log_path) -> dict[str, Any]:
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
        if result.get("status") not in RESULT_STATUSES:
            raise ValueError("no status")
        return result
    except ValueError:
        return _no_result("error", f"probe printed no JSON result: {line[:200]!r}", log_path)


def _no_result(status: str, reason: str, log_path) -> dict[str, Any]:
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


if __name__ == "__main__":
    main()
