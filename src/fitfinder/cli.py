"""Command line: one function per command, typed options, no logic, heavy imports inside commands.

Errors reach the user as one line: bad input exits 2, a run with no answer exits 1. Set
FITFINDER_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from fitfinder.errors import RunFailed, UserError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Find the best LoRA-training configuration that fits a GPU, and prove it fits.",
)

JobArg = typer.Argument(..., help="AI Toolkit job file (YAML); it is never written to.", show_default=False)
GpuOpt = typer.Option(None, "--gpu", help="Measure on this CUDA device (index). Without a GPU: the sim meter.")
VramOpt = typer.Option(None, "--vram", help="Memory budget, e.g. 24GiB (overrides `fitfinder: vram`).")
JsonOpt = typer.Option(False, "--json", help="End with one JSON object on stdout; progress goes to stderr.")


def _friendly(command):
    """Turn known failures into one line and an exit code; tracebacks only with FITFINDER_DEBUG."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (UserError, RunFailed) as exc:
            if os.environ.get("FITFINDER_DEBUG"):
                raise
            print(f"fitfinder: {'error: ' if isinstance(exc, UserError) else ''}{exc}", file=sys.stderr)
            raise typer.Exit(exc.exit_code)
        except KeyboardInterrupt:
            print("fitfinder: interrupted; run the same command again to resume", file=sys.stderr)
            raise typer.Exit(130)

    return wrapper


