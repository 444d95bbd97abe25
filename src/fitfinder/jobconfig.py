"""Trainer job files: read, validate, get and set knobs by path, write with comments kept.

AI Toolkit's YAML is the format read here: `job`, `config.name`, `config.process[0]` with
`network`, `datasets`, `train`, `model`, `sample`. Key paths are relative to
`config.process[0]`: `train.batch_size`, `datasets[0].resolution`, `datasets[*].resolution`
(every dataset). A key the file leaves out reads as AI Toolkit's own default, so the memory a
probe measures is the memory the trainer would use.
"""

from __future__ import annotations

import copy
import io
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitfinder.errors import ConfigError, UserError
from fitfinder.units import parse_bytes

# AI Toolkit's defaults for the keys that decide memory (its toolkit/config_modules.py).
AITK_DEFAULTS: dict[str, Any] = {
    "train.batch_size": 1,
    "train.gradient_accumulation": 1,
    "train.gradient_accumulation_steps": 1,
    "train.gradient_checkpointing": True,
    "train.dtype": "fp32",
    "train.optimizer": "adamw",
    "train.lr": 1e-6,
    "train.skip_first_sample": False,
    "train.disable_sampling": False,
    "train.cache_text_embeddings": False,
    "train.unload_text_encoder": False,
    "train.switch_boundary_every": 1,
    "model.quantize": False,
    "model.qtype": "qfloat8",
    "model.qtype_te": "qfloat8",
    "model.low_vram": False,
    "model.is_flux": False,
    "model.is_xl": False,
    "model.model_kwargs.train_high_noise": True,  # Wan 2.2: LoRA on the high-noise expert
    "model.model_kwargs.train_low_noise": True,  # and on the low-noise one
    "datasets[*].resolution": 512,
    "datasets[*].num_frames": 1,
    "datasets[*].bucket_tolerance": 64,
    "datasets[*].cache_latents": False,
    "datasets[*].cache_latents_to_disk": False,
    "sample.width": 512,
    "sample.height": 512,
    "sample.sample_steps": 20,
    "sample.num_frames": 1,
    "sample.guidance_scale": 7,
}

# The knobs the search may turn, by name; `fitfinder: candidates:` overrides their values.
KNOB_NAMES = (
    "buckets", "frames", "rank", "batch", "gradient_checkpointing", "quantize", "low_vram",
    "text_encoder", "optimizer", "sample_size", "sample_frames", "sampling",
)

# AI Toolkit's quantization types (optimum-quanto, torchao and its own uint names) -> bits; the
# probe quantizes each as AI Toolkit does (models._weights.quantize). A "uint4|adapter" value adds
# an accuracy-recovery LoRA, small next to the weights; it is not probed.
QTYPE_BITS = {"qfloat8": 8, "float8": 8, "qfloat8_e4m3fn": 8, "float8_e4m3fn": 8, "fp8": 8, "qint8": 8, "int8": 8,
              "qint4": 4, "uint4": 4, "int4": 4, "nf4": 4, "fp4": 4,
              "uint2": 2, "uint3": 3, "uint5": 5, "uint6": 6, "uint7": 7}
# Optimizers the probe runs, by AI Toolkit's names -> the implementation (Adam and AdamW hold the
# same state).
OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "adamw8bit": "adamw8bit", "adam8bit": "adamw8bit"}

DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
          "fp16": "fp16", "float16": "fp16", "half": "fp16"}

def qtype_bits(qtype: Any) -> tuple[int, str]:
    """(bits, 4-bit kind) of an AI Toolkit qtype such as 'qfloat8' or 'uint4|ostris/...'."""
    base = str(qtype).split("|")[0].strip().lower()
    return QTYPE_BITS[base], "fp4" if base == "fp4" else "nf4"


def _qtype_ok(value: Any) -> bool:
    return isinstance(value, str) and value.split("|")[0].strip().lower() in QTYPE_BITS


_INDEX = re.compile(r"^([A-Za-z_][\w]*)\[(\d+|\*)\]$")
_MISSING = object()


@dataclass
class Settings:
    """fitfinder's own settings: the `fitfinder:` section, then command-line options on top."""

    vram_bytes: int | None = None
    margin: float = 0.05
    probe_steps: int = 20
    probe_timeout: float = 600.0
    trials: int = 40
    weights: str = "pretrained"
    candidates: dict[str, list] = field(default_factory=dict)
    priorities: list[str] = field(default_factory=list)

    def with_options(self, **options: Any) -> "Settings":
        """Command-line options win over the file; None means 'not given'."""
        merged = copy.deepcopy(self)
        for key, value in options.items():
            if value is not None:
                setattr(merged, key, value)
        return merged


