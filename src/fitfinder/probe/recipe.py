"""One probe: a short LoRA training of the job, in its own process, metered phase by phase.

The process boundary is a tiny protocol: the parent sends one JSON request, the child answers
with exactly one JSON result line. An OOM, a crash or a hang in the child cannot poison the
search; the parent turns each into a result with its reason.

Children are forked from a forkserver that has imported torch, diffusers and peft once (and
never touched a GPU), so each probe starts in a fresh process without paying ~8 s of imports.
`python -m fitfinder.probe < request.json` runs one probe the same way from a shell.

The recipe, phase by phase, each metered on its own (AI Toolkit's order and device placement):

    load          every part (denoiser(s), text encoder(s), VAE), quantized as asked, a LoRA on the
                  trained denoiser(s); without low_vram all on the device, with it all in host memory
    text_encoder  prompts through the text encoders: a batch of captions when they stay loaded (each
                  step encodes its captions); one prompt at a time when embeddings are cached (the
                  encoders alone on the device, then unloaded) or the encoders unloaded (moved to the
                  host after, back on the device for previews)
    latents       images through the VAE encoder at the heaviest bucket and clip: the whole batch when
                  latents are not cached (each step encodes its batch; the VAE stays on the device),
                  one image when they are (AI Toolkit's caching pass, everything but the VAE moved off)
    sample        the first preview unless skip_first_sample/disable_sampling: SAMPLE_STEPS denoising
                  steps at sample.width x height (x num_frames) with the guidance as configured, then
                  the VAE decode
    train         `steps` training steps (a LoRA, or the whole denoiser without `network`) over a
                  bucket schedule with the heaviest bucket and clip at the first, middle and last
                  step (optimizer state, EMA and fragmentation present by then)
    last_sample   the preview at the end of training, unless disable_sampling, with the optimizer's
                  state still held

Request (built by `request_for` from a job file with AI Toolkit's defaults): model (see
models.model_spec), dtype, quantize and quantize_te (None or the bits) with quant_type and
quant_type_te (AI Toolkit's qtype names, see models._weights.quantize), low_vram, text_encoder
("keep", "cache" or "unload"), cache_latents, shapes
([resolution, frames] pairs the datasets train on), batch_size, accumulation,
gradient_checkpointing, rank and alpha (None for a full fine-tune, which adds only_if_contains
and ignore_if_contains), optimizer, optimizer_params, ema_decay (None without EMA), lr, trained
(the denoisers that get a LoRA, or train whole),
switch_every (two-expert models), sample ({first, last, width, height, frames, steps,
guidance_scale}), steps, meter, budget_bytes, gpu, seed; optional: prime_optimizer (the
optimizer's state made before the first step, see `_prime_optimizer`; the estimate runs one
step), overhead (the estimate meter's GPU overhead model, see overhead.py).

Result: {"status": "ok"|"oom"|"error"|"timeout", "phase": the phase that failed or None,
"peak_bytes", "phases": {name: peak bytes}, "phase_stats": {name: {peak_allocated,
peak_reserved, seconds; estimate: peak_live}}, "seconds_per_step", "steps_run", "error",
"oom_kind", "meter", "outside_bytes" (cuda: memory outside PyTorch's allocator, included in
every peak; estimate: the modelled CUDA context), "max_rss_bytes" and "cpu_seconds" (host
memory of the probe process at its highest, and its CPU time)}.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fitfinder import jobconfig

RESULT_STATUSES = ("ok", "oom", "error", "timeout")
# Denoising steps of a preview in a probe: each step costs the same memory, so two show the
# peak (and that it holds from one step to the next) at a tenth of the time of 20 or 30.
SAMPLE_STEPS = 2


# -- the request, built by the parent from a job file (no torch here) ----------------------------
def request_for(job, steps: int, meter: str, budget_bytes: int | None, gpu: int = 0,
                spec: dict | None = None) -> dict[str, Any]:
    """Everything a probe needs, read from the job file with AI Toolkit's defaults (`spec`: the
    model, when the caller has it another way, such as an estimate's weightless architecture)."""
    from fitfinder import models

    spec = spec or models.model_spec(job)
    family = models.FAMILIES[spec["family"]]
    quantize_te = job.get("model.quantize_te", None)
    if quantize_te is None:  # AI Toolkit: quantize_te defaults to quantize
        quantize_te = job.get("model.quantize")
    # The families probed here quantize their T5/UMT5 encoder with model.qtype, not qtype_te (see
    # models.Family.quantized_text_encoders).
    qtype = str(job.get("model.qtype")).split("|")[0].strip().lower()
    bits = jobconfig.qtype_bits(qtype)[0]
    return {
        "model": spec,
        "dtype": jobconfig.DTYPES[str(job.get("train.dtype")).lower()],
        "quantize": bits if job.get("model.quantize") else None, "quant_type": qtype,
        "quantize_te": bits if quantize_te else None, "quant_type_te": qtype,
        "low_vram": bool(job.get("model.low_vram")),
        "text_encoder": _text_encoder_mode(job),
        "cache_latents": _latents_cached(job),
        "shapes": _shapes(job, family.video),
        "batch_size": int(job.get("train.batch_size")),
        "accumulation": job.accumulation,
        "gradient_checkpointing": bool(job.get("train.gradient_checkpointing")),
        **_trained_weights(job),
        "optimizer": jobconfig.optimizer_name(job.get("train.optimizer")),
        "optimizer_params": json.loads(json.dumps(job.get("train.optimizer_params", None) or {})),
        "ema_decay": _ema_decay(job),
        "lr": float(job.get("train.lr")),
        "trained": _trained_denoisers(job, family),
        "switch_every": int(job.get("train.switch_boundary_every")),
        "sample": _sample_settings(job, family.video),
        # AI Toolkit counts a step per micro-batch with gradient_accumulation_steps and samples on
        # that count (BaseSDTrainProcess.run), so a preview can land while gradients accumulate.
        "preview_holds_gradients": int(job.get("train.gradient_accumulation_steps")) > 1,
        "steps": int(steps),
        "meter": meter,
        "budget_bytes": budget_bytes,
        "gpu": gpu,
        "seed": 0,
    }


