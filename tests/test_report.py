"""results/NAME/report.html, summary.json, trials.csv: written by every search and by `fitfinder report`,
and drawn by a real browser (headless Chromium) with no network and no console errors."""

import csv
import json
import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import DEMO, run_cli

pytestmark = pytest.mark.slow

NAME = "demo_flux_lora"
FIGURES = ("peak-by-knob", "fit-map", "phases", "timeline")


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("FITFINDER_REQUIRE_CHROMIUM"):
            pytest.fail("chromium is not installed, and FITFINDER_REQUIRE_CHROMIUM is set (.ci/run installs it)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); .ci/run installs it")
    profile = tmp_path / "chromium-profile"
    # No network at all: any fetch the page tried would fail and show up as a console error.
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}", "--hide-scrollbars",
            "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000"]


def _open_in_chromium(html_path, tmp_path):
    """(the DOM after the page's scripts ran, console messages, the screenshot) of the page."""
    base = _browser(tmp_path)
    url = html_path.resolve().as_uri()
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    shot = tmp_path / "report.png"
    picture = subprocess.run([*base, f"--screenshot={shot}", "--window-size=1280,3600", url],
                             capture_output=True, text=True, timeout=120)
    console = [line for line in (dom.stderr + picture.stderr).splitlines() if ":CONSOLE" in line]
    assert dom.returncode == 0 and picture.returncode == 0, dom.stderr[-2000:] + picture.stderr[-2000:]
    return dom.stdout, console, shot


def _drawn_figures(dom: str) -> set[str]:
    """The figure divs plotly drew into: it marks them js-plotly-plot and fills them with SVG."""
    drawn = set()
    for div_id in FIGURES:
        match = re.search(rf'<div id="{div_id}"[^>]*class="[^"]*js-plotly-plot[^"]*"', dom)
        start = dom.find(f'<div id="{div_id}"')
        if match and '<svg class="main-svg"' in dom[start:start + 200000]:
            drawn.add(div_id)
    return drawn


