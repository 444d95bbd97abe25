"""What a search leaves behind in results/NAME/: the winning job file, the trials table, the
summary (summary.json) and a one-file HTML report with plots (report.html).

The report is written at the end of every search, and again by `fitfinder report NAME` from
the study alone (plus the job file it was made from). It is one self-contained file: plotly.js
is inlined, so it opens with no network.
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fitfinder import space as spaces
from fitfinder.errors import UserError
from fitfinder.files import write_atomic
from fitfinder.trainers import aitoolkit_job
from fitfinder.trainers.aitoolkit_job import JobFile
from fitfinder.probe import trainer
from fitfinder.results import _plots
from fitfinder.search import planner, study as studies, tiers
from fitfinder.search.loop import SearchSummary
from fitfinder.search.study import params_of
from fitfinder.space import PHASES, Point, Space
from fitfinder.units import format_bytes
from fitfinder.verdict import FITS, TIGHT, Wall, owner_name, share_of


def check_output_dir(path: Path, option: str) -> None:
    """Refuse, before anything is written, a folder that cannot be made or written to: a file in
    its place, a link to nowhere, a read-only folder or disk. Nothing is created here."""
    path = Path(path)
    found = path
    while not os.path.lexists(found) and found.parent != found:
        found = found.parent  # the nearest part of the path that exists
    if found.is_symlink() and not found.exists():
        raise UserError(f"{option} {path}: {found} is a link to {os.readlink(found)}, which does not exist; "
                        f"remove the link or give another {option}")
    if not found.is_dir():
        raise UserError(f"{option} {path}: {found} is a file, not a folder; move it or give another {option}")
    if not os.access(found, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: {found} is not writable (read-only); give another {option}")


def export_best(job: JobFile, space: Space, point: Point, out_dir: Path, facts: list[str]) -> Path:
    """results/NAME/best.yaml: the job file with the winner's values, comments kept, and a header
    saying what changed (old -> new) and why it fits. The `fitfinder:` section is left out."""
    changes = space.changes(point)
    header = ["fitfinder: the best configuration found that fits."] + [f"  {line}" for line in facts]
    if changes:
        header.append("Changed from the base file (key under config.process[0]: old -> new):")
        header += [f"  {path}: {_yaml_scalar(old)} -> {_yaml_scalar(new)}" for path, old, new in changes]
    else:
        header.append("Nothing changed: the base file fits as written.")
    best_job = space.apply(job, point)
    return best_job.write(out_dir / "best.yaml", header)


def write_trials_csv(study, space: Space, path: Path) -> Path:
    """One row per trial: its knobs, what the probe found, and how the search read it."""
    columns = ["trial", "state", "status", *space.names, "peak_bytes", "host_peak_bytes", "limit_bytes", "phase",
               "seconds_per_step", "seconds_per_sample", "verdict", "wall_seconds", "error"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        point = params_of(trial)
        writer.writerow([
            trial.number, trial.state.name, attrs.get("status", ""),
            *(point.get(name, "") for name in space.names),
            *(_blank(attrs.get(key)) for key in ("peak_bytes", "host_peak_bytes", "limit_bytes", "phase",
                                                 "seconds_per_step", "seconds_per_sample", "verdict", "wall_seconds",
                                                 "error")),
        ])
    write_atomic(path, buffer.getvalue())
    return path


def fit_facts(result, budget_bytes: int | None, margin: float, meter: str, study_name: str) -> list[str]:
    peak = format_bytes(result.peak_bytes)
    budget = format_bytes(budget_bytes) if budget_bytes else "the whole card"
    return [f"Study {study_name}, trial {result.trial}: peak {peak} of {budget} "
            f"(margin {margin:.0%}, {meter} meter)."]


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "(unset)" if value is None else str(value)


def _blank(value: Any) -> Any:
    return "" if value is None else value


# -- reading a study back ------------------------------------------------------------------------
@dataclass
class StudyView:
    """A study read back from its storage, with the space it was searched over."""

    name: str
    url: str
    study: Any
    space: Space
    known: Any  # planner.Knowledge
    budget_bytes: int | None
    margin: float
    limit_bytes: int | None
    meter: str


def study_names(studies_dir: Path) -> list[str]:
    return sorted(p.stem for p in Path(studies_dir).glob("*.db"))


def open_study(name: str, studies_dir: Path, storage: str | None, job_path: Path | None = None) -> StudyView:
    """The study NAME in `storage` (default studies/NAME.db), its space rebuilt from the job file
    it was made from (`job_path`, or the path the study recorded)."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if storage is None:
        db = Path(studies_dir) / f"{name}.db"
        if not db.exists():
            here = study_names(studies_dir)
            there = f"studies there: {', '.join(here)}" if here else "run `fitfinder search JOB.yaml` first"
            raise UserError(f"no study {name!r} in {studies_dir}/; {there}")
        storage = f"sqlite:///{db.resolve()}"
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise UserError(f"no study {name!r} in {storage}") from None
    attrs = study.user_attrs
    job_path = Path(job_path or attrs.get("job_file") or "")
    if not job_path.is_file():
        raise UserError(f"study {name!r} was made from {attrs.get('job_file')!r}, which is not here; "
                        "run from the folder the search ran in, or give --job PATH")
    space = spaces.build(aitoolkit_job.load(job_path))
    changed = studies.signature_changes(attrs, studies.space_signature(space), studies.job_signature(space))
    if changed:
        raise UserError(f"{job_path} is no longer the job study {name!r} searched ({'; '.join(changed[:3])} "
                        "changed); give the job file it was made from with --job PATH")
    budget, margin = studies.budget_of(study)
    limit = int(budget * (1 - margin)) if budget else None
    ram = attrs.get("ram_bytes")  # the last search's host budget
    known = studies.load_knowledge(study, space, limit, ram if isinstance(ram, int) and ram > 0 else None)
    return StudyView(name, storage, study, space, known, budget, margin, limit, str(attrs.get("meter", "")))


