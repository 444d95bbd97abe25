"""`fitfinder tiers`: the best point predicted per card size, its JSON, its job files, its section
in report.html; and the per-phase memory of estimates (estimate.Estimator) that makes it cheap."""

import json

import pytest

from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate
from fitfinder.results import report
from fitfinder.search import tiers
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import DEMO, EXAMPLES, assert_one_clean_line, run_cli

MiB = 2**20


@pytest.fixture(scope="module")
def demo_tiers(tmp_path_factory):
    """The demo at two card sizes on tensor bytes (its budget is MiB, not GiB), with --write."""
    where = tmp_path_factory.mktemp("tiers")
    before = DEMO.read_text()
    done = run_cli("tiers", str(DEMO), "--cards", "0.1,0.012", "--no-overhead", "--write", cwd=where)
    assert DEMO.read_text() == before  # the input is never written
    return where, done


def test_the_table_says_per_card_what_differs_and_what_was_given_up(demo_tiers):
    _, done = demo_tiers
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("card")))
    assert lines[header:header + 3] == [
        "card       peak      differs from the job file  given up",
        "0.012 GiB  11.6 MiB  rank=8 gc=on batch=1       rank",
        "0.1 GiB    66.5 MiB  the job as written         nothing",
    ]
    assert lines[-1] == "wrote results/demo_flux_lora/tiers.json and 2 job files in results/demo_flux_lora/tiers"


def test_tiers_json_and_one_job_file_per_tier(demo_tiers):
    where, _ = demo_tiers
    found = json.loads((where / "results/demo_flux_lora/tiers.json").read_text())
    small, large = found["tiers"]
    assert (small["card_gib"], small["budget_bytes"], small["fits"]) == (0.012, int(0.012 * 2**30), True)
    assert small["point"] == {"buckets": "256,384,512", "rank": 8, "gradient_checkpointing": True, "batch": 1}
    assert small["given_up"] == ["rank"] and small["differs"] == "rank=8 gc=on batch=1"
    assert small["peak_bytes"] <= small["limit_bytes"] == int(small["budget_bytes"] * 0.95)
    assert large["changed"] == [] and large["point"]["rank"] == 32 and large["given_up"] == []
    assert found["estimates"] + found["recalled"] >= found["estimates"] > 0
    written = aitoolkit_job.load(where / "results/demo_flux_lora/tiers/0.012gib.yaml")
    assert written.get("network.linear") == 8 and written.get("train.gradient_checkpointing") is True
    assert written.get("train.batch_size") == 1 and written.get("train.gradient_accumulation_steps") == 4
    text = (where / "results/demo_flux_lora/tiers/0.012gib.yaml").read_text()
    assert text.startswith("# fitfinder tiers: the best configuration predicted to fit a 0.012 GiB card")
    assert "#   network.linear: 32 -> 8" in text


def test_report_html_shows_the_tiers_beside_it(demo_tiers):
    where, _ = demo_tiers
    section = report._tiers_section(tiers.read_json(where / "results/demo_flux_lora"))
    assert "<h2>Card sizes: the best configuration predicted to fit each</h2>" in section
    assert "<tr><td>0.012 GiB</td><td>11.6 MiB</td><td>rank=8 gc=on batch=1</td><td>rank</td></tr>" in section


@pytest.mark.parametrize("cards, expected", [
    ("8,lots", "--cards: 'lots' is not a size in GiB"),
    ("0,8", "--cards: sizes in GiB must be between 1/1024 (1 MiB) and 1048576 (1 PiB), got 0"),
    (",", "--cards: give at least one card size in GiB"),
])
def test_bad_cards_are_one_line_and_exit_2(tmp_path, cards, expected):
    assert_one_clean_line(run_cli("tiers", str(DEMO), "--cards", cards, cwd=tmp_path), expected)


def test_cards_are_sorted_and_deduplicated():
    assert tiers.parse_cards("24, 8,24GiB,12GB") == (8.0, 12.0, 24.0)


