"""What kohya's two trainers share: a job read from a shell file or a `--config_file` TOML, its
settings by their own names, its dataset TOML, and the job written back in the same form.

sd-scripts and musubi-tuner read their arguments the same way (argparse; `--config_file` flattened
into the namespace before the command line is parsed over it: train_util.py / parser_common.py
read_config_from_file), so a value is, in order: the command line's, the config TOML's, the
argument parser's default. `KohyaJob.get(name)` answers that, by the trainer's own option names;
the dataset TOML's keys are `datasets[i].KEY` (the value the dataset takes after its fallbacks).

The job is what space, the search and the results hold: `get`/`set` by name, `copy`, `write`
(the same form: best.sh, or best.toml and best_dataset.toml), and the trainer's answers for the
layers above (`knob_specs`, `probe_request`, `phases_run`, `architecture_spec`, `model_spec`).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fitfinder import files, models
from fitfinder.errors import ConfigError, UserError
from fitfinder.errors import brief, one_line
from fitfinder.files import write_atomic
from fitfinder.settings import Settings
from fitfinder.trainers import _safetensors, _shell, _toml
from fitfinder.trainers._knob import ALL, DATA, KnobSpec

BOOL, INT, FLOAT, STR, LIST = "bool", "int", "float", "str", "list"


@dataclass(frozen=True)
class Option:
    """One option of a trainer's argument parser, as its source declares it."""

    kind: str  # bool (store_true), int, float, str, list (nargs="*")
    default: Any
    where: str  # the file and line of its add_argument


_MISSING = object()


@dataclass
class KohyaJob:
    """A kohya job as the user wrote it, plus what fitfinder changed (by option name)."""

    trainer: Any  # the trainer's module: sd_scripts or musubi_tuner
    script: Any  # its Script for the job's script
    source: str
    form: str  # "shell" or "toml"
    shell_text: str | None = None
    command: _shell.Command | None = None
    script_index: int = 0  # the script's word in the command
    line_flags: dict[str, tuple[int, int, Any]] = field(default_factory=dict)  # name -> (first word, last+1, value)
    launcher: dict[str, str] = field(default_factory=dict)  # accelerate launch's own options
    config_path: Path | None = None
    config_text: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # flattened
    config_tables: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (table, occurrence)
    dataset_path: Path | None = None
    dataset_text: str | None = None
    dataset: dict[str, Any] = field(default_factory=dict)
    caching: list[dict[str, Any]] = field(default_factory=list)  # musubi's caching commands: script, flags
    changes: dict[str, Any] = field(default_factory=dict)
    settings: Settings = field(default_factory=Settings)
    arch: str | None = None  # --arch: a shipped architecture instead of the checkpoint's
    folder_vars: frozenset = frozenset()  # shell variables the file sets to its own folder (`here=$(dirname $0)`)
    notes: list[str] = field(default_factory=list)  # what the output says about the job (not modelled, ...)

    # -- reading ---------------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        return Path(self.source).resolve().parent

    @property
    def name(self) -> str:
        return str(self.get("output_name") or Path(self.source).stem)

    @property
    def options(self) -> dict[str, Option]:
        return self.trainer.options(self.script)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value the trainer runs with: fitfinder's change, the command line's, the config's, the default."""
        if key.startswith("datasets[*]."):
            return [self.get(f"datasets[{i}].{key[len('datasets[*].'):]}") for i in range(len(self.datasets))]
        if key in self.changes:
            return self.changes[key]
        if key.startswith("datasets["):
            return self._dataset_value(key)
        if key in self.line_flags:
            return self.line_flags[key][2]
        if key in self.config:
            return self.config[key]
        if key in self.options:
            return self.options[key].default
        return None if default is _MISSING else default

    def has(self, key: str) -> bool:
        return key in self.changes or key in self.line_flags or key in self.config

    def set(self, key: str, value: Any) -> None:
        if key.startswith("datasets[*]."):
            for i in range(len(self.datasets)):
                self.set(f"datasets[{i}].{key[len('datasets[*].'):]}", value)
            return
        self.changes[key] = value

    def copy(self) -> "KohyaJob":
        twin = copy.copy(self)
        twin.changes = dict(self.changes)
        twin.settings = copy.deepcopy(self.settings)
        return twin

    @property
    def datasets(self) -> list[dict]:
        return list(self.dataset.get("datasets") or [])

    def _dataset_value(self, key: str) -> Any:
        index, _, name = key[len("datasets["):].partition("].")
        return self.trainer.dataset_value(self, int(index), name)

    # -- what the layers above ask ----------------------------------------------------------
    @property
    def accumulation(self) -> int:
        return int(self.get("gradient_accumulation_steps") or 1)

    @property
    def effective_batch(self) -> int:
        return max(int(self.get(f"datasets[{i}].batch_size")) for i in range(len(self.datasets))) * self.accumulation

    @property
    def best_name(self) -> str:
        return "best.sh" if self.form == "shell" else "best.toml"

    def knob_specs(self) -> list[KnobSpec]:
        return self.trainer.knob_specs(self)

    def diagnose_settings(self) -> dict[str, Any]:
        return diagnose_settings(self)

    def lever_changes(self, lever: str) -> list[tuple[str, Any, Any]]:
        return lever_changes(self, lever)

    def probe_request(self, **run) -> dict:
        return self.trainer.probe_request(self, **run)

    def phases_run(self, point: dict) -> list[str]:
        return self.trainer.phases_run(self, point)

    def architecture_spec(self) -> dict:
        return self.trainer.architecture_spec(self)

    def model_spec(self) -> dict:
        """Probes build the architecture with random weights: a kohya checkpoint is one file in the
        trainer's own layout, which fitfinder's diffusers parts do not load."""
        spec = self.architecture_spec()
        return {**spec, "weights": "random"}

    # -- writing ---------------------------------------------------------------------------
    def files(self, stem: str, header: list[str] | None = None, folder: Path | None = None,
              dest: Path | None = None) -> dict[str, str]:
        """File name -> text of the job in its own form with fitfinder's changes: `{stem}.sh` (or
        `{stem}.toml` for a config TOML), and `{stem}.toml` / `{stem}_dataset.toml` where their keys
        changed (every file, naming each other by their paths in `folder`, when a folder is given)."""
        return write_files(self, stem, header or [], folder, dest)

    def write(self, path: str | Path, header: list[str] | None = None) -> Path:
        """Write atomically beside `path`, named by its stem (best.yaml -> best.sh, best.toml and
        best_dataset.toml); refuses to write over an input file. Returns the main file."""
        path = Path(path)
        texts = self.files(path.stem, header, dest=path.parent)
        inputs = {Path(p).resolve() for p in (self.source, self.config_path, self.dataset_path,
                                              resolve(self, self.get("sample_prompts"))) if p}
        for name in texts:
            if (path.parent / name).resolve() in inputs:
                raise UserError(f"{path.parent / name}: refusing to write over an input file of the job")
        main = None
        for name, text in texts.items():
            target = path.parent / name
            write_atomic(target, text, mode=0o777 if name.endswith(".sh") else 0o666)
            main = main or target
        return main

    def dumps(self, header: list[str] | None = None) -> str:
        return next(iter(self.files("best", header).values()))

    def options_set(self) -> dict[str, Any]:
        """Every option the job sets, with the value the trainer runs with (see `options_set`)."""
        return options_set(self)

    def dataset_data(self) -> dict[str, Any]:
        """The dataset TOML as data, with fitfinder's changes in it."""
        edits, _ = self.trainer.dataset_edits(self, _dataset_changes(self))
        return _toml.parse(_dataset_text(self, edits), str(self.dataset_path))


