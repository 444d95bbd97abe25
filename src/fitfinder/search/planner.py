"""The search: which point to probe next, what is known, when the answer is proven.

The plan is a pure function of what the study already knows, so rerunning the same command
resumes where it stopped, and every decision can be explained by the trials behind it:

1. Base: trial 0 is the job file as written (the desired point).
2. Rollback: while the last probe ran out of memory, its phase picks the next move, in the
   seeds' order: load -> offload, cached text embeddings, then base quantization; sample ->
   sampling off; latents and train -> checkpointing on and batch 1. Each move keeps the ones
   before it, and the walk stops at the first fit or when the phase has nothing left to give.
3. Quality, knob by knob in priority order: first the optimistic point (every remaining quality
   knob as desired, every speed knob at its lightest); if it does not fit, the knob's desired
   value with every later knob at its lightest, then bisection between the highest level known
   to fit and the lowest known not to. This finds the lexicographic optimum exactly.
4. Speed, at the best quality: escalation one knob at a time in the seeds' order (checkpointing
   off, a larger batch, offload off), for each setting of the switches; each maximal point is
   probed once for its seconds per sample, unless a heavier point that fits makes it slower for
   sure. The fastest wins.
5. Confirmation: the winner is probed again for longer (3x the steps); if that fails, the plan
   goes on from what it learned and confirms the next best.

Faults: a probe that crashed, hung or printed garbage says nothing about memory. Its point is
probed once more (the plan, finding it still unknown, asks for it again); if that fails too, the
point alone is excluded: it stays unknown, not infeasible -- only an out-of-memory implies
dominance, so nothing heavier is ruled out by it, and a heavier point that fits shows that it
fits (it is then no longer excluded). Where the quality stage's point for a level is excluded,
the plan asks for the same level with a later knob one step up (_level_stand_in); a
speed climb steps over an excluded level to the next. A level that no point can settle is given
up, named after the excluded trial, and the answer is proven only around it (`excluded`).

Dominance: memory is monotone in every knob, so a point at least as heavy as one that ran out of
memory in a phase -- on the knobs that phase depends on -- fails too, and a point at most as
heavy as one that fit fits too. Such points are never probed; the ones the plan would have
probed are recorded as decided, with the trial that decided them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from fitfinder.probe.protocol import Phase, ProbeResult, Purpose, Status, Verdict
from fitfinder.space import PHASES, Point, Space

FIT: Verdict = "fit"
NOFIT: Verdict = "nofit"
EXCLUDED = "excluded"  # its last ATTEMPTS probes crashed, hung or gave garbage
ATTEMPTS = 2  # a probe that failed without running out of memory is tried once more
CONFIRM_FACTOR = 3  # a confirmation probe runs this many times the probe steps
HOST_MEMORY = "host memory"  # the reason a point does not fit when its host peak passes the RAM budget
# The seeds' rollback moves: the knobs to lighten when a probe runs out of memory in a phase.
# diagnose.ROWS orders a load OOM the other way (quantize before low_vram), on purpose: diagnose
# names one change for a user to make blind, and quantizing is the one most sure to fit; the
# search proves each move with a probe, so it takes the moves that cost only speed first and
# gives up base precision only when they were not enough.
ROLLBACK = {
    "load": (("low_vram", "text_encoder"), ("quantize",)),
    "text_encoder": (("text_encoder", "low_vram"), ("quantize",)),
    "latents": (("batch",),),
    "sample": (("sampling",),),
    "last_sample": (("sampling",),),
    "train": (("gradient_checkpointing", "batch"),),
}


@dataclass
class Result:
    """What one trial says about one point."""

    trial: int
    point: Point
    status: Status
    peak_bytes: int | None = None
    seconds_per_sample: float | None = None
    phase: Phase | None = None  # the phase that ran out of memory
    error: str | None = None
    phases: dict[str, int] = field(default_factory=dict)  # phase -> peak bytes
    confirm: bool = False
    verdict: Verdict | None = None  # FIT, NOFIT, or None (an error says nothing about memory)
    failed_phases: tuple = ()  # phases over the limit; () with NOFIT means "unknown: all" (unless the host failed)
    extra: dict[str, Any] = field(default_factory=dict)
    host_phases: dict[str, int] = field(default_factory=dict)  # phase -> host peak bytes
    oom_kind: str | None = None  # oom.classify's: "host" when the machine's RAM ran out, not the card's
    # Phases whose host peak passed the RAM budget, or where the host ran out (None in it: phase unknown).
    host_failed_phases: tuple = ()

    @property
    def host_peak_bytes(self) -> int | None:
        return max(self.host_phases.values(), default=None)

    @property
    def wall_reason(self) -> str:
        """Why it does not fit, in the trial line's words: "host memory" when only the host stopped it."""
        return HOST_MEMORY if self.host_failed_phases and not self.failed_phases else ""


@dataclass
class Step:
    """The plan's answer: a point to probe (or None: done) and what it decided without probing."""

    point: Point | None
    purpose: Purpose = ""  # base | rollback | quality | speed | confirm
    steps_factor: int = 1
    decided: list[tuple[Point, Result]] = field(default_factory=list)


