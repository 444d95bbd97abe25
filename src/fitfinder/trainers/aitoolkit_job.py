"""AI Toolkit's job file: read, validate, get and set knobs by path, write back with comments kept.

AI Toolkit's YAML (or JSON, which its run.py also takes): `job`, `config.name`, `config.process[0]`
with `network`, `datasets`, `train`, `model`, `sample`. Key paths are relative to
`config.process[0]`: `train.batch_size`, `datasets[0].resolution`, `datasets[*].resolution`
(every dataset). A key the file leaves out reads as AI Toolkit's own default, so the memory a
probe measures is the memory the trainer would use. The file's `fitfinder:` section holds
fitfinder's own settings (fitfinder.settings). AI Toolkit's rules above the file (its knobs, its
probe request, its model) are aitoolkit.py's.
"""

from __future__ import annotations

import copy
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from fitfinder.errors import ConfigError, UserError, brief, one_line
from fitfinder.files import write_atomic
from fitfinder.settings import Settings, read_settings

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
    "train.ema_config.use_ema": False,
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

# AI Toolkit's quantization types (optimum-quanto, torchao and its own uint names) -> bits; the
# probe quantizes each as AI Toolkit does (models._weights.quantize). A "uint4|adapter" value adds
# an accuracy-recovery LoRA, small next to the weights; it is not probed.
QTYPE_BITS = {"qfloat8": 8, "float8": 8, "qfloat8_e4m3fn": 8, "float8_e4m3fn": 8, "fp8": 8, "qint8": 8, "int8": 8,
              "qint4": 4, "uint4": 4, "int4": 4, "nf4": 4, "fp4": 4,
              "uint2": 2, "uint3": 3, "uint5": 5, "uint6": 6, "uint7": 7,
              # uint8 resolves to AI Toolkit's UIntXQuantizer, whose can_quantize refuses every layer
              # (toolkit/util/uintx_quant.py): the model stays in its dtype, as the probe leaves it
              "uint8": 8}
# AI Toolkit's own quantization backends (toolkit/util/ostris_quant.py get_ostris_quantizer, commit
# 27a03a91) that fitfinder does not follow yet: qtype -> the backend. Each keeps its own packed state and
# forward (rotations, codebooks, fp4 blocks, triton kernels on a card); a job naming one is refused.
UNFOLLOWED_QTYPES = {
    **{f"orbit{bits}": "OrbitQuant (toolkit/util/orbit_quant.py)" for bits in (2, 3, 4)},
    **{f"orbitvq{bits}": "OrbitVQ (toolkit/util/orbit_vq_quant.py)" for bits in (2, 3, 4)},
    **{name: "ConvRot (toolkit/util/convrot_quant.py)" for name in (
        "convrot4", "convrot8", "convrotbitnet", "convrotcomfyw4a4", *(f"convrotint{b}" for b in range(2, 9)))},
    "nvfp4": "NVFP4 (toolkit/util/nvfp4_quant.py)",
}
# Optimizers the probe builds, by the names AI Toolkit's toolkit/optimizer.py accepts (any case);
# every name starting with "prodigy" but prodigy8bit is prodigyopt's Prodigy there.
OPTIMIZERS = ("adafactor", "adam", "adamw", "adam8bit", "adamw8bit", "lion", "lion8bit", "prodigy")


def optimizer_name(value: Any) -> str | None:
    """The optimizer AI Toolkit builds for `train.optimizer`, or None when fitfinder does not probe it."""
    name = str(value).strip().lower()
    if name.startswith("prodigy") and not name.startswith("prodigy8bit"):
        return "prodigy"
    return name if name in OPTIMIZERS else None


def _qtype_name(value: Any) -> str:
    return str(value).split("|")[0].strip().lower()


# network.type values fitfinder follows (AI Toolkit's BaseSDTrainProcess.run: 'locon' and 'lycoris' take
# LycorisSpecialNetwork; toolkit/lora_special.py: 'lokr' takes LokrModule; 'dora', 'fullrank' and 'lorm'
# are not followed).
NETWORK_TYPES = ("lora", "lokr", "locon", "lycoris")


def network_type(job: "JobFile") -> str:
    """AI Toolkit's NetworkConfig.type, lower case ('lora' by default)."""
    return str(job.get("network.type", None) or "lora").lower()


