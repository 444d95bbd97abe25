"""Model families: which one a job trains, its architecture, its weights, its training inputs.

A job's model comes either from real weights (`model.name_or_path`: a local diffusers folder or
the Hugging Face cache, read offline) or, with `fitfinder: {weights: random}`, from one of the
architecture configs shipped in `archs/` with random weights: the same shapes and the same
memory, without reading 20 GB from disk.

This module is imported by probe children only; the CLI reads the arch files without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fitfinder.errors import UserError

ARCH_DIR = Path(__file__).parent / "archs"
FAMILIES = ("flux",)
# peft target modules: the attention projections AI Toolkit's LoRA trains for each family.
LORA_TARGETS = {
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
}
# Random weights of models up to this size are saved once and then loaded with from_pretrained,
# as real weights would be; larger ones are built in place on the device.
SAVE_RANDOM_UP_TO_BYTES = 512 * 2**20


# -- which model (no torch needed) ---------------------------------------------------------------
def known_archs() -> dict[str, dict]:
    """Shipped architecture configs by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(ARCH_DIR.glob("*.json"))}


def family_of(job) -> str:
    """The family from `model.arch`, AI Toolkit's `is_flux`/`is_xl` flags, or the model name."""
    arch = str(job.get("model.arch", "") or "").lower()
    name = str(job.get("model.name_or_path", "") or "").lower()
    for family in FAMILIES:
        if arch.startswith(family) or job.get(f"model.is_{family}", False) or family in name:
            return family
    raise UserError(
        f"{job.source}: config.process[0].model: cannot tell the model family from "
        f"arch={arch or '-'!s}, name_or_path={name or '-'!s}; set model.arch to one of: {', '.join(FAMILIES)}"
    )


VIDEO_FAMILIES = ("wan",)


def is_video(job) -> bool:
    """Video jobs have a frames knob: a video family, or any dataset with more than one frame."""
    frames = [int(f) for f in job.get("datasets[*].num_frames")]
    return family_of(job).startswith(VIDEO_FAMILIES) or any(f > 1 for f in frames)


def model_spec(job) -> dict[str, Any]:
    """What a probe needs to build the job's model: family, architecture, where the weights are."""
    family = family_of(job)
    name = str(job.get("model.name_or_path", "") or "")
    if job.settings.weights == "random":
        arch_name, arch = _shipped_arch(name, family, job.source)
        return {"family": family, "weights": "random", "arch_name": arch_name, "arch": arch, "path": None}
    path = _local_weights(name, job.source)
    arch = _arch_from_folder(path, family)
    return {"family": family, "weights": "pretrained", "arch_name": name, "arch": arch, "path": str(path)}


def _shipped_arch(name: str, family: str, source: str) -> tuple[str, dict]:
    archs = known_archs()
    for stem, arch in archs.items():
        if name == stem or name.lower() in (n.lower() for n in arch.get("names", [])):
            return stem, arch
    matching = [stem for stem, arch in archs.items() if arch["family"] == family]
    raise UserError(
        f"{source}: model.name_or_path {name!r} has no shipped architecture for random weights; "
        f"use one of: {', '.join(matching) or ', '.join(archs)}"
    )


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


def _arch_from_folder(path: Path, family: str) -> dict:
    """The arch dict of a diffusers pipeline folder (or a bare transformer folder)."""
    for config in (path / "transformer" / "config.json", path / "config.json"):
        if config.exists():
            transformer = {k: v for k, v in json.loads(config.read_text()).items() if not k.startswith("_")}
            defaults = next((a for a in known_archs().values() if a["family"] == family), {})
            return {**defaults, "family": family, "transformer": transformer, "names": [str(path)]}
    raise UserError(f"{path}: no transformer/config.json; expected a diffusers model folder")


# -- building (probe child only) -------------------------------------------------------------------
def load_transformer(spec: dict, dtype, meter):
    """The family's denoiser with the job's weights, on the meter's device, frozen."""
    import torch

    cls = _transformer_class(spec["family"])
    folder = spec["path"] and _transformer_folder(Path(spec["path"]))
    if folder is None and _param_bytes_estimate(spec["arch"]["transformer"]) <= SAVE_RANDOM_UP_TO_BYTES:
        folder = _saved_random(cls, spec)
    if folder is not None:
        model = cls.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)
    else:
        with torch.device(meter.device):
            torch.manual_seed(0)
            model = cls(**spec["arch"]["transformer"]).to(dtype)
    model = meter.to_device(model)
    meter.register(model)  # weights read by safetensors bypass the meter's dispatch
    model.requires_grad_(False)
    return model


def _transformer_class(family: str):
    if family == "flux":
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel
    raise ValueError(f"unknown family {family!r}")


def _transformer_folder(path: Path) -> Path:
    return path / "transformer" if (path / "transformer" / "config.json").exists() else path


def _param_bytes_estimate(config: dict) -> int:
    """Rough fp32 size from the widest dimensions; only decides save-or-build for random weights."""
    width = config.get("num_attention_heads", 1) * config.get("attention_head_dim", 1)
    layers = config.get("num_layers", 1) + config.get("num_single_layers", 0)
    return 12 * width * width * layers * 4


def _saved_random(cls, spec: dict) -> Path:
    """Random weights saved once under the cache (keyed by the arch), then loaded like real ones."""
    import torch

    digest = hashlib.sha256(json.dumps(spec["arch"]["transformer"], sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "random" / f"{spec['arch_name']}-{digest}"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        torch.manual_seed(0)
        cls(**spec["arch"]["transformer"]).save_pretrained(tmp)
        try:
            os.rename(tmp, folder)  # atomic; a concurrent probe may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def cache_dir() -> Path:
    return Path(os.environ.get("FITFINDER_CACHE", Path.home() / ".cache" / "fitfinder"))


# -- training inputs -----------------------------------------------------------------------------
def flux_inputs(arch: dict, resolution: int, batch: int, dtype, device, generator) -> tuple[dict, Any, Any]:
    """Model kwargs for one Flux step at `resolution` pixels, plus the clean latents and noise.

    Latents are (batch, C, res/8, res/8) packed 2x2 into (batch, (res/16)^2, 4C) tokens, as the
    Flux pipeline packs them; text is `text_seq_len` T5 tokens plus a pooled CLIP vector.
    """
    import torch

    config = arch["transformer"]
    side = resolution // (arch["vae_scale_factor"] * 2)
    tokens = side * side
    channels = config["in_channels"]
    seq = arch["text_seq_len"]

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    latents, noise = randn(batch, tokens, channels), randn(batch, tokens, channels)
    image_ids = torch.zeros(side, side, 3)
    image_ids[..., 1] = torch.arange(side)[:, None]
    image_ids[..., 2] = torch.arange(side)[None, :]
    kwargs = {
        "encoder_hidden_states": randn(batch, seq, config["joint_attention_dim"]),
        "pooled_projections": randn(batch, config["pooled_projection_dim"]),
        "img_ids": image_ids.reshape(tokens, 3).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(seq, 3).to(device=device, dtype=dtype),
        "guidance": torch.full((batch,), 3.5).to(device=device, dtype=dtype) if config.get("guidance_embeds") else None,
        "return_dict": False,
    }
    return kwargs, latents, noise
