"""The report's figures: plotly figures built from the study's probes, one function per figure.

Every figure reads memory in one unit (chosen from the budget) and colours a probe by its
outcome the same way: fits (under the limit), tight (ran, under the budget but past the limit:
verdict.py), oom, error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fitfinder.units import format_bytes

OUTCOME_COLORS = {
    "fits": "#2e9e44",
    "tight": "#f0a020",
    "oom": "#d43d35",
    "error": "#7f7f7f",
    "timeout": "#9467bd",
    "running": "#3a78c2",
}
_TEMPLATE = "plotly_white"


@dataclass
class Probe:
    """One trial of the study as the report shows it."""

    number: int
    outcome: str  # fits | tight | oom | error | timeout | running
    point: dict[str, Any] | None
    peak_bytes: int | None = None
    phases: dict[str, int] = field(default_factory=dict)
    phase: str | None = None
    seconds_per_step: float | None = None
    start: datetime | None = None
    end: datetime | None = None
    error: str | None = None
    host_peak_bytes: int | None = None  # the host's peak over the probe's phases (issue 32)
    reason: str = ""  # why it did not fit, where it is not the card: "host memory"


def memory_unit(*sizes: int | None) -> tuple[str, int]:
    """The binary unit that reads best for the largest of `sizes`."""
    largest = max((s for s in sizes if s), default=0)
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def _hover(probe: Probe, space) -> str:
    point = space.describe(probe.point) if probe.point else "(no point)"
    peak = format_bytes(probe.peak_bytes) if probe.peak_bytes is not None else "not measured"
    where = f" in {probe.phase}" if probe.phase and probe.outcome != "fits" else ""
    return f"trial {probe.number}: {probe.outcome}{where}<br>{point}<br>peak {peak}"


def _limit_lines(fig, budget: int | None, limit: int | None, unit: tuple[str, int], cols: int = 1) -> None:
    """The budget and the limit (budget minus the margin) as horizontal lines on every panel."""
    name, size = unit
    for value, label, dash, where in ((budget, "budget", "solid", "top left"),
                                      (limit, "limit after margin", "dash", "bottom left")):
        if not value:
            continue
        for col in range(1, cols + 1):
            extra = {"row": 1, "col": col} if cols > 1 else {}
            if col == 1:  # label the line once, on the first panel
                extra.update(annotation_text=f"{label} {format_bytes(value)}", annotation_position=where)
            fig.add_hline(y=value / size, line_dash=dash, line_color="#333", line_width=1, **extra)


# -- peak memory against each knob ----------------------------------------------------------
def peak_by_knob(space, probes: list[Probe], budget: int | None, limit: int | None):
    """One panel per knob: every measured peak at the knob value it was probed with."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    knobs = space.knobs
    unit = memory_unit(budget, *(p.peak_bytes for p in probes))
    fig = make_subplots(rows=1, cols=len(knobs), shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[f"{k.name} ({k.role})" for k in knobs])
    measured = [p for p in probes if p.peak_bytes is not None and p.point]
    for col, knob in enumerate(knobs, start=1):
        for outcome, color in OUTCOME_COLORS.items():
            group = [p for p in measured if p.outcome == outcome]
            if not group:
                continue
            fig.add_trace(go.Scatter(
                x=[knob.label(p.point[knob.name]) for p in group], y=[p.peak_bytes / unit[1] for p in group],
                mode="markers", name=outcome, legendgroup=outcome, showlegend=col == 1,
                marker={"color": color, "size": 11, "opacity": 0.8,
                        "symbol": "x" if outcome == "oom" else "circle", "line": {"width": 1, "color": "#fff"}},
                hovertext=[_hover(p, space) for p in group], hoverinfo="text",
            ), row=1, col=col)
        fig.update_xaxes(type="category", categoryorder="array", range=[-0.5, len(knob.candidates) - 0.5],
                         categoryarray=[knob.label(v) for v in knob.candidates], row=1, col=col)
    _limit_lines(fig, budget, limit, unit, cols=len(knobs))
    fig.update_yaxes(title_text=f"peak ({unit[0]})", row=1, col=1)
    fig.update_layout(template=_TEMPLATE, height=420, margin={"t": 60, "b": 40, "l": 60, "r": 20},
                      legend={"orientation": "h", "y": -0.15})
    return fig