def _trained_weights(job) -> dict[str, Any]:
    """A LoRA's rank and alpha; or, without `network` (a full fine-tune), rank None and the
    parameter name filters AI Toolkit applies to the denoiser (model.only_if_contains and
    ignore_if_contains, matched as substrings of "transformer.NAME" / "unet.NAME")."""
    if jobconfig.is_full_fine_tune(job):
        return {"rank": None, "alpha": None,
                "only_if_contains": list(job.get("model.only_if_contains", None) or []),
                "ignore_if_contains": list(job.get("model.ignore_if_contains", None) or [])}
    return {"rank": int(job.get("network.linear", None) or job.get("network.rank")),
            "alpha": float(job.get("network.linear_alpha", None) or job.get("network.alpha", 1.0))}


def _ema_decay(job) -> float | None:
    """train.ema_config: None without EMA; AI Toolkit's decay defaults to 0.999."""
    if not job.get("train.ema_config.use_ema"):
        return None
    return float(job.get("train.ema_config.ema_decay", None) or 0.999)


def _text_encoder_mode(job) -> str:
    """cache: all captions encoded before training; unload: trigger and sample prompts only; keep.
    AI Toolkit caches when the train section or any dataset says so (BaseSDTrainProcess:
    is_caching_text_embeddings)."""
    if job.get("train.cache_text_embeddings") or any(job.get("datasets[*].cache_text_embeddings", None)):
        return "cache"
    return "unload" if job.get("train.unload_text_encoder") else "keep"


def _latents_cached(job) -> bool:
    """AI Toolkit keeps the VAE off the device only when every dataset caches its latents."""
    return all(bool(memory) or bool(disk) for memory, disk in
               zip(job.get("datasets[*].cache_latents"), job.get("datasets[*].cache_latents_to_disk")))