# -- everything in results/NAME/ -----------------------------------------------------------------
def write_results(summary: SearchSummary, out_dir: Path, job: JobFile | None = None) -> dict[str, Path]:
    """results/NAME/: trials.csv, best.yaml (with `job`, when something fits), summary.json and
    report.html, from the search's summary. `fitfinder search` writes all four; `fitfinder report`
    rewrites all but best.yaml from the study. Returns the paths written."""
    study, space, known = summary.optuna_study, summary.space, summary.known
    paths = {"trials": write_trials_csv(study, space, Path(out_dir) / "trials.csv")}
    if job is not None and summary.best is not None:
        facts = fit_facts(summary.best, summary.budget_bytes, summary.margin, summary.meter, summary.study)
        if not summary.finished:
            facts.append(f"The search stopped at its cap of {summary.trial_cap} probes before proving this is the "
                         "best.")
        for failed in summary.excluded:
            facts.append(f"Proven only around trial {failed.trial} ({space.describe(failed.point)}): its probe "
                         f"failed {planner.ATTEMPTS} times without running out of memory, so it was left out.")
        paths["best"] = export_best(job, space, summary.best_point, Path(out_dir), facts)
    paths.update(write_report(study, space, known, Path(out_dir), summary.as_json()))
    return paths


# -- summary.json and report.html --------------------------------------------------------------
def write_report(study, space: Space, known, out_dir: Path, summary: dict[str, Any]) -> dict[str, Path]:
    """results/NAME/summary.json and results/NAME/report.html; returns their paths."""
    attrs = study.user_attrs
    budget, limit = attrs.get("budget_bytes"), known.limit_bytes
    probes = probes_of(study, known)
    winner = planner.best(space, known)
    rows = planner.explain(space, known, winner.point) if winner else []
    base = next(iter(known.probed(space.desired())), None)
    other = shown_result(space, known)
    payload = {**summary, "explanation": rows, "wall": wall_json(study, other, limit),
               "phases": {"base": _phase_facts(base, study, limit), "winner": _phase_facts(winner, study, limit)},
               "files": {"report": "report.html", "summary": "summary.json", "trials": "trials.csv",
                         "best": "best.yaml" if winner else None}}
    out_dir = Path(out_dir)
    summary_path = out_dir / "summary.json"
    write_atomic(summary_path, json.dumps(payload, indent=2, default=str) + "\n")

    sections = [_facts_section(study, space, known, summary, winner),
                _explanation_section(space, known, rows, winner)]
    tiers_found = tiers.read_json(out_dir)
    if tiers_found is not None:
        sections.append(_tiers_section(tiers_found))
    if space.knobs:
        sections.append(_figure_section(
            "Peak memory against each knob",
            "Every probe that measured a peak, at the value of each knob it was run with. "
            "An OOM's peak is what was in use when it ran out.",
            _plots.peak_by_knob(space, probes, budget, limit), "peak-by-knob"))
        x_knob, *rest = _plots.map_knobs(space, probes)
        center = winner.point if winner else space.desired()
        sections.append(_figure_section(
            "Where the wall is",
            f"Fits or not over {x_knob.name}" + (f" and {rest[0].name}" if rest else "")
            + f", the other knobs as in the {'winner' if winner else 'base file'} (outlined). "
            "Dark cells were probed: #3 12.3 MiB is trial 3 and its peak, #4 oom (or tight) a trial that "
            "did not fit. Light cells are implied without a probe: ≤#3 fits because trial 3 was at least as "
            "heavy and fit, ≥#4 does not because trial 4 was at most as heavy and did not. ? is not known: "
            "no probe decides it.",
            _plots.fit_map(space, known, center, x_knob, rest[0] if rest else None), "fit-map"))
    groups = [(f"base, trial {base.trial}", base.phases)] if base else []
    if other is not None and other is not base:
        label = "winner" if winner else "lowest peak"
        groups.append((f"{label}, trial {other.trial}", other.phases))
    if groups:
        sections.append(_figure_section(
            "Peak of each phase: " + (" against ".join(label.split(",")[0] for label, _ in groups[::-1])),
            "The highest memory in use during each phase of the probe.",
            _plots.phase_bars(groups, PHASES, budget, limit), "phases"))
    walls = [(label, wall_of(study, result, limit)) for label, result in
             (("base", base), ("winner" if winner else "lowest peak", other if other is not base else None))]
    if any(wall and wall.owners for _, wall in walls):
        sections.append(_owners_section([(label, wall) for label, wall in walls if wall and wall.owners]))
    if any(p.host_peak_bytes is not None for p in probes):
        sections.append(_figure_section(
            "Host memory beside the card",
            "Each probe's device peak and, beside it, its host peak: the probe's process and the tensors it holds "
            "in host memory (offloaded layers, a part loaded or quantized there, cached latents and embeddings). "
            "A point whose host peak passes the RAM budget does not fit (host memory).",
            _plots.host_beside_device(probes, budget, known.ram_bytes), "host"))
    sections.append(_figure_section("Timeline of the probes", "Each probe from its start to its end.",
                                    _plots.timeline(space, probes), "timeline"))
    sections.append(_trials_section(space, probes, budget))
    trainer_rows = _trainer_rows(study, space, str(attrs.get("meter", "")))
    if trainer_rows:
        sections.append(_trainer_section(trainer_rows, attrs.get("trainer_command")))
    report_path = out_dir / "report.html"
    write_atomic(report_path, _page(study.study_name, sections, _plots.plotly_js()))
    return {"report": report_path, "summary": summary_path}