# -- where the wall is: fit / no fit over two knobs ---------------------------------------------
_CELL_STATES = (  # code, label, colour
    (0, "not known", "#e6e6e6"),
    (1, "no fit (implied)", "#f3b7b2"),
    (2, "no fit (probed)", "#d43d35"),
    (3, "fits (implied)", "#b5e0bd"),
    (4, "fits (probed)", "#2e9e44"),
)


def map_knobs(space, probes: list[Probe]) -> list:
    """The two knobs the map is drawn over: the highest-priority knobs the search varied
    (priority is the space's order: quality knobs first), topped up in priority order."""
    varied = [k for k in space.knobs
              if len({repr(p.point[k.name]) for p in probes if p.point and k.name in p.point}) > 1]
    chosen = varied[:2]
    for knob in space.knobs:
        if len(chosen) == 2:
            break
        if knob not in chosen:
            chosen.append(knob)
    return sorted(chosen, key=space.knobs.index)


def fit_map(space, known, center: dict[str, Any], x_knob, y_knob=None):
    """Every combination of two knobs, the others held at `center` (the winner, or the base):
    fits or not, probed or implied by dominance from a probe that was."""
    import plotly.graph_objects as go

    ys = list(y_knob.candidates) if y_knob else [None]
    z, text, hover = [], [], []
    for y_value in ys:
        z_row, text_row, hover_row = [], [], []
        for x_value in x_knob.candidates:
            point = {**center, x_knob.name: x_value, **({y_knob.name: y_value} if y_knob else {})}
            code, short, long = _cell(space, known, point)
            z_row.append(code)
            text_row.append(short)
            hover_row.append(f"{space.describe(point)}<br>{long}")
        z.append(z_row)
        text.append(text_row)
        hover.append(hover_row)
    n = len(_CELL_STATES)
    scale = []
    for code, _, color in _CELL_STATES:
        scale += [[code / n, color], [(code + 1) / n, color]]
    x_labels = [x_knob.label(v) for v in x_knob.candidates]
    y_labels = [y_knob.label(v) for v in ys] if y_knob else [""]
    fig = go.Figure(go.Heatmap(
        z=[[c + 0.5 for c in row] for row in z], x=x_labels, y=y_labels, zmin=0, zmax=n,
        colorscale=scale, showscale=False, text=text, texttemplate="%{text}",
        hovertext=hover, hoverinfo="text", xgap=3, ygap=3,
    ))
    for code, label, color in _CELL_STATES:  # a legend for the colours
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker={"color": color, "size": 12, "symbol": "square"}))
    # The point the other knobs are held at: outlined (category axes place cell i at i +- 0.5).
    col, row = x_knob.level(center[x_knob.name]), y_knob.level(center[y_knob.name]) if y_knob else 0
    fig.add_shape(type="rect", x0=col - 0.5, x1=col + 0.5, y0=row - 0.5, y1=row + 0.5,
                  line={"color": "#1a1a1a", "width": 3})
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="this point (outlined)",
                             marker={"color": "rgba(0,0,0,0)", "size": 12, "symbol": "square",
                                     "line": {"width": 2, "color": "#1a1a1a"}}))
    fig.update_xaxes(title_text=x_knob.name, type="category")
    fig.update_yaxes(title_text=y_knob.name if y_knob else "", type="category")
    fig.update_layout(template=_TEMPLATE, height=max(260, 90 * len(ys) + 140),
                      margin={"t": 30, "b": 40, "l": 80, "r": 20}, legend={"orientation": "h", "y": -0.25})
    return fig


def _cell(space, known, point) -> tuple[int, str, str]:
    state, result = known.decider(point)
    if state is None:
        return 0, "?", "not probed, and no probe decides it"
    probed = result is not None and space.key(result.point) == space.key(point)
    peak = format_bytes(result.peak_bytes) if result and result.peak_bytes is not None else "-"
    if state == "fit":
        if probed:
            return 4, f"#{result.trial} {peak}", f"fits: trial {result.trial} peaked at {peak}"
        return 3, f"≤#{result.trial}", f"fits: lighter than trial {result.trial}, which fit ({peak})"
    if probed:
        reason = result.status if result.status != "ok" else "tight"
        return 2, f"#{result.trial} {reason}", f"does not fit: trial {result.trial} {reason} ({peak})"
    return 1, f"≥#{result.trial}", f"does not fit: heavier than trial {result.trial}, which did not fit ({peak})"


