"""Command line: one function per command, typed options, no logic, heavy imports inside commands.

Errors reach the user as one line: bad input exits 2, a run with no answer exits 1. Set
FITFINDER_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from fitfinder.errors import RunFailed, UserError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Find the best LoRA-training configuration that fits a GPU, and prove it fits.\n\n"
         "No GPU? `fitfinder estimate JOB --vram 24GiB` predicts a job's peak memory on the CPU in seconds, "
         "`estimate --search` the best configuration for that card, `tiers` the best for each card size. "
         "Verdicts: fits (under the limit: the budget less the margin), tight (under the budget, over the "
         "limit: it may run out), does not fit.",
)

JobArg = typer.Argument(..., help="The job: an AI Toolkit job file (YAML), a shell file with an sd-scripts or "
                        "musubi-tuner command line, or a kohya --config_file TOML; it is never written to.",
                        show_default=False)
GpuOpt = typer.Option(None, "--gpu", help="Measure on this CUDA device (index); without it, the sim meter on "
                                           "the CPU (for tiny models: `estimate` predicts full-size ones).")
VramOpt = typer.Option(None, "--vram", help="Memory budget, e.g. 24GiB (overrides `fitfinder: vram`).")
RamOpt = typer.Option(None, "--ram", help="Host memory budget, e.g. 32GiB (overrides `fitfinder: ram`) [what the "
                                          "machine has available now, less the margin].")
RamNoneOpt = typer.Option(None, "--ram", help="Host memory budget, e.g. 32GiB (overrides `fitfinder: ram`) [none].")
JsonOpt = typer.Option(False, "--json", help="End with one JSON object on stdout; progress goes to stderr.")
NameArg = typer.Argument(..., help="Study name (as in studies/NAME.db and results/NAME/).", show_default=False)
StorageOpt = typer.Option(None, "--storage", help="Optuna storage URL [sqlite:///studies/NAME.db].")
StudiesDirOpt = typer.Option(Path("studies"), "--studies-dir", help="Where SQLite studies live.")
ResultsDirOpt = typer.Option(Path("results"), "--results-dir", help="Where results/NAME/ goes.")
ScriptOpt = typer.Option(None, "--script", help="The kohya script a --config_file TOML is for, where its keys do not "
                                                "say (flux_train_network.py, qwen_image_train_network.py).")
ArchOpt = typer.Option(None, "--arch", help="A kohya job's model as this shipped architecture (e.g. flux-tiny, "
                                            "random weights) instead of its checkpoint's.")
TrainerOpt = typer.Option(None, "--trainer-command",
                          help="Probe with your trainer: its command line, {job} where it takes the job file, e.g. "
                               "\"python /opt/ai-toolkit/run.py {job}\" (docs/trainer-probe.md; overrides "
                               "`fitfinder: trainer_command`).")
# An estimate that runs longer than this says on stderr which phase it is in (a FLUX.1-dev estimate
# takes 10-40 s on a busy 2-core machine, and printed nothing until it ended).
PROGRESS_AFTER_S = 3.0


def _show_version(value: bool) -> None:
    if value:
        from fitfinder import __version__

        print(f"fitfinder {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                       help="Print fitfinder's version and exit.")) -> None:
    """`fitfinder --version`; the commands are below."""


def _friendly(command):
    """Turn known failures into one line and an exit code; tracebacks only with FITFINDER_DEBUG."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (UserError, RunFailed) as exc:
            if os.environ.get("FITFINDER_DEBUG"):
                raise
            from fitfinder.errors import one_line  # a message quoting user text stays one line

            print(f"fitfinder: {'error: ' if isinstance(exc, UserError) else ''}{one_line(exc, 4000)}", file=sys.stderr)
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
    ram: Optional[str] = RamOpt,
    margin: Optional[float] = typer.Option(None, "--margin", help="Safety margin, share of the budget [0.05]."),
    trials: Optional[int] = typer.Option(None, "--trials", help="Stop after this many probes [40]."),
    probe_steps: Optional[int] = typer.Option(None, "--probe-steps", help="Training steps per probe [20]."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before a probe is killed [600]."),
    study: Optional[str] = typer.Option(None, "--study", help="Study name [config.name]."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Optuna storage URL [sqlite:///studies/NAME.db]."),
    studies_dir: Path = typer.Option(Path("studies"), "--studies-dir", help="Where SQLite studies live."),
    results_dir: Path = typer.Option(Path("results"), "--results-dir", help="Where results/NAME/ goes."),
    force: bool = typer.Option(False, "--force", help="Search even if the GPU preflight finds the card not clean, "
                                                     "or with more --workers than CPU cores."),
    workers: int = typer.Option(1, "--workers",
                                help="Worker processes on the CPU (sim meter); with --gpu: one per GPU."),
    worker: bool = typer.Option(False, "--worker", hidden=True, help="Run as one worker of a launched search."),
    prescreen: Optional[bool] = typer.Option(
        None, "--prescreen/--no-prescreen",
        help="Estimate each point first (fake tensors, seconds) and decide without a probe those estimated at "
             "1.25 x the budget or more [on with --gpu, off with the sim meter]."),
    guided: Optional[bool] = typer.Option(
        None, "--guided/--no-guided",
        help="Plan on estimates and probe only where they cannot decide (near the limit), the speed "
             "settings' timings and the winner's proof [on with --gpu, off with the sim meter]."),
    script: Optional[str] = ScriptOpt,
    arch: Optional[str] = ArchOpt,
    trainer_command: Optional[str] = TrainerOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Search the best configuration that fits; export it as results/NAME/best.yaml.

    Each probe is a short training run: on a card with --gpu N (the cuda meter), or on the CPU
    with --vram and the sim meter, which is for tiny models (the demo, tests). Without a GPU, a
    full-size model is predicted instead, in seconds: `fitfinder estimate JOB --vram 24GiB` (one
    point), `fitfinder estimate JOB --vram 24GiB --search` (the best point for that card) and
    `fitfinder tiers JOB` (the best point per card size). Exit code 0 when something fits, 1 when
    nothing does, 2 for bad input, 3 for a card that is not clean.
    """
    from fitfinder import search as searching
    from fitfinder.probe import trainer_command as trainer_check
    from fitfinder.results import report as reporting
    from fitfinder.results.output import Output, usage_bar
    from fitfinder.units import format_bytes

    out = Output(json_output, fancy=False if worker else None)
    job = _load(job_file, vram=vram, ram=ram, margin=margin, trials=trials, probe_steps=probe_steps,
                timeout=timeout, script=script, arch=arch, trainer_command=trainer_command)
    trainer_check.check(job)  # a trainer command that cannot run: one line, before any probe or note
    _default_ram(job)
    _notes(out, job)
    budget_given = job.settings.vram_bytes is not None
    meter, gpus = _meter(gpu, job, out)
    if meter == "sim" and not force and not worker:
        _refuse_full_size_on_the_cpu(job)
    if workers < 1:
        raise UserError(f"--workers: must be at least 1, got {workers}")
    if len(gpus) > 1 and workers > 1:
        raise UserError("--workers is for the CPU; with --gpu 0,1,... there is one worker per GPU")
    workers = max(workers, len(gpus))
    if meter == "cuda" and workers > len(gpus) and not force:
        raise UserError(f"--workers {workers} on {len(gpus)} card(s): workers sharing a card measure each other's "
                        "memory; give one card per worker with --gpu 0,1,..., or add --force to insist")
    cores = os.cpu_count() or 1
    if meter == "sim" and workers > cores and not worker:
        if not force:  # each worker is a process with its own probes: a thousand would be a fork bomb
            raise UserError(f"--workers {workers} is more than the {cores} CPU cores here, and a search with more "
                            "workers than cores is slower, not faster (docs/scaleout.md); add --force to insist")
        out.note(f"{workers} workers on {cores} CPU cores: sim probes will share the cores")
    if meter == "cuda" and not worker:  # a dirty card would prune configurations that fit: check first
        from fitfinder.probe import preflight

        for index in gpus:
            preflight.ensure_clean(index, job.settings.vram_bytes, out, force=force)
    name = _study_name(study or job.name)
    _check_outputs(job, results_dir / name, None if storage else studies_dir)
    options = searching.SearchOptions(study_name=name, meter=meter, gpu=gpus[0], storage=storage,
                                      studies_dir=studies_dir, results_dir=results_dir, workers=workers,
                                      gpus=tuple(gpus) if meter == "cuda" and len(gpus) > 1 else (),
                                      worker=worker, budget_is_card=meter == "cuda" and not budget_given,
                                      prescreen=prescreen, guided=guided)
    summary = searching.run(job, options, out)
    if summary is None:  # a worker: the search that launched it reports
        return
    reporting.write_results(summary, results_dir / name, job)  # best.yaml, trials.csv, summary.json, report.html
    space_ = summary.space
    shown = reporting.shown_result(space_, summary.known)
    out.result({**summary.as_json(), "wall": reporting.wall_json(summary.optuna_study, shown, summary.limit_bytes)})
    report_file = results_dir / name / "report.html"
    if summary.best is None:
        lightest = summary.lightest
        detail = (f"; the lightest point tried (trial {lightest.trial}: {space_.describe(lightest.point)}) "
                  f"peaked at {format_bytes(lightest.peak_bytes)}" if lightest else "")
        _say_tight(out, space_, summary.closest_tight(), summary.budget_bytes, summary.limit_bytes, probed=True)
        out.line(f"report: {report_file}")
        if not summary.finished:  # stopped by --trials: nothing is proven not to fit
            raise RunFailed(f"no fit found in the {summary.probes_run} probes of the trial cap (--trials "
                            f"{summary.trial_cap}){detail}; lighter points are still untried: run again with a "
                            "larger --trials (the study resumes)")
        if summary.excluded:  # a point that could not be probed may fit
            raise RunFailed(f"no fit found in {format_bytes(summary.budget_bytes)} among the points that could be "
                            f"probed; {summary.proven_around()}{detail}; see their logs in {results_dir / name}/probes")
        host = summary.host_walls()
        if host:  # the host stopped some: say so, and which lever is the RAM's
            raise RunFailed(f"does not fit: nothing fits in {format_bytes(summary.budget_bytes)} of the card and "
                            f"{format_bytes(summary.ram_bytes)} of host memory{detail}; {len(host)} probe(s) ran "
                            f"out of host memory (trial {', '.join(str(r.trial) for r in host[:5])}); try a larger "
                            "--ram or --vram, or less offloading in the `fitfinder:` candidates")
        raise RunFailed(f"does not fit: nothing fits in {format_bytes(summary.budget_bytes)}{detail}; "
                        "try a larger --vram, or lighter candidates in the `fitfinder:` section "
                        f"(`fitfinder tiers {job.source}` predicts the smallest card that takes it)")
    rows = [[row["knob"], space_.by_name[row["knob"]].label(row["desired"]),
             space_.by_name[row["knob"]].label(row["chosen"]), row["verdict"],
             "" if row["forced_by"] is None else f"trial {row['forced_by']}"] for row in summary.explanation]
    out.table(["knob", "desired", "chosen", "outcome", "forced by"], rows)
    host_peak = summary.best.host_peak_bytes
    out.line(f"best: {space_.describe(summary.best_point)}  peak {format_bytes(summary.best.peak_bytes)} "
             f"of {format_bytes(summary.budget_bytes)}  ({summary.probes_run} probes"
             f"{'' if summary.finished else ', not proven: trial cap reached'}"
             f"{'; ' + summary.proven_around() if summary.excluded else ''})")
    if host_peak is not None:
        out.line(f"host peak {usage_bar(host_peak, summary.ram_bytes)}"
                 + (" (the RAM budget)" if summary.ram_bytes else ""))
    _say_tight(out, space_, summary.closest_tight(), summary.budget_bytes, summary.limit_bytes, probed=True)
    if summary.host_walls():
        out.line(f"host memory stopped {len(summary.host_walls())} probe(s) (past --ram "
                 f"{format_bytes(summary.ram_bytes)}): trial {', '.join(str(r.trial) for r in summary.host_walls())}")
    out.line(f"wrote {summary.best_file}")
    out.line(f"report: {report_file}")


@app.command()
@_friendly
def probe(
    job_file: Path = JobArg,
    gpu: Optional[str] = GpuOpt,
    vram: Optional[str] = VramOpt,
    ram: Optional[str] = RamOpt,
    margin: Optional[float] = typer.Option(None, "--margin", help="Safety margin, share of the budget [0.05]."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Training steps [probe_steps, 20]."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before the probe is killed [600]."),
    script: Optional[str] = ScriptOpt,
    arch: Optional[str] = ArchOpt,
    trainer_command: Optional[str] = TrainerOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Run one probe of the job file as written and print the peak of each phase.

    Phases: load, text_encoder, latents, sample (first preview), train, last_sample. The verdict,
    as `estimate` gives it: fits (under the limit, the budget less the margin), tight (under the
    budget, over the limit) or does not fit (it ran out of memory). Exit code 0 when it fits or is
    tight (or no budget is given), 1 when it does not fit or the probe failed (crashed, timed
    out), 2 for bad input. With --json, stdout is the result object: verdict, status, phase (where
    it ran out, if it did), phases (name -> peak bytes), phase_stats, seconds_per_step, error, wall
    (the phase that ran out or peaked highest, with its owners on the sim meter: wall.owners).
    """
    from fitfinder import probe as probing
    from fitfinder.probe import trainer, trainer_command as trainer_check
    from fitfinder.results.output import Output, usage_bar
    from fitfinder.units import format_bytes
    from fitfinder.verdict import NO_FIT, Verdict, Wall, of_host

    out = Output(json_output)
    job = _load(job_file, vram=vram, ram=ram, margin=margin, probe_steps=steps, timeout=timeout,
                names={"probe_steps": "--steps"}, script=script, arch=arch, trainer_command=trainer_command)
    trainer_check.check(job)  # a trainer command that cannot run: one line, before any probe or note
    _default_ram(job)
    _notes(out, job)
    meter, gpus = _meter(gpu, job, out, need_budget=False)
    if meter == "sim":
        _refuse_full_size_on_the_cpu(job, force_option=False)
    gpu_index = gpus[0]
    request = probing.request_for(job, job.settings.probe_steps, meter, job.settings.vram_bytes, gpu_index,
                                  ram_bytes=job.settings.ram_bytes)
    result = trainer.one_probe_runner(job.settings).run(request)
    budget = job.settings.vram_bytes
    verdict = Verdict.of(result.get("peak_bytes"), budget, job.settings.margin)
    if result["status"] == "oom":
        verdict = Verdict(NO_FIT, result.get("peak_bytes"), budget, job.settings.margin, phase=result.get("phase"),
                          ran_out=True)
    elif result["status"] != "ok":
        verdict = Verdict(None, None, budget, job.settings.margin)
    host = of_host(result.get("host_phases") or {}, job.settings.ram_bytes, result.get("peak_bytes"), budget,
                   job.settings.margin, ran_out_in=result.get("phase") if result.get("oom_kind") == "host" else False)
    verdict = host or verdict
    if "trainer_run" not in result and not host:  # a trainer's own storages carry no owner: only fitfinder's recipe
        verdict.wall = Wall.of_probe(result.get("phase_stats") or {}, result.get("phase"), verdict.limit_bytes)
    out.result({**result, **verdict.as_json(), "reason": "host memory" if host else None})
    described = result.get("meter") or meter
    ram = job.settings.ram_bytes
    out.line(f"{described}{f', RAM {format_bytes(ram)}' if ram and 'RAM' not in described else ''}: "
             f"{result['status']}" + (f" in phase {result['phase']}" if result.get("phase") else ""))
    if "trainer_run" in result:
        _print_trainer_probe(out, result, meter)
    else:
        rows = [[name, format_bytes(p["peak_allocated"]), format_bytes(p["peak_reserved"]), f"{p['seconds']:.2f}",
                 format_bytes(p["peak_host"]) if "peak_host" in p else "-"]
                for name, p in result.get("phase_stats", {}).items()]
        out.table(["phase", "peak allocated", "peak reserved", "seconds", "host"], rows)
    if result.get("outside_bytes"):
        out.line(f"each peak includes {format_bytes(result['outside_bytes'])} outside PyTorch "
                 "(CUDA context, libraries, other processes on the card)")
    out.line(f"peak {usage_bar(result.get('peak_bytes'), job.settings.vram_bytes)}"
             + (f", {result['seconds_per_step']:.3f} s/step" if result.get("seconds_per_step") else ""))
    if result.get("host_phases"):
        out.line(f"host peak {usage_bar(max(result['host_phases'].values()), ram)}")
    if result.get("error"):
        out.line(result["error"])
    if verdict.verdict is not None:
        out.line(verdict.headline())
    if verdict.wall is not None and verdict.wall.owners:  # the cuda meter counts no owners
        for line in verdict.wall.lines():
            out.line(line)
    if result["status"] in ("error", "timeout") or verdict.exit_code:
        raise typer.Exit(1)


def _print_trainer_probe(out, result, meter: str) -> None:
    """The trainer's peaks per phase beside the estimate of the same point."""
    from fitfinder.probe import trainer
    from fitfinder.units import format_bytes

    rows = [[name, format_bytes(measured), format_bytes(estimated) if estimated else "-",
             f"{measured / estimated - 1:+.0%}" if estimated else ""]
            for name, measured, estimated in trainer.beside_estimate(result, meter)]
    out.table(["phase", "trainer", "estimate", "trainer - estimate"], rows)
    info = result["trainer_run"]
    if info.get("phases_from") == "whole run":
        out.line("the trainer's log marked no phase: one peak for the whole run")
    if result.get("estimate", {}).get("error"):
        out.line(f"no estimate of the same point: {result['estimate']['error']}")
    out.line(f"trainer exit code {info.get('exit_code')}, {info.get('seconds', 0):.1f} s; wrote "
             f"{', '.join(info.get('files') or []) or 'nothing'} in its folder (deleted)")


@app.command()
@_friendly
def estimate(
    job_file: Path = JobArg,
    vram: Optional[str] = VramOpt,
    ram: Optional[str] = RamNoneOpt,
    margin: Optional[float] = typer.Option(None, "--margin", help="Safety margin, share of the budget [0.05]."),
    card: Optional[str] = typer.Option(None, "--card", help="Use the GPU overhead `fitfinder calibrate` measured "
                                                            "on this card (its name or part of it) [defaults]."),
    no_overhead: bool = typer.Option(False, "--no-overhead", help="Tensor bytes only, as the sim meter counts them "
                                                                  "(no CUDA context, workspace, rounding)."),
    search_points: bool = typer.Option(False, "--search", help="Run the search's planner on estimates and print "
                                                               "the highest-quality point predicted to fit."),
    trials: Optional[int] = typer.Option(None, "--trials", help="With --search: stop after this many estimates [40]."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before an estimate is killed [600]."),
    script: Optional[str] = ScriptOpt,
    arch: Optional[str] = ArchOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Predict the peak memory of each phase on the CPU: no GPU, no weights, seconds.

    The probe's phases run on fake tensors of the full-size architecture. The verdict: fits
    (under the limit, the budget less the margin), tight (under the budget, over the limit: it
    may run out) or does not fit, with the wall and the smallest card that would take it. Exit
    code 0 when it fits or is tight (or no budget is given), 1 when it does not fit (with
    --search: when nothing does), 2 for bad input. With --json, stdout is one object: verdict,
    fits (under the budget), peak_bytes, budget_bytes, limit_bytes, phases (name -> predicted peak
    bytes), host_phases (name -> predicted host peak bytes), phase_stats, overhead, wall (with
    wall.owners: what holds its memory, largest first), host_wall, would_take.
    """
    from fitfinder.probe import estimate as estimating, overhead
    from fitfinder.results.output import Output
    from fitfinder.verdict import of_host

    out = Output(json_output)
    job = _load(job_file, vram=vram, ram=ram, margin=margin, trials=trials, timeout=timeout, script=script, arch=arch)
    _notes(out, job)
    if card is not None and no_overhead:
        raise UserError("--card and --no-overhead contradict each other: give one of them")
    model = overhead.GpuOverhead.none() if no_overhead else (
        overhead.for_card(card) if card is not None else overhead.GpuOverhead())
    runner = estimating.InProcess(job.settings.probe_timeout, PROGRESS_AFTER_S)
    if search_points:
        _estimate_search(job, runner, model, out)
        return
    found = estimating.run(job, runner, model)
    verdict = estimating.explain(job, found, model)
    host_phases = found.host_phases
    host = of_host(host_phases, job.settings.ram_bytes, found.peak_bytes, found.budget_bytes, job.settings.margin)
    verdict = host or verdict
    out.result({**found.as_json(), **verdict.as_json(), "ram_bytes": job.settings.ram_bytes,
                "host_peak_bytes": max(host_phases.values(), default=None), "reason": "host memory" if host else None})
    _print_estimate(out, job, found, verdict)
    if verdict.exit_code:
        raise typer.Exit(verdict.exit_code)


def _print_estimate(out, job, found, verdict) -> None:
    from fitfinder.units import format_bytes

    ram = job.settings.ram_bytes
    out.line(f"estimate of {job.source} ({found.arch_name}), {found.overhead.describe()}"
             + (f", RAM {format_bytes(ram)}" if ram else ""))
    _note_assumptions(out, job)
    budget, hosts = found.budget_bytes, found.host_phases
    rows = [[name, format_bytes(stats["peak_live"]), format_bytes(stats["peak_allocated"]),
             format_bytes(found.phases[name]), f"{found.phases[name] / budget:.0%}" if budget else "",
             format_bytes(hosts.get(name))]
            for name, stats in found.phase_stats.items()]
    out.table(["phase", "tensors", "allocated", "peak", "of the budget", "host"], rows)
    _say_host_wall(out, found.host_wall())
    if found.seconds is not None and found.max_rss_bytes:
        out.line(f"({found.seconds:.1f} s, {found.cpu_seconds or 0:.1f} s of CPU, "
                 f"{format_bytes(found.max_rss_bytes)} of host memory)")
    for line in verdict.lines():
        out.line(line)


def _say_host_wall(out, host_wall) -> None:
    """One line for the host's peak: its phase, and what holds it (the process, the largest host tensors)."""
    from fitfinder.units import format_bytes

    if not host_wall:
        return
    held = [f"the process {format_bytes(host_wall['outside_bytes'])}"]
    held += [f"{owner['owner']} {format_bytes(owner['bytes'])}" for owner in host_wall["owners"][:3]]
    if len(host_wall["owners"]) > 3:
        held.append(f"other {format_bytes(sum(owner['bytes'] for owner in host_wall['owners'][3:]))}")
    pinned = f" ({format_bytes(host_wall['pinned_bytes'])} pinned)" if host_wall["pinned_bytes"] else ""
    out.line(f"host peak: {host_wall['phase']}, {format_bytes(host_wall['peak_bytes'])}{pinned}: {', '.join(held)}")


def _say_tight(out, space, tight, budget_bytes: int, limit_bytes: int, probed: bool = False) -> None:
    """One line for the best tight point, if any: how far past the limit, and the margin that takes it."""
    from fitfinder.probe.estimate import margin_fitting
    from fitfinder.units import format_bytes

    if tight is None:
        return
    which = f"trial {tight.trial} " if probed else ""
    out.line(f"tight: {which}{space.describe(tight.point)} peaks {format_bytes(tight.peak_bytes)}, "
             f"{format_bytes(tight.peak_bytes - limit_bytes)} past the limit; with --margin "
             f"{margin_fitting(tight.peak_bytes, budget_bytes):.2f} or less a search takes it (it may run out)")


def _note_assumptions(out, job) -> None:
    """What the estimate assumes where the job's files are not on this machine, or what it does not follow."""
    from fitfinder import trainers

    for note in trainers.assumptions(job):
        out.note(note)


def _estimate_search(job, runner, model, out) -> None:
    from fitfinder.probe import estimate as estimating
    from fitfinder.search import estimated, planner, tiers as tiering
    from fitfinder.results.output import usage_bar
    from fitfinder.units import format_bytes
    from fitfinder.verdict import NO_FIT, judge

    if job.settings.vram_bytes is None:
        raise UserError("--search needs a memory budget: give --vram (e.g. --vram 24GiB) or `fitfinder: {vram: 24GiB}`")

    def on_estimate(space, result, budget) -> None:
        verdict = judge(result.peak_bytes, budget, job.settings.margin)
        if result.wall_reason:  # in the card, over the RAM budget
            verdict = f"{NO_FIT} in {result.host_failed_phases[0]}: {result.wall_reason}"
        elif verdict == NO_FIT:  # how far over too: a peak a few MiB past 16 GiB also reads "16 GiB", 100%
            phase, peak = next((p, peak) for p, peak in result.phases.items() if peak > budget)
            verdict += f" in {phase} ({format_bytes(peak - budget)} over)"
        stage = result.extra.get("purpose") or ""
        card = "" if budget == job.settings.vram_bytes else f"{format_bytes(budget)} card  "
        out.line(f"estimate {result.trial:3d}  {card}{stage:<9} {space.describe(result.point)}  {verdict}  "
                 f"{usage_bar(result.peak_bytes, budget)}")

    out.note(f"estimating the search of {job.source}: {model.describe()}; "
             f"budget {format_bytes(job.settings.vram_bytes)}"
             + (f", RAM {format_bytes(job.settings.ram_bytes)}" if job.settings.ram_bytes else ""))
    found = estimated.search(job, runner, model, on_estimate)
    space = found.space
    if found.best is None and not found.proven:  # stopped by --trials: nothing is proven not to fit
        raise RunFailed(f"no point predicted to fit in the {found.estimates_run} estimates of the cap (--trials "
                        f"{job.settings.trials}); lighter points are still unestimated: give a larger --trials")
    if found.best is None:
        out.note("nothing is predicted to fit; estimating what would take it (the smallest card, "
                 "the phase that stops it)")
        verdict = tiering.nothing_fits(job, runner, model, found.estimator, found.budget_bytes, found.known,
                                       found.estimates_run, on_estimate=on_estimate)
        out.result({**found.as_json(), **verdict.as_json()})
        for line in verdict.lines():
            out.line(line)
        raise typer.Exit(verdict.exit_code)
    tight = planner.best_tight(space, found.known, found.budget_bytes, found.best.point)
    wall = found.estimator.of(found.best.point).wall()  # estimated already: recalled, not run again
    out.result({**found.as_json(), "wall": wall.as_json(), "tight": None if tight is None else {
        "point": tight.point, "peak_bytes": tight.peak_bytes,
        "margin_at_most": estimating.margin_fitting(tight.peak_bytes, found.budget_bytes)}})
    rows = [[row["knob"], space.by_name[row["knob"]].label(row["desired"]),
             space.by_name[row["knob"]].label(row["chosen"]), row["verdict"]]
            for row in found.as_json()["explanation"]]
    out.table(["knob", "desired", "predicted best", "outcome"], rows)
    out.line(f"best predicted: {space.describe(found.best.point)}  peak {format_bytes(found.best.peak_bytes)} of "
             f"{format_bytes(found.budget_bytes)}  ({found.estimates_run} estimates"
             f"{'' if found.proven else ', not proven: estimate cap reached'})")
    for other in found.alternatives:
        out.line(f"  as good, also predicted to fit: {space.describe(other.point)}  "
                 f"peak {format_bytes(other.peak_bytes)}")
    if found.alternatives:
        out.line("  (speed is not estimated: which of these is fastest, a probe on the card tells)")
    for line in wall.lines():
        out.line(line)
    _say_tight(out, space, tight, found.budget_bytes, found.limit_bytes)


@app.command()
@_friendly
def tiers(
    job_file: Path = JobArg,
    cards: str = typer.Option("8,12,16,24,32,48,80,96", "--cards", help="Card sizes in GiB, as sold."),
    ram: Optional[str] = RamNoneOpt,
    margin: Optional[float] = typer.Option(None, "--margin", help="Safety margin, share of the budget [0.05]."),
    card: Optional[str] = typer.Option(None, "--card", help="Use the GPU overhead `fitfinder calibrate` measured "
                                                            "on this card (its name or part of it) [defaults]."),
    no_overhead: bool = typer.Option(False, "--no-overhead", help="Tensor bytes only, as the sim meter counts them "
                                                                  "(no CUDA context, workspace, rounding)."),
    write: bool = typer.Option(False, "--write", help="Also export one job file per tier: results/NAME/tiers/*.yaml."),
    study: Optional[str] = typer.Option(None, "--study", help="Name for results/NAME/ [config.name]."),
    results_dir: Path = ResultsDirOpt,
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before an estimate is killed [600]."),
    script: Optional[str] = ScriptOpt,
    arch: Optional[str] = ArchOpt,
    json_output: bool = JsonOpt,
) -> None:
    """The best configuration predicted to fit each card size, on estimates (no GPU): results/NAME/tiers.json.

    A card nothing fits says which phase stops even the lightest point. Exit code 0 when some card
    fits, 1 when none does (then it says the smallest card that would, up to 141 GB), 2 for bad input.
    """
    from fitfinder.probe import estimate as estimating, overhead
    from fitfinder.search import outputs, tiers as tiering
    from fitfinder.results.output import Output
    from fitfinder.units import format_bytes
    from fitfinder.verdict import NO_FIT

    out = Output(json_output)
    job = _load(job_file, ram=ram, margin=margin, timeout=timeout, script=script, arch=arch)
    _notes(out, job)
    sizes = tiering.parse_cards(cards)
    if card is not None and no_overhead:
        raise UserError("--card and --no-overhead contradict each other: give one of them")
    model = overhead.GpuOverhead.none() if no_overhead else (
        overhead.for_card(card) if card is not None else overhead.GpuOverhead())
    out_dir = results_dir / _study_name(study or job.name)
    _check_outputs(job, out_dir, None, outputs.TIERS)  # before the estimates, not after them
    ram = job.settings.ram_bytes
    out.note(f"estimating {job_file} for {len(sizes)} card sizes: {model.describe()}"
             + (f"; RAM {format_bytes(ram)}" if ram else ""))

    def on_tier(space, tier) -> None:
        found = (f"fits: peak {format_bytes(tier.peak_bytes)}, host {format_bytes(tier.host_peak_bytes)}  "
                 f"{tier.differs or 'the job as written'}" if tier.point
                 else f"does not fit: host memory (needs {format_bytes(tier.needs_ram_bytes)})" if tier.needs_ram_bytes
                 else "does not fit" if tier.proven else "none found before the estimate cap")
        out.note(f"{tier.label}: {found}")

    runner = estimating.InProcess(job.settings.probe_timeout, PROGRESS_AFTER_S)
    table = tiering.compute(job, runner, model, sizes, on_tier)
    verdict = None
    host_walled = any(tier.needs_ram_bytes for tier in table.tiers)  # the cards would take it, the host not
    if not any(tier.point for tier in table.tiers) and all(tier.proven for tier in table.tiers) and not host_walled:
        out.note(f"nothing fits these cards; estimating the smallest card that would (up to "
                 f"{tiering.CARD_SIZES_GB[-1]} GB)")
        verdict = tiering.nothing_fits(job, runner, model, table.estimator, table.tiers[-1].budget_bytes,
                                       estimates=table.estimator.runs)
    out_dir = results_dir / _study_name(study or job.name)
    path = tiering.write_json(table, out_dir)
    written = tiering.write_jobs(job, table, out_dir) if write else []
    fitted = any(tier.point for tier in table.tiers)
    out.result({**table.as_json(), "ram_bytes": job.settings.ram_bytes,
                "verdict": "fits" if fitted else verdict.verdict if verdict else NO_FIT if host_walled else None,
                "would_take": verdict.would_take.as_json() if verdict else None,
                "tiers_json": str(path), "written": [str(p) for p in written]})
    shown = table.as_json()["tiers"]
    out.table(tiering.header(shown), tiering.rows(shown))
    short = [tier for tier in table.tiers if tier.needs_ram_bytes]
    if short:  # in the card, not in the host: what the RAM would have to be
        out.line(f"need more RAM than the {format_bytes(job.settings.ram_bytes)} given: "
                 + ", ".join(f"{tier.label} ({format_bytes(tier.needs_ram_bytes)})" for tier in short))
    out.line(f"({table.estimates_run} estimates, {table.recalled} points recalled from their phases, "
             f"{table.seconds:.0f} s; predictions: confirm a tier with `fitfinder search` on its card)")
    out.line(f"wrote {path}" + (f" and {len(written)} job files in {out_dir / 'tiers'}" if written else ""))
    if verdict is not None:
        for line in verdict.lines():
            out.line(line)
        raise typer.Exit(verdict.exit_code)
    if not fitted and host_walled:
        least = min(tier.needs_ram_bytes for tier in table.tiers if tier.needs_ram_bytes)
        raise RunFailed(f"does not fit: host memory; no card's best point holds within --ram "
                        f"{format_bytes(job.settings.ram_bytes)} (the least it needs is {format_bytes(least)}); "
                        "give a larger --ram, or lighter candidates in the `fitfinder:` section")
    if not fitted:  # the estimate cap stopped every card's search: nothing is proven not to fit
        raise RunFailed("no card's search found a fit before its estimate cap; raise `fitfinder: trials:` in the "
                        "job file and run again")


@app.command()
@_friendly
def calibrate(
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Measure this CUDA device (index).", show_default=False),
    study: Optional[str] = typer.Option(None, "--study", help="Fit the estimate to the trainer probes of this study "
                                                              "(a search with --trainer-command) instead."),
    storage: Optional[str] = StorageOpt,
    studies_dir: Path = StudiesDirOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Measure a card's overhead for estimates (CUDA context, cuBLAS workspace, fragmentation) and store it;
    with --study, fit it to a trainer's own probes instead (for later trainer searches on that card)."""
    from fitfinder.probe import overhead
    from fitfinder.results.output import Output
    from fitfinder.units import format_bytes

    out = Output(json_output)
    if (gpu is None) == (study is None):
        raise UserError("calibrate: give --gpu N (measure a card) or --study NAME (fit a study's trainer probes)")
    if study is not None:
        _calibrate_study(out, study, storage, studies_dir)
        return
    if not re.fullmatch(r"\d+", gpu.strip()):
        raise UserError(f"--gpu: expected a device index such as 0, got {gpu!r}")
    if cuda_device_count() <= int(gpu):
        raise UserError(f"--gpu: no CUDA device {gpu} here; calibrate on the machine that has the card")
    model, path, measured = overhead.calibrate(int(gpu))
    out.result({"gpu_name": measured["gpu_name"], "overhead": model.as_dict(), "file": str(path), "measured": measured})
    out.line(f"{measured['gpu_name']}: context {format_bytes(model.context_bytes)}, cuBLAS workspace "
             f"{format_bytes(model.workspace_bytes)}, fragmentation {model.fragmentation:.1%}")
    out.line(f"stored in {path}; use it with `fitfinder estimate JOB --card \"{measured['gpu_name']}\"` "
             "(searches on this card use it for their pre-screen)")


def _calibrate_study(out, name: str, storage: Optional[str], studies_dir: Path) -> None:
    from fitfinder.search import calibration
    from fitfinder.units import format_bytes

    _check_name(name)
    fit, path, pairs, card, dialect = calibration.calibrate(name, studies_dir, storage)
    model = fit.overhead
    out.result({"study": name, "card": card, "dialect": dialect, "overhead": model.as_dict(), "band": fit.band,
                "pairs": len(pairs), "file": str(path)})
    out.table(["trial", "phase", "trainer", "estimate", "fitted", "off"],
              [[p.trial, p.phase, format_bytes(p.measured_bytes), format_bytes(p.estimated_bytes),
                format_bytes(model.device_peaks(p.estimated_bytes)[1]),
                f"{p.measured_bytes / model.device_peaks(p.estimated_bytes)[1] - 1:+.1%}"] for p in pairs])
    out.line(f"{dialect} on {card}: context {format_bytes(model.context_bytes)}, fragmentation "
             f"{model.fragmentation:.1%} over {len(pairs)} phases; the pairs lie within {fit.band:.1%} of it")
    out.line(f"stored in {path}; estimate-guided searches with this trainer on this card start from that band")


@app.command()
@_friendly
def diagnose(
    log: Path = typer.Argument(..., help="A failed run's training log (AI Toolkit, kohya, musubi, diffusers, PyTorch).",
                               show_default=False),
    job_file: Optional[Path] = typer.Option(None, "--job", help="The run's job file (AI Toolkit YAML, a kohya shell "
                                                                 "file or --config_file TOML): exact first change."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the job with the first change here."),
    script: Optional[str] = ScriptOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Say why a run ran out of memory, when, and the first change to make (written to -o with --job)."""
    from fitfinder import diagnose as diagnosing
    from fitfinder.results.output import Output

    out = Output(json_output)
    answer = diagnosing.run(log, job_file, output, script)
    out.result(answer.as_json())
    for line in answer.lines():
        out.line(line)


@app.command()
@_friendly
def report(
    name: str = NameArg,
    job: Optional[Path] = typer.Option(None, "--job", help="The job file the study was made from [as recorded]."),
    storage: Optional[str] = StorageOpt,
    studies_dir: Path = StudiesDirOpt,
    results_dir: Path = ResultsDirOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Write results/NAME/report.html (plots, one file), summary.json and trials.csv from the study."""
    from fitfinder import search as searching
    from fitfinder.results import report as reporting
    from fitfinder.results.output import Output
    from fitfinder.search import outputs

    out = Output(json_output)
    _check_name(name)
    view = reporting.open_study(name, studies_dir, storage, job)
    out_dir = results_dir / name
    reporting.check_output_dir(out_dir, "--results-dir")
    outputs.check(job or view.study.user_attrs.get("job_file") or "", results_dir, name, None, outputs.REPORT)
    best_file = out_dir / "best.yaml"
    summary = searching.summarize(view.study, view.space, view.known, view.url,
                                  best_file if best_file.exists() else None)
    paths = reporting.write_results(summary, out_dir)
    out.result({**summary.as_json(), "report": str(paths["report"]), "summary": str(paths["summary"]),
                "trials_csv": str(paths["trials"])})
    found = "fits" if summary.best else "does not fit: nothing fits" if summary.proven else "no fit found yet"
    out.line(f"wrote {paths['report']}, {paths['summary'].name} and {paths['trials'].name} "
             f"({len(view.known.results)} probes; {found})")


@app.command()
@_friendly
def export(
    name: str = NameArg,
    fmt: str = typer.Option("kohya", "--format", help="kohya: sd-scripts / musubi-tuner settings and command."),
    results_dir: Path = ResultsDirOpt,
    json_output: bool = JsonOpt,
) -> None:
    """Write the winner (results/NAME/best.yaml) for another trainer, and say what has no equivalent."""
    from fitfinder.trainers import aitoolkit_job, aitoolkit_to_kohya as kohya
    from fitfinder.results.output import Output

    out = Output(json_output)
    _check_name(name)
    if fmt != "kohya":
        raise UserError(f"--format: expected kohya, got {fmt!r} (the AI Toolkit job file is results/NAME/best.yaml)")
    best = results_dir / name / "best.yaml"
    if not best.is_file():
        known = sorted(p.parent.name for p in results_dir.glob("*/best.yaml"))
        raise UserError(f"{best}: no such file; no search of {name!r} has found a fit here"
                        + (f" (winners in {results_dir}/: {', '.join(known)})" if known else
                           "; run `fitfinder search JOB.yaml` first"))
    done = kohya.write(aitoolkit_job.load(best), results_dir / name)
    out.result({"format": fmt, "trainer": done.trainer.repo, "script": done.trainer.script,
                "files": [str(f) for f in done.files], "settings": [vars(r) for r in done.rows]})
    out.table(["AI Toolkit setting", "value", "kohya", "match"],
              [[r.setting, _short(r.value), r.kohya, r.kind + (f": {r.note}" if r.note else "")] for r in done.rows])
    unmatched = [r for r in done.rows if r.kind != "exact"]
    out.line(f"wrote {', '.join(str(f) for f in done.files)} for {done.trainer.repo} {done.trainer.script}"
             + (f"; {len(unmatched)} settings are not the same there (see above and the head of kohya.toml)"
                if unmatched else "; every setting has an exact equivalent"))


@app.command()
@_friendly
def dashboard(
    study_db: Optional[str] = typer.Argument(None, help="studies/NAME.db, a study NAME or a storage URL "
                                                        "[the one study in --studies-dir].", show_default=False),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; 0.0.0.0 offers it to the network."),
    port: int = typer.Option(8080, "--port", help="Port to listen on; 0 picks a free one."),
    studies_dir: Path = StudiesDirOpt,
    create: bool = typer.Option(False, "--create", help="Add Optuna's tables to a storage that has none "
                                                        "[refused: it may be someone else's database]."),
) -> None:
    """Serve the Optuna dashboard of a study on this machine; Ctrl-C stops it."""
    from fitfinder.results import dashboard as dashboards
    from fitfinder.results.output import Output

    out = Output()
    if not 0 <= port <= 65535:
        raise UserError(f"--port: must be between 0 and 65535, got {port}")
    url, shown = dashboards.storage_for(study_db, studies_dir, create)
    server = dashboards.Dashboard(url, host, port)
    if host not in ("127.0.0.1", "localhost", "::1"):
        out.note(f"listening on {host}: whoever can reach this machine can read, edit and delete the study")
    out.note(f"dashboard of {shown} at {server.url}  (Ctrl-C stops it)")
    server.serve()
    out.note("dashboard stopped")


# -- shared option handling -----------------------------------------------------------------------
def _short(value) -> str:
    from fitfinder.errors import one_line

    return one_line(value, 40)


def _load(job_file: Path, vram: Optional[str] = None, names: Optional[dict] = None, script: Optional[str] = None,
          arch: Optional[str] = None, ram: Optional[str] = None, **options):
    """Read and validate the job file, in its trainer's form (fitfinder.trainers.load), then let
    command-line options win over `fitfinder:` (`names`: an option's name where it is not --key-with-dashes)."""
    from fitfinder import trainers
    from fitfinder.units import parse_budget

    job = trainers.load(job_file, script=script, arch=arch)
    _check_options(options, names or {})
    overrides = {key: value for key, value in options.items() if key != "timeout"}
    overrides["probe_timeout"] = options.get("timeout")
    overrides["vram_bytes"] = parse_budget(vram, "--vram") if vram is not None else None
    overrides["ram_bytes"] = parse_budget(ram, "--ram") if ram is not None else None
    job.settings = job.settings.with_options(**overrides)
    return job


def _default_ram(job) -> None:
    """Without --ram or `fitfinder: ram`, a search or probe holds the host to what this machine has
    available as it starts (MemAvailable), less the same margin as the card: past it the kernel's
    OOM killer ends the trainer (issue 32). Nothing where /proc/meminfo cannot be read."""
    from fitfinder.probe import preflight

    if job.settings.ram_bytes is None:
        available = preflight.ram_available()
        if available:
            job.settings.ram_bytes = int(available * (1 - job.settings.margin))


def _notes(out, job) -> None:
    """What a trainer's job says about itself: which architecture and from where, what is not modelled."""
    from fitfinder import trainers

    if isinstance(job, trainers.KohyaJob):  # its checkpoint's header read, or --arch's shipped one: notes
        job.architecture_spec()
    for note in getattr(job, "notes", []):
        out.note(note)


def _check_outputs(job, out_dir: Path, studies_dir: Optional[Path], writes: Optional[tuple] = None) -> None:
    """What would fail only after the probes, refused before anything is written: the space, an
    output folder that cannot be written, the job file among the outputs or a link in their way
    (search.outputs; a search checks those and the model's weights in search.loop._refuse_before_writing)."""
    from fitfinder import space
    from fitfinder.results import report
    from fitfinder.search import outputs

    space.build(job)  # bad candidates
    report.check_output_dir(out_dir, "--results-dir")
    outputs.check(job.source, out_dir.parent, out_dir.name, None, writes or outputs.SEARCH)
    if studies_dir is not None:
        report.check_output_dir(studies_dir, "--studies-dir")


# The command line's numbers, in the same ranges as the `fitfinder:` section's.
_OPTION_RANGES = {"trials": (1, 100_000), "probe_steps": (1, 100_000), "timeout": (1, 86_400)}


def _check_options(options: dict, names: dict) -> None:
    """Finite numbers in sane ranges; NaN compares false with everything, so it is named first."""
    margin = options.get("margin")
    if margin is not None and not (math.isfinite(margin) and 0 <= margin < 0.9):
        raise UserError(f"--margin: must be between 0 and 0.9, got {margin}")
    for key, (low, high) in _OPTION_RANGES.items():
        value, option = options.get(key), names.get(key, f"--{key.replace('_', '-')}")
        if value is None:
            continue
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"{option}: must be positive, got {value}")
        if not low <= value <= high:
            raise UserError(f"{option}: must be between {low} and {high}, got {value}")


def _meter(gpu: Optional[str], job, out, need_budget: bool = True) -> tuple[str, list[int]]:
    """cuda on the given GPUs (`0` or `0,1,2,3`; one that is not here is bad input, as calibrate
    has it), or sim without --gpu. Without --vram the budget is the first card's memory."""
    if gpu is not None:
        if not re.fullmatch(r"\d+(,\d+)*", gpu.strip()):
            raise UserError(f"--gpu: expected device indexes such as 0 or 0,1,2,3, got {gpu!r}")
        gpus = [int(g) for g in gpu.strip().split(",")]
        if len(set(gpus)) != len(gpus):
            raise UserError(f"--gpu: each device once, got {gpu!r}")
        present = cuda_device_count()
        if not all(index < present for index in gpus):
            missing = ",".join(str(index) for index in gpus if index >= present)
            raise UserError(f"--gpu: no CUDA device {missing} here ({present} found); without a GPU, "
                            f"`fitfinder estimate JOB --vram 24GiB` (add --search for the best point) and "
                            f"`fitfinder tiers JOB` predict on the CPU")
        if job.settings.vram_bytes is None:
            from fitfinder.probe import preflight

            job.settings.vram_bytes = preflight.read_card(gpus[0]).total_bytes
        return "cuda", gpus
    if need_budget and job.settings.vram_bytes is None:
        raise UserError("the sim meter needs a memory budget: give --vram (e.g. --vram 24GiB) "
                        "or `fitfinder: {vram: 24GiB}` in the job file, or --gpu N on a machine with a GPU")
    return "sim", [0]


def _refuse_full_size_on_the_cpu(job, force_option: bool = True) -> None:
    """The sim meter trains for real on the CPU: a full-size model is predicted there, not probed."""
    from fitfinder import trainers

    model = trainers.full_size(job)
    if model is not None:
        source = job.source
        raise UserError(f"{source}: {model} is a full-size model; the sim meter (no --gpu) would train it for real "
                        f"on the CPU. Predict it there instead: `fitfinder estimate {source} --vram 24GiB` (add "
                        f"--search for the best point) or `fitfinder tiers {source}` (the best per card size); "
                        f"or give --gpu N{' (--force insists)' if force_option else ''}")


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


def _study_name(name: str) -> str:
    """A name safe as a file name: studies/NAME.db, results/NAME/ (its length: study.check_name)."""
    from fitfinder.search import study

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "study"
    study.check_name(safe)
    return safe


def _check_name(name: str) -> None:
    """A study NAME given on the command line names studies/NAME.db and results/NAME/: one file
    name, as search makes them, so `../elsewhere` cannot read or write outside those folders."""
    if _study_name(name) != name:
        raise UserError(f"{_short(name)}: not a study name; search names them with letters, digits, _ . and - "
                        f"(studies there: {', '.join(p.stem for p in sorted(Path('studies').glob('*.db'))) or 'none'})")


def main(argv: Optional[list[str]] = None) -> None:
    """The `fitfinder` command. A usage error (an unknown option, `--trials abc`) is one line and
    exit code 2 like every other bad input, not click's four-line usage block."""
    try:  # typer 0.22+ carries its own copy of click
        from typer._click import exceptions as click
    except ImportError:
        from click import exceptions as click

    try:
        code = app(args=argv, standalone_mode=False)
    except click.NoArgsIsHelpError as exc:  # `fitfinder` alone: the help, as before
        print(exc.ctx.get_help() if exc.ctx else exc.format_message())
        sys.exit(2)
    except click.UsageError as exc:
        if os.environ.get("FITFINDER_DEBUG"):
            raise
        from fitfinder.errors import one_line

        where = f"; see `{exc.ctx.command_path} --help`" if exc.ctx else ""
        print(f"fitfinder: error: {one_line(exc.format_message(), 300).rstrip('.')}{where}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
