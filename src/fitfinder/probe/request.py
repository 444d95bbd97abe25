"""A probe's request, built in the parent from a job file with AI Toolkit's defaults (no torch here).

See protocol.py for every field.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from fitfinder import jobconfig, models
from fitfinder.errors import UserError
from fitfinder.probe import trainer_command
from fitfinder.probe.protocol import ProbeRequest, SampleSettings

# Denoising steps of a preview in a probe: each step costs the same memory, so two show the
# peak (and that it holds from one step to the next) at a tenth of the time of 20 or 30.
SAMPLE_STEPS = 2


def request_for(job, steps: int, meter: str, budget_bytes: int | None, gpu: int = 0,
                spec: dict | None = None, fault: str | None = None, ram_bytes: int | None = None) -> ProbeRequest:
    """Everything a probe needs, read from the job file with AI Toolkit's defaults (`spec`: the
    model, when the caller has it another way, such as an estimate's weightless architecture;
    `fault`: a test hook's injected failure, see probe.faults; `ram_bytes`: the host's budget,
    which the sim meter enforces). The one place a request is built."""
    request = _request(job, steps, meter, budget_bytes, gpu, spec, fault)
    if ram_bytes is not None:
        request["ram_bytes"] = int(ram_bytes)
    return request


def _request(job, steps: int, meter: str, budget_bytes: int | None, gpu: int, spec: dict | None,
             fault: str | None) -> ProbeRequest:
    if hasattr(job, "probe_request"):  # a trainer's job maps itself, by its trainer's rules (trainers/)
        return {**job.probe_request(steps=steps, meter=meter, budget_bytes=budget_bytes, gpu=gpu, spec=spec,
                                    fault=fault, sample_steps=SAMPLE_STEPS),
                **trainer_command.request_fields(job)}  # the user's trainer runs it, when the job names one
    spec = spec or models.model_spec(job)
    family = models.FAMILIES[spec["family"]]
    qtype, qtype_te = quant_types(job, family)
    bits = jobconfig.qtype_bits(qtype)[0] if job.quantize else None  # a blank qtype is unused (jobconfig)
    bits_te = jobconfig.qtype_bits(qtype_te)[0] if job.quantize_te else None
    return {
        "model": spec,
        "dtype": jobconfig.DTYPES[str(job.get("train.dtype")).lower()],
        "quantize": bits, "quant_type": qtype,
        "recovery_adapter": recovery_adapter(job, family),
        "quantize_te": bits_te, "quant_type_te": qtype_te,
        "low_vram": bool(job.get("model.low_vram")),
        "tiled_preview_decode": family.tiles_preview_decode(job),
        "layer_offloading": layer_offloading(job, family),
        "text_encoder": job.text_encoder_mode,
        "cache_latents": job.latents_cached,
        "shapes": _shapes(job, family.video),
        "batch_size": job.batch_size,
        "accumulation": job.accumulation,
        "gradient_checkpointing": bool(job.get("train.gradient_checkpointing")),
        **_trained_weights(job, family),
        "optimizer": jobconfig.optimizer_name(job.get("train.optimizer")),
        "optimizer_params": json.loads(json.dumps(job.get("train.optimizer_params", None) or {})),
        "ema_decay": _ema_decay(job),
        "preservation": _preservation(job),
        **_validation(job),
        "lr": float(job.get("train.lr")),
        "trained": family.trained_denoisers(job),
        "switch_every": int(job.get("train.switch_boundary_every")),
        "sample": _sample_settings(job, family.video),
        **_first_sample(job, family.video),
        # AI Toolkit counts a step per micro-batch with gradient_accumulation_steps and samples on
        # that count (BaseSDTrainProcess.run), so a preview can land while gradients accumulate.
        "preview_holds_gradients": int(job.get("train.gradient_accumulation_steps")) > 1,
        "steps": int(steps),
        "meter": meter,
        "budget_bytes": budget_bytes,
        "gpu": gpu,
        "seed": 0,
        **({"fault": fault} if fault else {}),
        **trainer_command.request_fields(job),  # the user's trainer runs it, when the job names one
    }


def quant_types(job, family) -> tuple[str, str]:
    """The base model's and the text encoders' qtype names as AI Toolkit's loaders quantize with them.

    Which key gives the text encoders' is the family's (models.Family.te_qtype_key): Flux and Wan
    quantize T5/UMT5 with model.qtype, Qwen-Image and Z-Image read qtype_te. ModelConfig turns a qtype
    of exactly `qfloat8` into torchao's `float8` under model.layer_offloading, whatever the family
    (toolkit/config_modules.py, before it splits an adapter off at '|'), and Z-Image's loader turns
    model.qtype's with a training adapter (Family.float8_with; AI Toolkit commit 27a03a91)."""
    offloading = job.get("model.layer_offloading", None)
    offloading = bool(job.get("model.auto_memory", False) if offloading is None else offloading)

    with_adapter = bool(family.float8_with and job.get(family.float8_with, None))
    qtype = "float8" if (offloading or with_adapter) and str(job.get("model.qtype")) == "qfloat8" else job.qtype
    if family.te_qtype_key != "qtype_te":
        return qtype, qtype
    return qtype, "float8" if offloading and str(job.get("model.qtype_te")) == "qfloat8" else job.qtype_te