class Knowledge:
    """Every result so far, and what they imply through dominance."""

    def __init__(self, space: Space, limit_bytes: int | None, ram_bytes: int | None = None):
        self.space = space
        self.limit_bytes = limit_bytes
        self.ram_bytes = ram_bytes  # the host's budget (--ram), or None: the host is not judged
        self.results: list[Result] = []
        self._by_key: dict[tuple, list[Result]] = {}

    def add(self, result: Result) -> Result:
        result.verdict, result.failed_phases, result.host_failed_phases = self._judge(result)
        self.results.append(result)
        self._by_key.setdefault(self.space.key(result.point), []).append(result)
        return result

    def _judge(self, result: Result) -> tuple[str | None, tuple, tuple]:
        """ok under the limit (and every phase's host peak under the RAM budget) fits; an OOM, or
        ok over the limit (tight, or over the budget) or over the RAM budget, does not. Returns the
        verdict, the device's failed phases and the host's."""
        phase = result.phase if result.phase in PHASES else None
        if result.status == "oom":
            if result.oom_kind == "host":  # the machine's RAM ran out (MemoryError, the OOM killer)
                return NOFIT, (), (phase,)
            return NOFIT, (phase,) if phase else (), ()
        if result.status != "ok":
            return None, (), ()
        ram = self.ram_bytes
        host_over = () if ram is None else tuple(p for p, peak in result.host_phases.items()
                                                 if peak > ram and p in PHASES)
        limit = self.limit_bytes
        if limit is None or result.peak_bytes is None or result.peak_bytes <= limit:
            return (NOFIT if host_over else FIT), (), host_over
        over = tuple(p for p, peak in result.phases.items() if peak > limit and p in PHASES)
        return NOFIT, over, host_over

    def probed(self, point: Point) -> list[Result]:
        return self._by_key.get(self.space.key(point), [])

    def state(self, point: Point) -> str | None:
        """FIT, NOFIT, EXCLUDED (its probes failed ATTEMPTS times, not out of memory, and no other
        result decides it) or unknown (None). A probe that failed once leaves its point unknown, so
        the plan asks for it again."""
        return self.decider(point)[0]

    def decider(self, point: Point) -> tuple[str | None, Result | None]:
        """The state of `point` and the result that decides it. Failure wins over fit; a point
        whose own probes failed ATTEMPTS times is EXCLUDED unless dominance decides it anyway
        (a lighter point ran out of memory, a heavier one fit: memory says so, not its probes)."""
        own = self.probed(point)
        for result in own:
            if result.verdict == NOFIT:
                return NOFIT, result
        for result in self.results:
            if result.verdict == NOFIT and self._fails_like(point, result):
                return NOFIT, result
        excluded = self.failures_in_a_row(point) >= ATTEMPTS
        # An excluded point is decided only by other points: its own fit came before its failures.
        others = [r for r in self.results if not excluded or self.space.key(r.point) != self.space.key(point)]
        for result in () if excluded else own:
            if result.verdict == FIT:
                return FIT, result
        for result in others:
            if result.verdict == FIT and self.space.heavier_or_equal(result.point, point) \
                    and self._host_at_most(point, result.point):
                return FIT, result
        witnesses = self._phase_witnesses(point, others)
        if witnesses:
            return FIT, witnesses[-1]
        return (EXCLUDED, own[-1]) if excluded else (None, None)

    def _phase_witnesses(self, point: Point, results: list[Result]) -> list[Result]:
        """One of `results` per phase that ran that phase under the limit at a point at least as
        heavy there -- or [] if some phase has none. Each phase's peak depends only on its own
        knobs, so witnesses from different probes together prove the point fits."""
        limit = self.limit_bytes if self.limit_bytes is not None else float("inf")
        witnesses = []
        for phase in self.space.phases_run(point):
            witness = next((r for r in results if r.verdict is not None and phase not in r.failed_phases
                            and r.phase != phase and r.phases.get(phase, limit + 1) <= limit
                            and self.space.heavier_or_equal(r.point, point, phase)
                            and self._host_witness(r, point, phase)), None)
            if witness is None:
                return []
            witnesses.append(witness)
        return witnesses


    def _fails_like(self, point: Point, failed: Result) -> bool:
        """At least as heavy as `failed` on every knob one of its failing phases depends on: on the
        device for the device's failures, on the host (Space.host_heavier_or_equal) for the host's,
        so a host failure rules out only what holds at least as much host memory."""
        on_host = self.space.host_heavier_or_equal
        if any(on_host(point, failed.point, phase) for phase in failed.host_failed_phases):
            return True
        if failed.host_failed_phases and not failed.failed_phases:
            return False  # only the host ran out: the device said nothing against it
        heavier = self.space.heavier_or_equal
        if not failed.failed_phases:
            return heavier(point, failed.point)
        return any(heavier(point, failed.point, phase) for phase in failed.failed_phases)

    def _host_at_most(self, point: Point, fit: Point) -> bool:
        """Whether a fit at `fit` proves `point`'s host side: always without a RAM budget; else
        only where `point` holds no more host memory (more offloading is lighter on the card)."""
        return self.ram_bytes is None or self.space.host_heavier_or_equal(fit, point)

    def _host_witness(self, result: Result, point: Point, phase: str) -> bool:
        """Whether `result` ran `phase` within the RAM budget at a point holding at least as much
        host memory there as `point` (a phase whose host peak the meter did not read counts as
        within it, as `_judge` reads it)."""
        if self.ram_bytes is None:
            return True
        return (phase not in result.host_failed_phases and result.host_phases.get(phase, 0) <= self.ram_bytes
                and self.space.host_heavier_or_equal(result.point, point, phase))

    def failures_in_a_row(self, point: Point) -> int:
        """How many of the point's last probes failed without saying anything about memory (a
        crash, a hang, garbage): 1 asks for a retry, ATTEMPTS excludes the point."""
        count = 0
        for result in reversed(self.probed(point)):
            if result.verdict is not None:
                break
            count += 1
        return count

    def excluded(self) -> list[Result]:
        """The last failure of each point excluded after ATTEMPTS failed probes and left unknown
        (one that dominance decides hides nothing)."""
        last = {self.space.key(r.point): r for r in self.results if r.verdict is None}
        return [r for r in last.values() if self.state(r.point) == EXCLUDED]

    def fits(self) -> list[Result]:
        """The fits a winner may be: a point whose last probes failed is none, even where a
        heavier point shows that it fits (its confirmation crashed twice, say)."""
        return [r for r in self.results if r.verdict == FIT and self.state(r.point) == FIT
                and self.failures_in_a_row(r.point) < ATTEMPTS]

    def confirmed(self, point: Point) -> bool:
        return any(r.confirm and r.verdict == FIT for r in self.probed(point))