def _shapes(job, video: bool) -> list[list[int]]:
    """Every [resolution, frames] the datasets train on; frames are 1 for image families."""
    shapes = set()
    for resolutions, frames in zip(job.get("datasets[*].resolution"), job.get("datasets[*].num_frames")):
        for resolution in resolutions if isinstance(resolutions, list) else [resolutions]:
            shapes.add((int(resolution), int(frames) if video else 1))
    return [list(shape) for shape in sorted(shapes)]


def _trained_denoisers(job, family) -> list[str]:
    """Denoisers with a LoRA: Wan 2.2's high-noise (transformer) and low-noise (transformer_2) experts."""
    if len(family.denoisers) == 1:
        return list(family.denoisers)
    wanted = {"transformer": job.get("model.model_kwargs.train_high_noise"),
              "transformer_2": job.get("model.model_kwargs.train_low_noise")}
    trained = [name for name in family.denoisers if wanted.get(name, True) is not False]
    if not trained:
        from fitfinder.errors import UserError

        raise UserError(f"{job.source}: config.process[0].model.model_kwargs: train_high_noise and "
                        "train_low_noise are both false; nothing would be trained")
    return trained


def _sample_settings(job, video: bool) -> dict[str, Any]:
    enabled = not job.get("train.disable_sampling")
    width, height = _preview_size(job)
    return {"first": enabled and not job.get("train.skip_first_sample"), "last": enabled,
            "width": width, "height": height,
            "frames": int(job.get("sample.num_frames")) if video else 1,
            "steps": min(SAMPLE_STEPS, int(job.get("sample.sample_steps"))),
            "guidance_scale": float(job.get("sample.guidance_scale"))}


def _preview_size(job) -> tuple[int, int]:
    """The largest preview (by pixels): sample.width x height, each of sample.samples' own
    width/height, and a prompt's `--w`/`--h` flags (AI Toolkit's SampleConfig and
    GenerateImageConfig read them per prompt, commit 27a03a91)."""
    default = (int(job.get("sample.width")), int(job.get("sample.height")))
    sizes = [default]
    for item in (job.get("sample.samples", None) or []) + (job.get("sample.prompts", None) or []):
        if isinstance(item, dict):
            sizes.append((int(item.get("width", default[0])), int(item.get("height", default[1]))))
            item = item.get("prompt", "")
        if isinstance(item, str):
            found = {flag: int(value) for flag, value in re.findall(r"--([wh])\s+(\d+)", item)}
            sizes.append((found.get("w", default[0]), found.get("h", default[1])))
    return max(sizes, key=lambda size: (size[0] * size[1], size))


# -- the recipe (child) ------------------------------------------------------------------------
def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load, encode, sample, train `steps` steps, sample; report the peak of each phase."""
    import gc

    from fitfinder import meter as meters
    from fitfinder import oom

    _quiet_libraries()
    # The imported libraries' objects never become garbage: freezing them makes each phase's
    # collection (so that one phase's garbage does not count in the next) cost ms, not 0.3 s.
    gc.freeze()
    meter = meters.make(request["meter"], request.get("budget_bytes"), request.get("gpu", 0), request.get("overhead"))
    result: dict[str, Any] = {"status": "ok", "phase": None, "error": None, "oom_kind": None,
                              "seconds_per_step": None, "steps_run": 0, "meter": meter.describe()}
    failure = None
    try:
        with meter:
            _recipe(request, meter, result)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result line
        failure = exc
        verdict = oom.classify(exc)
        result.update(status="oom" if verdict.is_oom else "error", phase=meter.current_phase,
                      oom_kind=verdict.kind if verdict.is_oom else None,
                      error=f"{type(exc).__name__}: {exc}".strip()[:2000])
        if not verdict.is_oom:
            result["traceback"] = traceback.format_exc(limit=40)[-4000:]
    del failure  # the traceback pins tensors; drop it before reading the peaks
    result["phase_stats"] = meter.phases
    result["phases"] = {name: int(p["peak_reserved"]) for name, p in meter.phases.items()}
    result["peak_bytes"] = meter.peak_bytes
    result["budget_bytes"] = request.get("budget_bytes")
    result["outside_bytes"] = getattr(meter, "outside_bytes", None)
    result["meter"] = meter.describe()
    result.update(_host_usage())
    return result


def _host_usage() -> dict[str, Any]:
    """This process's host memory at its highest and the CPU time it used (a forked child's
    count starts at its fork)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"max_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3)}


