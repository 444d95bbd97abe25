"""Shared test helpers: run the CLI the way a user does, in a scratch folder; tiny jobs per family."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
# The project's own job files with the settings of AI Toolkit's examples (nothing outside the checkout).
EXAMPLES = ROOT / "examples" / "aitk"

# The families every default run sweeps (the flow-matching transformer, its full fine-tune, a UNet,
# one video family and Wan 2.2's two experts, Qwen-Image's VL encoder); the other families' cases of
# a per-family sweep are marked `exhaustive`, deselected by default (pyproject's addopts) so the
# suite keeps within CI's 30 minutes, and run with `python -m pytest -n auto -m exhaustive`.
SWEPT = frozenset({"flux", "flux_full", "sd15", "wan21", "wan22", "qwen_image"})


def sweep(names, kept=SWEPT) -> list:
    """`names` as parameters, those outside `kept` marked exhaustive."""
    return [name if name in kept else pytest.param(name, marks=pytest.mark.exhaustive) for name in names]



def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is: everywhere else they are skipped, saying why."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FITFINDER_DEBUG", None)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`fitfinder ARGS` in `cwd`, as a separate process, output captured."""
    return subprocess.run([sys.executable, "-m", "fitfinder", *args], cwd=cwd, env=cli_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_clean_line(result: subprocess.CompletedProcess, expected: str) -> None:
    """Bad input: exit code 2 and one line on stderr that says what is wrong, no traceback."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory) -> Path:
    """Random-weight models are saved here once per test session, never under the user's home."""
    cache = tmp_path_factory.mktemp("fitfinder-cache")
    os.environ["FITFINDER_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, model_cache) -> tuple[Path, dict]:
    """The demo searched once per session (real probes, ~20 s): its folder and its JSON summary.
    Tests read it; a test that writes into it must only rewrite what the search wrote."""
    import json

    folder = tmp_path_factory.mktemp("demo-run")
    (folder / "configs").mkdir()
    shutil.copy(DEMO, folder / "configs" / "demo.yaml")
    done = run_cli("search", "configs/demo.yaml", "--json", cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder, json.loads(done.stdout)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch project folder holding a copy of the demo job."""
    (tmp_path / "configs").mkdir()
    shutil.copy(DEMO, tmp_path / "configs" / "demo.yaml")
    return tmp_path


# -- tiny jobs, one per family: the real part classes at toy widths, random weights ----------------
# Every family of the registry gets one: its first `model.arch` value, its tiny arch
# (archs/FAMILY-tiny.json, named "fitfinder/FAMILY-tiny"), and a job sized by whether it is video.
TINY_IMAGE = {"resolution": 256, "frames": 1, "sample": 256, "sample_frames": 1}
TINY_VIDEO = {"resolution": 64, "frames": 9, "sample": 64, "sample_frames": 5}


def tiny_sizes(family: str) -> dict:
    """Training bucket, frames, preview size and frames: fast, and every phase has work to do."""
    from fitfinder.models import FAMILIES

    return TINY_VIDEO if FAMILIES[family].video else TINY_IMAGE


TINY_JOB = """\
job: extension
config:
  name: tiny_{family}
  process:
    - type: sd_trainer
      network: {{type: lora, linear: 8, linear_alpha: 8}}
      datasets:
        - folder_path: /data/clips
          resolution: [{resolution}]
          num_frames: {frames}
          cache_latents_to_disk: true
      train: {{batch_size: 1, gradient_checkpointing: true, optimizer: adamw, lr: 0.0001, dtype: fp32}}
      model: {{name_or_path: "{name}", arch: {arch}}}
      sample: {{width: {sample}, height: {sample}, num_frames: {sample_frames}, sample_steps: 20, guidance_scale: 5}}
fitfinder: {{weights: {weights}}}
"""


def tiny_job(family: str, changes: dict | None = None, name: str | None = None, weights: str = "random",
             more_datasets: list | None = None):
    """The tiny job of a family, with `changes` ({key path: value}) applied as the search would."""
    from fitfinder.trainers import aitoolkit_job

    from fitfinder.models import FAMILIES

    text = TINY_JOB.format(family=family, arch=FAMILIES[family].arch_values[0],
                           name=name or f"fitfinder/{family}-tiny", weights=weights, **tiny_sizes(family))
    job = aitoolkit_job.loads(text, f"<tiny {family} job>")
    job.process["datasets"].extend(more_datasets or [])
    for path, value in (changes or {}).items():
        job.set(path, value)
    return job


@pytest.fixture(scope="module")
def run_tiny():
    """Probe a tiny job in a fresh process; results are kept per module (the sim meter is exact)."""
    import json

    from fitfinder import probe

    runner = probe.ProbeRunner(timeout_s=300)
    done = {}

    def run(family, changes=None, budget=None, steps=3, **job_options):
        key = json.dumps([family, changes, budget, steps, job_options], sort_keys=True)
        if key not in done:
            done[key] = runner.run(probe.request_for(tiny_job(family, changes, **job_options), steps, "sim", budget))
        return done[key]

    return run


def supports_line() -> str:
    """How errors end: the families fitfinder probes, as the registry lists them (models.FAMILIES,
    one public module per family; importing it costs no torch), so the line grows with each family added."""
    from fitfinder.models import FAMILIES

    return "it supports: " + ", ".join(FAMILIES)