def is_full_fine_tune(job: "JobFile") -> bool:
    """No `network` section: AI Toolkit trains the denoiser's own weights."""
    return not job.has("network")

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

class JobFile:
    """An AI Toolkit job file held as ruamel round-trip data (comments and key order kept)."""

    def __init__(self, data: Any, source: str, settings: Settings | None = None,
                 explicit_start: bool = False):
        self.data = data
        self.source = source
        self.settings = settings or Settings()
        self.explicit_start = explicit_start  # the file began with `---`; keep it
        # Copy-on-write (`copy`): None while no other JobFile shares these nodes; else the nodes
        # this one has copied since, by id, which `set` may change in place.
        self._own: dict[int, Any] | None = None

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
        node = self._writable_process()
        for part in parents:
            child = _child(node, part)
            if child is _MISSING:
                child = self._mine(CommentedMap())
                node[part] = child
            else:
                child = self._writable_child(node, part)
            node = child
        old = node.get(last, _MISSING) if hasattr(node, "get") else _MISSING
        node[last] = _yaml_value(value, None if old is _MISSING else old)
        if old is not _MISSING and _plain(old) != _plain(value):
            _mark_old_comment(node, last, old)

    def copy(self) -> "JobFile":
        """A copy that shares every node with this file until one of them sets a value: `set` first
        copies the nodes on its path (each with its comments), so copying costs nothing whatever the
        file holds. Every probe copies the job (space.apply), and ruamel's deep copy is quadratic in
        a list's length: a job with 9000 prompts or 9900 `process` entries stalled a search (issue 35)."""
        self._own = {} if self._own is None else self._own
        copied = JobFile(self.data, self.source, copy.deepcopy(self.settings), self.explicit_start)
        copied._own = {}
        return copied

    def _mine(self, node: Any) -> Any:
        """`node` if this file may change it in place, else its copy (made once, kept as its own)."""
        if self._own is None or id(node) in self._own:
            return node
        if hasattr(node, "copy_attributes"):
            mine = _shallow_copy(node)
        elif isinstance(node, (dict, list)):  # a plain mapping or list set from Python (job.set(path, {...}))
            mine = type(node)(node)
        else:
            mine = node
        self._own[id(mine)] = mine
        return mine

    def _writable_process(self) -> Any:
        """config.process[0], and every node above it, this file's own."""
        root = self.data = self._mine(self.data)
        config = root["config"] = self._mine(root["config"])
        processes = config["process"] = self._mine(config["process"])
        processes[0] = self._mine(processes[0])
        return processes[0]

    def _writable_child(self, node: Any, part: str) -> Any:
        """The child `part` (`train`, `datasets[0]`) of a node of this file's own, made its own too."""
        match = _INDEX.match(part)
        if match:
            items = node[match.group(1)] = self._mine(node[match.group(1)])
            index = int(match.group(2))
            items[index] = self._mine(items[index])
            return items[index]
        node[part] = self._mine(node[part])
        return node[part]

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

    # -- AI Toolkit's rules, read here once (probe, space, kohya and diagnose ask these) ----------
    @property
    def quantize(self) -> bool:
        return bool(self.get("model.quantize"))

    @property
    def quantize_te(self) -> bool:
        """AI Toolkit quantizes the text encoders as it does the model unless `quantize_te` says
        otherwise (ModelConfig: `quantize_te` defaults to `quantize`)."""
        return bool(self.get("model.quantize_te") if self.has("model.quantize_te") else self.get("model.quantize"))

    @property
    def qtype(self) -> str:
        """The base model's qtype name as AI Toolkit reads it (`qfloat8`, `uint4|ostris/...`: the
        part before `|`, the adapter after it changes no memory)."""
        return _qtype_name(self.get("model.qtype"))

    @property
    def qtype_te(self) -> str:
        return _qtype_name(self.get("model.qtype_te"))

    @property
    def batch_size(self) -> int:
        """The batch a step trains: the datasets' own `batch_size`, which overrides train.batch_size
        (toolkit/data_loader.py get_dataloader_from_datasets, AI Toolkit b96476a8; the checks allow one
        value across datasets), else train.batch_size."""
        own = [d.get("batch_size") for d in self.process.get("datasets") or [] if isinstance(d, dict)]
        own = [value for value in own if value is not None]
        return int(own[0]) if own else int(self.get("train.batch_size"))

    @property
    def lora_rank(self) -> int | None:
        """The LoRA's rank, None for a full fine-tune (no `network`). AI Toolkit's NetworkConfig
        takes `rank` over `linear` when both are given."""
        if is_full_fine_tune(self):
            return None
        return int(self.get("network.rank", None) or self.get("network.linear"))

    @property
    def lora_alpha(self) -> float | None:
        """`linear_alpha`, which defaults to `alpha`, which defaults to 1.0 (NetworkConfig)."""
        if is_full_fine_tune(self):
            return None
        return float(self.get("network.linear_alpha", None) or self.get("network.alpha", None) or 1.0)

    @property
    def buckets(self) -> list[int]:
        """Every resolution the datasets train at (`resolution` is one size or a list), sorted."""
        return sorted({int(r) for value in self.get("datasets[*].resolution")
                       for r in (value if isinstance(value, list) else [value])})

    @property
    def text_encoder_mode(self) -> str:
        """cache: all captions encoded before training; unload: trigger and sample prompts only;
        keep. AI Toolkit caches when the train section or any dataset says so
        (BaseSDTrainProcess: is_caching_text_embeddings), which wins over unload_text_encoder."""
        if self.get("train.cache_text_embeddings") or any(self.get("datasets[*].cache_text_embeddings", None)):
            return "cache"
        return "unload" if self.get("train.unload_text_encoder") else "keep"

    @property
    def latents_cached(self) -> bool:
        """AI Toolkit keeps the VAE off the device only when every dataset caches its latents."""
        return all(bool(memory) or bool(disk) for memory, disk in
                   zip(self.get("datasets[*].cache_latents"), self.get("datasets[*].cache_latents_to_disk")))

    # -- writing ---------------------------------------------------------------------------
    def dumps(self, header: list[str] | None = None) -> str:
        """The job file as YAML without the `fitfinder:` section, `header` lines as comments."""
        data = _shallow_copy(self.data) if hasattr(self.data, "copy_attributes") else self.data
        if hasattr(data, "pop"):
            data.pop("fitfinder", None)
        stream = io.StringIO()
        yaml = _yaml()
        yaml.explicit_start = self.explicit_start
        yaml.dump(data, stream)
        lines = [f"# {one_line(line, 1000)}".rstrip() for line in (header or [])]  # a newline would add YAML
        return "\n".join(lines) + ("\n" if lines else "") + stream.getvalue()

    def write(self, path: str | Path, header: list[str] | None = None) -> Path:
        """Write atomically; refuses to write over the file it was read from."""
        path = Path(path)
        if Path(self.source).resolve() == path.resolve():
            raise UserError(f"{path}: refusing to write over the input job file")
        write_atomic(path, self.dumps(header))
        return path