# How a probe is run, not what it trains: the same job on another card, meter or machine puts the
# same tensors in each phase (a study compares everything else, search.study.job_signature). The
# user's trainer that runs it (probe/trainer.py) is recorded beside, as the study's `trainer_command`;
# the point's job it carries says again what the request says.
RUN_FIELDS = ("steps", "meter", "budget_bytes", "ram_bytes", "gpu", "seed", "fault", "overhead", "prime_optimizer",
              "trainer_run", "trainer_job")


@functools.cache
def recipe_digest() -> str:
    """A digest of the code and data that decide what a probe holds (probe/, models/, the
    architectures, the optimizers): a study made by another recipe may not answer for this one."""
    root = Path(__file__).resolve().parent.parent
    files = sorted([*root.glob("probe/*.py"), *root.glob("models/*.py"), *root.glob("archs/*.json"),
                    *root.glob("trainers/*.py"), root / "optimizers.py"])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


# The rank fitfinder assumes for an accuracy-recovery adapter whose file is not on this machine (the
# adapters' own README calls 16 the sweet spot for Qwen-Image at 3 bits; AI Toolkit reads it from the file).
RECOVERY_RANK_ASSUMED = 16


def recovery_adapter(job, family) -> dict | None:
    """The accuracy-recovery adapter of `model.qtype: QTYPE|PATH` (or model.accuracy_recovery_adapter),
    as toolkit/util/quantize.py `quantize_model` loads it (AI Toolkit commit 27a03a91): None without one,
    or for a family whose loader quantizes otherwise (Family.recovery_adapter).

    quantize_model builds a LoRA from the file: its rank is the first `lora_A` weight's rows, alpha the
    rank, its layers the keys' prefixes (`key.split(".lora_")[0]`). The file is read here when it is on
    this machine (a local path, or the Hugging Face cache; its safetensors header only, no weights);
    otherwise the rank is RECOVERY_RANK_ASSUMED on the LoRA's own layers, and "read" says so."""
    path = str(job.get("model.qtype", "")).partition("|")[2].strip() or job.get("model.accuracy_recovery_adapter", None)
    if not (path and job.quantize and family.recovery_adapter):
        return None
    header = _safetensors_header(path)
    rank = next((int(entry["shape"][0]) for key, entry in (header or {}).items() if "lora_A" in key), None)
    if rank is None:
        return {"rank": RECOVERY_RANK_ASSUMED, "layers": None, "read": False, "path": path}
    layers = sorted({re.sub(r"^(transformer|diffusion_model|unet)\.", "", key.split(".lora_")[0])
                     for key in header if ".lora_" in key})
    return {"rank": rank, "layers": layers, "read": True, "path": path}


def _safetensors_header(path: str) -> dict | None:
    """The tensor table of a safetensors file (8 bytes of header length, then JSON), found as AI Toolkit
    finds it (a local file, or 'user/repo/file.safetensors' on the hub, here from the local cache only);
    None when it is not on this machine or not readable."""
    local = Path(path)
    if not local.is_file():
        parts = path.split("/")
        if len(parts) != 3:
            return None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(f"{parts[0]}/{parts[1]}", parts[2])
        if not isinstance(cached, str):
            return None
        local = Path(cached)
    try:
        with open(local, "rb") as file:
            size = int.from_bytes(file.read(8), "little")
            table = json.loads(file.read(size))
    except (OSError, ValueError):
        return None
    table.pop("__metadata__", None)
    return table