def _assert_not_blank(shot) -> None:
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    raw = image.resize((image.width // 4, image.height // 4)).tobytes()
    pixels = list(zip(raw[0::3], raw[1::3], raw[2::3]))
    inked = sum(1 for p in pixels if min(p) < 235) / len(pixels)
    green = sum(1 for r, g, b in pixels if g > 120 and r < 110 and b < 110)  # fit markers and bars
    assert inked > 0.04 and len(set(pixels)) > 100, f"screenshot looks blank: {inked:.1%} inked"
    assert green > 20, "no green (fit) marks drawn in the screenshot"


def _assert_self_contained(page: str) -> None:
    assert not re.search(r"<script[^>]+src=", page), "the page loads a script from elsewhere"
    assert not re.search(r"<link[^>]+href=", page), "the page loads a stylesheet from elsewhere"
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js inlined, not linked


# -- the demo's report ------------------------------------------------------------------------------
def test_search_writes_report_summary_and_trials(demo_run):
    folder, summary = demo_run
    results = folder / "results" / NAME
    page = (results / "report.html").read_text(encoding="utf-8")
    _assert_self_contained(page)
    for div_id in FIGURES:
        assert f'id="{div_id}"' in page
    for text in ("What was kept and what was given up", "given up", "kept", "Peak memory against each knob",
                 "Where the wall is", "Timeline of the probes", "winner against base",
                 "Fits: the best that fits is",  # the verdict's words, as every command says them
                 "≤#3 fits because trial 3 was at least as heavy and fit", "? is not known"):  # the cells' legend
        assert text in page
    assert summary["verdict"] == "fits"

    written = json.loads((results / "summary.json").read_text())
    assert {k: written[k] for k in summary} == summary  # the search's JSON summary, as printed
    rows = {row["knob"]: row for row in written["explanation"]}
    assert rows["rank"] == {"knob": "rank", "role": "quality", "desired": 32, "chosen": summary["best"]["rank"],
                            "verdict": "given up", "forced_by": rows["rank"]["forced_by"]}
    assert rows["buckets"]["verdict"] == "kept"
    assert rows["rank"]["forced_by"] is not None
    phases = written["phases"]
    assert phases["base"]["trial"] == 0 and phases["base"]["status"] == "oom"
    assert phases["winner"]["point"] == summary["best"]
    assert phases["winner"]["phases"]["train"] == summary["peak_bytes"]
    assert max(phases["base"]["phases"].values()) > summary["budget_bytes"]
    with open(results / "trials.csv") as handle:
        assert len(list(csv.DictReader(handle))) == summary["trials"]


def test_report_draws_in_headless_chromium(demo_run, tmp_path):
    folder, _ = demo_run
    dom, console, shot = _open_in_chromium(folder / "results" / NAME / "report.html", tmp_path)
    assert console == [], "console messages:\n" + "\n".join(console)
    assert _drawn_figures(dom) == set(FIGURES)
    _assert_not_blank(shot)


def test_report_command_rebuilds_the_same_summary_from_the_study(demo_run, tmp_path):
    folder, summary = demo_run
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("probes"))
    (copy / "results" / NAME / "report.html").unlink()
    before = json.loads((copy / "results" / NAME / "summary.json").read_text())

    done = run_cli("report", NAME, "--json", cwd=copy)
    assert done.returncode == 0, done.stderr
    after = json.loads((copy / "results" / NAME / "summary.json").read_text())
    assert {k: v for k, v in after.items() if k != "storage"} == {k: v for k, v in before.items() if k != "storage"}
    assert (copy / "results" / NAME / "report.html").stat().st_size > 1_000_000
    payload = json.loads(done.stdout)
    assert payload["best"] == summary["best"] and payload["report"].endswith("report.html")


# -- studies that are not the happy path -------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_studies(tmp_path_factory, model_cache):
    """Two real, short searches: nothing fits (an OOM and a crashed probe), and a base that fits
    (one probe, and its confirmation)."""
    runs = {}
    for label, args, env in (
        ("none", ["--trials", "2"], {"FITFINDER_PROBE_FAULT": "1:abort"}),
        ("single", ["--trials", "2", "--vram", "128MiB"], {}),
    ):
        folder = tmp_path_factory.mktemp(f"odd-{label}")
        (folder / "configs").mkdir()
        shutil.copy(DEMO, folder / "configs" / "demo.yaml")
        done = run_cli("search", "configs/demo.yaml", "--json", *args, cwd=folder, **env)
        runs[label] = (folder, done)
    return runs


def test_no_fit_with_a_crashed_probe_still_gets_a_report(odd_studies, tmp_path):
    folder, done = odd_studies["none"]
    assert done.returncode == 1, done.stderr
    assert "report: results/demo_flux_lora/report.html" in done.stderr
    written = json.loads((folder / "results" / NAME / "summary.json").read_text())
    assert written["status"] == "none" and written["explanation"] == [] and written["phases"]["winner"] is None
    page = (folder / "results" / NAME / "report.html").read_text(encoding="utf-8")
    assert "Does not fit: nothing that was probed fits" in page and "SIGABRT" in page  # the crash, with its reason
    assert written["verdict"] == "does not fit"
    dom, console, shot = _open_in_chromium(folder / "results" / NAME / "report.html", tmp_path)
    assert console == [], "console messages:\n" + "\n".join(console)
    assert _drawn_figures(dom) == set(FIGURES)


def test_a_single_probe_that_fits(odd_studies, tmp_path):
    folder, done = odd_studies["single"]
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["trials"] == 2 and summary["proven"]  # the base, then its longer confirmation
    written = json.loads((folder / "results" / NAME / "summary.json").read_text())
    winner, base = written["phases"]["winner"], written["phases"]["base"]
    assert winner["point"] == base["point"] and winner["phases"] == base["phases"]  # the base, confirmed
    assert {row["verdict"] for row in written["explanation"]} == {"kept"}
    page = (folder / "results" / NAME / "report.html").read_text(encoding="utf-8")
    assert "Nothing changed: the base file fits as written." in page
    dom, console, shot = _open_in_chromium(folder / "results" / NAME / "report.html", tmp_path)
    assert console == [], "console messages:\n" + "\n".join(console)
    assert _drawn_figures(dom) == set(FIGURES)
    _assert_not_blank(shot)


# -- bad input ----------------------------------------------------------------------------------------
def test_report_of_an_unknown_study_is_one_line(demo_run, tmp_path):
    folder, _ = demo_run
    done = run_cli("report", "nope", cwd=folder)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "fitfinder: error: no study 'nope' in studies/; studies there: demo_flux_lora"
    empty = run_cli("report", "nope", cwd=tmp_path)
    assert empty.returncode == 2 and "run `fitfinder search JOB.yaml` first" in empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1


def test_report_without_the_job_file_says_how_to_give_it(demo_run, tmp_path):
    folder, _ = demo_run
    shutil.copytree(folder / "studies", tmp_path / "studies")
    done = run_cli("report", NAME, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "was made from 'configs/demo.yaml', which is not here" in done.stderr and "--job PATH" in done.stderr
    with_job = run_cli("report", NAME, "--job", str(folder / "configs" / "demo.yaml"), cwd=tmp_path)
    assert with_job.returncode == 0, with_job.stderr
    assert (tmp_path / "results" / NAME / "report.html").exists()