# -- a timeline of the probes ----------------------------------------------------------------------
def timeline(space, probes: list[Probe]):
    """One bar per probe from its start to its end, coloured by outcome."""
    import plotly.graph_objects as go

    timed = [p for p in probes if p.start is not None]
    fig = go.Figure()
    for outcome, color in OUTCOME_COLORS.items():
        group = [p for p in timed if p.outcome == outcome]
        if not group:
            continue
        fig.add_trace(go.Bar(
            base=[p.start.isoformat() for p in group],
            x=[max(1.0, ((p.end or p.start) - p.start).total_seconds() * 1000) for p in group],
            y=[f"trial {p.number}" for p in group], orientation="h", name=outcome,
            marker={"color": color},
            hovertext=[_hover(p, space) + f"<br>{((p.end or p.start) - p.start).total_seconds():.1f} s"
                       for p in group], hoverinfo="text",
        ))
    order = [f"trial {p.number}" for p in sorted(timed, key=lambda p: p.number)]
    fig.update_xaxes(type="date", title_text="time")
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=order, autorange="reversed")
    fig.update_layout(template=_TEMPLATE, barmode="overlay", height=max(220, 28 * len(timed) + 120),
                      margin={"t": 20, "b": 40, "l": 80, "r": 20}, legend={"orientation": "h", "y": -0.2})
    return fig


# -- per-phase peaks: the winner against the base ------------------------------------------------
def phase_bars(groups: list[tuple[str, dict[str, int]]], phase_order: tuple[str, ...],
               budget: int | None, limit: int | None):
    """Grouped bars: the peak of each probe phase, one colour per probe."""
    import plotly.graph_objects as go

    seen = {name for _, phases in groups for name in phases}
    phases = [name for name in phase_order if name in seen] + sorted(seen - set(phase_order))
    unit = memory_unit(budget, *(v for _, ph in groups for v in ph.values()))
    fig = go.Figure()
    for (label, values), color in zip(groups, ("#8c8c8c", "#2e9e44", "#3a78c2")):
        fig.add_trace(go.Bar(
            x=phases, y=[values[name] / unit[1] if name in values else None for name in phases], name=label,
            marker={"color": color},
            hovertext=[f"{label}<br>{name}: {format_bytes(values.get(name)) if name in values else 'not reached'}"
                       for name in phases], hoverinfo="text",
        ))
    _limit_lines(fig, budget, limit, unit)
    fig.update_yaxes(title_text=f"peak ({unit[0]})")
    fig.update_xaxes(title_text="probe phase", type="category")
    fig.update_layout(template=_TEMPLATE, barmode="group", height=380,
                      margin={"t": 30, "b": 40, "l": 60, "r": 20}, legend={"orientation": "h", "y": -0.25})
    return fig


def host_beside_device(probes: list[Probe], budget: int | None, ram: int | None):
    """Two panels over the trials: each probe's device peak, and beside it its host peak (the
    process and the tensors it holds in host memory) against the RAM budget."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    measured = [p for p in probes if p.peak_bytes is not None or p.host_peak_bytes is not None]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=["device peak", "host peak"])
    for col, (values, line, label) in enumerate(((lambda p: p.peak_bytes, budget, "budget"),
                                                 (lambda p: p.host_peak_bytes, ram, "RAM budget")), start=1):
        unit = memory_unit(line, *(values(p) for p in measured))
        fig.add_trace(go.Bar(
            x=[f"#{p.number}" for p in measured],
            y=[values(p) / unit[1] if values(p) is not None else None for p in measured],
            marker={"color": [OUTCOME_COLORS.get(p.outcome, "#7f7f7f") for p in measured]}, showlegend=False,
            hovertext=[f"trial {p.number}: {p.outcome}{' (' + p.reason + ')' if p.reason else ''}<br>"
                       f"{format_bytes(values(p))}" for p in measured], hoverinfo="text"), row=1, col=col)
        if line:
            fig.add_hline(y=line / unit[1], line_color="#333", line_width=1, row=1, col=col,
                          annotation_text=f"{label} {format_bytes(line)}", annotation_position="top left")
        fig.update_yaxes(title_text=f"peak ({unit[0]})", row=1, col=col)
        fig.update_xaxes(type="category", title_text="trial", row=1, col=col)
    fig.update_layout(template=_TEMPLATE, height=380, margin={"t": 50, "b": 40, "l": 60, "r": 20})
    return fig


def to_div(fig, div_id: str) -> str:
    """The figure as a <div> and its script; plotly.js itself is inlined once by the page."""
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()
