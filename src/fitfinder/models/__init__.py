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
ARCH_VALUES = {"flux": "flux", "sdxl": "sdxl", "wan21": "wan21", "wan21_1b": "wan21", "wan21_14b": "wan21",
               "wan22_14b": "wan22"}
# AI Toolkit's family flags.
FLAGS = {"is_flux": "flux", "is_xl": "sdxl"}


# -- which model (no torch needed) ---------------------------------------------------------------
def known_archs() -> dict[str, dict]:
    """Shipped architecture configs by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(ARCH_DIR.glob("*.json"))}


def family_of(job) -> str:
    """The family from `model.arch`, AI Toolkit's `is_flux`/`is_xl` flags, or the model name."""
    arch = str(job.get("model.arch", None) or "").strip().lower()
    name = str(job.get("model.name_or_path", None) or "")
    if arch:
        family = ARCH_VALUES.get(arch.split(":")[0])
        if family is None:
            raise UserError(f"{job.source}: config.process[0].model.arch: {arch!r} is not a model family "
                            f"fitfinder can probe; known: {', '.join(ARCH_VALUES)}")
        return family
    for flag, family in FLAGS.items():
        if job.get(f"model.{flag}", None) is True:
            return family
    shipped = _shipped_by_name(name)
    if shipped is not None:
        return shipped[1]["family"]
    guessed = _family_from_name(name.lower())
    if guessed is not None:
        return guessed
    raise UserError(
        f"{job.source}: config.process[0].model: cannot tell the model family from "
        f"name_or_path={name or '-'!s}; set model.arch to one of: {', '.join(ARCH_VALUES)}"
    )


def _family_from_name(name: str) -> str | None:
    compact = name.replace(".", "").replace("-", "").replace("_", "")
    if "flux" in compact:
        return "flux"
    if "wan22" in compact:
        return "wan22"
    if "wan21" in compact:
        return "wan21"
    if "xl" in compact:
        return "sdxl"
    return None


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
