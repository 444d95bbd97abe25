"""Model families: which one a job trains, its architecture, where its weights come from.

Each family is one public module of this package (`flux.py`, `sdxl.py`, `wan22_5b.py`, ...): its declaration
`FAMILY` (models/_family.py; no torch) and its `Recipe` (what it computes; probe children only).
The registry below finds them, and answers by name: an `arch` value, a model's name, a shipped
architecture, a local folder or the Hugging Face cache (a trainer reads its own job's keys:
trainers/aitoolkit.py `family_of`, `model_spec`).

A family is the set of parts of a diffusers pipeline that a LoRA training holds in memory: the
denoiser(s), the text encoder(s) and the VAE, by their diffusers folder names. A job's model
comes either from real weights (`model.name_or_path`: a local diffusers folder or the Hugging
Face cache, read offline) or, with `fitfinder: {weights: random}`, from one of the architecture
configs shipped in `archs/` with random weights: the same shapes and the same memory, without
reading 20 GB from disk.

An architecture config (`archs/NAME.json`) is data:

    {"family": "flux", "description": "...", "names": ["black-forest-labs/FLUX.1-dev", ...],
     "text_seq_len": 512,                      # tokens of the T5/UMT5 encoder (CLIP: 77 or fewer)
     "boundary_ratio": 0.875,                  # two-expert Wan 2.2 only
     "parts": {"transformer": {...}, "text_encoder": {...}, "text_encoder_2": {...}, "vae": {...}}}

where each part's mapping is the keyword arguments of its class (the `config.json` a diffusers
folder holds for that part). This module needs no torch, so the CLI can read archs instantly;
building and running the parts lives in the private modules, imported by probe children only.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pkgutil
import re
from pathlib import Path
from typing import Any

from fitfinder import files
from fitfinder.errors import UserError
from fitfinder.models._family import Family

ARCH_DIR = Path(__file__).resolve().parent.parent / "archs"


# -- the registry: every public module of this package is a family (see models/_family.py) --------
def _family_modules() -> dict[str, Family]:
    """Each `models/NAME.py` (no leading underscore) declares `FAMILY`; no torch is imported here."""
    found = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not module.name.startswith("_"):
            family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
            if family.name != module.name:  # archs/*.json and jobs name the family by its module
                raise ImportError(f"models/{module.name}.py declares the family {family.name!r}; name them alike")
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _family_modules()

# Models AI Toolkit trains that no family module probes yet: named here so a job of one is told so by
# name. Their `arch` values as AI Toolkit's model classes declare them (extensions_built_in/
# diffusion_models/*, audio_models/ace_step; the UI's ui/src/app/jobs/new/options.tsx offers each) and
# toolkit/config_modules.py ModelArch's older ones; commit 27a03a91. docs/models.md says why each waits.
# A family module that claims one of these names takes precedence, so adding a family needs no edit
# here (delete its rows when you add it, to keep this list honest).
_TO_COME_ARCH_VALUES = {
    "omnigen2": "omnigen2", "ltx2.3": "ltx2.3", "ltx2.5": "ltx2.5",
    **{arch: arch for arch in (
        "ace_step_15", "ace_step_15_xl", "boogu_image", "boogu_image_edit", "chroma_radiance", "ernie_image",
        "f-lite", "hidream_o1", "ideogram4", "krea2", "mageflow", "mageflow_edit", "minimax_h3",
        "minimax_h3_ref2va", "prx_pixel", "zeta_chroma", "zimage_l2p", "cogview4",
        "sd2", "pixart", "pixart_sigma", "auraflow", "vega", "ssd")},
}
# AI Toolkit's ModelConfig flags of those older models (is_v3, is_lumina2, is_xl and is_flux name
# families that have their module).
_TO_COME_FLAGS = {"is_v2": "sd2", "is_pixart": "pixart", "is_pixart_sigma": "pixart_sigma",
                  "is_auraflow": "auraflow", "is_vega": "vega", "is_ssd": "ssd"}
_TO_COME_NAME_HINTS = {
    "omnigen": "omnigen2", "ltx23": "ltx2.3", "ltx25": "ltx2.5",
    "cogview4": "cogview4",  # toolkit/models/cogview4.py CogView4 (THUDM/CogView4-6B)
}

# AI Toolkit's `model.arch` values (the part before a ':' such as in 'wan21:14b') -> family.
ARCH_VALUES = {**_TO_COME_ARCH_VALUES, **{value: f.name for f in FAMILIES.values() for value in f.arch_values}}
# AI Toolkit's family flags (`model.is_flux: true`) -> family.
FLAGS = {**_TO_COME_FLAGS, **{flag: f.name for f in FAMILIES.values() for flag in f.flags}}
# Substrings of a compacted lowercase model name -> family; the longest one a name holds decides
# (FLUX.2 is not FLUX.1, Wan2.2-TI2V is not Wan 2.2 A14B).
NAME_HINTS = {**_TO_COME_NAME_HINTS, **{hint: f.name for f in FAMILIES.values() for hint in f.name_hints}}


# -- which model (no torch needed) ---------------------------------------------------------------
def known_archs() -> dict[str, dict]:
    """Shipped architecture configs by file stem, those of families fitfinder cannot probe yet included."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(ARCH_DIR.glob("*.json"))}


