"""Model families: which one a job trains, its architecture, where its weights come from.

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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitfinder.errors import UserError

ARCH_DIR = Path(__file__).resolve().parent.parent / "archs"


@dataclass(frozen=True)
class Family:
    """The parts of one kind of pipeline, by diffusers folder name, and where its LoRA goes."""

    name: str
    denoisers: tuple[str, ...]
    text_encoders: tuple[str, ...]
    classes: dict[str, str]  # part -> "library.ClassName"
    lora_blocks: str  # regex of the module names whose Linear layers the LoRA trains
    video: bool = False
    # What AI Toolkit's loader quantizes (AI Toolkit commit 27a03a91): `model.quantize` the
    # denoiser(s) unless the loader never does (SDXL's branch of toolkit/stable_diffusion_model.py
    # load_model has no quantize call); `model.quantize_te` these encoders, with `model.qtype`
    # (Flux: T5 in load_model; Wan: UMT5 in toolkit/models/wan21/wan21.py load_model). CLIP never.
    quantized_denoisers: bool = True
    quantized_text_encoders: tuple[str, ...] = ()

    @property
    def parts(self) -> tuple[str, ...]:
        return (*self.denoisers, *self.text_encoders, "vae")


_WAN = {"transformer": "diffusers.WanTransformer3DModel", "text_encoder": "transformers.UMT5EncoderModel",
        "vae": "diffusers.AutoencoderKLWan"}
# LoRA targets follow AI Toolkit's LoRA networks: every Linear layer inside the denoiser's blocks
# (Flux: attention, MLP and modulation of both block kinds; SDXL: the transformer blocks of the
# UNet's attentions; Wan: attention and feed-forward of every block).
FAMILIES: dict[str, Family] = {
    "flux": Family("flux", ("transformer",), ("text_encoder", "text_encoder_2"),
                   {"transformer": "diffusers.FluxTransformer2DModel", "text_encoder": "transformers.CLIPTextModel",
                    "text_encoder_2": "transformers.T5EncoderModel", "vae": "diffusers.AutoencoderKL"},
                   r"(single_)?transformer_blocks\.\d+\..*", quantized_text_encoders=("text_encoder_2",)),
    "sdxl": Family("sdxl", ("unet",), ("text_encoder", "text_encoder_2"),
                   {"unet": "diffusers.UNet2DConditionModel", "text_encoder": "transformers.CLIPTextModel",
                    "text_encoder_2": "transformers.CLIPTextModelWithProjection", "vae": "diffusers.AutoencoderKL"},
                   r"(down_blocks|up_blocks)\.\d+\.attentions\.\d+\..*|mid_block\.attentions\.\d+\..*",
                   quantized_denoisers=False),
    "wan21": Family("wan21", ("transformer",), ("text_encoder",), _WAN, r"blocks\.\d+\..*", video=True,
                    quantized_text_encoders=("text_encoder",)),
    "wan22": Family("wan22", ("transformer", "transformer_2"), ("text_encoder",),
                    {**_WAN, "transformer_2": "diffusers.WanTransformer3DModel"}, r"blocks\.\d+\..*", video=True,
                    quantized_text_encoders=("text_encoder",)),
}
# AI Toolkit's `model.arch` values (the part before a ':' such as in 'wan21:14b') -> family.
ARCH_VALUES = {
    "flux": "flux", "flex1": "flux", "sdxl": "sdxl", "wan21": "wan21", "wan21_1b": "wan21", "wan21_14b": "wan21",
    "wan22_14b": "wan22",
    # Known to AI Toolkit and shipped in archs/, but no family module probes them yet (issues 15, 16).
    "flux_kontext": "flux_kontext", "flex2": "flex2", "chroma": "chroma", "hidream": "hidream",
    "qwen_image": "qwen_image", "qwen_image_edit": "qwen_image", "qwen_image_edit_plus": "qwen_image",
    "sd3": "sd3", "lumina2": "lumina2", "omnigen2": "omnigen2",
    "flux2": "flux2", "flux2_klein_4b": "flux2", "flux2_klein_9b": "flux2", "zimage": "zimage",
    "wan21_i2v": "wan21_i2v", "wan22_14b_i2v": "wan22_i2v", "wan22_5b": "wan22_5b",
    "ltx2": "ltx2", "ltx2.3": "ltx2", "ltx2.5": "ltx2",
}
# AI Toolkit's family flags (its ModelConfig turns `is_v3` into arch sd3 and `is_lumina2` into lumina2).
FLAGS = {"is_flux": "flux", "is_xl": "sdxl", "is_v3": "sd3", "is_lumina2": "lumina2"}


# -- which model (no torch needed) ---------------------------------------------------------------
def known_archs() -> dict[str, dict]:
    """Shipped architecture configs by file stem, those of families fitfinder cannot probe yet included."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(ARCH_DIR.glob("*.json"))}