# -- the plan ----------------------------------------------------------------------------------
def plan(space: Space, known: Knowledge) -> Step:
    """The next point to probe, or Step(None) when the best point is confirmed (or nothing fits)."""
    decided: list[tuple[Point, Result]] = []
    desired = space.desired()
    if not known.probed(desired) or known.failures_in_a_row(desired) == len(known.probed(desired)) < ATTEMPTS:
        return Step(desired, "base")  # never probed, or its probe failed once: (again) the base
    point = _rollback(space, known, decided)
    if point is not None:
        return Step(point, "rollback", decided=decided)
    point, quality = _quality_stage(space, known, decided)
    if point is not None:
        return Step(point, "quality", decided=decided)
    if quality is not None:
        point = _speed_stage(space, known, quality, decided)
        if point is not None:
            return Step(point, "speed", decided=decided)
    winner = best(space, known)
    if winner is not None and not known.confirmed(winner.point):
        return Step(winner.point, "confirm", CONFIRM_FACTOR, decided)
    return Step(None, decided=decided)


def plan_around(space: Space, known: Knowledge, pending: list[Point], depth: int = 3, choices=None) -> Step:
    """The next point for one more worker while `pending` points are being probed by others.

    With nothing pending this is `plan`: one worker's search is the plan's. When the plan's next
    point is already being probed, the worker takes, in this order:

    1. at the speed stage (the best quality settled by real results), the heaviest speed setting
       still open on any line the stage climbs (_open_speed): the k workers probe k levels of
       the batch climb at once, where the plan climbs one step at a time;
    2. else the likeliest point some branch of the pending outcomes needs (_speculate): each
       pending probe may fit or run out of memory, in the phase _likely_phases names; a branch is
       as likely as its guesses together, the fit and the failure even odds, and branches down
       to 1 in 2**depth are searched, the likeliest first. A bisection then runs as a k-ary
       section: the midpoint, the midpoints of both halves, ...
    3. else, at the speed stage, the confirmation of the best point measured so far (the likely
       winner), while the last speed probes run: the confirmation is the longest probe and
       ends every search, so it is the one worth starting early.

    The speculation only picks *which* point to probe; every result the search learns from is a
    real one, and a point being probed is never planned again. Step(None) with points pending
    means "wait for them". `choices(space, known, step)` says, for the plan's step on what is
    known or guessed, the steps a worker may take in order (_choices, what the search runs);
    benchmarks/scaleout.py measures others against it through tests/standin.py (docs/scaleout.md).
    """
    choices = choices or _choices
    step = plan(space, known)
    if step.point is None or not _among(space, step.point, pending):
        return step
    if step.purpose == "confirm":
        return Step(None)  # the winner is being confirmed: nothing is left to plan on
    for choice in choices(space, known, step):
        if not _among(space, choice.point, pending):
            return choice
    guess = _speculate(space, known, pending, step.point, 0.5 ** depth, choices)
    if guess.point is None and step.purpose == "speed":
        leader = best(space, known)
        if leader is not None and not known.confirmed(leader.point) and not _among(space, leader.point, pending):
            return Step(leader.point, "confirm", CONFIRM_FACTOR)
    return guess


def _choices(space: Space, known: Knowledge, step: Step):
    """The steps a worker may take for the plan's `step`, in order: the step itself, then at the
    speed stage the open speed settings, heaviest first (_open_speed). None for a confirmation,
    which waits for the real results it rests on."""
    if step.point is None or step.purpose == "confirm":
        return
    yield Step(step.point, step.purpose, step.steps_factor)
    for point in _open_speed(space, known) if step.purpose == "speed" else ():
        yield Step(point, "speed")


def _speculate(space: Space, known: Knowledge, pending: list[Point], first: Point, least_odds: float,
               choices) -> Step:
    """The likeliest point that a branch of the pending outcomes needs and nobody probes yet.

    Best-first over the tree of guesses: a branch is `known` plus a guessed outcome of each
    pending point the plan asked for on the way, as likely as its guesses together (a fit and a
    failure even odds, a failure only in a phase where it would contradict no result). Branches
    less likely than `least_odds` are not searched. A branch offers what `choices` gives for its
    plan's step; one that offers nothing is not searched further. Step(None) if no branch needs a
    new point.
    """
    import heapq

    order = itertools.count()  # ties: the earlier branch, so the fit branch before the failure
    frontier: list = []

    def branch_on(branch: Knowledge, rest: list[Point], asked: Point, odds: float) -> None:
        guess = rest[[space.key(p) for p in rest].index(space.key(asked))]
        left = [p for p in rest if p is not guess]
        phases = _likely_phases(branch, guess)
        fit = 0.5 if phases else 1.0
        heapq.heappush(frontier, (-odds * fit, next(order), branch, guess, left, None))
        if phases:
            heapq.heappush(frontier, (-odds * (1 - fit), next(order), branch, guess, left, phases[0]))

    branch_on(known, pending, first, 1.0)
    while frontier:
        minus_odds, _, before, guess, rest, failed_in = heapq.heappop(frontier)
        if -minus_odds < least_odds:
            break
        branch = _with_guess(space, before, guess, "ok" if failed_in is None else "oom", failed_in)
        step = plan(space, branch)
        offered = False
        for choice in choices(space, branch, step):
            if not _among(space, choice.point, pending):
                return choice
            offered = True
        if offered and _among(space, step.point, rest):
            branch_on(branch, rest, step.point, -minus_odds)
    return Step(None)