def _shallow_copy(node: Any) -> Any:
    """A new ruamel mapping or sequence holding the same children, with its own copy of the node's
    comments, anchor and format (so that changing one node never changes the other's comments)."""
    from ruamel.yaml.comments import CommentedMap

    copied = type(node)()
    if isinstance(node, CommentedMap):
        for key in node:  # as CommentedMap.__deepcopy__ does, merged (<<) keys included
            copied[key] = node[key]
    else:
        copied.extend(node)
    node.copy_attributes(copied, memo={id(node): copied})
    return copied

# A job file is a few KiB; 1 MiB leaves room for hundreds of prompts. Past it, parsing and the
# search's copies of the file take minutes (measured: 50 MB took 50 s to parse).
MAX_JOB_BYTES = 1 << 20
# Values in the file once its aliases are expanded: an alias bomb (`&a [*b, *b, ...]` nested)
# is a few lines that expand to billions of values when anything walks or prints it.
MAX_VALUES = 10_000
MAX_DEPTH = 50


def load(path: str | Path) -> JobFile:
    """Read and validate a job file; every problem is reported at once as a ConfigError."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file; give the path of an AI Toolkit job file (.yaml)")
    if path.is_dir():
        raise UserError(f"{path}: is a folder; give the path of an AI Toolkit job file (.yaml)")
    if not path.is_file():  # a FIFO would block the open, /dev/zero never ends
        raise UserError(f"{path}: not a regular file; give the path of an AI Toolkit job file (.yaml)")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_JOB_BYTES + 1)  # a FIFO or /dev/zero must not be read to the end
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > MAX_JOB_BYTES:
        raise UserError(f"{path}: larger than 1 MiB; an AI Toolkit job file is a few KiB")
    return loads(_decode(raw, path), str(path))


def _decode(raw: bytes, path: Path) -> str:
    """UTF-8, refused otherwise: a replacement character would end up in best.yaml as if it were the name."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
                        "save the job file as UTF-8") from None


