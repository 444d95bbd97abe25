"""Shared test helpers: run the CLI the way a user does, in a scratch folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
# ../shared next to the checkout; from a git worktree (.worktrees/NAME) it is further up.
REFERENCE = next((parent / "shared" / "reference" / "configs" for parent in ROOT.parents
                  if (parent / "shared" / "reference" / "configs").is_dir()),
                 ROOT.parent / "shared" / "reference" / "configs")


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


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory) -> Path:
    """Random-weight models are saved here once per test session, never under the user's home."""
    cache = tmp_path_factory.mktemp("fitfinder-cache")
    os.environ["FITFINDER_CACHE"] = str(cache)
    return cache


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch project folder holding a copy of the demo job."""
    (tmp_path / "configs").mkdir()
    shutil.copy(DEMO, tmp_path / "configs" / "demo.yaml")
    return tmp_path


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