def _open_speed(space: Space, known: Knowledge) -> list[Point]:
    """The speed settings the speed stage may still need at the best quality, heaviest first (the
    most speed knobs raised, then the plan's order of the switches): every unknown level between
    the bounds of every line it climbs, one line per setting of the switches. What k workers
    probe at once, where one worker climbs one step at a time; a heavy one that fits settles the
    lighter ones by dominance, and is the likelier winner."""
    _, quality = _quality_stage(space, known, [])
    if quality is None or not space.speed_knobs:
        return []
    chain, switches = _speed_lines(space)
    open_points = []
    for order, setting in enumerate(_switch_settings(switches)):
        line = lambda level, s={**quality, **setting}: {**s, chain.name: chain.candidates[level]}  # noqa: E731
        lo, hi = _bounds(known, line, len(chain.candidates) - 1, chain)
        switched = sum(k.level(setting[k.name]) for k in switches)
        open_points += [(-level - switched, order, line(level)) for level in range(lo + 1, hi)
                        if known.state(line(level)) is None]
    return [point for *_, point in sorted(open_points, key=lambda t: t[:2])]


def next_step(space: Space, known: Knowledge, pending: list[Point], guide=None) -> Step:
    """What one worker probes next: guided by estimates when it is alone (plan_guided), else
    around the others' pending points (plan_around, which does not speculate on estimates)."""
    if guide is not None and not pending:
        return plan_guided(space, known, guide)
    return plan_around(space, known, pending)


def _among(space: Space, point: Point, points: list[Point]) -> bool:
    key = space.key(point)
    return any(space.key(p) == key for p in points)


def _likely_phases(known: Knowledge, point: Point) -> list[str]:
    """The phases to guess `point` runs out of memory in, likeliest first: the last failure's,
    then train, load and the others it runs, one per rollback move -- only phases where nothing
    known ran at a point at least as heavy there under the limit (a guess never contradicts a
    result). [] when every phase it runs is known to fit."""
    space, limit = known.space, known.limit_bytes if known.limit_bytes is not None else math.inf
    last = next((r.failed_phases[0] for r in reversed(known.results) if r.verdict == NOFIT and r.failed_phases), None)
    run = space.phases_run(point)
    phases, moves = [], []
    for phase in dict.fromkeys([last, "train", "load", *run]):
        if phase not in run or ROLLBACK.get(phase) in moves:
            continue
        if not any(r.verdict is not None and phase not in r.failed_phases and r.phase != phase
                   and (r.verdict == FIT or r.phases.get(phase, limit + 1) <= limit)
                   and space.heavier_or_equal(r.point, point, phase) for r in known.results):
            phases.append(phase)
            moves.append(ROLLBACK.get(phase))
    return phases


def _with_guess(space: Space, known: Knowledge, point: Point, status: str, phase: str | None = None) -> Knowledge:
    """A copy of `known` that assumes `point` ends with `status`: a fit, or an OOM in `phase`
    (in every phase if None)."""
    guessed = Knowledge(space, known.limit_bytes, known.ram_bytes)
    for result in known.results:
        guessed.add(result)
    guessed.add(Result(trial=-1, point=point, status=status, peak_bytes=0 if status == "ok" else None, phase=phase))
    return guessed


def _consider(known: Knowledge, point: Point, decided: list) -> str | None:
    """The state of a point the plan would probe; a failure decided without probing is noted."""
    state, result = known.decider(point)
    if state == NOFIT and result is not None and known.space.key(result.point) != known.space.key(point):
        decided.append((point, result))
    return state


def _rollback(space: Space, known: Knowledge, decided: list) -> Point | None:
    """The seeds' walk from the base: lighten what the failing phase needs, until something fits."""
    point = space.desired()
    while True:
        state, failing = known.decider(point)
        if state is None:
            return point
        if state == FIT or failing.verdict != NOFIT or not failing.failed_phases:
            return None  # a fit, an error, or no phase to go on: the quality stage takes over
        lighter = _lighten(space, point, failing.failed_phases[0])
        if lighter is None:
            return None
        point = lighter
        if _consider(known, point, decided) is None:
            return point


def _lighten(space: Space, point: Point, phase: str) -> Point | None:
    """The first move of the seeds' order for `phase` that still changes `point`, or None.

    A move's knobs that do not claim `phase` stay (low_vram moves only the load for FLUX.1, as its
    AI Toolkit loader uses it: a text-encoder OOM there gets cached embeddings alone)."""
    for move in ROLLBACK.get(phase, ()):
        knobs = [space.by_name[name] for name in move if name in space.by_name and phase in space.by_name[name].phases]
        lighter = {**point, **{k.name: k.candidates[0] for k in knobs}}
        if lighter != point:
            return lighter
    return None


def _lightest_speed(space: Space) -> Point:
    return {k.name: k.candidates[0] for k in space.speed_knobs}


def _host_relief(known: Knowledge, point: Point) -> Point:
    """`point` (a quality level with the speed knobs at their lightest), or where the host is its
    wall, the same level with less offloading: the speed knobs whose lightest setting on the card is
    the heaviest on the host (Knob.host_order "reversed": layer offloading, then low_vram) one step
    up at a time, until a point the host does not rule out. The quality stage judges a level at
    the speed setting lightest on the card, which would give quality up where only the host ran
    out; this keeps the level while some offloading lets it fit. Without a RAM budget, `point`."""
    if known.ram_bytes is None:
        return point
    space = known.space
    levers = [k for k in reversed(space.speed_knobs) if k.host_order == "reversed"]
    while True:
        if not _stopped_by_host(known, point):
            return point
        lever = next((k for k in levers if k.level(point[k.name]) + 1 < len(k.candidates)), None)
        if lever is None:
            return point  # as little offloading as there is, and the host still runs out
        point = {**point, lever.name: lever.candidates[lever.level(point[lever.name]) + 1]}