def family_by_arch(arch: str) -> str | None:
    """The family of an AI Toolkit `model.arch` value (the part before a ':', any case), or None."""
    return ARCH_VALUES.get(arch.strip().lower().split(":")[0])


def arch_problem(arch: str) -> str | None:
    """Why `model.arch` names no model fitfinder knows, for the job file's validation; None when it does."""
    if arch.split(":")[0].strip().lower() in ARCH_VALUES:
        return None
    return f"fitfinder does not support the model {arch!r}; {supported()}"


def supported() -> str:
    return f"it supports: {', '.join(FAMILIES)}"


def family_from_name(name: str) -> str | None:
    """A guess from a local folder's or a fine-tune's name: the family of the longest hint it holds."""
    compact = name.lower().replace(".", "").replace("-", "").replace("_", "")
    held = [hint for hint in NAME_HINTS if hint in compact]
    return NAME_HINTS[max(held, key=len)] if held else None


def shipped_by_name(name: str) -> tuple[str, dict] | None:
    """(stem, config) of the shipped architecture called `name` (its stem or one of its names)."""
    wanted = name.strip().lower()
    for stem, arch in known_archs().items():
        if wanted == stem or wanted in (n.lower() for n in arch.get("names", [])):
            return stem, arch
    return None


def shipped_of(family: str) -> list[str]:
    """The stems of the shipped architectures of `family`, for a message listing the choices."""
    return [stem for stem, arch in known_archs().items() if arch["family"] == family]


def local_weights(name: str, source: str) -> Path:
    """A local diffusers folder, or the Hugging Face cache's snapshot, never the network."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        gated = (f"; it is gated: accept its terms on https://huggingface.co/{name} and log in with "
                 "`hf auth login` first" if is_gated(name) else "")
        raise UserError(
            f"{source}: model {name!r} is neither a local folder nor in the Hugging Face cache; "
            f"download it first (`hf download {name}`{gated}), or set `fitfinder: {{weights: random}}` "
            "to probe its architecture with random weights"
        ) from None


# Hugging Face repos that are gated: a download needs the model's terms accepted on its page, and a
# token (`hf auth login`). From AI Toolkit's UI, which marks each with a `gateUrl`
# (ui/src/app/jobs/new/options.tsx, commit 27a03a91); FLUX.1-schnell, gated since 2025 (AI Toolkit's
# extensions_built_in/diffusion_models/chroma/chroma_model.py: "schnell model is gated now"); and
# FLUX.2-klein-9B (its GatedRepoError in mflux-community/mflux issue 418). Add a repo with where its
# gate is shown.
GATED_REPOS = frozenset(name.lower() for name in (
    "black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-Kontext-dev", "black-forest-labs/FLUX.1-schnell",
    "black-forest-labs/FLUX.2-dev", "black-forest-labs/FLUX.2-klein-base-9B", "black-forest-labs/FLUX.2-klein-9B",
))


def is_gated(name: str) -> bool:
    return name.strip().lower() in GATED_REPOS


# The sim meter trains for real on the CPU, on one thread: it is for the tiny architectures (the
# `*-tiny` archs, a few MiB: a probe takes seconds). A full-size model (FLUX.1-dev: 12 B parameters)
# would need its weights in host memory and hours a step; the estimate predicts it in seconds
# instead. A folder holding more weights than this counts as full-size.
SIM_WEIGHTS_LIMIT = 2**30
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def weights_held(folder: Path) -> int:
    """Bytes of weight files under `folder` (a diffusers folder: one file per part, or shards)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.suffix in _WEIGHT_FILES and f.is_file())


def load_note(request: dict) -> str:
    """What the load holds that its quantized model does not show: the parts AI Toolkit's loader
    brings onto the card whole, in the job's dtype, to quantize them there (Family.quantized_on_device);
    '' when it brings none."""
    family = FAMILIES[request["model"]["family"]]
    whole = family.quantized_on_device(request)
    if not whole:
        return ""
    named = " and ".join(f"{part} ({family.classes[part].rpartition('.')[2]})" for part in whole)
    qtypes = sorted({family.qtype_of(part, request) for part in whole})
    verb = "comes" if len(whole) == 1 else "come"
    return (f"{named} {verb} onto the card whole in {request['dtype']} to be quantized there "
            f"({', '.join(qtypes)}), as AI Toolkit's loader does (docs/fidelity.md)")