def probes_of(study, known) -> list:
    """Every trial as a report Probe, in trial order. A trial whose point is not a whole point of
    the space (a worker killed while an older fitfinder wrote it) shows without one."""
    from optuna.trial import TrialState


    verdicts = {r.trial: r.verdict for r in known.results}
    reasons = {r.trial: r.wall_reason for r in known.results}
    probes = []
    for trial in studies.trials_of(study):
        attrs = trial.user_attrs
        status = attrs.get("status")
        if status == "decided":
            continue  # settled by dominance, never probed
        if not studies.facts_readable(attrs):  # changed by hand: shown, with none of its numbers
            attrs = {key: value for key, value in attrs.items() if key in ("status", "error")}
        if trial.state == TrialState.RUNNING:
            outcome = "running"
        elif status == "ok" and reasons.get(trial.number):
            outcome = "oom"  # in the card, over the RAM budget: does not fit, for host memory
        elif status == "ok":
            outcome = FITS if verdicts.get(trial.number) == "fit" else TIGHT
        elif status in ("oom", "timeout"):
            outcome = status
        else:
            outcome = "error"
        probes.append(_plots.Probe(
            number=trial.number, outcome=outcome, point=_whole_point(known.space, params_of(trial)),
            peak_bytes=attrs.get("peak_bytes"), phases=attrs.get("phases") or {}, phase=attrs.get("phase"),
            seconds_per_step=attrs.get("seconds_per_step"), start=trial.datetime_start,
            end=trial.datetime_complete, error=attrs.get("error"),
            host_peak_bytes=max((attrs.get("host_phases") or {}).values(), default=None),
            reason=reasons.get(trial.number) or ("host memory" if attrs.get("oom_kind") == "host" else ""),
        ))
    return probes