def _quality_stage(space: Space, known: Knowledge, decided: list) -> tuple[Point | None, Point | None]:
    """(the next probe towards the best quality, None), or (None, the best quality values) once
    they are settled, or (None, None) when nothing fits."""
    light = _lightest_speed(space)
    quality = space.quality_knobs
    fixed: Point = {}
    for i, knob in enumerate(quality):
        optimistic = _host_relief(known, {**fixed, **{k.name: k.desired for k in quality[i:]}, **light})
        state = _consider(known, optimistic, decided)
        if state is None:
            return optimistic, None
        if state == FIT:
            return None, {**fixed, **{k.name: k.desired for k in quality[i:]}}
        lower = {k.name: k.candidates[0] for k in quality[i + 1:]}
        top = knob.level(knob.desired)
        line = lambda level: _host_relief(known, {**fixed, knob.name: knob.candidates[level], **lower,  # noqa: E731
                                                  **light})
        lo, hi = _bounds(known, line, top)
        if hi - lo > 1:
            # The desired value with every later knob at its lightest first: the later knobs are
            # what usually broke the optimistic point. Then bisect, leaning high.
            point = _open_point(known, line, lo, hi, top if hi > top else (lo + hi + 1) // 2,
                                [*quality[i + 1:], *space.speed_knobs])
            if point is not None:
                return point, None
            # No point can settle a level left between the bounds: settled at `lo`, proven only around them.
        if lo < 0:
            return None, None  # not even the lightest value fits after the fixed ones
        fixed[knob.name] = knob.candidates[lo]
    return None, fixed


def _open_point(known: Knowledge, line, lo: int, hi: int, wanted: int, later) -> Point | None:
    """The point that settles the level nearest `wanted` strictly between `lo` and `hi` (the
    higher first): the level's point on the line, or where that one is excluded a stand-in for it
    (_level_stand_in); None when no level there can be settled."""
    for level in sorted(range(lo + 1, hi), key=lambda level: (abs(level - wanted), -level)):
        point = line(level)
        if known.state(point) != EXCLUDED:
            return point
        stand_in = _level_stand_in(known, point, later)
        if stand_in is not None:
            return stand_in
    return None


def _level_stand_in(known: Knowledge, excluded: Point, later) -> Point | None:
    """A point that settles the level of `excluded` (a level with every later knob at its
    lightest, whose probes failed twice): `excluded` with one of the `later` knobs raised (the
    later quality knobs in priority order, up to their desired values, then the speed knobs), the
    first knob and its lowest step that is neither excluded nor known to fail. If it fits, the
    level fits (dominance: the excluded point is lighter), which is what a failed probe cannot
    say. None when every such point is excluded or fails: the level stays unknown."""
    for knob in later:
        top = knob.level(knob.desired) if knob.role == "quality" else len(knob.candidates) - 1
        for level in range(1, top + 1):
            candidate = {**excluded, knob.name: knob.candidates[level]}
            state = known.state(candidate)
            if state is None:
                return candidate
            if state == NOFIT:
                break  # heavier steps of this knob fail too: try the next knob
    return None


def _stopped_by_host(known: Knowledge, point: Point) -> bool:
    """Whether `point` is known not to fit only because the host runs out (a host failure at a
    point it holds at least as much host memory as)."""
    state, decider = known.decider(point)
    return state == NOFIT and decider is not None and decider.wall_reason == HOST_MEMORY


def _bounds(known: Knowledge, line, top: int, knob=None) -> tuple[int, int]:
    """(highest level known to fit or -1, lowest level above it known not to fit or top + 1).

    On a line of `knob` whose levels weigh the other way on the host (layer offloading: the
    lightest on the card holds the most host memory), a level the host stops bounds nothing
    above it: the levels above hold less host memory, and may fit."""
    states = [known.state(line(level)) for level in range(top + 1)]
    reversed_on_host = knob is not None and knob.host_order == "reversed" and known.ram_bytes is not None
    lo = max((level for level, s in enumerate(states) if s == FIT), default=-1)
    hi = min((level for level, s in enumerate(states) if s == NOFIT and level > lo
              and not (reversed_on_host and _stopped_by_host(known, line(level)))), default=top + 1)
    return lo, hi


def _speed_stage(space: Space, known: Knowledge, quality: Point, decided: list) -> Point | None:
    """Escalate the speed knobs at the best quality; probe each maximal point for its speed."""
    speed = space.speed_knobs
    if not speed:
        return None
    chain, switches = _speed_lines(space)
    maximal: list[Point] = []
    for setting in _switch_settings(switches):
        base = {**quality, **setting}
        line = lambda level, s=base: {**s, chain.name: chain.candidates[level]}  # noqa: E731
        lo, hi = _bounds(known, line, len(chain.candidates) - 1, chain)
        # One step at a time, as the seeds escalate; over an excluded step to the next (a fit there
        # shows the excluded one fits too), and over a step the host stops (more offloading than the
        # host holds: the next steps offload less).
        up = next((level for level in range(lo + 1, hi) if known.state(line(level)) not in (EXCLUDED, NOFIT)), None)
        if up is not None:
            step = line(up)
            if _consider(known, step, decided) is None:
                return step
        elif lo >= 0:
            maximal.append(line(lo))  # as far as it is proven (every step up excluded, or none left)
    for point in maximal:
        surely_slower = any(other != point and space.heavier_or_equal(other, point) for other in maximal)
        if not surely_slower and not any(r.verdict == FIT and not r.extra.get("predicted")
                                         for r in known.probed(point)):
            return point  # fits by dominance (or by a prediction), but its speed is not measured yet
    return None