class JobFile:
    """An AI Toolkit job file held as ruamel round-trip data (comments and key order kept)."""

    def __init__(self, data: Any, source: str, settings: Settings | None = None,
                 explicit_start: bool = False):
        self.data = data
        self.source = source
        self.settings = settings or Settings()
        self.explicit_start = explicit_start  # the file began with `---`; keep it

    # -- reading ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self.data["config"]["name"])

    @property
    def process(self) -> Any:
        return self.data["config"]["process"][0]

    @property
    def datasets(self) -> list:
        return list(self.process.get("datasets") or [])

    def get(self, path: str, default: Any = _MISSING) -> Any:
        """The value at `path`, or AI Toolkit's default when the file leaves it out.

        `datasets[*].key` gives a list with one value per dataset.
        """
        if path.startswith("datasets[*]."):
            key = path[len("datasets[*]."):]
            return [self.get(f"datasets[{i}].{key}", default) for i in range(len(self.datasets))]
        node = self.process
        for part in path.split("."):
            node = _child(node, part)
            if node is _MISSING:
                break
        if node is not _MISSING:
            return node
        if default is not _MISSING:
            return default
        return AITK_DEFAULTS.get(re.sub(r"datasets\[\d+\]", "datasets[*]", path))

    def has(self, path: str) -> bool:
        node = self.process
        for part in path.split("."):
            node = _child(node, part)
            if node is _MISSING:
                return False
        return True

    def set(self, path: str, value: Any) -> None:
        """Set `path` (creating missing mappings); `datasets[*].key` sets it on every dataset."""
        if path.startswith("datasets[*]."):
            for i in range(len(self.datasets)):
                self.set(f"datasets[{i}].{path[len('datasets[*].'):]}", value)
            return
        from ruamel.yaml.comments import CommentedMap

        *parents, last = path.split(".")
        node = self.process
        for part in parents:
            child = _child(node, part)
            if child is _MISSING:
                child = CommentedMap()
                node[part] = child
            node = child
        node[last] = _yaml_value(value, node.get(last) if hasattr(node, "get") else None)

    def copy(self) -> "JobFile":
        return JobFile(copy.deepcopy(self.data), self.source, copy.deepcopy(self.settings),
                       self.explicit_start)

    # -- accumulation: AI Toolkit reads two mutually exclusive keys ---------------------------
    @property
    def accumulation_key(self) -> str:
        """The accumulation key this file uses; `gradient_accumulation` when it uses neither."""
        if self.has("train.gradient_accumulation_steps") and not self.has("train.gradient_accumulation"):
            return "train.gradient_accumulation_steps"
        return "train.gradient_accumulation"

    @property
    def accumulation(self) -> int:
        return max(int(self.get("train.gradient_accumulation")),
                   int(self.get("train.gradient_accumulation_steps")))

    # -- writing ---------------------------------------------------------------------------
    def dumps(self, header: list[str] | None = None) -> str:
        """The job file as YAML without the `fitfinder:` section, `header` lines as comments."""
        data = copy.deepcopy(self.data)
        if hasattr(data, "pop"):
            data.pop("fitfinder", None)
        stream = io.StringIO()
        yaml = _yaml()
        yaml.explicit_start = self.explicit_start
        yaml.dump(data, stream)
        lines = [f"# {line}".rstrip() for line in (header or [])]
        return "\n".join(lines) + ("\n" if lines else "") + stream.getvalue()

    def write(self, path: str | Path, header: list[str] | None = None) -> Path:
        """Write atomically; refuses to write over the file it was read from."""
        path = Path(path)
        if Path(self.source).resolve() == path.resolve():
            raise UserError(f"{path}: refusing to write over the input job file")
        write_atomic(path, self.dumps(header))
        return path


def write_atomic(path: str | Path, text: str) -> None:
    """Write through a temporary file in the same folder and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path) -> JobFile:
    """Read and validate a job file; every problem is reported at once as a ConfigError."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file; give the path of an AI Toolkit job file (.yaml)")
    if path.is_dir():
        raise UserError(f"{path}: is a folder; give the path of an AI Toolkit job file (.yaml)")
    text = path.read_text(encoding="utf-8", errors="replace")
    return loads(text, str(path))


