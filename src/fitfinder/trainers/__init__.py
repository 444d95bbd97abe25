"""Trainers: each trainer's file forms, defaults, knobs, request and recipe, one module per trainer.

`load(path)` reads the job a user already has, in its trainer's own form:

- an AI Toolkit job file (YAML or JSON), read by aitoolkit_job.py (its rules: aitoolkit.py);
- a shell file with kohya sd-scripts' or musubi-tuner's command line (`accelerate launch [options]
  flux_train_network.py --flag value ...`), whose `--config_file` and `--dataset_config` are read
  relative to the shell file's folder; the script names the trainer and the model;
- a kohya `--config_file` TOML, whose keys name the script where they can (`t5xxl` with `ae`:
  flux_train_network.py), else `--script NAME` does; its `dataset_config` names the dataset TOML.

The layers above ask a job's trainer through the functions here, whichever trainer it is
(`knob_specs`, `phases_run`, `effective_batch`, `probe_request`, `model_spec`, `architecture_spec`,
`full_size`, `diagnose_settings`, `lever_changes`, `assumptions`): AI Toolkit's rules are
aitoolkit.py's; a kohya job (`_kohya.KohyaJob`) answers by its trainer's module (sd_scripts.py,
musubi_tuner.py). Every job also has `write`, which writes it back in the same form with only
fitfinder's changes differing.

`aitoolkit_to_kohya` writes an AI Toolkit job as a kohya one (`fitfinder export --format kohya`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitfinder import files
from fitfinder.errors import UserError, brief
from fitfinder.trainers import _kohya, _shell, _toml, aitoolkit, aitoolkit_job, musubi_tuner, sd_scripts
from fitfinder.trainers._knob import KnobSpec
from fitfinder.trainers._kohya import KohyaJob

KOHYA = (sd_scripts, musubi_tuner)
FORMATS = ("an AI Toolkit job file (.yaml), a shell file with an sd-scripts or musubi-tuner command line (.sh), "
           "or a kohya --config_file TOML (.toml)")


def load(path: str | Path, script: str | None = None, arch: str | None = None) -> Any:
    """The job in `path`, in whichever form it is (see the module's docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml", ".json"):  # AI Toolkit's run.py takes a .json job as well
        return aitoolkit_job.load(path)
    text = _text(path)
    if suffix in (".sh", ".bash") or text.startswith("#!") or _names_a_script(text):
        return _from_shell(path, text, arch)
    if suffix == ".toml":
        return _from_toml(path, text, script, arch)
    # Any other name (none, .txt, .cfg, or a file that lies where an output goes): whichever form
    # reads it, so that the checks after the load (is it among the outputs?) still see it.
    for reader in (lambda: _from_toml(path, text, script, arch), lambda: aitoolkit_job.load(path)):
        try:
            return reader()
        except UserError:
            continue
    raise UserError(f"{path}: not a job file fitfinder reads; it reads {FORMATS}")


# -- what the layers above ask a job's trainer ----------------------------------------------------
def knob_specs(job: Any) -> list[KnobSpec]:
    """The job's knobs with more than one candidate, in its trainer's own names."""
    return job.knob_specs() if isinstance(job, KohyaJob) else aitoolkit.knob_specs(job)


def phases_run(job: Any, point: dict) -> list[str]:
    """The phases a probe of `point` runs: its trainer's previews decide which."""
    return job.phases_run(point) if isinstance(job, KohyaJob) else aitoolkit.phases_run(job, point)


def effective_batch(job: Any) -> int:
    """Samples per optimizer step, which the batch knob keeps (batch x accumulation)."""
    return job.effective_batch if isinstance(job, KohyaJob) else aitoolkit.effective_batch(job)


def diagnose_settings(job: Any) -> dict[str, Any]:
    """What diagnose's rollback reads of the job (diagnose.Settings' fields), by its trainer's defaults."""
    return job.diagnose_settings() if isinstance(job, KohyaJob) else aitoolkit.diagnose_settings(job)


def lever_changes(job: Any, lever: str) -> list[tuple[str, Any, Any]]:
    """diagnose's lever as the job's edits, (key or option, old, new), in its trainer's own names."""
    return job.lever_changes(lever) if isinstance(job, KohyaJob) else aitoolkit.lever_changes(job, lever)


def assumptions(job: Any) -> list[str]:
    """What an estimate of the job assumes or does not follow, beyond what loading it noted: AI Toolkit's
    (an adapter file not here, attention backends, compile); a kohya job's are its `notes`, made as it
    is read."""
    return [] if isinstance(job, KohyaJob) else aitoolkit.assumptions(job)


def model_spec(job: Any) -> dict[str, Any]:
    """What a probe builds the job's model from (family, architecture, weights), as its trainer finds it."""
    return job.model_spec() if isinstance(job, KohyaJob) else aitoolkit.model_spec(job)


def architecture_spec(job: Any) -> dict[str, Any]:
    """The job's model as an estimate needs it: its architecture, never its weights."""
    return job.architecture_spec() if isinstance(job, KohyaJob) else aitoolkit.architecture_spec(job)


def full_size(job: Any) -> str | None:
    """The job's model, named, when it is too large for the sim meter's real CPU training; None otherwise."""
    if isinstance(job, KohyaJob):  # its checkpoint's architecture or --arch's
        spec = job.architecture_spec()
        return None if spec["arch_name"].endswith("-tiny") else f"{spec['arch_name']} ({spec['family']})"
    return aitoolkit.full_size(job)


def probe_request(job: Any, **run: Any) -> dict:
    """The probe request of the job by its trainer's rules (`run`: steps, meter, budget_bytes, gpu,
    spec, fault, sample_steps: how the probe runs)."""
    return job.probe_request(**run) if isinstance(job, KohyaJob) else aitoolkit.probe_request(job, **run)


def _text(path: Path) -> str:
    if not path.exists():
        raise UserError(f"{path}: no such file; give the job file: {FORMATS}")
    if path.is_dir():
        raise UserError(f"{path}: is a folder; give the job file: {FORMATS}")
    if not path.is_file():
        raise UserError(f"{path}: not a regular file; give the job file: {FORMATS}")
    return _kohya.read_text(path, "job file")


def _names_a_script(text: str) -> bool:
    return any(_is_training_script(word) for word in text.split())


def _is_training_script(word: str) -> bool:
    """A kohya training script: NAME_train_network.py, sd-scripts' own train_network.py (SD 1.x),
    NAME_train.py, or musubi-tuner's module form (`-m musubi_tuner.wan_train_network`)."""
    return (word.endswith(("_train_network.py", "_train.py")) or Path(word).name == "train_network.py"
            or ".train_network" in word or word.startswith("musubi_tuner.") and "train" in word)


def script_of(name: str) -> tuple[Any, Any]:
    """(trainer module, Script) for a script's file name or module path; a known script fitfinder
    does not follow yet, or an unknown one, is one line."""
    base = Path(name.replace("musubi_tuner.", "musubi_tuner/")).name
    base = base if base.endswith(".py") else base + ".py"
    for trainer in KOHYA:
        if base in trainer.SCRIPTS:
            return trainer, trainer.SCRIPTS[base]
    for trainer in KOHYA:
        if base in trainer.TO_COME:
            raise UserError(f"{base}: a {trainer.REPO} script fitfinder does not follow yet; it follows "
                            f"{', '.join(_followed())}")
    raise UserError(f"{brief(name)}: not a training script fitfinder knows; it follows {', '.join(_followed())}")


def _followed() -> list[str]:
    return [f"{name} ({trainer.REPO})" for trainer in KOHYA for name in trainer.SCRIPTS]


def _training_command(commands: list[_shell.Command]) -> tuple[_shell.Command, int]:
    for command in commands:
        for index, word in enumerate(command.words):
            if _is_training_script(word.text) and "cache" not in word.text:
                return command, index
    raise UserError("no training command (a *_train_network.py script) in the shell file")


def _from_shell(path: Path, text: str, arch: str | None) -> KohyaJob:
    commands = _shell.commands(text, str(path))
    try:
        command, index = _training_command(commands)
    except UserError:
        raise UserError(f"{path}: no sd-scripts or musubi-tuner training command in it; fitfinder reads "
                        f"{FORMATS}") from None
    trainer, script = script_of(command.words[index].text)
    flags = _kohya.parse_flags(list(command.words[index + 1:]), trainer.options(script), str(path))
    job = KohyaJob(trainer=trainer, script=script, source=str(path), form="shell", shell_text=text,
                   command=command, script_index=index, arch=arch,
                   line_flags={name: (first + index + 1, end + index + 1, value)
                               for name, (first, end, value) in flags.items()},
                   launcher=_kohya.launcher_options(list(command.words[:index])),
                   folder_vars=_kohya.folder_variables(text))
    job.caching = _caching_commands(commands, trainer, script, str(path))
    config = job.get("config_file")
    if config:
        config_path = _kohya.resolve(job, config if str(config).endswith(".toml") else f"{config}.toml")
        if config_path is None:
            raise UserError(f"{path}: --config_file {brief(config)}: not a plain path fitfinder can read")
        _read_config(job, config_path)
    return _finish(job)


def _caching_commands(commands, trainer, script, source: str) -> list[dict]:
    found = []
    for command in commands:
        for index, word in enumerate(command.words):
            if Path(word.text).name in script.cache_scripts:
                words = [w for w in command.words[index + 1:]]
                flags = _kohya.parse_flags(words, script.cache_scripts[Path(word.text).name], source)
                dataset = flags.get("dataset_config")
                found.append({"script": Path(word.text).name, "flags": {k: v for k, (_, _, v) in flags.items()},
                              "dataset_word": words[dataset[0] + 1] if dataset and dataset[1] > dataset[0] + 1
                              else None,
                              # where each flag's words are, so a change to one is made where it stands
                              "words": words, "spans": {k: (first, end) for k, (first, end, _) in flags.items()}})
    return found


def _read_config(job: KohyaJob, config_path: Path) -> None:
    job.config_path = config_path
    job.config_text = _kohya.read_text(config_path, "config file (--config_file)")
    data = _toml.parse(job.config_text, str(config_path))
    job.config = _toml.flattened(data)
    job.config_tables = _kohya.config_tables(data)


def _from_toml(path: Path, text: str, script: str | None, arch: str | None) -> KohyaJob:
    data = _toml.parse(text, str(path))
    if isinstance(data.get("datasets"), list) and not any(k in data for k in ("network_dim", "network_module")):
        raise UserError(f"{path}: a dataset config (its [[datasets]]); give the shell file or the --config_file "
                        "TOML that names it")
    flat = _toml.flattened(data)
    name = script or next((found for trainer in KOHYA for found in [trainer.infer_script(flat)] if found), None)
    if name is None:
        raise UserError(f"{path}: read as a kohya --config_file TOML, but its keys do not say which script it is "
                        f"for; give --script NAME ({', '.join(n for t in KOHYA for n in t.SCRIPTS)}); fitfinder "
                        f"reads {FORMATS}")
    trainer, found = script_of(name)
    job = KohyaJob(trainer=trainer, script=found, source=str(path), form="toml", arch=arch)
    _read_config(job, path)
    return _finish(job)


def _finish(job: KohyaJob) -> KohyaJob:
    _kohya.load_dataset(job)
    job.trainer.check(job)
    return job


def write_job_files(job: Any, folder: str | Path, overrides: dict[str, Any] | None = None,
                    stem: str = "job") -> list[Path]:
    """The job as its trainer's own files in `folder` (the trainer probe's private folder): `overrides`
    by the trainer's option names first (max_train_steps, output_dir, sample_prompts, ...), every
    file written there and each naming the others by its path there. Returns the files written."""
    if not isinstance(job, KohyaJob):
        raise UserError("write_job_files: only kohya jobs are written this way (AI Toolkit's: JobFile.write)")
    folder = Path(folder)
    twin = job.copy()
    for key, value in (overrides or {}).items():
        twin.set(key, value)
    written = []
    for name, text in twin.files(stem, folder=folder).items():
        target = folder / name
        files.write_atomic(target, text, mode=0o777 if name.endswith(".sh") else 0o666)
        written.append(target)
    return written


__all__ = ["FORMATS", "KnobSpec", "KohyaJob", "assumptions", "diagnose_settings", "effective_batch", "knob_specs",
           "lever_changes", "load", "phases_run", "probe_request", "script_of", "write_job_files"]