def _speed_lines(space: Space):
    """The speed knob worth climbing (batch: the most levels), and the on/off switches."""
    chain = max(space.speed_knobs, key=lambda k: len(k.candidates))
    return chain, [k for k in space.speed_knobs if k is not chain]


def _switch_settings(switches: list) -> list[Point]:
    """Settings of the on/off speed knobs: the lightest first, then one raised at a time in
    escalation order, then two, ...: never two risky changes before each alone."""
    settings = []
    for levels in itertools.product(*(range(len(k.candidates)) for k in switches)):
        settings.append((sum(levels), [-lvl for lvl in levels],
                         {k.name: k.candidates[lvl] for k, lvl in zip(switches, levels)}))
    return [s for *_, s in sorted(settings, key=lambda t: (t[0], t[1]))]


# Two speeds closer than this share, or than the probes' own timing noise up to SPEED_NOISE_CAP,
# are a tie: a tie never gives up more than the cap's share of speed for memory.
SPEED_NOISE_FLOOR = 0.03
SPEED_NOISE_CAP = 0.10


def best(space: Space, known: Knowledge) -> Result | None:
    """The highest-quality point that fits; among equals the fewest seconds per sample, and
    among speeds within the timings' noise the one with the least layer offloading, then the most
    memory to spare.

    On a busy machine one probe's timing can be off by more than two settings differ; a tie
    broken by memory keeps the answer from resting on that noise, and spare memory is what a
    long run needs when something else takes a share of the card.
    """
    fits = known.fits()
    if not fits:
        return None
    top = max(space.quality_key(r.point) for r in fits)
    equals = [r for r in fits if space.quality_key(r.point) == top]
    fastest = min(equals, key=_seconds)
    if fastest.seconds_per_sample is None:
        return fastest
    ties = [r for r in equals if r.seconds_per_sample is not None
            and r.seconds_per_sample <= fastest.seconds_per_sample * (1 + _noise(fastest, r))]
    return min(ties, key=lambda r: (-_offloading_level(space, r.point),
                                    r.peak_bytes if r.peak_bytes is not None else math.inf, _seconds(r)))


def best_tight(space: Space, known: Knowledge, budget_bytes: int | None,
               at_least: Point | None = None) -> Result | None:
    """The highest-quality result that ran under `budget_bytes` but past the limit (tight, in
    verdict.py's words: never picked, unless the margin is 0), the lowest peak among equals; with
    `at_least`, only one of at least that point's quality (the winner's: what the margin cost).
    None when there is none. A point the host stops (past --ram) is not tight: no margin lets it fit."""
    if not budget_bytes:
        return None
    tight = [r for r in known.results
             if r.status == "ok" and r.verdict != FIT and r.peak_bytes is not None and r.peak_bytes <= budget_bytes
             and not r.host_failed_phases]
    if at_least is not None:
        floor = space.quality_key(at_least)
        tight = [r for r in tight if space.quality_key(r.point) >= floor]
    return max(tight, key=lambda r: (space.quality_key(r.point), -r.peak_bytes), default=None)


def _offloading_level(space: Space, point: Point) -> int:
    """How little a point offloads (the layer_offloading knob's level; 0 without the knob). Among
    ties the least offloading wins before the most memory to spare: on a card every offloaded layer
    crosses from host memory at each step, a cost the sim meter's timing does not show."""
    knob = space.by_name.get("layer_offloading")
    return knob.level(point[knob.name]) if knob else 0


def _seconds(result: Result) -> float:
    return result.seconds_per_sample if result.seconds_per_sample is not None else math.inf


def _noise(*results: Result) -> float:
    return min(SPEED_NOISE_CAP, max([SPEED_NOISE_FLOOR, *(r.extra.get("timing_noise") or 0.0 for r in results)]))


# -- planning on estimates ---------------------------------------------------------------------
@dataclass
class Guide:
    """Estimated peaks per phase, and how far to trust them: the estimate-guided plan's input.

    `phases(point)` gives a point's estimated peak per phase (or None: no estimate); `band`, the
    estimate's relative error as calibration measured it. A real peak is taken to lie within
    `band` of its estimate either way, until a probe shows otherwise: then the band widens to
    WIDEN times the largest error seen (`band_for`), and every prediction is made again.
    """

    phases: Any  # Callable[[Point], dict[str, int] | None]
    band: float

    WIDEN = 1.5

    def __post_init__(self):
        if not 0 <= self.band < 1:
            raise ValueError(f"the estimate's error band must be in [0, 1) but got {self.band}")

    def error(self, result: Result) -> float | None:
        """How far a probe's peaks were from their estimates (relative), or None if it says nothing."""
        estimated = self.phases(result.point)
        if not estimated or result.status not in ("ok", "oom"):
            return None
        errors = [abs(peak / estimated[phase] - 1) for phase, peak in result.phases.items()
                  if estimated.get(phase) and (result.status == "ok" or phase != result.phase)]
        budget = result.extra.get("budget_bytes")
        if result.status == "oom" and budget and estimated.get(result.phase):
            errors.append(max(0.0, budget / estimated[result.phase] - 1))  # it ran out above the budget
        return max(errors, default=None)

    def disagreement(self, result: Result) -> dict[str, Any]:
        """A probe against its estimate, as trial user attributes: the relative error, and
        whether it passed the band (each such disagreement widens the band)."""
        error = self.error(result)
        if error is None:
            return {}
        return {"estimate_error": round(error, 4), "estimate_disagrees": error > self.band,
                "estimated_phases": self.phases(result.point)}

    def band_for(self, known: Knowledge) -> float:
        """The band, widened past the largest disagreement a probe has shown."""
        worst = max((e for e in map(self.error, known.results) if e is not None), default=0.0)
        return self.band if worst <= self.band else self.WIDEN * worst

    def predict(self, space: Space, point: Point, limit: int, band: float) -> Result | None:
        """A prediction the plan may take as a result, or None when the estimate cannot decide.

        Fits: every phase's estimate, raised by the band, under the limit. Does not: some phase's
        estimate, lowered by the band, over it (that phase is where it would run out). The peaks
        recorded are the raised ones, so a phase that witnesses a fit is one that surely fits.
        """
        estimated = self.phases(point)
        if not estimated:
            return None
        high = {phase: int(estimated[phase] * (1 + band)) for phase in space.phases_run(point) if phase in estimated}
        extra = {"predicted": True, "purpose": "predicted"}
        if max(high.values()) <= limit:
            return Result(trial=-1, point=point, status="ok", peak_bytes=max(high.values()), phases=high, extra=extra)
        over = next((p for p in high if estimated[p] * (1 - band) > limit), None)
        if over is None:
            return None
        return Result(trial=-1, point=point, status="oom", phase=over, peak_bytes=max(high.values()), phases=high,
                      extra=extra)