def _whole_point(space: Space, point: dict) -> Point | None:
    return point if space.contains(point) else None


def _phase_facts(result, study, limit_bytes: int | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"trial": result.trial, "point": result.point, "status": result.status,
            "peak_bytes": result.peak_bytes, "phases": result.phases, "wall": wall_json(study, result, limit_bytes),
            "host_peak_bytes": result.host_peak_bytes, "host_phases": result.host_phases}


def shown_result(space: Space, known):
    """The probe the search's summary explains: the winner, else the one of the lowest peak."""
    winner = planner.best(space, known)
    return winner or min((r for r in known.results if r.peak_bytes), key=lambda r: r.peak_bytes, default=None)


def wall_of(study, result, limit_bytes: int | None) -> Wall | None:
    """A probe's wall (verdict.Wall.of_probe) from its trial's phases: where it ran out, else its
    highest phase, with what holds the memory there by owner; None for no result or no phases."""
    if result is None or result.trial < 0:
        return None
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == result.trial), None)
    stats = trial.user_attrs.get("phase_stats") if trial is not None else None
    if not isinstance(stats, dict):
        return None
    ran_out = result.phase if result.status == "oom" else None
    return Wall.of_probe(stats, ran_out, limit_bytes)


def wall_json(study, result, limit_bytes: int | None) -> dict[str, Any] | None:
    """summary.json's and `search --json`'s `wall`: the winner's (or the lowest peak's), by owner."""
    wall = wall_of(study, result, limit_bytes)
    return None if wall is None else {"trial": result.trial, **wall.as_json()}


# -- the page ------------------------------------------------------------------------------------
def _facts_section(study, space: Space, known, summary: dict[str, Any], winner) -> str:
    attrs = study.user_attrs
    counts: dict[str, int] = {}
    for result in known.results:
        key = FITS if result.verdict == "fit" else (TIGHT if result.status == "ok" else result.status)
        counts[key] = counts.get(key, 0) + 1
    budget = attrs.get("budget_bytes")
    facts = [
        ("job file", attrs.get("job_file", "-")),
        ("meter", attrs.get("meter", "-")),
        ("budget", f"{format_bytes(budget)}, limit {format_bytes(known.limit_bytes)} after the "
                   f"{float(attrs.get('margin', 0)):.0%} margin" if budget else "the whole card"),
        ("RAM", f"{format_bytes(known.ram_bytes)} of host memory (a point whose host peak passes it does not fit)"
                if known.ram_bytes else "not judged"),
        ("space", f"{len(space.knobs)} knobs, {space.size()} points"),
        ("probes", f"{len(known.results)} (" + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ")"
                   if known.results else "none yet"),
        ("proven", "yes: no other point can be better" if summary.get("proven")
                   else f"no: {summary['proven_around']}" if summary.get("proven_around")
                   else "no: the search stopped before proving it"),
    ]
    if winner is not None:
        verdict = (f"<p class='verdict fit'>Fits: the best that fits is <b>{_e(space.describe(winner.point))}</b>, "
                   f"peak {_e(format_bytes(winner.peak_bytes))} (trial {winner.trial}).</p>")
    else:
        tight = counts.get(TIGHT)
        verdict = ("<p class='verdict none'>Does not fit: nothing that was probed fits."
                   + (f" {tight} tight (under the budget, past the limit: a search picks it only with --margin 0)."
                      if tight else "") + "</p>")
    items = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
    return (f"<section><h1>fitfinder report: {_e(study.study_name)}</h1>{verdict}"
            f"<table class='facts'>{items}</table></section>")


