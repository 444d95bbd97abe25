"""The output object: a live table of trials on a terminal, plain `trial N` lines when piped, JSON apart."""

import io
import json
import re

from fitfinder import space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.results.output import Output
from fitfinder.search import Knowledge, Result
from tests.conftest import DEMO

BUDGET = 6_081_740  # the demo's 5.8 MiB
LIMIT = int(BUDGET * 0.95)


def _results():
    space = spaces.build(aitoolkit_job.load(DEMO))
    known = Knowledge(space, LIMIT)
    oom = known.add(Result(trial=0, point=space.desired(), status="oom", peak_bytes=6_488_384, phase="train",
                           error="OutOfMemoryError: CUDA out of memory (simulated)"))
    fits = known.add(Result(trial=3, point={**space.desired(), "rank": 16, "batch": 1, "gradient_checkpointing": True},
                            status="ok", peak_bytes=5_571_328, extra={"seconds_per_step": 0.078}))
    close = known.add(Result(trial=1, point={**space.desired(), "batch": 1, "gradient_checkpointing": True},
                             status="ok", peak_bytes=6_003_456, extra={"seconds_per_step": 0.077}))
    crash = known.add(Result(trial=4, point=space.lightest(), status="error", error="probe died with SIGABRT"))
    return space, [oom, fits, close, crash]


def test_plain_lines_when_piped():
    space, results = _results()
    stream = io.StringIO()
    out = Output(stream=stream)  # a StringIO is no terminal
    assert not out.fancy
    with out.progress(40, "probing"):
        for result, purpose in zip(results, ["base", "quality", "rollback", ""]):
            out.trial(space, result, BUDGET, purpose)
            out.advance()
    assert stream.getvalue().splitlines() == [
        "trial   0  base      buckets=[256,384,512] rank=32 gc=off batch=4  oom in train  "
        "6.19 MiB / 5.8 MiB [##########] 107%",
        "trial   3  quality   buckets=[256,384,512] rank=16 gc=on batch=1  fits  "
        "5.31 MiB / 5.8 MiB [#########-] 92%  0.078 s/step",
        "trial   1  rollback  buckets=[256,384,512] rank=32 gc=on batch=1  tight  "
        "5.73 MiB / 5.8 MiB [##########] 99%  0.077 s/step",
        "trial   4  buckets=[256] rank=4 gc=on batch=1  error  -",
        "           probe died with SIGABRT",
    ]


def test_live_table_on_a_terminal_leaves_the_whole_table_printed(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # a wide terminal
    space, results = _results()
    stream = io.StringIO()
    out = Output(stream=stream, fancy=True)
    with out.progress(40, "probing"):
        out.note("study demo: 4 knobs")  # lines still print above the table
        for result, purpose in zip(results, ["base", "quality", "rollback", "speed"]):
            out.trial(space, result, BUDGET, purpose)
            out.advance()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())  # colours and cursor moves
    final = text[text.rindex("trial  stage"):]  # the table printed when the live display ended
    header, *rows = [line.rstrip() for line in final.splitlines() if line.strip()]
    assert header.split() == ["trial", "stage", "buckets", "rank", "gc", "batch", "status", "peak",
                              "/", "budget", "s/step"]
    assert [row.split()[:2] for row in rows] == [["0", "base"], ["3", "quality"], ["1", "rollback"], ["4", "speed"]]
    assert re.search(r"3\s+quality\s+\[256,384,512\]\s+16\s+on\s+1\s+fits\s+█{11}░ 5\.31 MiB / 5\.8 MiB 92%\s+0\.078",
                     rows[1])
    assert "oom in train" in rows[0] and "tight" in rows[2] and rows[3].split()[6] == "error"
    assert "fitfinder: study demo: 4 knobs" in text
    assert "probing: 4 of at most 40 probes" in text  # the footer under the live table


def test_json_mode_keeps_stdout_for_the_answer(capsys):
    space, results = _results()
    out = Output(json_mode=True)
    out.trial(space, results[1], BUDGET)
    out.result({"status": "fit"})
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"status": "fit"}
    assert captured.err.startswith("trial   3  buckets=[256,384,512] rank=16")  # no stage given


# -- one verdict everywhere (verdict.py) ---------------------------------------------------------------
def test_the_three_verdicts_their_exit_codes_and_lines():
    from fitfinder import verdict

    budget, limit = 100 * 2**20, int(100 * 2**20 * 0.95)
    assert [verdict.judge(peak, budget, 0.05) for peak in (limit, limit + 1, budget, budget + 1)] == [
        "fits", "tight", "tight", "does not fit"]
    assert verdict.judge(budget, budget, 0.0) == "fits"  # --margin 0: nothing is tight
    assert verdict.judge(None, budget, 0.05) is None and verdict.judge(budget, None, 0.05) is None
    assert [verdict.exit_code(v) for v in ("fits", "tight", "does not fit", None)] == [0, 0, 1, 0]
    # a search's probe: the planner's fit, tight under the budget, an OOM or over the budget does not fit
    assert verdict.of_probe("ok", True, limit, budget) == "fits"
    assert verdict.of_probe("ok", False, budget, budget) == "tight"
    assert verdict.of_probe("ok", False, budget + 1, budget) == "does not fit"
    assert verdict.of_probe("oom", False, None, budget) == "does not fit"
    assert verdict.of_probe("error", None, None, budget) is None

    tight = verdict.Verdict.of(98 * 2**20, budget, 0.05, wall=verdict.Wall("load", 98 * 2**20, "T5 is quantized there"),
                               would_take=verdict.WouldTake(8, 98 * 2**20, margin_at_most=0.02))
    assert tight.lines() == [
        "tight: peak 98 MiB of 100 MiB, 3 MiB past the limit 95 MiB: the budget less the 5% margin; "
        "warning: it may run out, and a search picks it only with --margin 0",
        "the wall: load, 98 MiB",
        "  T5 is quantized there",
        "with --margin 0.02 or less it fits this card",
        "the smallest card that takes it: 8 GB, as written (peak 98 MiB)",
    ]
    found = tight.as_json()
    assert (found["verdict"], found["fits"], found["limit_bytes"], tight.exit_code) == ("tight", True, limit, 0)
    assert found["wall"] == {"phase": "load", "peak_bytes": 98 * 2**20, "why": "T5 is quantized there", "point": None,
                             "stops": True, "owners": None}
    assert found["would_take"]["card_gb"] == 8 and found["would_take"]["margin_at_most"] == 0.02
    assert verdict.smallest_card(int(20.5 * 2**30), 0.05) == 24  # 20 GB holds 19 GiB under its limit
    assert verdict.smallest_card(200 * 2**30, 0.05) is None