def _quiet_libraries() -> None:
    """No progress bars from transformers and diffusers, no per-call bitsandbytes notices."""
    import logging

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()  # e.g. "modules that should be kept in float32: []"
    transformers_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast", every call


def _recipe(request: dict, meter, result: dict) -> None:
    from fitfinder import models

    sample = request["sample"]
    with meter.phase("load"):
        pipe = models.load_pipeline(request["model"], request, meter)
    meter.replay_repeated_blocks(*pipe.parts.values())
    with _phase("text_encoder", pipe, request):
        prompts = _encode_text(pipe, request)
    # The captions' embeddings wait on the host until the steps that use them, as a trainer keeps
    # cached embeddings (or encodes each batch when its step comes); the sample prompts stay.
    prompts["train"] = {key: meter.to_host(value) for key, value in prompts["train"].items()}
    with _phase("latents", pipe, request):
        _encode_latents(pipe, request)
    # AI Toolkit's setup_ema runs before any caching; made here, before the first preview, the
    # shadow leaves the text_encoder and latents phases one copy light (docs/fidelity.md, item 4).
    ema = None
    if sample["first"]:
        with _phase("sample", pipe, request):
            ema = _ema(pipe, request)
            with _ema_weights(ema):
                _sample(pipe, request, prompts)
    with _phase("train", pipe, request):
        ema = ema or _ema(pipe, request)
        prompts["train"] = {key: meter.to_device(value) for key, value in prompts["train"].items()}
        optimizer = _train(pipe, request, prompts, result, ema)
    del prompts["train"]  # and end with the training steps
    if sample["last"]:
        # A preview during training: the optimizer's state is still held, as in a run that
        # samples every N steps.
        with _phase("last_sample", pipe, request), _gradients_held(pipe, request):
            with _ema_weights(ema):
                _sample(pipe, request, prompts)
    del optimizer, ema


@contextlib.contextmanager
def _phase(name: str, pipe, request: dict):
    """A metered phase with its parts on the device.

    Parts the phase does not use leave before its meter starts (moving off frees memory, it is
    nobody's peak); parts it needs arrive inside it (moving on can run out, and that is this
    phase's failure).
    """
    wanted = resident(name, request, pipe.family)
    pipe.place(pipe.on_device & wanted)
    with pipe.meter.phase(name):
        pipe.place(wanted)
        yield


def resident(phase: str, request: dict, family, active: str | None = None) -> set[str]:
    """The parts on the device during `phase`, as AI Toolkit's device presets place them
    (toolkit/stable_diffusion_model.py, set_device_state_preset; AI Toolkit commit 27a03a91).

    Without low_vram everything loaded stays, except: the text-embedding caching pass holds the
    encoders alone ('cache_text_encoder'), cached embeddings unload the encoders for good
    (toolkit/unloader.py), `unload_text_encoder` moves them to the host after encoding and
    previews bring them back ('generate' places every part, SDTrainer's hook_before_train_loop
    only moves them to the CPU); the latent-caching pass moves all but the VAE off, and cached
    latents keep the VAE off during training (it comes back for previews). With low_vram only the
    parts a phase uses, and of two experts only the `active` one.
    """
    encoders = set(family.text_encoders)
    mode = request["text_encoder"]
    kept = encoders if mode == "keep" else set()
    previews = encoders if mode != "cache" else set()
    denoisers, cached = set(family.denoisers), request["cache_latents"]
    if request["low_vram"]:
        denoisers = {active} if active else set(request["trained"][:1])
    if phase == "text_encoder":
        return encoders if request["low_vram"] or mode == "cache" else denoisers | encoders | {"vae"}
    if phase == "latents" and cached:
        return {"vae"}
    if phase in ("latents", "train"):
        return denoisers | kept | (set() if cached and phase == "train" else {"vae"})
    return denoisers | previews | {"vae"}  # sample, last_sample