def _explanation_section(space: Space, known, rows: list[dict[str, Any]], winner) -> str:
    if winner is None:
        return ("<section><h2>What was kept and what was given up</h2><p>No point fits, so nothing was "
                "chosen. The plots below show how far the lightest probes were from the limit.</p></section>")
    by_trial = {r.trial: r for r in known.results}
    body = []
    for row in rows:
        knob = space.by_name[row["knob"]]
        forced = by_trial.get(row["forced_by"]) if row["forced_by"] is not None else None
        why = ""
        if forced is not None:
            what = forced.status if forced.status != "ok" else "tight"
            where = f" in {forced.phase}" if forced.phase and forced.status != "ok" else ""
            why = (f"trial {forced.trial}: {space.describe(forced.point)} went {what}{where} "
                   f"({format_bytes(forced.peak_bytes)})")
        body.append(f"<tr class='{row['verdict'].replace(' ', '-')}'><td>{_e(knob.name)}</td><td>{_e(knob.role)}</td>"
                    f"<td>{_e(knob.label(row['desired']))}</td><td>{_e(knob.label(row['chosen']))}</td>"
                    f"<td>{_e(row['verdict'])}</td><td>{_e(why)}</td></tr>")
    changes = space.changes(winner.point)
    changed = "".join(f"<li><code>{_e(path)}</code>: {_e(_yaml_scalar(old))} &rarr; {_e(_yaml_scalar(new))}</li>"
                      for path, old, new in changes)
    return ("<section><h2>What was kept and what was given up</h2>"
            "<table class='grid'><tr><th>knob</th><th>role</th><th>desired</th><th>chosen</th><th>verdict</th>"
            "<th>forced by</th></tr>" + "".join(body) + "</table>"
            + (f"<p>Changed from the base file:</p><ul>{changed}</ul>" if changes
               else "<p>Nothing changed: the base file fits as written.</p>") + "</section>")


def _tiers_section(found: dict[str, Any]) -> str:
    """tiers.json beside the report (`fitfinder tiers`): the best point predicted per card size."""
    body = "".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>"
                   for row in tiers.rows(found["tiers"]))
    return ("<section id='tiers'><h2>Card sizes: the best configuration predicted to fit each</h2>"
            f"<p class='note'>From <code>fitfinder tiers</code> on estimates ({_e(found.get('overhead'))}; "
            f"{_e(found.get('estimates'))} estimates), not probes: confirm a tier on its card.</p>"
            "<table class='grid'><tr>" + "".join(f"<th>{_e(name)}</th>" for name in tiers.header(found["tiers"]))
            + "</tr>" + body + "</table></section>")


def _figure_section(title: str, note: str, fig, div_id: str) -> str:
    return f"<section><h2>{_e(title)}</h2><p class='note'>{_e(note)}</p>{_plots.to_div(fig, div_id)}</section>"


def _owners_section(walls: list[tuple[str, Wall]]) -> str:
    """Each probe's wall (where it ran out, else its highest phase) split by owner, largest first."""
    tables = []
    for label, wall in walls:
        rows = "".join(f"<tr><td>{_e(owner_name(tag))}</td><td>{_e(format_bytes(size))}</td>"
                       f"<td>{share_of(size, wall.peak_bytes)}</td></tr>"
                       for tag, size in sorted(wall.owners.items(), key=lambda item: -item[1]))
        tables.append(f"<h3>{_e(label)}: {_e(wall.phase)}, {_e(format_bytes(wall.peak_bytes))}</h3>"
                      f"<table class='grid'><tr><th>owner</th><th>bytes</th><th>share</th></tr>{rows}</table>")
    return ("<section id='owners'><h2>What holds the memory at the wall</h2><p class='note'>The phase that ran out "
            "of memory, or the one with the highest peak, by owner at its peak: each part's weights, the LoRA, its "
            "gradients, the optimizer's state, activations and transients (whatever no code claims while it is "
            "made); with an estimate also the GPU's own overhead. The cuda meter counts no owners.</p>"
            + "".join(tables) + "</section>")