class _ByRequest:
    """A stand-in estimate: each phase's peak is a sum over the request's fields that phase reads."""

    def __init__(self):
        self.requests = []

    def run(self, request, log_path=None):
        self.requests.append(request)
        rank, batch, gc = request["rank"], request["batch_size"], request["gradient_checkpointing"]
        peaks = {"load": 100 + rank, "text_encoder": 90 + rank + batch, "latents": 10 + batch, "sample": 50 + rank,
                 "train": 200 + rank + 40 * batch + (0 if gc else 60), "last_sample": 50 + rank}
        stats = {p: {"peak_live": v, "peak_allocated": v, "peak_reserved": v, "seconds": 0.1} for p, v in peaks.items()}
        return {"status": "ok", "phase_stats": stats}


def test_a_point_whose_every_phase_is_known_is_recalled_not_estimated():
    job = aitoolkit_job.load(DEMO)
    runner = _ByRequest()
    estimator = estimate.Estimator(job, runner, GpuOverhead.none())
    base = estimator.space.desired()
    gc_on = {**base, "gradient_checkpointing": True}
    lower_rank = {**base, "rank": 16}
    both = {**lower_rank, "gradient_checkpointing": True}
    first, second, third = estimator.of(base), estimator.of(gc_on), estimator.of(lower_rank)
    assert estimator.runs == 3 and len(runner.requests) == 3
    # checkpointing changes only the training step, which gc_on measured at rank 32, not at 16:
    fourth = estimator.of(both)
    assert estimator.runs == 4
    again = estimator.of(gc_on)  # every phase known: nothing runs
    assert (estimator.runs, estimator.recalled) == (4, 1) and again.phases == second.phases
    assert first.phases["train"] - second.phases["train"] == 60 and fourth.phases["load"] == third.phases["load"]


GiB = 2**30


def test_nothing_fits_names_the_wall_and_the_smallest_card_that_takes_it():
    job = aitoolkit_job.load(DEMO)
    estimator = estimate.Estimator(job, _ByRequest(), GpuOverhead.none())
    cards = (256 / GiB, 400 / GiB, 2000 / GiB)  # bytes, as GiB: the stand-in's peaks are a few hundred bytes
    found = tiers.nothing_fits(job, estimator.runner, GpuOverhead.none(), estimator, 200, cards=cards)
    assert (found.verdict, found.exit_code, found.limit_bytes) == ("does not fit", 1, 190)
    # the lightest point (rank 4, batch 1, checkpointing on) trains at 200 + 4 + 40: past the limit
    assert (found.wall.phase, found.wall.peak_bytes, found.wall.why) == ("train", 244, "")
    assert found.wall.point.startswith("even at the lightest point (buckets=[256] rank=4 gc=on batch=1")
    # 256 bytes' limit (243) is under the lightest point's peak: passed over; 400 takes a point
    would = found.would_take
    assert would.card_gb == cards[1] and would.point is not None and would.peak_bytes <= int(400 * 0.95)
    assert would.differs and would.margin_at_most is None  # nothing was tight at 200
    assert found.as_json()["would_take"]["card_gb"] == cards[1]


def test_a_wall_in_the_load_says_what_ai_toolkits_loader_holds_there():
    job = aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")
    estimator = estimate.Estimator(job, _ByRequest(), GpuOverhead.none())
    wall = tiers.wall_of(job, GpuOverhead.none(), estimator, 95)  # the lightest point loads at 100 + rank 4
    assert (wall.phase, wall.peak_bytes) == ("load", 104)
    assert wall.why.startswith("text_encoder_2 (T5EncoderModel) comes onto the card whole in bf16")
    assert tiers.wall_of(job, GpuOverhead.none(), estimator, 10_000) is None  # nothing stops it there


def test_tiers_when_no_card_fits_exits_1_with_the_smallest_card_sold(tmp_path):
    done = run_cli("tiers", str(DEMO), "--cards", "0.003", "--no-overhead", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    found = json.loads(done.stdout)
    assert found["verdict"] == "does not fit" and found["tiers"][0]["verdict"] == "does not fit"
    assert found["tiers"][0]["wall"]["phase"] == "train" and found["would_take"]["card_gb"] == 8
    lines = done.stderr.splitlines()
    row = next(line for line in lines if line.startswith("0.003 GiB"))
    assert row.split(None, 3)[3].startswith("does not fit: train needs ") and row.endswith("at the lightest point")
    assert lines[-1].startswith("the smallest card that takes it: 8 GB, as written")