def family_of(job) -> str:
    """The family from `model.arch`, AI Toolkit's flags, or the model name; only a family fitfinder probes.

    A model AI Toolkit trains whose family module does not exist yet is refused by name, and an
    unknown one as unsupported: relabelling a model as another family would probe the wrong network.
    """
    arch = str(job.get("model.arch", None) or "").strip().lower()
    name = str(job.get("model.name_or_path", None) or "")
    if arch:
        family = ARCH_VALUES.get(arch.split(":")[0])
        return _probeable(job, family, f"model.arch {arch!r}")
    for flag, family in FLAGS.items():
        if job.get(f"model.{flag}", None) is True:
            return _probeable(job, family, f"model.{flag}")
    shipped = _shipped_by_name(name)
    if shipped is not None:
        return _probeable(job, shipped[1]["family"], f"{name} ({shipped[0]})")
    guessed = _family_from_name(name.lower())
    if guessed is not None:
        return _probeable(job, guessed, name)
    return _probeable(job, None, f"the model {name or '-'} (neither model.arch, an is_* flag nor its name "
                                 "says which it is)")


def arch_problem(arch: str) -> str | None:
    """Why `model.arch` names no model fitfinder knows, for the job file's validation; None when it does."""
    if arch.split(":")[0].strip().lower() in ARCH_VALUES:
        return None
    return f"fitfinder does not support the model {arch!r}; {_supported()}"


def _probeable(job, family: str | None, model: str) -> str:
    if family in FAMILIES:
        return family
    where = f"{job.source}: config.process[0].model"
    if family is None:
        raise UserError(f"{where}: fitfinder does not support {model}; {_supported()}")
    raise UserError(f"{where}: fitfinder knows {model} but cannot probe the {family} family yet; {_supported()}")


def _supported() -> str:
    return f"it supports: {', '.join(FAMILIES)}"


def _family_from_name(name: str) -> str | None:
    """A guess from a local folder's or a fine-tune's name, most specific first (FLUX.2 is not FLUX.1)."""
    compact = name.replace(".", "").replace("-", "").replace("_", "")
    for needle, family in _NAME_HINTS:
        if needle in compact:
            return family
    return None


# Substrings of a compacted lowercase name -> family, the more specific before the ones they contain.
_NAME_HINTS = (
    ("flux2", "flux2"), ("kontext", "flux_kontext"), ("flex2", "flex2"), ("flex1", "flux"), ("chroma", "chroma"),
    ("flux", "flux"), ("hidream", "hidream"), ("qwenimage", "qwen_image"), ("lumina", "lumina2"),
    ("omnigen", "omnigen2"), ("stablediffusion3", "sd3"), ("sd35", "sd3"), ("zimage", "zimage"),
    ("ltx2", "ltx2"), ("ti2v", "wan22_5b"), ("wan225b", "wan22_5b"), ("wan22i2v", "wan22_i2v"),
    ("wan21i2v", "wan21_i2v"), ("wan22", "wan22"), ("wan21", "wan21"), ("xl", "sdxl"),
)


def is_video(job) -> bool:
    """Video jobs have a frames knob: a video family, or any dataset with more than one frame."""
    frames = [int(f) for f in job.get("datasets[*].num_frames")]
    return FAMILIES[family_of(job)].video or any(f > 1 for f in frames)


def model_spec(job) -> dict[str, Any]:
    """What a probe needs to build the job's model: family, architecture, where the weights are."""
    family = family_of(job)
    name = str(job.get("model.name_or_path", None) or "")
    if job.settings.weights == "random":
        arch_name, arch = shipped_arch(job, family)
        return {"family": family, "weights": "random", "arch_name": arch_name, "arch": arch, "path": None}
    path = _local_weights(name, job.source)
    arch = arch_from_folder(path, family)
    return {"family": family, "weights": "pretrained", "arch_name": name, "arch": arch, "path": str(path)}