def loads(text: str, source: str = "<job>") -> JobFile:
    from ruamel.yaml.error import YAMLError

    if len(text) > MAX_JOB_BYTES:
        raise UserError(f"{source}: larger than 1 MiB; an AI Toolkit job file is a few KiB")
    if _flow_depth(text) > MAX_DEPTH:  # ruamel's scanner is quadratic in it: 3000 `[` took 12 s
        raise UserError(f"{source}: nested more than {MAX_DEPTH} levels deep")
    try:
        data = _yaml().load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}: not valid YAML{where}: {one_line(problem, 200)}") from None
    except RecursionError:
        raise UserError(f"{source}: not valid YAML: nested too deeply") from None
    except (ValueError, TypeError) as exc:  # a 5000-digit integer, a list used as a key
        raise UserError(f"{source}: not valid YAML: {one_line(str(exc), 120)}") from None
    size_problem = _size_problem(data)
    if size_problem:
        raise UserError(f"{source}: {size_problem}")
    problems = _structure_problems(data)
    if problems:
        raise ConfigError(source, problems)
    settings, settings_problems = read_settings(_plain(data.get("fitfinder")))
    content = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    explicit_start = bool(content) and content[0].startswith("---")
    job = JobFile(data, source, settings, explicit_start)
    problems = settings_problems + _value_problems(job)
    if problems:
        raise ConfigError(source, problems)
    return job


def _flow_depth(text: str) -> int:
    """How deep `[` and `{` nest, counted on the brackets alone (quotes are not told apart: a
    prompt would need 50 unclosed brackets to be miscounted)."""
    depth = deepest = 0
    for bracket in re.sub(r"[^\[\]{}]+", "", text):
        depth = depth + 1 if bracket in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _size_problem(data: Any) -> str | None:
    """Walk the values as they read once aliases are expanded, stopping at the budget: of values,
    and of text (a 900 KiB string referenced 9000 times is 8 GB once anything copies each)."""
    stack, seen, chars = [(data, 0)], 0, 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        chars += len(node) if isinstance(node, str) else 0
        if seen > MAX_VALUES:
            return (f"more than {MAX_VALUES} values once its aliases (*name) are expanded; "
                    "a job file holds a few hundred")
        if chars > 2 * MAX_JOB_BYTES:
            return "more than 2 MiB of text once its aliases (*name) are expanded"
        if depth > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} levels deep"
        if isinstance(node, dict):
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
    return None


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


# Sane ranges of the numbers fitfinder reads (inclusive). Past them a value is a typo, and some
# would hang the search: the batch's divisors, a million frames, a 10^10 pixel bucket.
PIXELS, RANKS, FRAMES = (1, 16384), (1, 4096), (1, 10_000)
_INTEGERS = {
    "network.linear": RANKS, "network.rank": RANKS,
    "train.batch_size": (1, 10_000), "train.gradient_accumulation": (1, 10_000),
    "train.gradient_accumulation_steps": (1, 10_000), "train.switch_boundary_every": (1, 1_000_000),
    "train.steps": (1, 100_000_000), "sample.width": PIXELS, "sample.height": PIXELS,
    "sample.sample_steps": (1, 10_000), "sample.num_frames": FRAMES,
    "sample.sample_every": (1, 100_000_000), "sample.seed": (-(2**63), 2**63 - 1),
    "save.save_every": (1, 100_000_000),
    "network.lokr_factor": (-1, 1_000_000),  # NetworkConfig: -1 (the default) splits each side most evenly
}
_DATASET_INTEGERS = {"num_frames": FRAMES, "bucket_tolerance": (1, 4096), "num_repeats": (1, 1_000_000),
                     "batch_size": (1, 10_000)}