def plan_guided(space: Space, known: Knowledge, guide: Guide) -> Step:
    """The next point to probe when estimates decide what they can: `plan` on what the probes
    found plus the predictions, and a real probe only where the estimate cannot decide.

    Each point the plan asks for is predicted first (Guide.predict); a prediction joins the
    plan's knowledge as a result and the plan goes on. A probe is asked for: where the estimate
    is within its band of the limit (a speed setting, at the best quality, with the
    confirmation's steps: if it fits it may be the winner); for the seconds per sample of a speed
    setting predicted to fit (also with the confirmation's steps, so that the fastest is
    confirmed by its own probe); the confirmation; and the proof of the winner, each quality knob's next level up
    (as `explain` names it) shown not to fit by a probe, or by dominance from one. Pure, like
    `plan`: the predictions are made again from `known` each time.

    Where the band leaves a rollback or quality point undecided, the probe goes where the
    estimate itself, read without its band, puts the answer (_likely_step): the likely winner's
    proof first, then its confirmation. A bisection through points near the limit then costs the
    probes that prove its answer, not one per level it passes.
    """
    band = guide.band_for(known)
    view = _copy(space, known)
    while True:
        step = plan(space, view)
        if step.point is None:
            return _proof_step(space, known, view)
        timing = step.purpose == "speed" and view.state(step.point) == FIT
        if step.purpose == "confirm" or timing:
            return Step(step.point, "confirm", CONFIRM_FACTOR)
        predicted = guide.predict(space, step.point, known.limit_bytes, band)
        if predicted is None or _contradicted(space, known, predicted):
            if step.purpose == "speed":  # at the best quality: if it fits, it may be the winner
                return Step(step.point, "confirm", CONFIRM_FACTOR)
            return _likely_step(space, known, view, guide) or Step(step.point, step.purpose)
        view.add(predicted)


def _copy(space: Space, known: Knowledge) -> Knowledge:
    copy = Knowledge(space, known.limit_bytes, known.ram_bytes)
    for result in known.results:
        copy.add(result)
    return copy


def _likely_step(space: Space, known: Knowledge, view: Knowledge, guide: Guide) -> Step | None:
    """The probe that settles most when the band cannot decide: the first step of the likely
    winner's proof still to probe, else its confirmation; None when the estimate cannot name one
    or both are done.

    The likely winner is where the plan ends when every point it asks for and the band leaves
    undecided is taken as its estimate says, without the band (_likely_view). Only which point to
    probe rests on that reading: what the search concludes rests on probes and on predictions
    outside the band, as everywhere in the guided plan. The proof (each quality knob's next level
    up shown not to fit) is what the bisection would have ended on; it comes before the
    confirmation because a level up that fits after all changes the likely winner, and a
    confirmation made before it would be spent on a point that is not the answer. If the likely
    winner does not fit, that probe too is a result the next reading starts from.
    """
    likely, winner = _likely_view(space, view, guide)
    if winner is None:
        return None
    proof = _unproven_level_up(space, known, likely, winner)
    if proof is not None:
        return Step(proof, "proof")
    return Step(winner, "confirm", CONFIRM_FACTOR) if not known.confirmed(winner) else None


def _likely_view(space: Space, view: Knowledge, guide: Guide) -> tuple[Knowledge, Point | None]:
    """`view` plus the estimate, read without its band, of each point the plan asks for, until it
    asks for a measurement: the point it asks to confirm or to time (speed is not estimated) is
    the likely winner. None when no estimate reads an answer (none, or one a probe disproves)."""
    likely = _copy(space, view)
    while True:
        step = plan(space, likely)
        if step.point is None:
            winner = best(space, likely)
            return likely, winner.point if winner is not None else None
        if step.purpose == "confirm" or (step.purpose == "speed" and likely.state(step.point) == FIT):
            return likely, step.point
        guess = _likely_reading(space, view, guide, step.point)
        if guess is None:
            return likely, None
        likely.add(guess)


def _likely_reading(space: Space, view: Knowledge, guide: Guide, point: Point) -> Result | None:
    """`point` as its estimate says without the band, except where a probe has spoken: a phase
    that ran under the limit at a point at least as heavy there fits, whatever its estimate
    (a reading never overrules a measurement). None without an estimate."""
    estimated = guide.phases(point)
    if not estimated:
        return None
    limit = view.limit_bytes
    phases = {phase: estimated[phase] for phase in space.phases_run(point) if phase in estimated}
    for phase in phases:
        if phases[phase] > limit and _contradicted(space, view, Result(-1, point, "oom", phase=phase)):
            phases[phase] = limit
    over = next((phase for phase, peak in phases.items() if peak > limit), None)
    return Result(trial=-1, point=point, status="ok" if over is None else "oom", phase=over,
                  peak_bytes=max(phases.values()), phases=phases, extra={"predicted": True, "purpose": "likely"})