def _accepted_size(pipe, resolution: int) -> int:
    """A pixel size the denoiser accepts (AI Toolkit rounds buckets and samples down the same way)."""
    divisor = pipe.recipe.divisor
    return max(divisor, resolution // divisor * divisor)


def shape_schedule(shapes: list[list[int]], steps: int) -> list[tuple[int, int]]:
    """One (resolution, frames) per step; the heaviest at the first, the middle and the last step.

    The first step meets the worst shape before any optimizer state exists, the middle and last
    ones meet it with the state and the allocator's fragmentation present, as a long run would.
    """
    ordered = sorted((tuple(shape) for shape in shapes), key=lambda s: (s[0] * s[0] * s[1], s))
    heaviest_steps = {0, steps // 2, steps - 1}
    rest = itertools.cycle(ordered)  # every other step takes the shapes in turn, lightest first
    return [ordered[-1] if step in heaviest_steps else next(rest) for step in range(steps)]


def _heaviest(request: dict) -> tuple[int, int]:
    return shape_schedule(request["shapes"], 1)[0]


# -- the phases ----------------------------------------------------------------------------------
def _encode_text(pipe, request: dict) -> dict:
    """Conditioning for training and previews; cached or unloaded encoders leave the device after."""
    import torch

    encoders = {name: pipe.parts[name] for name in pipe.family.text_encoders}
    batch = request["batch_size"] if request["text_encoder"] == "keep" else 1
    with torch.no_grad():
        prompts = {"train": pipe.recipe.encode_prompts(encoders, batch)}
        if request["sample"]["first"] or request["sample"]["last"]:
            prompts["sample"] = pipe.recipe.encode_prompts(encoders, 1)
            prompts["negative"] = pipe.recipe.encode_prompts(encoders, 1)
    del encoders
    if request["text_encoder"] == "cache":  # unloaded for good; "unload" only moves them off
        for name in pipe.family.text_encoders:
            pipe.unload(name)
    return prompts


def _encode_latents(pipe, request: dict) -> None:
    """The heaviest bucket and clip through the VAE encoder: one image when caching, else a batch."""
    import torch

    resolution, frames = _heaviest(request)
    side = _accepted_size(pipe, resolution)
    batch = 1 if request["cache_latents"] else request["batch_size"]
    with torch.no_grad():
        latents = pipe.recipe.encode_images(pipe.parts["vae"], pipe.recipe.pixels(side, side, frames, batch))
    del latents


@contextlib.contextmanager
def _gradients_held(pipe, request: dict):
    """The LoRA's gradients alive through a preview that lands in the middle of an accumulation."""
    if not request.get("preview_holds_gradients"):
        yield
        return
    import torch

    params = pipe.trainable_parameters(request["trained"][:1])
    for param in params:
        param.grad = torch.zeros_like(param)
    try:
        yield
    finally:
        for param in params:
            param.grad = None


def _sample(pipe, request: dict, prompts: dict) -> None:
    """A preview as AI Toolkit renders one: denoising steps with guidance, then the VAE decode."""
    _denoise_and_decode(pipe, request, prompts)


def _denoise_and_decode(pipe, request: dict, prompts: dict) -> None:
    import torch

    settings, recipe = request["sample"], pipe.recipe
    height, width = _accepted_size(pipe, settings["height"]), _accepted_size(pipe, settings["width"])
    for name in pipe.family.denoisers:
        pipe.parts[name].eval()
    with torch.no_grad():
        latents = recipe.inputs.randn(recipe.latent_shape(height, width, settings["frames"], 1))
        levels = [1.0 - i / settings["steps"] for i in range(settings["steps"])]
        for level, next_level in zip(levels, levels[1:] + [0.0]):
            expert = _expert(pipe, level)
            pipe.place(resident("sample", request, pipe.family, active=expert))
            t = torch.full((1,), level, device=recipe.inputs.device, dtype=recipe.inputs.dtype)
            velocity = recipe.guided(pipe.parts[expert], latents, t, prompts["sample"], prompts["negative"],
                                     settings["guidance_scale"])
            latents = latents + (next_level - level) * velocity
            del velocity
        images = recipe.decode(pipe.parts["vae"], latents)
    del images, latents


def _expert(pipe, level: float) -> str:
    """The denoiser for a noise level: Wan 2.2's high-noise expert above the boundary, else the other."""
    denoisers = pipe.family.denoisers
    if len(denoisers) == 1:
        return denoisers[0]
    return denoisers[0] if level >= pipe.arch.get("boundary_ratio", 0.875) else denoisers[1]


def _train(pipe, request: dict, prompts: dict, result: dict, ema=None):
    """Training steps (LoRA or full) over the shape schedule; the optimizer steps every
    `accumulation` micro-steps, the EMA follows each optimizer step.
    Returns the optimizer, whose state outlives the phase (previews happen during training)."""
    import torch.nn.functional as F

    _maybe_fault(request.get("fault"))
    recipe, trained = pipe.recipe, request["trained"]
    for name in trained:
        pipe.parts[name].train()
    with pipe.meter.concrete():  # bitsandbytes builds its code books from values
        optimizer = _optimizer(request, pipe, trained)
    steps, accumulation = request["steps"], max(1, request["accumulation"])
    if request.get("prime_optimizer"):
        # Gradients outlive a step only while the same denoiser keeps training (see the loop).
        carried = accumulation > 1 and (len(trained) == 1 or request["switch_every"] > 1)
        _prime_optimizer(pipe, request, optimizer, keep_gradients=carried)
    schedule = shape_schedule(request["shapes"], steps)
    middle = steps // 2
    heaviest_steps = {0, middle, steps - 1}
    timings = []
    def expert_at(step: int) -> str:
        # Two experts take turns every `switch_every` steps (AI Toolkit's switch_boundary_every).
        return trained[(step // max(1, request["switch_every"])) % len(trained)]

    for step, (resolution, frames) in enumerate(schedule):
        start = time.perf_counter()
        expert = expert_at(step)
        pipe.place(resident("train", request, pipe.family, active=expert))
        side = _accepted_size(pipe, resolution)
        latents = _training_latents(pipe, request, side, frames, step in heaviest_steps)
        noise = recipe.inputs.randn(latents.shape)
        t = recipe.inputs.timesteps(latents.shape[0])
        noisy, target = recipe.noisy_and_target(latents, noise, t)
        prediction = recipe.predict(pipe.parts[expert], noisy, t, prompts["train"])
        loss = F.mse_loss(prediction.float(), target.float()) / accumulation
        loss.backward()
        del latents, noise, noisy, target, prediction, loss
        # Step the optimizer every `accumulation` micro-steps, once before the middle step so its
        # state exists when the heaviest shape comes back, and before the other expert takes over.
        if (step + 1) % accumulation == 0 or step in (middle - 1, steps - 1) or expert_at(step + 1) != expert:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update()
            pipe.meter.register(optimizer)
        timings.append(time.perf_counter() - start)
        result["steps_run"] = step + 1
    steady = timings[1:] or timings  # the first step pays one-time costs
    result["seconds_per_step"] = round(sum(steady) / len(steady), 5)
    return optimizer


def _prime_optimizer(pipe, request: dict, optimizer, keep_gradients: bool) -> None:
    """The state a run has by its later steps, made without training steps (prime_optimizer).

    Each trained denoiser, placed as its training step would place it, gets zero gradients on
    its LoRA and the optimizer steps, which creates its state exactly as a real step does (same
    tensors, same transient). With `keep_gradients` (accumulation) the first denoiser keeps
    gradients, as the next micro-step finds them. A one-step run (the estimate's) then meets its
    heaviest shape in the state the probe's later steps meet it in.
    """
    import torch

    trained = request["trained"]
    for name in trained:
        pipe.place(resident("train", request, pipe.family, active=name))
        for param in pipe.trainable_parameters([name]):
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if keep_gradients:
        for param in pipe.trainable_parameters(trained[:1]):
            param.grad = torch.zeros_like(param)
    pipe.meter.register(optimizer)


def _training_latents(pipe, request: dict, side: int, frames: int, heaviest: bool):
    """Cached latents are read from disk; otherwise the step encodes its batch through the VAE.

    The encode runs at the heaviest shape (first, middle and last step), where its transient
    meets the optimizer state; other steps draw latents of the right shape, which costs the same
    memory in the denoiser and keeps the probe fast.
    """
    import torch

    recipe, batch = pipe.recipe, request["batch_size"]
    if request["cache_latents"] or not heaviest:
        return recipe.inputs.randn(recipe.latent_shape(side, side, frames, batch))
    with torch.no_grad():
        return recipe.encode_images(pipe.parts["vae"], recipe.pixels(side, side, frames, batch)).detach()


def _optimizer(request: dict, pipe, trained: list[str]):
    """The job's optimizer as AI Toolkit builds it (see optimizers.py), over the trained parameters."""
    from fitfinder import optimizers

    zero_at_start = [param for name in trained for param_name, param in pipe.parts[name].named_parameters()
                     if param.requires_grad and ".lora_B." in param_name]  # peft's B starts at zero
    return optimizers.build(request["optimizer"], pipe.trainable_parameters(trained), request["lr"],
                            request.get("optimizer_params"), zero_at_start)


def _ema(pipe, request: dict):
    """train.ema_config.use_ema: a shadow of every trained parameter (see optimizers.Ema), or None."""
    if request.get("ema_decay") is None:
        return None
    from fitfinder import optimizers

    return optimizers.Ema(pipe.trainable_parameters(request["trained"]), request["ema_decay"])


def _ema_weights(ema):
    """A preview renders with the EMA weights, as AI Toolkit's sample() does."""
    return contextlib.nullcontext() if ema is None else ema.swapped_in()


def _maybe_fault(fault: str | None) -> None:
    """Injected failures for testing the parent's handling (FITFINDER_PROBE_FAULT, see faults.py);
    "garbage" happens where the result line is written (`_result_line`)."""
    if fault == "abort":
        os.abort()
    elif fault == "hang":
        time.sleep(10**6)
    elif fault == "silent":
        os._exit(0)


def _result_line(result: dict[str, Any], request: dict[str, Any]) -> bytes:
    """The one JSON result line; with the "garbage" fault, the first half of it, as a probe
    killed while writing would leave it."""
    line = json.dumps(result)
    if request.get("fault") == "garbage":
        line = line[:len(line) // 2]
    return (line + "\n").encode()


# -- the child process -------------------------------------------------------------------------
def child_main(request_json: str, result_conn, log_path: str | None) -> None:
    """Forkserver child: all output to the log, the one result line to the parent's pipe."""
    _die_with_parent()
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    request = json.loads(request_json)
    result = run(request)
    sys.stdout.flush()
    result_conn.send_bytes(_result_line(result, request))
    result_conn.close()


def main() -> None:
    """`python -m fitfinder.probe`: one JSON request on stdin, exactly one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    stdout = os.dup(1)
    os.dup2(2, 1)  # whatever libraries print goes to stderr, never into the result line
    result = run(request)
    sys.stdout.flush()
    os.write(stdout, _result_line(result, request))


def _die_with_parent() -> None:
    """Ask Linux to kill this probe when the forkserver goes (it goes when the search dies)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


# -- the parent ----------------------------------------------------------------------------------
class ProbeRunner:
    """Runs probes in fresh processes forked from a preloaded forkserver, each with a timeout."""

    def __init__(self, timeout_s: float = 600.0):
        import multiprocessing

        self.timeout_s = timeout_s
        self._server_ready = False
        # Children inherit the user's environment, PYTORCH_CUDA_ALLOC_CONF included: AI Toolkit sets
        # no allocator option of its own, so the probe measures the allocator the training will have.
        _children_import_this_fitfinder()
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["fitfinder._preload"])

    def run(self, request: dict[str, Any], log_path: str | Path | None = None) -> dict[str, Any]:
        self._wait_for_the_server()
        reader, writer = self.context.Pipe(duplex=False)
        started = time.perf_counter()
        process = self.context.Process(target=child_main, daemon=True,
                                       args=(json.dumps(request), writer, str(log_path) if log_path else None))
        process.start()
        writer.close()
        try:
            line = self._read_line(reader, process)
        finally:
            reader.close()
            if process.is_alive():
                process.kill()
            process.join(5)
        result = _parse(line, process, self.timeout_s, log_path)
        result["wall_seconds"] = round(time.perf_counter() - started, 3)
        return result

    def _wait_for_the_server(self) -> None:
        """Fork one empty child first: the forkserver answers only once its imports are done
        (~10 s on a busy machine), which must not count against the first probe's timeout."""
        if self._server_ready:
            return
        child = self.context.Process(target=_nothing, daemon=True)
        child.start()
        child.join()
        self._server_ready = True

    def _read_line(self, reader, process) -> bytes | None:
        if not reader.poll(self.timeout_s):
            return b"timeout"
        try:
            return reader.recv_bytes()
        except EOFError:  # the child ended without a result line
            process.join(5)
            return None


def _nothing() -> None:
    pass


def _children_import_this_fitfinder() -> None:
    """Put this fitfinder's folder first on the children's import path.

    Python before 3.13 starts the forkserver with the environment's path, not the parent's
    sys.path; without this a probe could run another installed copy of fitfinder.
    """
    package_root = str(Path(__file__).resolve().parents[1])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not paths or paths[0] != package_root:
        os.environ["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in paths if p != package_root])


def _parse(line: bytes | None, process, timeout_s: float, log_path) -> dict[str, Any]:
    """The child's result, or a result that says why there is none."""
    if line == b"timeout":
        return _no_result("timeout", f"probe passed its {timeout_s:g} s timeout and was killed", log_path)
    if line is None:
        code = process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return _no_result("error", f"probe process was killed by {name}", log_path)
        return _no_result("error", f"probe process exited with code {code} without a result line", log_path)
    try:
        result = json.loads(line)
    except ValueError:
        result = None
    if not _well_formed(result):
        return _no_result("error", f"probe printed no JSON result: {line[:200]!r}", log_path)
    return result


def _well_formed(result: Any) -> bool:
    """A result the search can read: a known status, and numbers where it reads numbers (a line
    that parses as JSON can still be garbage)."""
    def count(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0)

    if not isinstance(result, dict) or result.get("status") not in RESULT_STATUSES:
        return False
    phases = result.get("phases") or {}
    return (count(result.get("peak_bytes")) and count(result.get("seconds_per_step")) and isinstance(phases, dict)
            and all(isinstance(name, str) and count(peak) for name, peak in phases.items())
            and (result["status"] != "ok" or result.get("peak_bytes") is not None))


def _no_result(status: str, reason: str, log_path) -> dict[str, Any]:
    tail = _log_tail(log_path)
    return {"status": status, "phase": None, "error": reason + (f"; last output: {tail}" if tail else ""),
            "oom_kind": None, "peak_bytes": None, "phases": {}, "phase_stats": {},
            "seconds_per_step": None, "steps_run": None}


def _log_tail(log_path, lines: int = 3) -> str:
    try:
        text = Path(log_path).read_text(errors="replace").strip().splitlines()
    except (OSError, TypeError):
        return ""
    return " | ".join(text[-lines:])[-500:]


if __name__ == "__main__":
    main()