_NUMBERS = {  # (low, high, low excluded)
    "network.linear_alpha": (0, 1e6, True), "network.alpha": (0, 1e6, True), "network.conv_alpha": (0, 1e6, True),
    "sample.guidance_scale": (0, 100, False), "train.lr": (0, 10, True),
    "model.layer_offloading_transformer_percent": (0, 1, False),
    "model.layer_offloading_text_encoder_percent": (0, 1, False),
}
_STRINGS = ("model.name_or_path", "network.type", "training_folder")
_OPTIONAL_TEXTS = ("sample.neg", "trigger_word")  # `neg:` left empty reads as null: no text
_SWITCHES = ("train.gradient_checkpointing", "train.skip_first_sample", "train.disable_sampling",
             "train.cache_text_embeddings", "train.unload_text_encoder", "model.quantize", "model.quantize_te",
             "model.low_vram", "model.is_flux", "model.is_xl", "model.layer_offloading", "sample.walk_seed",
             "train.ema_config.use_ema", "network.lokr_full_rank", "train.diff_output_preservation",
             "train.blank_prompt_preservation")


def _value_problems(job: JobFile) -> list[str]:
    """Type and range of every key fitfinder reads or exports, all problems at once."""
    p = "config.process[0]."
    problems: list[str] = []

    def check(path: str, ok, expected: str) -> None:
        if job.has(path):
            value = job.get(path)
            if not ok(value):
                problems.append(f"{p}{path}: expected {expected}, got {brief(value)}")

    for section in ("network", "train", "model", "sample", "save"):
        if job.has(section) and not isinstance(job.get(section), dict):
            problems.append(f"{p}{section}: expected a mapping, got {brief(job.get(section))}")
    if problems:
        return problems

    if job.has("adapter") and not job.has("network"):
        # An adapter job (AI Toolkit's Redux, IP-Adapter, control adapters) trains neither a LoRA nor
        # the denoiser: taking it for a full fine-tune would meter the wrong model.
        problems.append(f"{p}adapter: fitfinder probes LoRA jobs and full fine-tunes, not adapter "
                        "training; it cannot size this job")
    if job.has("network") and not job.has("network.linear") and not job.has("network.rank"):
        problems.append(f"{p}network.linear: missing; set the LoRA rank, or leave `network` out for a full fine-tune")
    for path, (low, high) in _INTEGERS.items():
        check(path, lambda v, low=low, high=high: int_in(v, low, high), _integers(low, high))
    # NetworkConfig's `conv`: None or 0 is no LoRA on the larger convolutions (lora_special.py skips dim 0)
    check("network.conv", lambda v: v is None or int_in(v, 0, RANKS[1]), f"null or {_integers(0, RANKS[1])}")
    for path, (low, high, open_low) in _NUMBERS.items():
        check(path, lambda v, low=low, high=high, open_low=open_low: _number_in(v, low, high, open_low),
              f"a number {'above' if open_low else 'from'} {low} {'and at most' if open_low else 'to'} {high}")
    for path in _STRINGS:
        check(path, lambda v: isinstance(v, str) and v.strip() != "", "a text")
    check("network.type", lambda v: not isinstance(v, str) or v.strip() == "" or v.lower() in NETWORK_TYPES,
          f"one of {', '.join(NETWORK_TYPES)} (the networks fitfinder probes as AI Toolkit builds them)")
    for path in _OPTIONAL_TEXTS:
        check(path, lambda v: v is None or isinstance(v, str), "a text")
    for path in _SWITCHES:
        check(path, lambda v: isinstance(v, bool), "true or false")
    check("sample.prompts", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
          "a list of prompts (texts)")
    problems += _dataset_problems(job, check)

    if (int_in(job.get("train.gradient_accumulation"), 1, 10_000)
            and int_in(job.get("train.gradient_accumulation_steps"), 1, 10_000)
            and job.get("train.gradient_accumulation") > 1 and job.get("train.gradient_accumulation_steps") > 1):
        problems.append(f"{p}train.gradient_accumulation: AI Toolkit refuses it together with "
                        "gradient_accumulation_steps; keep one of them")
    check("train.dtype", lambda v: str(v).lower() in DTYPES, "one of bf16, fp16, fp32")
    check("train.optimizer", lambda v: optimizer_name(v) is not None,
          f"one of {', '.join(OPTIMIZERS)} (the optimizers fitfinder probes)")
    check("train.optimizer_params", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
          "a mapping of the optimizer's arguments")
    for key in ("model.only_if_contains", "model.ignore_if_contains"):
        check(key, lambda v: isinstance(v, list) and all(isinstance(t, str) and t for t in v),
              "a list of parameter name parts")
    # AI Toolkit's UI blanks both qtypes for Anima (ui/src/app/jobs/new/options.tsx, 'anima'); ModelConfig
    # keeps '' and get_qtype (toolkit/util/quantize.py) reads a qtype only to quantize with it.
    unused = {"model.qtype": not job.quantize and not job.quantize_te, "model.qtype_te": not job.quantize_te}
    for key in ("model.qtype", "model.qtype_te"):
        if not (unused[key] and job.has(key) and job.get(key) == ""):
            backend = UNFOLLOWED_QTYPES.get(_qtype_name(job.get(key))) if job.has(key) else None
            if backend:
                problems.append(f"{p}{key}: {job.get(key)} is AI Toolkit's {backend} quantization, which fitfinder "
                                "does not follow yet; probe it with qfloat8, qint8, qint4 or uint2 to uint7")
                continue
            check(key, _qtype_ok, f"one of {', '.join(QTYPE_BITS)} (optionally followed by |adapter)")
    from fitfinder.models import arch_problem  # no torch there

    arch = job.get("model.arch", None)
    if arch is not None and (not isinstance(arch, str) or arch_problem(arch)):
        problems.append(f"{p}model.arch: {arch_problem(str(arch))}")
    return problems