def _contradicted(space: Space, known: Knowledge, predicted: Result) -> bool:
    """A predicted failure that a probe already disproves: a point at least as heavy in that
    phase fit. The probe wins (a prediction never overrules a measurement): probe this one."""
    return predicted.status == "oom" and any(
        r.verdict == FIT and space.heavier_or_equal(r.point, predicted.point, predicted.phase) for r in known.results)


def _proof_step(space: Space, known: Knowledge, view: Knowledge) -> Step:
    """A probe of the winner's next level up on a quality knob not yet ruled out by a probe; with
    no winner, of the lightest point (that nothing fits is an answer too, and wants its proof)."""
    winner = best(space, view)
    if winner is None:
        lightest = space.lightest()
        return Step(None) if known.state(lightest) in (NOFIT, EXCLUDED) else Step(lightest, "proof")
    up = _unproven_level_up(space, known, view, winner.point)
    return Step(up, "proof") if up is not None else Step(None)


def _unproven_level_up(space: Space, known: Knowledge, view: Knowledge, winner: Point) -> Point | None:
    """The first quality knob `winner` gives up (in `view`) whose next level up no probe in
    `known` rules out or has excluded, as that point; None when every one is."""
    for row in explain(space, view, winner):
        knob = space.by_name[row["knob"]]
        if knob.role != "quality" or row["verdict"] != "given up":
            continue
        up = _next_up(space, winner, knob)
        if known.state(up) not in (NOFIT, EXCLUDED):  # an excluded point is not probed a third time
            return up
    return None


def _next_up(space: Space, winner: Point, knob) -> Point:
    """The winner with `knob` one level up and every later knob at its lightest: what rules out
    that level whatever the later knobs are (see explain)."""
    index = space.knobs.index(knob)
    later = {k.name: k.candidates[0] for k in space.knobs[index + 1:]}
    return {**winner, **later, knob.name: knob.candidates[knob.level(winner[knob.name]) + 1]}


# -- driving the plan ---------------------------------------------------------------------
def drive(space: Space, known: Knowledge, probe_step, probes_run: int, max_probes: int,
          on_decided=None, planner=None) -> tuple[bool, int]:
    """Plan, probe, learn until the plan is done or `max_probes` probes exist.

    `probe_step(step)` runs one probe and adds its Result to `known`; `on_decided(point,
    result)` hears of each point decided without a probe. Returns (whether the plan finished,
    the number of probes run so far).
    """
    planner = planner or plan  # e.g. lambda space, known: plan_guided(space, known, guide)
    while True:
        step = planner(space, known)
        for point, decider in step.decided:
            if on_decided is not None:
                on_decided(point, decider)
        if step.point is None:
            return True, probes_run
        if probes_run >= max_probes:
            return False, probes_run
        probe_step(step)
        probes_run += 1


# -- a probe's result as the planner reads it -------------------------------------------------
def result_from_probe(trial: int, step: Step, probe_result: ProbeResult) -> Result:
    """A probe's result line as the search's Result."""
    per_step = probe_result.get("seconds_per_step")
    batch = step.point.get("batch") or 1
    return Result(trial=trial, point=step.point, status=probe_result["status"],
                  peak_bytes=probe_result.get("peak_bytes"),
                  host_phases=dict(probe_result.get("host_phases") or {}), oom_kind=probe_result.get("oom_kind"),
                  seconds_per_sample=round(per_step / batch, 6) if per_step else None,
                  phase=probe_result.get("phase"), error=probe_result.get("error"),
                  phases=dict(probe_result.get("phases") or {}), confirm=step.purpose == "confirm",
                  extra={"seconds_per_step": per_step, "timing_noise": probe_result.get("timing_noise"),
                         "purpose": step.purpose,
                         "wall_seconds": probe_result.get("wall_seconds"),
                         "estimated": bool(probe_result.get("estimated")),
                         "budget_bytes": probe_result.get("budget_bytes")})


# -- explanation -----------------------------------------------------------------------------
def explain(space: Space, known: Knowledge, winner: Point) -> list[dict[str, Any]]:
    """Knob by knob: desired, chosen, kept / given up / gone past, and the trial that forced it.

    A quality knob below its desired value was forced down by the result that rules out the next
    level up (with every knob after it at its lightest, so nothing else is to blame); a speed
    knob lighter than desired, by the result that rules out the next heavier step at the winner.
    Where that point was excluded (its probes failed twice, not out of memory), its last failed
    trial is named: the level was given up because it could not be probed.
    """
    rows = []
    light = {k.name: k.candidates[0] for k in space.knobs}
    for index, knob in enumerate(space.knobs):
        chosen, desired = winner[knob.name], knob.desired
        level, wanted = knob.level(chosen), knob.level(desired)
        verdict = "kept" if level == wanted else ("given up" if level < wanted else "gone past")
        forced_by = None
        if level < wanted and level + 1 < len(knob.candidates):
            if knob.role == "quality":
                later = {k.name: light[k.name] for k in space.knobs[index + 1:]}
                probe_point = {**winner, **later, knob.name: knob.candidates[level + 1]}
            else:
                probe_point = {**winner, knob.name: knob.candidates[level + 1]}
            state, result = known.decider(probe_point)
            forced_by = result.trial if state in (NOFIT, EXCLUDED) and result is not None else None
        rows.append({"knob": knob.name, "role": knob.role, "desired": desired, "chosen": chosen,
                     "verdict": verdict, "forced_by": forced_by})
    return rows
