"""FitSampler: the plan as the study's Optuna sampler.

A search's study is created with it; `optuna.load_study(..., sampler=FitSampler(...))` and the
probe objective continue a search from Python and probe what the CLI would have probed; and why
the CLI's workers still create their trials themselves (`study.claim`), not through `study.ask()`.
"""

from __future__ import annotations

import json
import shutil

import optuna
import pytest

from fitfinder import space as spaces
from fitfinder.trainers import aitoolkit_job
from fitfinder.search import probe_objective
from fitfinder.search.sampler import FitSampler
from tests.conftest import DEMO, run_cli
from tests.test_demo_sequence import FIXTURE, kept

NAME = "demo_flux_lora"


def _demo(folder):
    job = aitoolkit_job.load(folder / "configs" / "demo.yaml")
    return job, spaces.build(job), int(job.settings.vram_bytes * (1 - job.settings.margin))


def test_a_search_study_names_its_sampler(demo_run):
    folder, summary = demo_run
    study = optuna.load_study(study_name=NAME, storage=summary["storage"])
    assert study.user_attrs["sampler"] == FitSampler.NAME  # what `fitfinder dashboard` shows


@pytest.mark.slow
def test_optimize_from_python_continues_a_search_as_the_cli_would(tmp_path, model_cache):
    """Three probes by the CLI (its trial cap), the rest by study.optimize with FitSampler: the
    same seven probes, in the same order, as the recorded demo, and the plan stops the study."""
    (tmp_path / "configs").mkdir()
    shutil.copy(DEMO, tmp_path / "configs" / "demo.yaml")
    started = run_cli("search", "configs/demo.yaml", "--trials", "3", "--json", cwd=tmp_path)
    assert started.returncode == 0 and json.loads(started.stdout)["probes_run"] == 3, started.stderr
    job, space, limit = _demo(tmp_path)
    storage = f"sqlite:///{tmp_path / 'studies' / (NAME + '.db')}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=NAME, storage=storage, sampler=FitSampler(space, limit))
    study.optimize(probe_objective(job, space, limit), n_trials=20)  # stops itself when the plan is done
    expected = json.loads(FIXTURE.read_text())["trials"]
    found = [{"number": t.number, "state": t.state.name, "params": t.params,
              **kept(t.user_attrs)} for t in study.trials]
    assert json.loads(json.dumps(found)) == [{k: v for k, v in t.items() if k != "quality"} for t in expected]


def test_ask_shows_a_trial_before_its_point_so_workers_claim_instead(tmp_path):
    """While Optuna samples, the new trial is already in the storage, RUNNING and without a point:
    a second worker reading then would plan that point again, and neither trial would look like
    the other's duplicate. study.claim writes the trial with its point in one transaction."""
    job = aitoolkit_job.load(DEMO)
    space = spaces.build(job)
    seen = []

    class Watching(FitSampler):
        def sample_relative(self, study, trial, search_space):
            reader = optuna.load_study(study_name="watch", storage=f"sqlite:///{tmp_path / 'w.db'}")
            seen.extend((t.state.name, t.params) for t in reader.get_trials(deepcopy=False))
            return super().sample_relative(study, trial, search_space)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="watch", storage=f"sqlite:///{tmp_path / 'w.db'}",
                                directions=["maximize", "minimize"], sampler=Watching(space, None))
    trial = study.ask()
    planned = trial.relative_params  # Optuna samples on first use, the trial already stored
    assert seen == [("RUNNING", {})]  # visible, with no point yet
    assert planned == space.desired() and study.sampler.purposes[trial.number] == "base"