def _dataset_problems(job: JobFile, check) -> list[str]:
    p = "config.process[0]."
    datasets = job.process.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        return [f"{p}datasets: missing or empty; expected a list of datasets with `resolution`"]
    problems = []
    for i, dataset in enumerate(datasets):
        if not isinstance(dataset, dict):
            problems.append(f"{p}datasets[{i}]: expected a mapping, got {brief(dataset)}")
            continue
        check(f"datasets[{i}].resolution", _resolution_ok,
              f"a positive integer or a non-empty list of positive integers (pixels, at most {PIXELS[1]})")
        for key, (low, high) in _DATASET_INTEGERS.items():
            check(f"datasets[{i}].{key}", lambda v, low=low, high=high: int_in(v, low, high), _integers(low, high))
        for key in ("cache_latents", "cache_latents_to_disk"):
            check(f"datasets[{i}].{key}", lambda v: isinstance(v, bool), "true or false")
        for key in ("folder_path", "caption_ext"):
            check(f"datasets[{i}].{key}", lambda v: isinstance(v, str) and v.strip() != "", "a text")
    own = sorted({d["batch_size"] for d in datasets if isinstance(d, dict) and d.get("batch_size") is not None},
                 key=str)
    if len(own) > 1:
        problems.append(f"{p}datasets[*].batch_size: these datasets batch by {', '.join(map(str, own))}; fitfinder "
                        "probes one batch size, so give them the same one (or leave it to train.batch_size)")
    return problems

def _integers(low: int, high: int) -> str:
    return f"a positive integer (at most {high})" if low == 1 else f"an integer from {low} to {high}"


def int_in(value: Any, low: int, high: int) -> bool:
    """An integer (not a bool) from low to high."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number_in(value: Any, low: float, high: float, open_low: bool) -> bool:
    """A finite number in range; a text such as "1e-4" counts (PyYAML, which AI Toolkit reads
    with, takes 1e-4 for a text, and AI Toolkit converts it)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (low < value if open_low else low <= value) and value <= high


def _resolution_ok(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(int_in(v, *PIXELS) for v in value)
    return int_in(value, *PIXELS)

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


def _mark_old_comment(node: Any, key: str, old: Any) -> None:
    """A changed key's end-of-line comment spoke of the value it had (`gradient_checkpointing:
    true  # off: faster, ...`): it is kept, marked as about that old value, so that it no longer
    contradicts the new one. Comment lines below it (ruamel keeps them in the same token) stay."""
    comments = getattr(node, "ca", None)
    token = comments.items.get(key, [None, None, None])[2] if comments is not None else None
    if token is None or not token.value.lstrip().startswith("#"):
        return
    first, newline, rest = token.value.partition("\n")
    said = first.lstrip().removeprefix("#").strip()
    if said.startswith("fitfinder: was "):  # already marked: the first value is the user's
        return
    shown = json.dumps(_plain(old)) if not isinstance(_plain(old), str) else _plain(old)
    token.value = f"{first[:len(first) - len(first.lstrip())]}# fitfinder: was {shown} ({said}){newline}{rest}"


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