def loads(text: str, source: str = "<job>") -> JobFile:
    from ruamel.yaml.error import YAMLError

    try:
        data = _yaml().load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}: not valid YAML{where}: {problem}") from None
    problems = _structure_problems(data)
    if problems:
        raise ConfigError(source, problems)
    settings, settings_problems = _read_settings(data.get("fitfinder"))
    content = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    explicit_start = bool(content) and content[0].startswith("---")
    job = JobFile(data, source, settings, explicit_start)
    problems = settings_problems + _value_problems(job)
    if problems:
        raise ConfigError(source, problems)
    return job


# -- validation ------------------------------------------------------------------------------
def _structure_problems(data: Any) -> list[str]:
    """The shape without which nothing else can be read: config.name, config.process[0]."""
    if not isinstance(data, dict):
        return ["top level: expected a mapping with `job` and `config` (an AI Toolkit job file)"]
    config = data.get("config")
    if not isinstance(config, dict):
        return ["config: missing; an AI Toolkit job file has `config: {name, process: [...]}`"]
    problems = []
    if not isinstance(config.get("name"), (str, int)) or not str(config.get("name")).strip():
        problems.append("config.name: missing; it names the study and the results folder")
    process = config.get("process")
    if not isinstance(process, list) or not process:
        problems.append("config.process: missing or empty; expected a list with one training process")
    elif not isinstance(process[0], dict):
        problems.append("config.process[0]: expected a mapping with network, datasets, train, model")
    return problems


def _value_problems(job: JobFile) -> list[str]:
    """Type and range of every memory-relevant key, all problems at once."""
    p = "config.process[0]."
    problems: list[str] = []

    def check(path: str, ok, expected: str) -> None:
        if job.has(path):
            value = job.get(path)
            if not ok(value):
                problems.append(f"{p}{path}: expected {expected}, got {value!r}")

    for section in ("network", "train", "model", "sample"):
        if job.has(section) and not isinstance(job.get(section), dict):
            problems.append(f"{p}{section}: expected a mapping, got {job.get(section)!r}")
    if problems:
        return problems

    if not job.has("network.linear") and not job.has("network.rank"):
        problems.append(f"{p}network.linear: missing; fitfinder tunes LoRA jobs (set the LoRA rank)")
    check("network.linear", _positive_int, "a positive integer (LoRA rank)")
    check("network.rank", _positive_int, "a positive integer (LoRA rank)")
    check("network.linear_alpha", _positive_number, "a positive number")
    check("network.alpha", _positive_number, "a positive number")

    datasets = job.process.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        problems.append(f"{p}datasets: missing or empty; expected a list of datasets with `resolution`")
    else:
        for i, dataset in enumerate(datasets):
            if not isinstance(dataset, dict):
                problems.append(f"{p}datasets[{i}]: expected a mapping, got {dataset!r}")
                continue
            check(f"datasets[{i}].resolution", _resolution_ok,
                  "a positive integer or a non-empty list of positive integers (pixels)")
            check(f"datasets[{i}].num_frames", _positive_int, "a positive integer")

    check("train.batch_size", _positive_int, "a positive integer")
    check("train.gradient_accumulation", _positive_int, "a positive integer")
    check("train.gradient_accumulation_steps", _positive_int, "a positive integer")
    if (_positive_int(job.get("train.gradient_accumulation"))
            and _positive_int(job.get("train.gradient_accumulation_steps"))
            and job.get("train.gradient_accumulation") > 1 and job.get("train.gradient_accumulation_steps") > 1):
        problems.append(f"{p}train.gradient_accumulation: AI Toolkit refuses it together with "
                        "gradient_accumulation_steps; keep one of them")
    for key in ("train.gradient_checkpointing", "train.skip_first_sample", "train.disable_sampling",
                "train.cache_text_embeddings", "train.unload_text_encoder", "model.quantize",
                "model.quantize_te", "model.low_vram", "model.is_flux", "model.is_xl"):
        check(key, lambda v: isinstance(v, bool), "true or false")
    for i in range(len(datasets) if isinstance(datasets, list) else 0):
        for key in ("cache_latents", "cache_latents_to_disk"):
            check(f"datasets[{i}].{key}", lambda v: isinstance(v, bool), "true or false")
    check("train.dtype", lambda v: str(v).lower() in DTYPES, "one of bf16, fp16, fp32")
    check("train.optimizer", lambda v: str(v).lower() in OPTIMIZERS,
          f"one of {', '.join(OPTIMIZERS)} (the optimizers fitfinder probes)")
    for key in ("model.qtype", "model.qtype_te"):
        check(key, _qtype_ok, f"one of {', '.join(QTYPE_BITS)} (optionally followed by |adapter)")
    from fitfinder.models import ARCH_VALUES  # no torch there

    check("model.arch", lambda v: isinstance(v, str) and v.split(":")[0].strip().lower() in ARCH_VALUES,
          f"one of {', '.join(ARCH_VALUES)} (the model families fitfinder probes)")
    check("train.switch_boundary_every", _positive_int, "a positive integer")
    check("sample.guidance_scale", lambda v: _positive_number(v) or v == 0, "a number >= 0")
    check("train.steps", _positive_int, "a positive integer")
    check("model.name_or_path", lambda v: isinstance(v, str) and v.strip(), "a model name or folder")
    for key in ("sample.width", "sample.height", "sample.sample_steps", "sample.num_frames"):
        check(key, _positive_int, "a positive integer")
    return problems


