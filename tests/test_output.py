"""The output object: a live table of trials on a terminal, plain `trial N` lines when piped, JSON apart."""

import io
import json
import re

from fitfinder import jobconfig, space as spaces
from fitfinder.results.output import Output
from fitfinder.search import Knowledge, Result
from tests.conftest import DEMO

BUDGET = 6_081_740  # the demo's 5.8 MiB
LIMIT = int(BUDGET * 0.95)


def _results():
    space = spaces.build(jobconfig.load(DEMO))
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
        "trial   3  quality   buckets=[256,384,512] rank=16 gc=on batch=1  ok  "
        "5.31 MiB / 5.8 MiB [#########-] 92%  0.078 s/step",
        "trial   1  rollback  buckets=[256,384,512] rank=32 gc=on batch=1  over margin  "
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
    assert re.search(r"3\s+quality\s+\[256,384,512\]\s+16\s+on\s+1\s+ok\s+█{11}░ 5\.31 MiB / 5\.8 MiB 92%\s+0\.078",
                     rows[1])
    assert "oom in train" in rows[0] and "over margin" in rows[2] and rows[3].split()[6] == "error"
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