def layer_offloading(job, family) -> dict[str, float]:
    """The share of layers offloaded per kind of part, {"denoiser": p, "text_encoder": p} (0: none).

    AI Toolkit's ModelConfig (toolkit/config_modules.py) reads `model.layer_offloading` (default:
    the deprecated `auto_memory`, false) and the two percents as fractions, each 1.0 by default,
    "0 is off"; only the loaders of `Family.layer_offloading` families act on them. A full
    fine-tune is probed without it (models/_offload.py says why).
    """
    on = job.get("model.layer_offloading", None)
    on = bool(job.get("model.auto_memory", False) if on is None else on)
    if not (on and family.layer_offloading) or jobconfig.is_full_fine_tune(job):
        return {"denoiser": 0.0, "text_encoder": 0.0}
    return {"denoiser": float(job.get("model.layer_offloading_transformer_percent", 1.0)),
            "text_encoder": float(job.get("model.layer_offloading_text_encoder_percent", 1.0))}


# NetworkConfig (toolkit/config_modules.py): lokr_full_rank, true by default, sets linear,
# linear_alpha, conv and conv_alpha to this for a LoKr.
LOKR_FULL_RANK = 9999999999


def _trained_weights(job, family) -> dict[str, Any]:
    """A LoRA's rank and alpha, and its kind (`network_type`: lora, lokr, or locon, which AI Toolkit
    also calls lycoris); or, without `network` (a full fine-tune), rank None and the parameter name
    filters AI Toolkit applies to the denoiser (model.only_if_contains and ignore_if_contains,
    matched as substrings of "transformer.NAME" / "unet.NAME")."""
    if jobconfig.is_full_fine_tune(job):
        return {"rank": None, "alpha": None,
                "only_if_contains": list(job.get("model.only_if_contains", None) or []),
                "ignore_if_contains": list(job.get("model.ignore_if_contains", None) or [])}
    kind = jobconfig.network_type(job)
    kind = "locon" if kind == "lycoris" else kind
    if kind == "locon" and not family.lora_convs:
        raise UserError(f"{job.source}: config.process[0].network.type: {job.get('network.type')}: AI Toolkit's "
                        "LyCORIS network (toolkit/lycoris_special.py) wraps UNet blocks only and finds no layer "
                        f"to train in {family.name}; use type: lora or lokr")
    conv = job.get("network.conv", None)
    rank, alpha = job.lora_rank, job.lora_alpha
    conv_alpha = float(job.get("network.conv_alpha", None) or conv) if conv else None
    if kind == "lokr" and job.get("network.lokr_full_rank", True):
        rank = alpha = conv = conv_alpha = LOKR_FULL_RANK
    return {"rank": rank, "alpha": alpha, "network_type": kind,
            # AI Toolkit's LoRA leaves out the layers whose names hold one of these (lora_special.py)
            "lora_ignore": [str(word) for word in job.get("network.network_kwargs.ignore_if_contains", None) or []],
            # NetworkConfig: `conv` (None: no LoRA on the larger convolutions), `conv_alpha` defaulting to it
            "conv_rank": int(conv) if conv else None,
            "conv_alpha": conv_alpha,
            **({"lokr_factor": int(job.get("network.lokr_factor", -1))} if kind == "lokr" else {})}


def _preservation(job) -> bool:
    """train.diff_output_preservation or blank_prompt_preservation: each training step adds a prior
    prediction and a preservation prediction (SDTrainer.train_single_accumulation). AI Toolkit refuses
    both at once (toolkit/config_modules.py validate_configs), either without a network, and the first
    without a trigger word (SDTrainer.__init__); so does fitfinder, in one line each."""
    where = f"{job.source}: config.process[0].train"
    dop, blank = bool(job.get("train.diff_output_preservation", False)), bool(
        job.get("train.blank_prompt_preservation", False))
    if dop and blank:
        raise UserError(f"{where}: AI Toolkit refuses diff_output_preservation and blank_prompt_preservation "
                        "together; keep one of them")
    if (dop or blank) and jobconfig.is_full_fine_tune(job):
        raise UserError(f"{where}: AI Toolkit's output preservation needs a network (a LoRA); add `network`")
    triggers = [job.get("trigger_word", None), *(dataset.get("trigger_word") for dataset in job.process["datasets"])]
    if dop and not any(trigger is not None for trigger in triggers):
        raise UserError(f"{where}.diff_output_preservation: AI Toolkit requires a trigger_word with it; set "
                        "config.process[0].trigger_word")
    return dop or blank