def arch_from_folder(path: Path, family: str) -> dict:
    """The arch dict of a diffusers pipeline folder: each part's config.json, as an arch config holds it.

    What the folder's files say is checked before anything is built from it (_checked_part): a
    config.json with 1,000,000 layers made an estimate run for an hour, a list, a folder, a FIFO
    or text that is not JSON gave tracebacks or hung, a size of NaN, 0 or -4 failed in the probe."""
    spec = FAMILIES[family]
    missing = [part for part in spec.parts if not os.path.lexists(path / part / "config.json")]
    if missing:
        raise UserError(f"{path}: not a diffusers {family} pipeline folder: no "
                        f"{', '.join(f'{part}/config.json' for part in missing)}")
    parts = {part: _config_of(path / part / "config.json") for part in spec.parts}
    arch = {"family": family, "names": [str(path)], "text_seq_len": _text_seq_len(path, family), "parts": parts}
    index = _json_or_empty(path / "model_index.json")
    for key, default in spec.index_defaults.items():
        value = index.get(key, default)
        if isinstance(default, float) and not (_is_number(value) and 0 <= value <= 1):
            raise UserError(f"{path / 'model_index.json'}: {key}: expected a number from 0 to 1, got {_brief(value)}")
        arch[key] = value
    return arch


def _text_seq_len(path: Path, family: str) -> int:
    """The long-prompt tokenizer's model_max_length (the family's `tokenizer` folder), else its default."""
    spec = FAMILIES[family]
    default = spec.text_seq_len
    length = _json_or_empty(path / spec.tokenizer / "tokenizer_config.json").get("model_max_length") \
        if spec.tokenizer else None
    # transformers writes a huge sentinel when a tokenizer has no limit; the pipeline's default holds then.
    return int(length) if isinstance(length, int) and 0 < length <= default else default


def _json_or_empty(path: Path) -> dict:
    """The JSON object in `path`, {} when there is no such file."""
    return read_json(path) if os.path.lexists(path) else {}


def _config_of(path: Path) -> dict:
    """A part's config.json without the bookkeeping keys diffusers and transformers add."""
    bookkeeping = {"architectures", "transformers_version", "dtype", "torch_dtype", "model_type"}
    config = {k: v for k, v in read_json(path).items() if not k.startswith("_") and k not in bookkeeping}
    problem = _checked_part(config)
    if problem is not None:
        raise UserError(f"{path}: {problem}; is this a diffusers model folder as its library saved it?")
    return config


# -- what a model folder's files may say: bounded work whatever they hold (docs/reliability.md) ------
# A part's config.json is a few KiB, a tokenizer's config at most a few MiB (its added tokens).
MAX_CONFIG_BYTES = 16 << 20
# The deepest stack shipped is Qwen-Image's 60 blocks (T5-XXL 24, Mistral Small 3.1 40 layers), the
# most experts HiDream's 64: the estimate builds and runs each one, so a million layers ran for an hour.
MAX_LAYERS = 1024
# Widths, heads, channels, vocabularies: the largest shipped is a 262,208-token vocabulary.
MAX_SIZE = 1 << 20
MAX_LIST = 1024  # block lists, RoPE axes, latents' means: the longest shipped has 48 entries
_LAYERS = re.compile(r"(^|_)(layers|depth|blocks|layers_per_block|experts)$")  # counts (or indexes) of layers
_SIZES = re.compile(r"(_size|_dim|^dim|channels|(^|_)heads|^d_model|^d_kv|^d_ff)$")  # widths: at least 1


def read_json(path: Path) -> dict:
    """The JSON object in the regular file `path`, read up to MAX_CONFIG_BYTES; anything else,
    NaN and Infinity included (Python's json reads them, no config means them), is one line."""
    raw = files.read_bounded(path, MAX_CONFIG_BYTES, "JSON file")

    def refuse_constant(name: str):
        raise ValueError(f"{name} is not a number JSON has")

    try:
        data = json.loads(raw, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise UserError(f"{path}: not valid JSON ({str(exc)[:100] or type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object ({{...}}), got {type(data).__name__} {_brief(data)}")
    return data


def _checked_part(config: dict, where: str = "") -> str | None:
    """The first problem of a part's config (or of a config nested in it) as '<key>: expected ...',
    or None: layer counts from 0 to MAX_LAYERS, sizes whole numbers from 1 to MAX_SIZE (or null:
    the class's default), lists of at most MAX_LIST entries."""
    for key, value in config.items():
        name = f"{where}{key}"
        if isinstance(value, dict):
            problem = _checked_part(value, f"{name}.")
            if problem is not None:
                return problem
            continue
        items = value if isinstance(value, list) else [value]
        if len(items) > MAX_LIST:
            return f"{name}: a list of {len(items)} entries, at most {MAX_LIST}"
        if _LAYERS.search(str(key)):
            low, high, what = 0, MAX_LAYERS, "a number of layers"
        elif _SIZES.search(str(key)):
            low, high, what = 1, MAX_SIZE, "a size"
        else:
            continue
        for item in items:
            if item is not None and not (_is_whole(item) and low <= item <= high):
                return f"{name}: expected {what}, a whole number from {low} to {high}, got {_brief(item)}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _brief(value: Any) -> str:
    """A value as a short text for a one-line error."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def cache_dir() -> Path:
    return Path(os.environ.get("FITFINDER_CACHE", Path.home() / ".cache" / "fitfinder"))


# -- building and running (probe children only; these import torch) --------------------------------
def load_pipeline(spec: dict, settings: dict, meter):
    """Every part of the job's pipeline, on the host or the meter's device as `settings` say."""
    from fitfinder.models._pipeline import load

    return load(spec, settings, meter)