def architecture_spec(job) -> dict[str, Any]:
    """The job's model as an estimate needs it: the architecture, never the weights.

    A local diffusers folder lends its config files; otherwise the shipped architecture of that
    name (or of any name with `fitfinder: {weights: random}`); otherwise the Hugging Face cache's
    snapshot, read offline. Nothing is downloaded and no weight file is opened.
    """
    family = family_of(job)
    name = str(job.get("model.name_or_path", None) or "")
    local = Path(name).expanduser() if name else None
    if job.settings.weights != "random" and local is not None and local.is_dir():
        return {"family": family, "weights": "none", "arch_name": name, "arch": arch_from_folder(local, family),
                "path": None}
    found = _shipped_by_name(name)
    if job.settings.weights == "random" or (found is not None and found[1]["family"] == family):
        arch_name, arch = shipped_arch(job, family)
        return {"family": family, "weights": "none", "arch_name": arch_name, "arch": arch, "path": None}
    try:
        folder = _local_weights(name, job.source)
    except UserError:
        matching = [stem for stem, arch in known_archs().items() if arch["family"] == family]
        raise UserError(f"{job.source}: model.name_or_path {name!r} is neither a shipped {family} architecture "
                        f"({', '.join(matching)}) nor a local diffusers folder; set it to one of those") from None
    return {"family": family, "weights": "none", "arch_name": name, "arch": arch_from_folder(folder, family),
            "path": None}


def shipped_arch(job, family: str | None = None) -> tuple[str, dict]:
    """The shipped architecture config named by `model.name_or_path` (stem or one of its names)."""
    family = family or family_of(job)
    name = str(job.get("model.name_or_path", None) or "")
    found = _shipped_by_name(name)
    if found is not None and found[1]["family"] == family:
        return found
    matching = [stem for stem, arch in known_archs().items() if arch["family"] == family]
    raise UserError(
        f"{job.source}: model.name_or_path {name!r} has no shipped {family} architecture for random "
        f"weights; use one of: {', '.join(matching)}"
    )


def _shipped_by_name(name: str) -> tuple[str, dict] | None:
    wanted = name.strip().lower()
    for stem, arch in known_archs().items():
        if wanted == stem or wanted in (n.lower() for n in arch.get("names", [])):
            return stem, arch
    return None


def _local_weights(name: str, source: str) -> Path:
    """A local diffusers folder, or the Hugging Face cache's snapshot, never the network."""
    if not name:
        raise UserError(f"{source}: config.process[0].model.name_or_path: missing")
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        raise UserError(
            f"{source}: model {name!r} is neither a local folder nor in the Hugging Face cache; "
            "download it first (huggingface-cli download), or set `fitfinder: {weights: random}` "
            "to probe its architecture with random weights"
        ) from None


def arch_from_folder(path: Path, family: str) -> dict:
    """The arch dict of a diffusers pipeline folder: each part's config.json, as an arch config holds it."""
    spec = FAMILIES[family]
    missing = [part for part in spec.parts if not (path / part / "config.json").exists()]
    if missing:
        raise UserError(f"{path}: not a diffusers {family} pipeline folder: no "
                        f"{', '.join(f'{part}/config.json' for part in missing)}")
    parts = {part: _config_of(path / part / "config.json") for part in spec.parts}
    arch = {"family": family, "names": [str(path)], "text_seq_len": _text_seq_len(path, family), "parts": parts}
    index = _json_or_empty(path / "model_index.json")
    if family == "wan22":
        arch["boundary_ratio"] = index.get("boundary_ratio", 0.875)  # Wan 2.2 A14B's published value
    return arch


# Sequence length of the long-prompt encoder when the folder does not say: what the diffusers
# pipelines pass by default (FluxPipeline and WanPipeline: max_sequence_length=512); CLIP: 77.
DEFAULT_TEXT_SEQ_LEN = {"flux": 512, "sdxl": 77, "wan21": 512, "wan22": 512}


def _text_seq_len(path: Path, family: str) -> int:
    """The long-prompt tokenizer's model_max_length (tokenizer_2 for Flux, tokenizer for Wan)."""
    default = DEFAULT_TEXT_SEQ_LEN[family]
    folder = {"flux": "tokenizer_2", "wan21": "tokenizer", "wan22": "tokenizer"}.get(family)
    length = _json_or_empty(path / folder / "tokenizer_config.json").get("model_max_length") if folder else None
    # transformers writes a huge sentinel when a tokenizer has no limit; the pipeline's default holds then.
    return int(length) if isinstance(length, int) and 0 < length <= default else default


def _json_or_empty(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _config_of(path: Path) -> dict:
    """A part's config.json without the bookkeeping keys diffusers and transformers add."""
    bookkeeping = {"architectures", "transformers_version", "dtype", "torch_dtype", "model_type"}
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_") and k not in bookkeeping}


def cache_dir() -> Path:
    return Path(os.environ.get("FITFINDER_CACHE", Path.home() / ".cache" / "fitfinder"))


# -- building and running (probe children only; these import torch) --------------------------------
def load_pipeline(spec: dict, settings: dict, meter):
    """Every part of the job's pipeline, on the host or the meter's device as `settings` say."""
    from fitfinder.models._pipeline import load

    return load(spec, settings, meter)