@app.command()
@_friendly
def search(
    job_file: Path = JobArg,
    gpu: Optional[str] = GpuOpt,
    vram: Optional[str] = VramOpt,
    margin: Optional[float] = typer.Option(None, "--margin", help="Safety margin, share of the budget [0.05]."),
    trials: Optional[int] = typer.Option(None, "--trials", help="Stop after this many probes [40]."),
    probe_steps: Optional[int] = typer.Option(None, "--probe-steps", help="Training steps per probe [20]."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before a probe is killed [600]."),
    study: Optional[str] = typer.Option(None, "--study", help="Study name [config.name]."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Optuna storage URL [sqlite:///studies/NAME.db]."),
    studies_dir: Path = typer.Option(Path("studies"), "--studies-dir", help="Where SQLite studies live."),
    results_dir: Path = typer.Option(Path("results"), "--results-dir", help="Where results/NAME/ goes."),
    json_output: bool = JsonOpt,
) -> None:
    """Search the best configuration that fits; export it as results/NAME/best.yaml."""
    from fitfinder import search as searching
    from fitfinder.output import Output
    from fitfinder.units import format_bytes

    out = Output(json_output)
    job = _load(job_file, vram=vram, margin=margin, trials=trials, probe_steps=probe_steps, timeout=timeout)
    meter, gpu_index = _meter(gpu, job, out)
    name = _study_name(study or job.name)
    options = searching.SearchOptions(study_name=name, meter=meter, gpu=gpu_index, storage=storage,
                                      studies_dir=studies_dir, results_dir=results_dir)
    summary = searching.run(job, options, out)
    space_ = summary.space
    out.result(summary.as_json())
    if summary.best is None:
        lightest = summary.lightest
        detail = (f"; the lightest point tried (trial {lightest.trial}: {space_.describe(lightest.point)}) "
                  f"peaked at {format_bytes(lightest.peak_bytes)}" if lightest else "")
        raise RunFailed(f"nothing fits in {format_bytes(summary.budget_bytes)}{detail}; "
                        "try a larger --vram, or lighter candidates in the `fitfinder:` section")
    out.line(f"best: {space_.describe(summary.best_point)}  peak {format_bytes(summary.best.peak_bytes)} "
             f"of {format_bytes(summary.budget_bytes)}  ({summary.probes_run} probes"
             f"{'' if summary.proven else ', not proven: trial cap reached'})")
    out.line(f"wrote {summary.best_file}")


@app.command()
@_friendly
def probe(
    job_file: Path = JobArg,
    gpu: Optional[str] = GpuOpt,
    vram: Optional[str] = VramOpt,
    steps: Optional[int] = typer.Option(None, "--steps", help="Training steps [probe_steps, 20]."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before the probe is killed [600]."),
    json_output: bool = JsonOpt,
) -> None:
    """Run one probe of the job file as written and print the peak of each phase.

    Phases: load, text_encoder, latents, sample (first preview), train, last_sample. With --json,
    stdout is the result object: status, phase (where it ran out, if it did), phases (name -> peak
    bytes), phase_stats, seconds_per_step, error.
    """
    from fitfinder import probe as probing
    from fitfinder.output import Output, usage_bar
    from fitfinder.units import format_bytes

    out = Output(json_output)
    job = _load(job_file, vram=vram, probe_steps=steps, timeout=timeout)
    meter, gpu_index = _meter(gpu, job, out, need_budget=False)
    request = probing.request_for(job, job.settings.probe_steps, meter, job.settings.vram_bytes, gpu_index)
    result = probing.ProbeRunner(job.settings.probe_timeout).run(request)
    out.result(result)
    out.line(f"{result.get('meter') or meter}: {result['status']}"
             + (f" in phase {result['phase']}" if result.get("phase") else ""))
    rows = [[name, format_bytes(p["peak_allocated"]), format_bytes(p["peak_reserved"]), f"{p['seconds']:.2f}"]
            for name, p in result.get("phase_stats", {}).items()]
    out.table(["phase", "peak allocated", "peak reserved", "seconds"], rows)
    if result.get("outside_bytes"):
        out.line(f"each peak includes {format_bytes(result['outside_bytes'])} outside PyTorch "
                 "(CUDA context, libraries, other processes on the card)")
    out.line(f"peak {usage_bar(result.get('peak_bytes'), job.settings.vram_bytes)}"
             + (f", {result['seconds_per_step']:.3f} s/step" if result.get("seconds_per_step") else ""))
    if result.get("error"):
        out.line(result["error"])
    if result["status"] in ("error", "timeout"):
        raise typer.Exit(1)


# -- shared option handling -----------------------------------------------------------------------
def _load(job_file: Path, vram: Optional[str] = None, **options):
    """Read and validate the job file, then let command-line options win over `fitfinder:`."""
    from fitfinder import jobconfig
    from fitfinder.units import parse_bytes

    job = jobconfig.load(job_file)
    _check_options(options)
    overrides = {key: value for key, value in options.items() if key != "timeout"}
    overrides["probe_timeout"] = options.get("timeout")
    overrides["vram_bytes"] = parse_bytes(vram, "--vram") if vram is not None else None
    job.settings = job.settings.with_options(**overrides)
    return job


def _check_options(options: dict) -> None:
    if options.get("margin") is not None and not 0 <= options["margin"] < 0.9:
        raise UserError(f"--margin: must be between 0 and 0.9, got {options['margin']}")
    for key in ("trials", "probe_steps", "timeout"):
        if options.get(key) is not None and options[key] <= 0:
            raise UserError(f"--{key.replace('_', '-')}: must be positive, got {options[key]}")


def _meter(gpu: Optional[str], job, out, need_budget: bool = True) -> tuple[str, int]:
    """cuda on the given GPU, or sim (with a one-line notice when a GPU was asked for but is absent)."""
    if gpu is not None:
        if not re.fullmatch(r"\d+", gpu.strip()):
            raise UserError(f"--gpu: expected a device index such as 0, got {gpu!r}")
        if cuda_device_count() > int(gpu):
            if job.settings.vram_bytes is None:
                job.settings.vram_bytes = gpu_total_bytes(int(gpu))
            return "cuda", int(gpu)
        out.note(f"no CUDA device {gpu} here; measuring on the CPU with the sim meter instead")
    if need_budget and job.settings.vram_bytes is None:
        raise UserError("the sim meter needs a memory budget: give --vram (e.g. --vram 24GiB) "
                        "or `fitfinder: {vram: 24GiB}` in the job file, or --gpu N on a machine with a GPU")
    return "sim", 0


def cuda_device_count() -> int:
    """GPUs visible through NVML, without creating a CUDA context in this process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def gpu_total_bytes(index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
    finally:
        pynvml.nvmlShutdown()


def _study_name(name: str) -> str:
    """A name safe as a file name: studies/NAME.db, results/NAME/."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "study"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