def _validation(job) -> dict:
    """train.validation_config (toolkit/config_modules.py ValidationConfig; BaseSDTrainProcess
    setup_validation, validate): every validate_every_n_steps, each validation image's cached latents
    at `resolution` (512) with every one of validation_sigmas (four) as one batch, predicted without
    gradients, the network on. AI Toolkit skips items without an image_path; the probe validates a
    square image at the resolution. {} without validation."""
    config = job.get("train.validation_config", None)
    if not isinstance(config, dict):
        return {}
    items = [item for item in config.get("validation_items") or [] if isinstance(item, dict) and item.get("image_path")]
    if not items:
        return {}
    sigmas = config.get("validation_sigmas") or [1.0, 0.75, 0.5, 0.25]
    return {"validation": {"resolution": int(config.get("resolution", 512)), "batch": len(sigmas)}}


def _ema_decay(job) -> float | None:
    """train.ema_config: None without EMA; AI Toolkit's decay defaults to 0.999."""
    if not job.get("train.ema_config.use_ema"):
        return None
    return float(job.get("train.ema_config.ema_decay", None) or 0.999)


def _shapes(job, video: bool) -> list[list[int]]:
    """Every [resolution, frames] the datasets train on; frames are 1 for image families."""
    shapes = set()
    for resolutions, frames in zip(job.get("datasets[*].resolution"), job.get("datasets[*].num_frames")):
        for resolution in resolutions if isinstance(resolutions, list) else [resolutions]:
            shapes.add((int(resolution), int(frames) if video else 1))
    return [list(shape) for shape in sorted(shapes)]


def _sample_settings(job, video: bool) -> SampleSettings:
    enabled = not job.get("train.disable_sampling")
    width, height = _preview_size(job)
    return {"first": enabled and not job.get("train.skip_first_sample"), "last": enabled,
            "width": width, "height": height,
            "frames": int(job.get("sample.num_frames")) if video else 1,
            "steps": min(SAMPLE_STEPS, int(job.get("sample.sample_steps"))),
            "guidance_scale": float(job.get("sample.guidance_scale"))}


# toolkit/config_modules.py SampleConfig's defaults, for a `first_sample:` section that leaves a key out.
SAMPLE_CONFIG_DEFAULTS = {"width": 512, "height": 512, "num_frames": 1, "sample_steps": 20, "guidance_scale": 7}


def _first_sample(job, video: bool) -> dict:
    """`first_sample:` (BaseSDTrainProcess: its own SampleConfig, made from that section alone): a
    preview before training from it, skip_first_sample or not (only disable_sampling stops it), then
    the baseline preview unless skipped; both are the probe's first preview phase. {} without it."""
    section = job.get("first_sample", None)
    if not isinstance(section, dict) or job.get("train.disable_sampling"):
        return {}
    read = {key: section.get(key, default) for key, default in SAMPLE_CONFIG_DEFAULTS.items()}
    width, height = _preview_size(job, "first_sample", (int(read["width"]), int(read["height"])))
    return {"first_sample": {"first": True, "last": False, "width": width, "height": height,
                             "frames": int(read["num_frames"]) if video else 1,
                             "steps": min(SAMPLE_STEPS, int(read["sample_steps"])),
                             "guidance_scale": float(read["guidance_scale"])}}


def _preview_size(job, section: str = "sample", default: tuple[int, int] | None = None) -> tuple[int, int]:
    """The largest preview (by pixels): sample.width x height (or `default`), each of the section's
    samples' own width/height, and a prompt's `--w`/`--h` flags (AI Toolkit's SampleConfig and
    GenerateImageConfig read them per prompt, commit 27a03a91)."""
    default = default or (int(job.get("sample.width")), int(job.get("sample.height")))
    sizes = [default]
    for item in (job.get(f"{section}.samples", None) or []) + (job.get(f"{section}.prompts", None) or []):
        if isinstance(item, dict):
            sizes.append((int(item.get("width", default[0])), int(item.get("height", default[1]))))
            item = item.get("prompt", "")
        if isinstance(item, str):
            found = {flag: int(value) for flag, value in re.findall(r"--([wh])\s+(\d+)", item)}
            sizes.append((found.get("w", default[0]), found.get("h", default[1])))
    return max(sizes, key=lambda size: (size[0] * size[1], size))