def _trials_section(space: Space, probes: list, budget: int | None) -> str:
    rows = []
    for p in probes:
        share = f" ({p.peak_bytes / budget:.0%})" if budget and p.peak_bytes is not None else ""
        rows.append(
            f"<tr class='{p.outcome.replace(' ', '-')}'><td>{p.number}</td>"
            + "".join(f"<td>{_e(k.label(p.point[k.name])) if p.point and k.name in p.point else ''}</td>"
                      for k in space.knobs)
            + f"<td>{_e(p.outcome)}{_e(' in ' + p.phase) if p.phase and p.outcome != FITS else ''}"
            f"{_e(' (' + p.reason + ')') if p.reason else ''}</td>"
            f"<td>{_e(format_bytes(p.peak_bytes))}{share}</td><td>{_e(format_bytes(p.host_peak_bytes))}</td>"
            f"<td>{f'{p.seconds_per_step:.3f}' if p.seconds_per_step else ''}</td>"
            f"<td class='error'>{_e((p.error or '')[:200])}</td></tr>")
    head = "".join(f"<th>{_e(k.name)}</th>" for k in space.knobs)
    return ("<section><h2>All trials</h2><table class='grid'><tr><th>trial</th>" + head
            + "<th>outcome</th><th>peak</th><th>host peak</th><th>s/step</th><th>error</th></tr>" + "".join(rows)
            + "</table><p class='note'>Also in trials.csv and summary.json beside this file.</p></section>")


def _trainer_rows(study, space: Space, meter: str) -> list[list[str]]:
    """Each trainer probe's phases: what the trainer held beside the estimate of the same point."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        if not attrs.get("trainer_run"):
            continue
        point = params_of(trial)
        where = space.describe(point) if space.contains(point) else ""
        outcome = attrs.get("status", "") + (f" in {attrs['phase']}" if attrs.get("phase") else "")
        for phase, measured, estimated in trainer.beside_estimate(attrs, meter):
            rows.append([str(trial.number), where, outcome, phase, format_bytes(measured),
                         format_bytes(estimated) if estimated else "-",
                         f"{measured / estimated - 1:+.0%}" if estimated else ""])
            where = outcome = ""
    return rows


def _trainer_section(rows: list[list[str]], command: Any) -> str:
    body = "".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return ("<section id='trainer'><h2>The trainer against the estimate</h2>"
            f"<p class='note'>Probed with <code>{_e(command or 'a trainer command')}</code>: each phase its log "
            "marked, "
            "the peak the meter inside the trainer saw beside fitfinder's estimate of the same point "
            "(tensor bytes on the sim meter, allocator blocks without overhead on a card). "
            "<code>fitfinder calibrate --study NAME</code> fits the estimate to these pairs.</p>"
            "<table class='grid'><tr><th>trial</th><th>point</th><th>outcome</th><th>phase</th><th>trainer</th>"
            "<th>estimate</th><th>trainer - estimate</th></tr>" + body + "</table></section>")


_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto; max-width: 1180px;
       color: #222; padding: 0 16px; }
h1 { font-size: 1.5em; margin-bottom: 4px; } h2 { font-size: 1.15em; margin-top: 28px; }
section { margin-bottom: 20px; } .note { color: #555; font-size: 0.9em; margin: 4px 0 8px; }
table { border-collapse: collapse; font-size: 0.9em; }
.facts th { text-align: left; padding: 2px 14px 2px 0; color: #555; font-weight: normal; }
.grid th, .grid td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; }
.grid th { background: #f5f5f5; } td.error { color: #777; font-size: 0.85em; }
tr.given-up td:nth-child(5) { color: #b3261e; font-weight: bold; }
tr.kept td:nth-child(5) { color: #2e7d32; } tr.gone-past td:nth-child(5) { color: #1565c0; }
.verdict { font-size: 1.05em; padding: 8px 12px; border-radius: 4px; }
.verdict.fit { background: #e8f5e9; } .verdict.none { background: #fdecea; }
"""


def _page(title: str, sections: list[str], plotly_js: str) -> str:
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>fitfinder: {_e(title)}</title><style>{_CSS}</style>"
            f"<script type='text/javascript'>{plotly_js}</script></head><body>\n"
            + "\n".join(sections)
            + f"\n<footer class='note'>Written by fitfinder on {stamp}.</footer></body></html>\n")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)