def _dataset_changes(job: KohyaJob) -> dict[str, Any]:
    return {key: value for key, value in job.changes.items() if key.startswith("datasets[")}


def options_set(job: KohyaJob) -> dict[str, Any]:
    """Every option the job sets (its config TOML's, its command line's, fitfinder's changes, and the
    options a dataset change lands in, such as --train_batch_size), by name, with the value the trainer
    runs with; unset ones (None) left out. What one --config_file TOML holds to run the same job:
    read_config_from_file (sd-scripts library/train_util.py, musubi-tuner training/parser_common.py)
    flattens its tables into the namespace the command line is parsed over."""
    _, from_datasets = job.trainer.dataset_edits(job, _dataset_changes(job))
    changed = [key for key in job.changes if not key.startswith(("datasets[", "cache:", PROMPTS_SIZE))]
    found: dict[str, Any] = {}
    for name in dict.fromkeys([*job.config, *job.line_flags, *changed, *from_datasets]):
        value = from_datasets.get(name, job.get(name))
        if value is None:
            continue
        if name not in job.options and name in job.line_flags:
            value = _as_written(value)
        found[name] = list(value) if isinstance(value, tuple) else value
    return found


def _as_written(value: Any) -> Any:
    """An option the parser fitfinder read does not declare holds its words as written: a number or a
    boolean in a TOML where a word reads as one, since argparse converts the command line's strings,
    not what the config file put in the namespace (ArgumentParser.parse_known_args)."""
    if isinstance(value, list):
        return [_as_written(item) for item in value]
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


# -- reading the files ------------------------------------------------------------------------
def parse_flags(words: list[_shell.Word], options: dict[str, Option], source: str) -> dict[str, tuple[int, int, Any]]:
    """The options after the script, by name: (first word, last word + 1, value), as argparse reads
    them (`--name value`, `--name=value`, a switch alone, a list of values up to the next option).
    An option the trainer's parser does not declare is kept with its words as written."""
    flags, i = {}, 0
    while i < len(words):
        text = words[i].text
        if not text.startswith("--"):
            raise UserError(f"{source}: {brief(text)} is not an option of the trainer's command line "
                            "(expected --name value after the script)")
        name, eq, inline = text[2:].partition("=")
        option = options.get(name)
        kind = option.kind if option else None
        end = i + 1
        if eq:
            raw = [inline]
        elif kind == BOOL:
            raw = []
        else:
            while end < len(words) and not words[end].text.startswith("--"):
                end += 1
                if kind != LIST:
                    break
            raw = [w.text for w in words[i + 1:end]]
        flags[name] = (i, end, _typed(name, raw, kind, source))
        i = end
    return flags


def _typed(name: str, raw: list[str], kind: str | None, source: str) -> Any:
    if kind == BOOL or (kind is None and not raw):
        return True if not raw else raw[0].lower() not in ("false", "0")
    if kind == LIST:
        return raw
    if kind is None:
        return raw[0] if len(raw) == 1 else raw
    if not raw:
        raise UserError(f"{source}: --{name}: expected a value")
    try:
        return {INT: int, FLOAT: float, STR: str}[kind](raw[0])
    except ValueError:
        raise UserError(f"{source}: --{name}: expected {'an integer' if kind == INT else 'a number'}, "
                        f"got {brief(raw[0])}") from None