def _read_settings(section: Any) -> tuple[Settings, list[str]]:
    """The `fitfinder:` section as Settings, with a problem for each unknown or bad key."""
    settings = Settings()
    if section is None:
        return settings, []
    if not isinstance(section, dict):
        return settings, [f"fitfinder: expected a mapping, got {section!r}"]
    problems: list[str] = []
    readers = {
        "vram": ("vram_bytes", lambda v: parse_bytes(v, "fitfinder.vram")),
        "margin": ("margin", lambda v: _in_range(v, 0.0, 0.9, "fitfinder.margin", float)),
        "probe_steps": ("probe_steps", lambda v: _in_range(v, 1, 100000, "fitfinder.probe_steps", int)),
        "probe_timeout": ("probe_timeout",
                          lambda v: _in_range(v, 1, 86400, "fitfinder.probe_timeout", float)),
        "trials": ("trials", lambda v: _in_range(v, 1, 100000, "fitfinder.trials", int)),
        "weights": ("weights", _weights),
        "candidates": ("candidates", _candidates),
        "priorities": ("priorities", _priorities),
    }
    for key, value in section.items():
        if key not in readers:
            problems.append(f"fitfinder.{key}: unknown key; known keys are {', '.join(readers)}")
            continue
        attribute, read = readers[key]
        try:
            setattr(settings, attribute, read(value))
        except UserError as exc:
            problems.append(str(exc))
    return settings, problems


def _in_range(value: Any, low: float, high: float, what: str, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise UserError(f"{what}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not low <= value <= high:
        raise UserError(f"{what}: must be between {low} and {high}, got {value!r}")
    return kind(value)


def _weights(value: Any) -> str:
    if value not in ("random", "pretrained"):
        raise UserError(f"fitfinder.weights: expected `random` or `pretrained`, got {value!r}")
    return str(value)


def _candidates(value: Any) -> dict[str, list]:
    if not isinstance(value, dict):
        raise UserError(f"fitfinder.candidates: expected a mapping of knob name to a list, got {value!r}")
    out = {}
    for name, values in value.items():
        if name not in KNOB_NAMES:
            raise UserError(f"fitfinder.candidates.{name}: unknown knob; known knobs are {', '.join(KNOB_NAMES)}")
        if not isinstance(values, list) or not values:
            raise UserError(f"fitfinder.candidates.{name}: expected a non-empty list, got {values!r}")
        out[str(name)] = _plain(values)
    return out


def _priorities(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"fitfinder.priorities: expected a list of knob names, got {value!r}")
    unknown = [v for v in value if v not in KNOB_NAMES]
    if unknown:
        raise UserError(f"fitfinder.priorities: unknown knob {unknown[0]!r}; known knobs are {', '.join(KNOB_NAMES)}")
    return list(value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _resolution_ok(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_positive_int(v) for v in value)
    return _positive_int(value)


# -- YAML plumbing -----------------------------------------------------------------------------
def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never fold long prompt lines
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def _child(node: Any, part: str) -> Any:
    match = _INDEX.match(part)
    if match:
        node = node.get(match.group(1)) if isinstance(node, dict) else None
        index = int(match.group(2))
        return node[index] if isinstance(node, list) and index < len(node) else _MISSING
    if isinstance(node, dict) and part in node:
        return node[part]
    return _MISSING


def _yaml_value(value: Any, old: Any) -> Any:
    """Lists are written in flow style (`[256, 384]`) as AI Toolkit's examples write them."""
    if isinstance(value, (list, tuple)):
        from ruamel.yaml.comments import CommentedSeq

        seq = CommentedSeq(list(value))
        seq.fa.set_flow_style()
        return seq
    return value


def _plain(value: Any) -> Any:
    """ruamel's scalar and sequence types as plain Python values."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return value if value is None else str(value) if not isinstance(value, str) else str(value)