def config_tables(data: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Which table each flattened key lives in (the last one wins, as flattening does)."""
    where = {}
    for name, value in data.items():
        if isinstance(value, dict):
            for key in value:
                where[key] = (name, 0)
        else:
            where[name] = ("", 0)
    return where


def read_text(path: Path, what: str) -> str:
    if not path.exists():
        raise UserError(f"{path}: no such file (the job's {what})")
    raw = files.read_bounded(path, _toml.MAX_TOML_BYTES, what)  # a FIFO or /dev/zero is refused, not read
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; save the job's {what} as UTF-8") from None


# A shell variable set to the script's own folder: `here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"`,
# `DIR=$(dirname "$0")` and their like (what fitfinder's own kohya.sh writes).
_FOLDER_VAR = re.compile(r"""^\s*(?:export\s+|local\s+)?([A-Za-z_]\w*)=["']?\$\((?:\s*cd\s+["']?\$\()?\s*dirname\s+"""
                         r"""["']?\$\{?(?:BASH_SOURCE(?:\[0\])?|0)\}?["']?\s*\)""", re.MULTILINE)


def folder_variables(text: str) -> frozenset:
    """The variables a shell text sets to its own folder (so `"$here/kohya.toml"` is a path beside it)."""
    return frozenset(match.group(1) for match in _FOLDER_VAR.finditer(text))


def resolve(job: KohyaJob, value: Any) -> Path | None:
    """A path the job names, read relative to the job file's folder (`~` expanded, `$here/` where the
    shell file sets `here` to its own folder); None when unset or when it holds a shell variable
    fitfinder does not expand."""
    if value and isinstance(value, (str, Path)):
        for name in job.folder_vars:
            for prefix in (f"${name}/", f"${{{name}}}/"):
                if str(value).startswith(prefix):
                    value = str(job.folder / str(value)[len(prefix):])
    if not value or not isinstance(value, (str, Path)) or "$" in str(value):
        return None
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() else job.folder / path


def load_dataset(job: KohyaJob) -> None:
    """The dataset TOML the job names (`dataset_config`), read and checked for what fitfinder reads."""
    value = job.get("dataset_config")
    path = resolve(job, value)
    if path is None:
        raise UserError(f"{job.source}: dataset_config: missing or not a plain path ({brief(value)}); "
                        "fitfinder reads the datasets' resolution and batch_size from it")
    job.dataset_path, job.dataset_text = path, read_text(path, "dataset config (dataset_config)")
    job.dataset = _toml.parse(job.dataset_text, str(path))
    datasets = job.dataset.get("datasets")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        raise ConfigError(str(path), ["datasets: missing or empty; expected [[datasets]] tables"])


# -- knobs shared by both trainers -----------------------------------------------------------
def on_off(value: Any) -> str:
    return "on" if value else "off"


def resolution_side(value: Any) -> int:
    """A dataset resolution (`1024` or `[w, h]`) as the side of the square of the same area: memory
    follows a bucket's pixels, and the buckets of an aspect-bucketed dataset hold that area at most."""
    if isinstance(value, (list, tuple)):
        width, height = (int(v) for v in value)
        return int(math.isqrt(width * height))
    return int(value)


def buckets_knob(job: KohyaJob) -> KnobSpec | None:
    sides = sorted({resolution_side(job.get(f"datasets[{i}].resolution")) for i in range(len(job.datasets))})
    sets = [sides[:n] for n in range(1, len(sides) + 1)]  # drop the largest first, as the seeds' rollback does
    labels = tuple(",".join(str(s) for s in chosen) for chosen in sets)

    def write(target: KohyaJob, label: str, space) -> None:
        allowed = [int(s) for s in label.split(",")]
        for i in range(len(target.datasets)):
            value = job.get(f"datasets[{i}].resolution")
            if resolution_side(value) not in allowed:
                target.set(f"datasets[{i}].resolution", max(allowed))

    return KnobSpec("buckets", "quality", labels, labels[-1], ("datasets[*].resolution",), DATA, "resolution",
                    lambda v: f"[{v}]", write)


def rank_knob(job: KohyaJob) -> KnobSpec | None:
    desired = int(job.get("network_dim") or 0)
    if desired <= 0:
        return None
    values = sorted({2**i for i in range(16) if 4 <= 2**i < desired} | {desired})
    alpha = float(job.get("network_alpha") or 1.0)

    def write(target: KohyaJob, rank: int, space) -> None:
        target.set("network_dim", rank)
        scaled = rank * alpha / desired
        target.set("network_alpha", int(scaled) if float(scaled).is_integer() else scaled)

    return KnobSpec("rank", "quality", tuple(values), desired, ("network_dim", "network_alpha"), ALL,
                    "network_dim", str, write)


def batch_knob(job: KohyaJob) -> KnobSpec:
    desired = max(int(job.get(f"datasets[{i}].batch_size")) for i in range(len(job.datasets)))
    effective = desired * job.accumulation
    small = [d for d in range(1, math.isqrt(effective) + 1) if effective % d == 0]
    divisors = sorted(set(small + [effective // d for d in small]))

    def write(target: KohyaJob, batch: int, space) -> None:
        target.set("datasets[*].batch_size", batch)
        target.set("gradient_accumulation_steps", effective // batch)

    return KnobSpec("batch", "speed", tuple(divisors), desired,
                    ("datasets[*].batch_size", "gradient_accumulation_steps"),
                    frozenset({"text_encoder", "latents", "train"}), "batch_size", str, write)


def switch_knob(name: str, option: str, job: KohyaJob, phases: frozenset, light: bool, role: str = "speed",
                title: str | None = None, host: str = "") -> KnobSpec:
    desired = bool(job.get(option))

    def write(target: KohyaJob, value: bool, space) -> None:
        target.set(option, bool(value))

    return KnobSpec(name, role, (light, not light), desired, (option,), phases, title or option, on_off, write,
                    host=host)


# kohya's optimizer names (optimizer_type, any case) -> the optimizer fitfinder builds; each trainer's
# get_optimizer compares lower-cased names (sd-scripts train_util.get_optimizer, musubi-tuner
# training/trainer_base.py get_optimizer).
OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "adafactor": "adafactor", "lion": "lion",
              "lion8bit": "lion8bit", "prodigy": "prodigy"}
OWN_OPTIMIZER_NAMES = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "adafactor": "Adafactor", "lion": "Lion",
                       "lion8bit": "Lion8bit", "prodigy": "Prodigy"}


def optimizer_of(job: KohyaJob, default: str | None) -> str:
    name = str(job.get("optimizer_type") or "").strip().lower() or (default or "")
    if not name:
        raise UserError(f"{job.source}: optimizer_type: missing; {job.trainer.REPO} needs one (e.g. adamw8bit)")
    if name not in OPTIMIZERS:
        raise UserError(f"{job.source}: optimizer_type {brief(job.get('optimizer_type'))}: not one fitfinder "
                        f"probes; give one of {', '.join(OWN_OPTIMIZER_NAMES.values())}")
    return OPTIMIZERS[name]


def optimizer_knob(job: KohyaJob, default: str | None) -> KnobSpec:
    desired = optimizer_of(job, default)
    twins = {"adamw": "adamw8bit", "lion": "lion8bit"}
    values = (twins[desired], desired) if desired in twins else (desired,)

    def write(target: KohyaJob, name: str, space) -> None:
        target.set("optimizer_type", OWN_OPTIMIZER_NAMES[name])

    return KnobSpec("optimizer", "quality", values, desired, ("optimizer_type",), frozenset({"train", "last_sample"}),
                    "optimizer_type", lambda v: OWN_OPTIMIZER_NAMES[v], write)


def swap_knob(job: KohyaJob, most: int, phases: frozenset) -> KnobSpec | None:
    """blocks_to_swap: every count from the model's maximum down to none, a speed knob."""
    desired = int(job.get("blocks_to_swap") or 0)
    if most <= 0:
        return None
    desired = min(desired, most)

    def write(target: KohyaJob, count: int, space) -> None:
        target.set("blocks_to_swap", int(count) if count else None)

    # The swapped blocks wait in host memory: the most swapped, lightest on the card, is heaviest there.
    return KnobSpec("layer_offloading", "speed", tuple(range(most, -1, -1)), desired, ("blocks_to_swap",), phases,
                    "blocks_to_swap", str, write, host="reversed")


def sampling_knob(job: KohyaJob) -> KnobSpec | None:
    desired = bool(job.get("sample_prompts"))
    if not desired:
        return None
    prompts = job.get("sample_prompts")

    def write(target: KohyaJob, on: bool, space) -> None:
        target.set("sample_prompts", prompts if on else None)

    return KnobSpec("sampling", "quality", (False, True), True, ("sample_prompts",), ALL - {"load"},
                    "sample_prompts", on_off, write)


# -- writing back ------------------------------------------------------------------------------
def write_files(job: KohyaJob, stem: str, header: list[str], folder: Path | None,
                dest: Path | None = None) -> dict[str, str]:
    """The job's files with its changes: each change goes where the trainer would read it from (the
    command line when the option is there, else the config TOML when it is there, else where the job
    is written: the command line of a shell file, the config TOML of a TOML job). With `folder` (the
    trainer probe's private folder) every file is written and each names the others by their path there."""
    line_edits: dict[str, Any] = {}
    config_edits: dict[str, Any] = {}
    option_edits = {key: value for key, value in job.changes.items()
                    if not key.startswith(("datasets[", "cache:", PROMPTS_SIZE))}
    dataset_edits, from_datasets = job.trainer.dataset_edits(
        job, {key: value for key, value in job.changes.items() if key.startswith("datasets[")})
    option_edits.update(from_datasets)
    for key, value in option_edits.items():
        on_line = key in job.line_flags or (job.form == "shell" and key not in job.config)
        (line_edits if on_line else config_edits)[key] = value
    _relocated(job, line_edits, config_edits, dest)
    files: dict[str, str] = {}
    names = {"dataset": f"{stem}_dataset.toml", "config": f"{stem}.toml", "prompts": f"{stem}_prompts.txt"}
    where = {kind: str(folder / name) if folder else _named_beside(job, kind, name) for kind, name in names.items()}
    prompts = prompt_text(job) if PROMPTS_SIZE in job.changes and job.get("sample_prompts") else None
    if prompts is not None:  # the previews' new size: a copy of the prompt file beside the job
        files[names["prompts"]] = prompts
        on_line = "sample_prompts" in job.line_flags or job.form == "shell" and "sample_prompts" not in job.config
        (line_edits if on_line else config_edits)["sample_prompts"] = where["prompts"]
    if job.dataset_text is not None and (dataset_edits or folder):
        files[names["dataset"]] = _dataset_text(job, dataset_edits)
        on_line = "dataset_config" in job.line_flags or job.form == "shell" and "dataset_config" not in job.config
        (line_edits if on_line else config_edits)["dataset_config"] = where["dataset"]
    if job.form == "shell":
        if job.config_text is not None and (config_edits or folder):
            files[names["config"]] = _config_text(job, config_edits, [])
            line_edits["config_file"] = where["config"]
        dataset = line_edits.get("dataset_config", config_edits.get("dataset_config"))
        return {f"{stem}.sh": _shell_text(job, line_edits, header, dataset), **files}
    return {names["config"]: _config_text(job, config_edits, header), **files}


_NAMING = {"dataset": "dataset_config", "config": "config_file", "prompts": "sample_prompts"}


def _named_beside(job: KohyaJob, kind: str, name: str) -> str:
    """A new file beside the written job, named as the job named the file it replaces: `$here/NAME`
    where the shell file named it by its own folder's variable (the trainer runs from its checkout,
    and a bare name would be read from there), else NAME (fitfinder reads it beside the job)."""
    old = str(job.get(_NAMING[kind], None) or "")
    for variable in job.folder_vars:
        for prefix in (f"${variable}/", f"${{{variable}}}/"):
            if old.startswith(prefix):
                return prefix + name
    return name


def _relocated(job: KohyaJob, line_edits: dict, config_edits: dict, dest: Path | None) -> None:
    """Files the job names by relative paths (its config and dataset TOMLs), named again relative to
    `dest` when the job is written elsewhere: fitfinder reads them relative to the job file's folder."""
    if dest is None:
        return
    import os

    for key in ("config_file", "dataset_config", "sample_prompts"):
        path = resolve(job, job.get(key))
        if path is None or Path(str(job.get(key))).is_absolute():
            continue
        moved = os.path.relpath(path, Path(dest).resolve())
        if moved != str(job.get(key)):
            (line_edits if key in job.line_flags or job.form == "shell" else config_edits).setdefault(key, moved)


def _shell_text(job: KohyaJob, edits: dict[str, Any], header: list[str], dataset: Any = None) -> str:
    text, command = job.shell_text, job.command
    words = command.words
    changes, appended = [], []
    for cached in job.caching:  # the caching commands read the same dataset TOML
        if dataset is not None and cached.get("dataset_word") is not None:
            word = cached["dataset_word"]
            changes.append((word.start, word.end, _shell.quoted(str(dataset))))
        changes += _caching_edits(job, cached)
    for key, value in edits.items():
        option = job.options.get(key)
        if key in job.line_flags:
            first, end, _ = job.line_flags[key]
            start, stop = words[first].start, words[end - 1].end
            if value is None or value is False:
                start = _blank_before(text, start)
                changes.append((start, stop, ""))
            else:
                changes.append((start, stop, _flag_words(key, value, option)))
        elif value is not None and value is not False:
            appended.append(_flag_words(key, value, option))
    if appended:
        line_start = text.rfind("\n", 0, words[-1].start) + 1
        indent = text[line_start:len(text) - len(text[line_start:].lstrip(" \t"))]
        joiner = f" \\\n{indent or '  '}" if command.multiline else " "
        changes.append((words[-1].end, words[-1].end, joiner + joiner.join(appended)))
    body = _shell.edited(text, changes)
    return _with_header(body, header, "#")


CACHE_KEY = "cache:{script}:{flag}"  # a change to a caching command's flag (musubi-tuner's text encoder's fp8)


def cache_key(script: str, flag: str) -> str:
    return CACHE_KEY.format(script=script, flag=flag)


def _caching_edits(job: KohyaJob, cached: dict) -> list[tuple[int, int, str]]:
    """A caching command's changed flags, made where each stands (removed when switched off), or
    appended after its last word."""
    text, words, edits = job.shell_text, cached.get("words") or [], []
    prefix = cache_key(cached["script"], "")
    for key, value in job.changes.items():
        if not key.startswith(prefix) or not words:
            continue
        flag = key[len(prefix):]
        if flag in cached["spans"]:
            first, end = cached["spans"][flag]
            start, stop = words[first].start, words[end - 1].end
            if value is None or value is False:
                edits.append((_blank_before(text, start), stop, ""))
            else:
                edits.append((start, stop, _flag_words(flag, value, None)))
        elif value is not None and value is not False:
            edits.append((words[-1].end, words[-1].end, " " + _flag_words(flag, value, None)))
    return edits


def _blank_before(text: str, start: int) -> int:
    """Where to cut a removed option from: the spaces before it, and a continuation that would be left alone."""
    cut = start
    while cut > 0 and text[cut - 1] in " \t":
        cut -= 1
    if text[max(0, cut - 2):cut] == "\\\n":
        probe = cut - 2
        while probe > 0 and text[probe - 1] in " \t":
            probe -= 1
        cut = probe
    return cut


def _flag_words(key: str, value: Any, option: Option | None) -> str:
    if value is True:
        return f"--{key}"
    if isinstance(value, (list, tuple)):
        return " ".join([f"--{key}", *(_shell.quoted(str(v)) for v in value)])
    return f"--{key} {_shell.quoted(_number(value))}"


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _config_text(job: KohyaJob, edits: dict[str, Any], header: list[str]) -> str:
    text, source = job.config_text, str(job.config_path or job.source)
    tables = [name for name, value in _toml.parse(text, source).items() if isinstance(value, dict)]
    for key, value in edits.items():
        table, occurrence = job.config_tables.get(key, (tables[-1] if tables else "", 0))
        if value is None:
            text = _toml.delete_key(text, table, occurrence, key, source)
        else:
            text = _toml.set_key(text, table, occurrence, key, value, source)
    return _with_header(text, header, "#")


def _dataset_text(job: KohyaJob, edits: dict[tuple[str, int, str], Any]) -> str:
    """The dataset TOML with each (table, occurrence, key) set: `("general", 0, "batch_size")`."""
    text, source = job.dataset_text, str(job.dataset_path)
    for (table, occurrence, name), value in edits.items():
        text = _toml.set_key(text, table, occurrence, name, value, source)
    return text


def _with_header(text: str, header: list[str], mark: str) -> str:
    if not header:
        return text
    lines = [f"{mark} {one_line(line, 1000)}".rstrip() for line in header]
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return first + "\n" + "\n".join(lines) + "\n" + rest
    return "\n".join(lines) + "\n" + text


# -- the command line of a shell file --------------------------------------------------------------
def launcher_options(words: list[_shell.Word]) -> dict[str, str]:
    """accelerate launch's own options before the script (`--mixed_precision bf16`, `--num_processes 2`)."""
    found, i = {}, 0
    while i < len(words):
        text = words[i].text
        if text.startswith("--"):
            name, eq, value = text[2:].partition("=")
            if not eq and i + 1 < len(words) and not words[i + 1].text.startswith("-"):
                value, i = words[i + 1].text, i + 1
            found[name] = value or "true"
        i += 1
    return found


def architecture(job: KohyaJob, family: str, default_arch: str, checkpoint_key: str,
                 decide: Callable[[_safetensors.Header], str] | None) -> dict:
    """The model to estimate and probe: `--arch NAME` if given; else the checkpoint's header decides
    the shipped architecture (`decide`); else the script's default, and the job's notes say which."""
    shipped = models.known_archs()
    if job.arch:
        found = models.shipped_by_name(job.arch)
        if found is None:
            matching = [stem for stem, arch in shipped.items() if arch["family"] == family]
            raise UserError(f"--arch {brief(job.arch)}: no shipped architecture of that name; "
                            f"{job.script.name} trains {family}: {', '.join(matching)}")
        if found[1]["family"] != family:
            raise UserError(f"--arch {job.arch}: a {found[1]['family']} architecture, but {job.script.name} "
                            f"trains {family}")
        stem, arch = found
        _note(job, f"architecture {stem} (--arch, random weights)")
    else:
        header = _safetensors.read(resolve(job, job.get(checkpoint_key)) or "")
        stem = decide(header) if header is not None and decide else default_arch
        arch = shipped[stem]
        how = (f"read from the header of {Path(header.path).name}" if header is not None
               else f"{checkpoint_key} {brief(job.get(checkpoint_key))} is not a file here: the script's shipped one")
        _note(job, f"architecture {stem} ({how})")
    return {"family": family, "weights": "none", "arch_name": stem, "arch": arch, "path": None}


def family(name: str):
    """A model family's declaration (models/NAME.py FAMILY): its parts' names."""
    return models.FAMILIES[name]


def _note(job: KohyaJob, text: str) -> None:
    if text not in job.notes:
        job.notes.append(text)


def part_dtype(job: KohyaJob, key: str, fallback: str) -> str:
    """A checkpoint's dtype: its header's where the file is here, else its name's, else `fallback`."""
    value = job.get(key)
    header = _safetensors.read(resolve(job, value) or "")
    if header is not None:
        return header.weight_dtype
    return _safetensors.dtype_from_name(str(value or "")) or fallback


def prompt_lines(job: KohyaJob) -> list[dict[str, str]] | None:
    """The sample prompt file's prompts, each with its options (`--w 1024 --h 1024 --s 20 ...`), as
    train_util.load_prompts reads a .txt file; None when there is no file to read (a .toml or .json
    prompt file is not read: its previews take the defaults, and the notes say so)."""
    text = prompt_text(job)
    if text is None:
        return None
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        options = {}
        for part in line.split(" --")[1:]:
            key, _, value = part.strip().partition(" ")
            options[key] = value.strip()
        found.append(options)
    return found


def prompt_text(job: KohyaJob) -> str | None:
    """The prompt file's text with fitfinder's preview size (PROMPTS_SIZE) in it; None where there is
    no .txt prompt file to read."""
    path = resolve(job, job.get("sample_prompts"))
    if path is None or not path.is_file() or path.suffix.lower() not in (".txt", ""):
        return None
    text = read_text(path, "sample prompt file")
    size = job.changes.get(PROMPTS_SIZE)
    return text if size is None else _sized_prompts(text, *size, job.trainer.PREVIEW_DEFAULT(job))


def largest_prompt_line(job: KohyaJob) -> str | None:
    """The prompt file's line with the most pixels (x --f frames for video; the script's default size
    where a line gives none), with fitfinder's preview size in it; None without a .txt prompt file.
    Every preview holds the same memory per denoising step, and the largest sets the peak."""
    text = prompt_text(job)
    if text is None:
        return None
    width, height = job.trainer.PREVIEW_DEFAULT(job)

    def pixels(line: str) -> int:
        options = dict(part.strip().partition(" ")[::2] for part in line.split(" --")[1:])
        try:
            return int(options.get("w", width)) * int(options.get("h", height)) * int(options.get("f", 1))
        except ValueError:  # a malformed number: the trainer reads it as it will
            return 0

    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return max(lines, key=pixels, default=None)


# A change to the previews' size: every prompt line's --w and --h at most these (the largest becomes them).
PROMPTS_SIZE = "prompts:size"
_SIZE_OPTION = re.compile(r"(\s--([wh])\s+)(\d+)")


def _sized_prompts(text: str, width: int, height: int, default: tuple[int, int]) -> str:
    """Each prompt line with its --w / --h (the script's default where it has none) capped at the size."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            lines.append(line)
            continue
        sizes = {"w": default[0], "h": default[1]}
        sizes.update({m.group(2): int(m.group(3)) for m in _SIZE_OPTION.finditer(line)})
        capped = {"w": min(sizes["w"], width), "h": min(sizes["h"], height)}
        line = _SIZE_OPTION.sub(lambda m: f"{m.group(1)}{capped[m.group(2)]}", line)
        for key in ("w", "h"):
            if not re.search(rf"\s--{key}\s+\d+", line):
                line = f"{line.rstrip()} --{key} {capped[key]}"
        lines.append(line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def sample_size_knob(job: KohyaJob) -> KnobSpec | None:
    """The previews' size (the prompt file's --w / --h): the largest, three quarters of it and half,
    keeping its aspect on a 64-pixel grid, as fitfinder's AI Toolkit knob; written as a copy of the
    prompt file beside the job. Offered where there is a .txt prompt file to read."""
    prompts = prompt_lines(job) if job.get("sample_prompts") else None
    if not prompts:
        return None
    default = job.trainer.PREVIEW_DEFAULT(job)
    sizes = [(int(p.get("w", default[0])), int(p.get("h", default[1]))) for p in prompts]
    width, height = max(sizes, key=lambda size: (size[0] * size[1], size))
    labels = {f"{width}x{height}"}
    for scale in (0.5, 0.75):
        labels.add(f"{max(64, round(width * scale / 64) * 64)}x{max(64, round(height * scale / 64) * 64)}")
    ordered = tuple(sorted(labels, key=lambda label: math.prod(int(p) for p in label.split("x"))))

    def write(target: KohyaJob, label: str, space) -> None:
        target.set(PROMPTS_SIZE, tuple(int(p) for p in label.split("x")))

    return KnobSpec("sample_size", "quality", ordered, f"{width}x{height}", ("sample_prompts",),
                    frozenset({"sample", "last_sample"}), "--w/--h", str, write)


def settings_problem(job: KohyaJob, where: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ConfigError(job.source, [f"{where}: expected {expected}, got {brief(job.get(where))}"])


def dtype_of_precision(value: Any) -> str:
    return {"bf16": "bf16", "fp16": "fp16", "no": "fp32", "fp32": "fp32"}.get(str(value or "no").lower(), "fp32")


def check_swap(job: KohyaJob, most: int | None) -> None:
    """--blocks_to_swap within what the model's enable_block_swap asserts (`most`; None: the script has
    no block swap, and its parser does not declare the option)."""
    value = job.get("blocks_to_swap")
    if not value:
        return
    if most is None:
        raise UserError(f"{job.source}: --blocks_to_swap: {job.script.name} has no block swap (its parser does not "
                        "declare the option)")
    if int(value) > most:
        raise UserError(f"{job.source}: --blocks_to_swap {value}: {job.script.name}'s model swaps at most {most} "
                        "blocks (enable_block_swap asserts it)")


def not_modelled(job: KohyaJob, flags: dict[str, str]) -> None:
    """Name each option that moves memory and that the recipe does not follow."""
    for flag, effect in flags.items():
        value = job.get(flag)
        if value not in (None, False, 0, "", []):
            job.notes.append(f"--{flag} is not modelled: {effect}")


__all__ = ["KohyaJob", "KnobSpec", "Option"]


def dataset_edits(job: KohyaJob, changes: dict[str, Any], from_args: dict[str, str]) -> tuple[dict, dict]:
    """Dataset changes as (table, occurrence, key) edits of the dataset TOML: in the dataset's own
    table where it has the key, in [general] where every dataset takes it from there, else in each
    dataset's table; and the options that hold the value instead (sd-scripts' --train_batch_size
    when no table sets batch_size)."""
    edits, options_changed = {}, {}
    general = job.dataset.get("general") or {}
    for key, value in changes.items():
        index_text, _, name = key[len("datasets["):].partition("].")
        index = int(index_text)
        value = list(value) if isinstance(value, tuple) else value
        if name in job.datasets[index]:
            edits[("datasets", index, name)] = value
        elif name in general:
            same = all(changes.get(f"datasets[{i}].{name}") == value
                       for i in range(len(job.datasets)) if name not in job.datasets[i])
            edits[("general", 0, name) if same else ("datasets", index, name)] = value
        elif name in from_args and job.has(from_args[name]):
            options_changed[from_args[name]] = value
        elif all(changes.get(f"datasets[{i}].{name}") == value for i in range(len(job.datasets))):
            edits[("general", 0, name)] = value
        else:
            edits[("datasets", index, name)] = value
    return edits, options_changed


# -- the probe's request ---------------------------------------------------------------------------
def sample_settings(job: KohyaJob, prompts: list[dict] | None, width: int, height: int, steps: int,
                    guidance_key: str, guidance: float, first: list[str], sample_steps: int,
                    frames_key: str | None = None) -> dict:
    """The previews as the prompt file asks for them: the largest --w x --h (with musubi-tuner's video
    models, x --f frames, rounded down to 4k+1 as sample_image_inference does; 1 by default), its --s
    (at most the probe's `sample_steps`: every denoising step holds the same memory) and guidance."""
    enabled = bool(job.get("sample_prompts"))
    if enabled and prompts is None:
        _note(job, f"sample_prompts {brief(job.get('sample_prompts'))} is not a prompt file here: previews "
                         f"at the script's defaults ({width}x{height}, {steps} steps)")
    def frames(p: dict) -> int:
        return (int(p.get(frames_key, 1)) - 1) // 4 * 4 + 1 if frames_key else 1

    sizes = [(int(p.get("w", width)), int(p.get("h", height)), frames(p)) for p in prompts or []] \
        or [(width, height, 1)]
    big = max(sizes, key=lambda size: (size[0] * size[1] * size[2], size))
    chosen = next((p for p in prompts or [] if (int(p.get("w", width)), int(p.get("h", height)), frames(p)) == big),
                  {})
    return {"first": enabled and "sample" in first, "last": enabled and "last_sample" in first,
            "width": big[0], "height": big[1], "frames": big[2],
            "steps": min(sample_steps, int(chosen.get("s", steps))),
            "guidance_scale": float(chosen.get(guidance_key, guidance))}


def request(job: KohyaJob, spec: dict, trainer: dict, sample: dict, rank_ignore: list[str], steps: int,
            meter: str, budget_bytes: int | None, gpu: int = 0, fault: str | None = None) -> dict:
    """A probe request (probe/protocol.py ProbeRequest) for a kohya job: AI Toolkit's fields at what
    the trainer does (no quanto quantization, no layer offloading: the `trainer` field carries fp8
    and block swap as this trainer does them), and the trainer's recipe."""
    dtype = dtype_of_precision(job.get("mixed_precision"))
    sides = sorted({resolution_side(job.get(f"datasets[{i}].resolution")) for i in range(len(job.datasets))})
    residency = trainer["residency"]
    cached_te = not set(residency["text_encoder"]) & set(residency["train"])  # the encoders leave before training
    return {
        "model": spec, "dtype": dtype,
        "quantize": None, "quant_type": "", "quantize_te": None, "quant_type_te": "",
        "low_vram": False, "tiled_preview_decode": False,
        "layer_offloading": {"denoiser": 0.0, "text_encoder": 0.0},
        "text_encoder": "cache" if cached_te else "keep",
        "cache_latents": trainer["residency"]["latents"] == ["vae"],
        "shapes": [[side, 1] for side in sides],
        "batch_size": max(int(job.get(f"datasets[{i}].batch_size")) for i in range(len(job.datasets))),
        "accumulation": job.accumulation,
        "gradient_checkpointing": bool(job.get("gradient_checkpointing")),
        "rank": int(job.get("network_dim")), "alpha": float(job.get("network_alpha") or 1.0),
        "lora_ignore": list(rank_ignore), "conv_rank": None, "conv_alpha": None,
        "optimizer": optimizer_of(job, job.trainer.DEFAULT_OPTIMIZER),
        "optimizer_params": {}, "ema_decay": None,
        "lr": float(job.get("learning_rate") or 1e-4),
        # one LoRA, on the first denoiser (Wan 2.2's two experts share musubi-tuner's one network)
        "trained": list(family(spec["family"]).denoisers[:1]), "switch_every": 1,
        "sample": sample, "preview_holds_gradients": False,
        "steps": int(steps), "meter": meter, "budget_bytes": budget_bytes, "gpu": gpu, "seed": 0,
        "trainer": trainer,
        **({"fault": fault} if fault else {}),
    }


# -- a new job, written from settings (the kohya export) ---------------------------------------------
@dataclass
class NewJob:
    """A kohya job fitfinder writes from settings rather than edits (`fitfinder export --format kohya`):
    a --config_file TOML, its dataset TOML, a prompt file, and the shell file that runs the caching
    scripts (musubi-tuner's) and the training script. The model's files come from environment
    variables: the settings name a model, the trainers want its files."""

    trainer: Any  # sd_scripts or musubi_tuner
    script: Any  # its Script
    own: dict[str, Any]  # the script's options that name the model (--task, --model_version, --model_type)
    sections: dict[str, dict[str, Any]]  # the config TOML's tables, which the trainers flatten
    datasets: dict[str, Any]  # the dataset TOML: general and datasets
    prompts: list[str]  # the prompt file's lines (none: no file, no --sample_prompts)
    header: list[str]  # comment lines at the head of the config TOML
    comments: list[str]  # comment lines at the head of the shell file, after the shebang
    precision: str  # accelerate launch --mixed_precision
    text_fp8: bool = False  # the text caching script's fp8 switch (musubi-tuner: --fp8_t5, --fp8_vl, ...)

    @property
    def script_path(self) -> str:
        """The training script as a shell file runs it: sd-scripts' at its checkout's root,
        musubi-tuner's under src/musubi_tuner/."""
        return f"src/musubi_tuner/{self.script.name}" if self.trainer.REPO == "musubi-tuner" else self.script.name

    @property
    def model_files(self) -> tuple[tuple[str, str, str], ...]:
        return self.trainer.model_files(self.script, self.own)


def new_job_texts(job: NewJob, stem: str = "kohya") -> dict[str, str]:
    """File name -> text: `{stem}.toml`, `{stem}_dataset.toml`, `{stem}_prompts.txt` (with prompts) and
    `{stem}.sh`. Every option is one the script's parser declares (an undeclared one would stop the
    trainer: argparse refuses it); TOML is written by a TOML library, so a newline or quote in a
    value stays inside its string."""
    for section in job.sections.values():
        for key in section:
            if key not in job.script.options:
                raise ValueError(f"{key}: not an option of {job.script.name} ({job.trainer.REPO})")
    texts = {f"{stem}.toml": _toml_text(job.sections, job.header),
             f"{stem}_dataset.toml": _toml_text(job.datasets, [f"Dataset config for {job.script.name}, written by "
                                                               "fitfinder."])}
    if job.prompts:
        texts[f"{stem}_prompts.txt"] = "\n".join(job.prompts) + "\n"
    texts[f"{stem}.sh"] = _new_shell_text(job, stem)
    return texts


def _toml_text(sections: dict[str, Any], header: list[str]) -> str:
    import tomli_w

    body = {name: content for name, content in sections.items() if content}  # no empty table
    return "".join(f"# {one_line(line, 1000)}\n" for line in header) + "\n" + tomli_w.dumps(body)


def _new_shell_text(job: NewJob, stem: str) -> str:
    """The shell file. Every value in a command is quoted and every comment is one line (a newline
    in a job's name would otherwise start a command of its own); the files beside it are named by
    `$here`, the file's own folder, which fitfinder reads back as that folder."""
    import shlex

    q = shlex.quote
    files = {option: f'"${env}"' for option, env, _ in job.model_files}
    lines = ["#!/usr/bin/env bash", *(f"# {one_line(line, 1000)}" for line in job.comments),
             "set -euo pipefail", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
    lines += [f': "${{{env}:?set {env} to {what}}}"' for _, env, what in job.model_files]
    dataset = f'--dataset_config "$here/{stem}_dataset.toml"'
    for script, options in _caching_scripts(job):  # musubi-tuner caches latents and text outputs first
        words = [f"--{option} {value}" for option, value in files.items() if option in options]
        if script.endswith("_cache_latents.py") and "i2v" in options and "i2v" in str(job.own.get("task")) \
                and "clip" not in files:
            words.append("--i2v")  # wan_cache_latents.py: encode the first frame (set by --clip where there is one)
        if script.endswith("_cache_text_encoder_outputs.py") and job.text_fp8:
            words.append(f"--{job.script.text_fp8}")
        words += [f"--{key} {q(str(value))}" for key, value in job.own.items() if key in options]
        lines.append(" ".join([f"python {q(script)} {dataset}", *words]))
    launch = [f"accelerate launch --num_cpu_threads_per_process 1 --mixed_precision {q(job.precision)} "
              f"{q(job.script_path)}", f'--config_file "$here/{stem}.toml"', dataset]
    launch += [f"--{option} {value}" for option, value in files.items()]
    if job.prompts:
        launch.append(f'--sample_prompts "$here/{stem}_prompts.txt"')
    lines.append(" \\\n  ".join(launch))
    return "\n".join(lines) + "\n"


def _caching_scripts(job: NewJob) -> list[tuple[str, dict[str, Option]]]:
    """musubi-tuner's caching scripts, latents first (its docs' order), each with its parser's options."""
    if not hasattr(job.script, "latent_cache"):
        return []  # sd-scripts caches inside the training script
    return [(f"src/musubi_tuner/{name}", options) for name, options in (job.script.latent_cache,
                                                                          job.script.text_cache)]


# -- a diagnosis's first change, in the trainer's own settings (fitfinder diagnose --job run.sh) -------
def diagnose_settings(job: KohyaJob) -> dict[str, Any]:
    """What diagnose's rollback looks at (diagnose.Settings' fields), read from the job: the datasets'
    batch and largest resolution, the clips' frames, fp8, block swap (or Wan 2.2's offloaded expert),
    the text encoders' caching (always, in musubi-tuner), the previews, the data loader's workers."""
    musubi = job.trainer.REPO == "musubi-tuner"
    frames = [job.trainer.clip_frames(job, i) for i in range(len(job.datasets))] if musubi else [1]
    prompts = prompt_lines(job) or []
    previews = [(int(p["w"]), int(p["h"])) for p in prompts if p.get("w") and p.get("h")]
    return {
        "batch": max(int(job.get(f"datasets[{i}].batch_size")) for i in range(len(job.datasets))),
        "accumulation": job.accumulation,
        "checkpointing": bool(job.get("gradient_checkpointing")),
        "buckets": sorted({resolution_side(v) for v in job.get("datasets[*].resolution")}),
        "frames": max(frames),
        "quantize": bool(job.get("fp8_base") or job.get("fp8_base_unet")),
        "quantize_text": _text_in_fp8(job),
        "low_vram": bool(job.get("blocks_to_swap") or job.get("offload_inactive_dit")),
        "cache_text": musubi or bool(job.get("cache_text_encoder_outputs")
                                     or job.get("cache_text_encoder_outputs_to_disk")),
        "sampling_off": not job.get("sample_prompts"),
        "sample_size": max(previews, key=lambda size: size[0] * size[1]) if previews else None,
        "cache_to_disk": musubi or bool(job.get("cache_latents_to_disk")),
        "workers": int(job.get("max_data_loader_n_workers") or 0),
    }


def _text_in_fp8(job: KohyaJob) -> bool | None:
    """Whether the text encoders' caching pass runs in fp8: musubi-tuner's caching script's switch
    (--fp8_vl, --fp8_t5, ...); sd-scripts' T5XXL from an fp8 file with --fp8_base (the CLIPs are
    "always not fp8" there); None where neither says (no T5XXL, or its file is not here)."""
    if job.trainer.REPO == "musubi-tuner":
        flag = job.script.text_fp8
        return bool(job.trainer.cache_flag(job, job.script.text_cache[0], flag) or job.get(flag))
    if "t5xxl" not in job.options or not job.get("t5xxl"):
        return None
    return bool(job.get("fp8_base")) and part_dtype(job, "t5xxl", "") == "fp8"


def lever_changes(job: KohyaJob, lever: str) -> list[tuple[str, Any, Any]]:
    """diagnose's lever (diagnose.LEVERS) as this job's edits, (option or dataset key, old, new): the knob
    that turns the same setting, written by its own writer (so the change reads as the search would
    write it), or the option itself; none where the job has no such setting (the text encoder's fp8 is
    a file, the preview's size a prompt file's flags)."""
    knobs = {knob.name: knob for knob in job.knob_specs()}
    value = _lever_value(job, lever, knobs)
    target = job.copy()
    target.changes = {}
    if value is not None:
        knob = knobs[value[0]]
        knob.writer(target, value[1], None)
    elif lever == "cache_to_disk" and "cache_latents_to_disk" in job.options \
            and not job.get("cache_latents_to_disk"):
        target.set("cache_latents_to_disk", True)
    elif lever == "fewer_workers" and int(job.get("max_data_loader_n_workers") or 0) > 0:
        target.set("max_data_loader_n_workers", 0)
    return [(key, job.get(key), new) for key, new in target.changes.items() if job.get(key) != new]


def _lever_value(job: KohyaJob, lever: str, knobs: dict[str, KnobSpec]) -> tuple[str, Any] | None:
    """(knob name, its value) for a lever: one step lighter than the job, on the knob's own ladder."""
    def lighter(name: str) -> tuple[str, Any] | None:
        knob = knobs.get(name)
        if knob is None:
            return None
        index = knob.candidates.index(knob.desired)
        return (name, knob.candidates[index - 1]) if index > 0 else None

    if lever == "checkpointing":
        return ("gradient_checkpointing", True) if "gradient_checkpointing" in knobs and not knobs[
            "gradient_checkpointing"].desired else None
    if lever == "batch":
        return ("batch", 1) if "batch" in knobs and knobs["batch"].desired != 1 else None
    if lever == "low_vram":  # Wan 2.2's inactive expert to the host first, else half the blocks it can swap
        if "low_vram" in knobs and not knobs["low_vram"].desired:
            return "low_vram", True
        swap = knobs.get("layer_offloading")
        if swap is None or swap.desired >= swap.candidates[0]:
            return None
        return "layer_offloading", min(swap.candidates[0], swap.desired + max(1, swap.candidates[0] // 2))
    if lever == "sampling_off":
        return ("sampling", False) if "sampling" in knobs else None
    text = knobs.get("text_encoder")
    if lever == "cache_text":  # sd-scripts: cache_text_encoder_outputs
        return ("text_encoder", "cache") if text and "cache" in text.candidates and text.desired != "cache" else None
    if lever == "quantize_text":  # musubi-tuner: the text caching script's fp8 switch
        return ("text_encoder", "fp8") if text and "fp8" in text.candidates and text.desired != "fp8" else None
    if lever == "smaller_sample":
        return lighter("sample_size")
    by_knob = {"bucket": "buckets", "frames": "frames", "quantize": "quantize"}
    return lighter(by_knob[lever]) if lever in by_knob else None
