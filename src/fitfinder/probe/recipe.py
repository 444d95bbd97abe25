"""One probe: a short LoRA training of the job, in its own process, metered phase by phase.

The process boundary is a tiny protocol: the parent sends one JSON request, the child answers
with exactly one JSON result line. An OOM, a crash or a hang in the child cannot poison the
search; the parent turns each into a result with its reason.

Children are forked from a forkserver that has imported torch, diffusers and peft once (and
never touched a GPU), so each probe starts in a fresh process without paying ~8 s of imports.
`python -m fitfinder.probe < request.json` runs one probe the same way from a shell. The
request is built in the parent (request.py), the processes run there too (runner.py); the
protocol's two halves are typed in protocol.py.

The recipe, phase by phase, each metered on its own (AI Toolkit's order and device placement):

    load          every part (denoiser(s), text encoder(s), VAE), quantized as asked, where the family's
                  loader quantizes and keeps it with or without low_vram (Family.placement); a LoRA
                  on the trained denoiser(s); the EMA's shadow
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
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import time
import traceback
from typing import Any

from fitfinder import files, models, oom
from fitfinder.probe.protocol import ProbeRequest, ProbeResult



# -- the recipe (child) ------------------------------------------------------------------------
def run(request: ProbeRequest, watch=None) -> ProbeResult:
    """Load, encode, sample, train `steps` steps, sample; report the peak of each phase.
    `watch(meter)` is told the meter before the recipe starts (the estimate's progress reads
    its `current_phase` from another thread)."""
    import gc

    from fitfinder.probe import meters  # torch: only in the child (and the estimate's process)

    _quiet_libraries()
    # The imported libraries' objects never become garbage: freezing them makes each phase's
    # collection (so that one phase's garbage does not count in the next) cost ms, not 0.3 s.
    gc.freeze()
    meter = meters.make(request["meter"], request.get("budget_bytes"), request.get("gpu", 0), request.get("overhead"),
                        request.get("ram_bytes"))
    if watch is not None:
        watch(meter)
    result: ProbeResult = {"status": "ok", "phase": None, "error": None, "oom_kind": None,
                              "seconds_per_step": None, "steps_run": 0, "meter": meter.describe()}
    failure = None
    try:
        with meter:
            _recipe(request, meter, result)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result line
        failure = exc
        verdict, line = _verdict_on(exc, meter)
        result.update(status="oom" if verdict.is_oom else "error", phase=meter.current_phase,
                      oom_kind=verdict.kind if verdict.is_oom else None, error=line.strip()[:2000])
        if not verdict.is_oom:
            result["traceback"] = traceback.format_exc(limit=40)[-4000:]
    del failure  # the traceback pins tensors; drop it before reading the peaks
    result["phase_stats"] = meter.phases
    result["phases"] = {name: int(p["peak_reserved"]) for name, p in meter.phases.items()}
    result["host_phases"] = {name: int(p["peak_host"]) for name, p in meter.phases.items() if "peak_host" in p}
    result["ram_bytes"] = request.get("ram_bytes")
    result["peak_bytes"] = meter.peak_bytes
    result["budget_bytes"] = request.get("budget_bytes")
    result["outside_bytes"] = getattr(meter, "outside_bytes", None)
    if hasattr(meter, "replayed"):  # the estimate's: blocks and updates replayed instead of run
        result["replayed"] = meter.replayed()
    result["meter"] = meter.describe()
    result.update(_host_usage())
    return result


def _verdict_on(error: Exception, meter) -> tuple[oom.Verdict, str]:
    """The verdict on a probe's failure, and its line. An out-of-memory error the meter saw counts
    even where a library swallowed it and raised another: safetensors' loader answers a MemoryError
    in an allocation with `ValueError: could not determine the shape of object type
    'torch.storage.UntypedStorage'`, which diffusers' `load_state_dict` rewraps as an OSError."""
    verdict, line = oom.classify(error), f"{type(error).__name__}: {error}"
    ran_out = meter.ran_out()
    if verdict.is_oom or ran_out is None:
        return verdict, line
    seen = ran_out if isinstance(ran_out, str) else f"{type(ran_out).__name__}: {ran_out}"
    return oom.classify(ran_out), f"{seen} (raised as {line})"


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
    sample = request["sample"]
    with meter.phase("load"):
        pipe = models.load_pipeline(request["model"], request, meter)
        # The EMA's shadow comes with the optimizer, before any caching (BaseSDTrainProcess.run calls
        # setup_ema right after building the optimizer, before the datasets cache anything).
        ema = _ema(pipe, request)
    meter.replay_repeated_blocks(*pipe.parts.values())
    with _phase("text_encoder", pipe, request):
        prompts = _encode_text(pipe, request)
    # The captions' embeddings wait on the host until the steps that use them, as a trainer keeps
    # cached embeddings (or encodes each batch when its step comes); the sample prompts stay.
    held = [kind for kind in ("train", "preservation", "validation") if kind in prompts]
    for kind in held:
        prompts[kind] = {key: meter.to_host(value) for key, value in prompts[kind].items()}
    with _phase("latents", pipe, request):
        _encode_latents(pipe, request)
    first = [settings for settings in (request.get("first_sample"), sample if sample["first"] else None) if settings]
    if first:
        with _phase("sample", pipe, request), _ema_weights(ema):
            for settings in first:  # `first_sample:`'s preview, then the baseline one
                _sample(pipe, request, prompts, settings)
    with _phase("train", pipe, request):
        for kind in held:
            prompts[kind] = {key: meter.to_device(value) for key, value in prompts[kind].items()}
        optimizer = _train(pipe, request, prompts, result, ema)
    for kind in held:  # and end with the training steps
        del prompts[kind]
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


def resident(phase: str, request: dict, family, active: str | None = None,
             preview_step: str | None = None) -> set[str]:
    """The parts on the device during `phase`: the ones AI Toolkit's device presets put there
    (toolkit/stable_diffusion_model.py, set_device_state_preset; AI Toolkit commit 27a03a91; see
    `_by_the_presets`), as the family's Placement changes them (Family.resident_in, the one place
    that reads a part's rules after load). `active`: the denoiser predicting, else the first
    trained one; `preview_step`: "denoise" or "decode" inside a preview."""
    trainer = request.get("trainer")
    if trainer:  # a kohya trainer's own placement, phase by phase (fitfinder.trainers: its recipe)
        decode = set(trainer.get("decode", ())) if preview_step == "decode" else set()
        return set(trainer["residency"][phase]) | decode
    presets = _by_the_presets(phase, request, family)
    return family.resident_in(phase, presets, request["low_vram"], active or request["trained"][0], preview_step)


def _by_the_presets(phase: str, request: dict, family) -> set[str]:
    """The denoisers, encoders and VAE that AI Toolkit's presets put on the device during `phase`.

    Everything loaded stays, except: the text-embedding caching pass holds the encoders alone
    ('cache_text_encoder'), cached embeddings unload the encoders for good (toolkit/unloader.py),
    `unload_text_encoder` moves them to the host after encoding and previews bring them back
    ('generate' places every part, SDTrainer's hook_before_train_loop only moves them to the CPU);
    the latent-caching pass moves all but the VAE off ('cache_latents'), and cached latents keep
    the VAE off during training (hook_before_train_loop; it comes back for previews). None of them
    reads low_vram.
    """
    encoders = set(family.text_encoders)
    mode = request["text_encoder"]
    kept = encoders if mode == "keep" else set()
    previews = encoders if mode != "cache" else set()
    denoisers, cached = set(family.denoisers), request["cache_latents"]
    if phase == "text_encoder":
        return encoders if mode == "cache" else denoisers | encoders | {"vae"}
    if phase == "latents" and cached:
        return {"vae"}
    if phase in ("latents", "train"):
        vae_off = cached and phase == "train"
        return denoisers | kept | (set() if vae_off else {"vae"})
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
    if request.get("trainer") and request["text_encoder"] == "cache":
        batch = request["trainer"].get("text_batch", 1)  # the trainer's caching pass takes its own batch
    with torch.no_grad(), _autocast(pipe, request):
        prompts = {"train": pipe.recipe.encode_prompts(encoders, batch)}
        if request.get("preservation"):  # the class or blank prompt, expanded to the batch
            prompts["preservation"] = pipe.recipe.encode_prompts(encoders, batch)
        if request.get("validation"):  # setup_validation: each item's prompt, one at a time
            prompts["validation"] = pipe.recipe.encode_prompts(encoders, 1)
        if request["sample"]["first"] or request["sample"]["last"] or request.get("first_sample"):
            prompts["sample"] = pipe.recipe.encode_prompts(encoders, 1)
            prompts["negative"] = pipe.recipe.encode_prompts(encoders, 1)
    del encoders
    pipe.meter.claim("embeddings", prompts)
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
    if request.get("trainer") and request["cache_latents"]:
        batch = request["trainer"].get("latent_batch", 1)  # the trainer's caching pass takes its own batch
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


def _sample(pipe, request: dict, prompts: dict, settings: dict | None = None) -> None:
    """A preview as AI Toolkit renders one: denoising steps with guidance, then the VAE decode
    (`settings`: request["sample"] unless given)."""
    _denoise_and_decode(pipe, request, prompts, settings or request["sample"])


def _denoise_and_decode(pipe, request: dict, prompts: dict, settings: dict) -> None:
    """The phase brought every part (the 'generate' preset); a preview pipeline may then move parts
    off for the denoising loop and for the decode (Placement.in_previews: Wan's under low_vram)."""
    import torch

    recipe = pipe.recipe
    height, width = _accepted_size(pipe, settings["height"]), _accepted_size(pipe, settings["width"])
    for name in pipe.family.denoisers:
        pipe.parts[name].eval()
    with torch.no_grad(), _autocast(pipe, request):
        latents = recipe.inputs.randn(recipe.latent_shape(height, width, settings["frames"], 1))
        levels = [1.0 - i / settings["steps"] for i in range(settings["steps"])]
        for level, next_level in zip(levels, levels[1:] + [0.0]):
            expert = _expert(pipe, level)
            pipe.place(resident("sample", request, pipe.family, active=expert, preview_step="denoise"))
            t = torch.full((1,), level, device=recipe.inputs.device, dtype=recipe.inputs.dtype)
            velocity = recipe.guided(pipe.parts[expert], latents, t, prompts["sample"], prompts["negative"],
                                     settings["guidance_scale"])
            latents = latents + (next_level - level) * velocity
            del velocity
        pipe.place(resident("sample", request, pipe.family, active=expert, preview_step="decode"))
        with _tiled(pipe.parts["vae"], request.get("tiled_preview_decode", False)):
            images = recipe.decode(pipe.parts["vae"], latents)
    del images, latents


@contextlib.contextmanager
def _tiled(vae, tiled: bool):
    """The VAE decodes in diffusers' spatial tiles while `tiled`, as generate_single_image sets it
    for a preview and unsets it after (toolkit/models/wan21/wan21.py Wan21.generate_single_image,
    use_vae_tiling; qwen_image.py QwenImageModel.generate_single_image under low_vram)."""
    if not tiled:
        yield
        return
    vae.enable_tiling()
    try:
        yield
    finally:
        vae.disable_tiling()


def _expert(pipe, level: float) -> str:
    """The denoiser for a noise level: Wan 2.2's high-noise expert above the boundary, else the other
    (a kohya trainer's previews may run one of them at every level: its recipe's `previews_by`)."""
    denoisers = pipe.family.denoisers
    own = (pipe.settings.get("trainer") or {}).get("previews_by")
    if len(denoisers) == 1 or own:
        return own or denoisers[0]
    return denoisers[0] if level >= pipe.arch.get("boundary_ratio", 0.875) else denoisers[1]


def _train(pipe, request: dict, prompts: dict, result: dict, ema=None):
    """Training steps (LoRA or full) over the shape schedule; the optimizer steps every
    `accumulation` micro-steps, the EMA follows each optimizer step.
    Returns the optimizer, whose state outlives the phase (previews happen during training)."""
    _maybe_fault(request.get("fault"))
    trained = request["trained"]
    for name in trained:
        pipe.parts[name].train()
    with pipe.meter.concrete(), pipe.meter.owning("optimizer"):  # bitsandbytes builds its code books from values
        optimizer = _optimizer(request, pipe, trained)
    _gradients_owned(pipe, trained)
    pipe.meter.replay_repeated_updates(optimizer)  # the estimate's: each layout's update runs once
    steps, accumulation = request["steps"], max(1, request["accumulation"])
    if request.get("prime_optimizer") and pipe.offloaded & set(trained):
        # Offloaded layers leave their last copies in the device's rings (models/_offload.py), so a
        # run's later steps start with a step's copies held: a one-step run (the estimate's) first
        # takes the first step of a run, its heaviest shape, as the probe does, and drops its gradients.
        resolution, frames = shape_schedule(request["shapes"], 1)[0]
        _training_step(pipe, request, prompts, trained[0], resolution, frames, accumulation)
        optimizer.zero_grad(set_to_none=True)
    if request.get("prime_optimizer"):
        # Gradients outlive a step only while the same denoiser keeps training (see the loop).
        carried = accumulation > 1 and (len(trained) == 1 or request["switch_every"] > 1)
        _prime_optimizer(pipe, request, optimizer, keep_gradients=carried)
    schedule = shape_schedule(request["shapes"], steps)
    middle = steps // 2
    heaviest_steps = {0, middle, steps - 1}
    timings, walls = [], []

    def expert_at(step: int) -> str:
        # Two experts take turns every `switch_every` steps (AI Toolkit's switch_boundary_every).
        return trained[(step // max(1, request["switch_every"])) % len(trained)]

    for step, (resolution, frames) in enumerate(schedule):
        start, wall_start = pipe.meter.step_clock(), time.perf_counter()
        expert = expert_at(step)
        _training_step(pipe, request, prompts, expert, resolution, frames, accumulation, step in heaviest_steps)
        # Step the optimizer every `accumulation` micro-steps, once before the middle step so its
        # state exists when the heaviest shape comes back, and before the other expert takes over.
        if (step + 1) % accumulation == 0 or step in (middle - 1, steps - 1) or expert_at(step + 1) != expert:
            with pipe.meter.owning("optimizer"):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update()
            pipe.meter.register(optimizer)
        timings.append(pipe.meter.step_clock() - start)
        walls.append(time.perf_counter() - wall_start)
        result["steps_run"] = step + 1
    if request.get("validation"):  # validate() runs between steps, with the optimizer's state held
        _validate(pipe, request, prompts, trained[0])
    result["step_seconds"] = [round(t, 5) for t in timings]
    result["step_wall_seconds"] = [round(t, 5) for t in walls]
    result["seconds_per_step"], result["timing_noise"] = step_timing(schedule, timings)
    return optimizer


def _training_step(pipe, request: dict, prompts: dict, expert: str, resolution: int, frames: int,
                   accumulation: int, heaviest: bool = True) -> None:
    """One micro-step's forward and backward of `expert` at a shape; its gradients stay."""
    import torch.nn.functional as F

    recipe = pipe.recipe
    pipe.place(resident("train", request, pipe.family, active=expert))
    side = _accepted_size(pipe, resolution)
    latents = _training_latents(pipe, request, side, frames, heaviest)
    noise = recipe.inputs.randn(latents.shape)
    t = recipe.inputs.timesteps(latents.shape[0])
    noisy, target = recipe.noisy_and_target(latents, noise, t)
    prior = _prior_prediction(pipe, request, prompts, expert, noisy, t)
    with _autocast(pipe, request):
        prediction = recipe.predict(pipe.parts[expert], noisy, t, prompts["train"])
    loss = F.mse_loss(prediction.float(), target.float()) / accumulation
    if prior is not None:
        # the preservation prediction, with gradients, held with the first one until the backward
        kept = recipe.predict(pipe.parts[expert], noisy, t, prompts["preservation"])
        loss = loss + F.mse_loss(kept, prior) / accumulation
        del kept, prior
    loss.backward()
    del latents, noise, noisy, target, prediction, loss
    # Gradients the estimate's replays set without a backward hook (CheckpointedBlocks) are the gradients' too.
    grads = [param.grad for param in pipe.trainable_parameters([expert]) if param.grad is not None]
    pipe.meter.claim("gradients", *grads)


def _autocast(pipe, request: dict):
    """A kohya trainer's forward passes under autocast (accelerator.autocast(): each op in the
    compute dtype, an fp8 weight upcast for its one op); AI Toolkit's run without."""
    import torch

    dtype = (request.get("trainer") or {}).get("autocast")
    if not dtype:
        return contextlib.nullcontext()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return torch.autocast(device_type=pipe.meter.device.type, dtype=compute)


def _prior_prediction(pipe, request: dict, prompts: dict, expert: str, noisy, t):
    """train.diff_output_preservation / blank_prompt_preservation (SDTrainer.train_single_accumulation,
    get_prior_prediction; AI Toolkit commit 27a03a91): before the step's prediction, one without
    gradients, the network off and the model in eval mode, on the class (or blank) prompt; its output
    stays for the preservation loss. None without preservation."""
    if not request.get("preservation"):
        return None
    import torch

    denoiser = pipe.parts[expert]
    denoiser.eval()
    try:
        with torch.no_grad(), pipe.lora_off(expert):
            return pipe.recipe.predict(denoiser, noisy, t, prompts["preservation"]).detach()
    finally:
        denoiser.train()


def _validate(pipe, request: dict, prompts: dict, expert: str) -> None:
    """BaseSDTrainProcess.validate (AI Toolkit commit 27a03a91): one validation image's cached latents
    and prompt, repeated once per sigma into one batch, noised and predicted without gradients, the
    model in eval mode and the network on; its loss in fp32."""
    import torch
    import torch.nn.functional as F

    settings, recipe = request["validation"], pipe.recipe
    side, batch = _accepted_size(pipe, settings["resolution"]), settings["batch"]
    denoiser = pipe.parts[expert]
    denoiser.eval()
    try:
        with torch.no_grad():
            latents = recipe.inputs.randn(recipe.latent_shape(side, side, 1, batch))
            noise = recipe.inputs.randn(latents.shape)
            t = recipe.inputs.timesteps(batch)
            noisy, target = recipe.noisy_and_target(latents, noise, t)
            cond = {key: torch.cat([value] * batch) for key, value in prompts["validation"].items()}
            loss = F.mse_loss(recipe.predict(denoiser, noisy, t, cond).float(), target.float())
            del latents, noise, noisy, target, cond, loss
    finally:
        denoiser.train()


def step_timing(schedule: list[tuple[int, int]], timings: list[float]) -> tuple[float, float]:
    """Seconds per step of a run that cycles its shapes evenly, and the timing's relative noise.

    The first step pays one-time costs and is left out. Each shape's steps are summarised by
    their median, so one step slowed by other work on the machine moves nothing; the shapes are
    then averaged as a run meets them, in turn. The noise is the largest relative median
    absolute deviation of a shape's steps (0 where no shape was timed three times): how far two
    probes' speeds can differ by chance alone.
    """
    steady = list(zip(schedule, timings))[1:] or list(zip(schedule, timings))
    by_shape: dict[tuple[int, int], list[float]] = {}
    for shape, seconds in steady:
        by_shape.setdefault(shape, []).append(seconds)
    medians, noise = [], 0.0
    for seconds in by_shape.values():
        middle = statistics.median(seconds)
        medians.append(middle)
        if len(seconds) >= 3 and middle > 0:
            noise = max(noise, statistics.median(abs(s - middle) for s in seconds) / middle)
    return round(sum(medians) / len(medians), 5), round(noise, 4)


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
        with pipe.meter.owning("gradients"):
            for param in _reached_by_the_loss(pipe, name):
                param.grad = torch.zeros_like(param)
        with pipe.meter.owning("optimizer"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with pipe.meter.owning("gradients"):
        if keep_gradients:
            for param in _reached_by_the_loss(pipe, trained[0]):
                param.grad = torch.zeros_like(param)
        # An accuracy-recovery adapter's gradients live from a run's first backward on (no optimizer clears them).
        for name in trained:
            for param in _reached_by_the_loss(pipe, name, pipe.recovery_parameters([name])):
                param.grad = torch.zeros_like(param)
    pipe.meter.register(optimizer)


def _gradients_owned(pipe, trained: list[str]) -> None:
    """Each trained parameter's gradient belongs to the gradients from the moment it is accumulated
    (until then, in the backward, it is one of its transients)."""
    meter = pipe.meter
    if not hasattr(meter, "tracker"):  # the cuda meter counts no tensor, and has no owners
        return
    for param in pipe.trainable_parameters(trained):
        if not getattr(param, "_gradient_owned", False):
            param.register_post_accumulate_grad_hook(lambda p: meter.claim("gradients", p.grad))
            param._gradient_owned = True


def _reached_by_the_loss(pipe, name: str, params: list | None = None) -> list:
    """The trainable parameters (or `params`) a training step gives a gradient: all but those the
    recipe names in `without_gradient(denoiser)` (Qwen-Image's last block's text stream, whose output
    nothing reads); an optimizer makes no state for a parameter without a gradient, so priming must not
    either."""
    params = pipe.trainable_parameters([name]) if params is None else params
    unreached = getattr(pipe.recipe, "without_gradient", None)
    if unreached is None:
        return params
    skipped = {id(param) for param in unreached(pipe.parts[name])}
    return [param for param in params if id(param) not in skipped]


def _training_latents(pipe, request: dict, side: int, frames: int, heaviest: bool):
    """Cached latents are read from disk; otherwise the step encodes its batch through the VAE.

    The encode runs at the heaviest shape (first, middle and last step), where its transient
    meets the optimizer state; other steps draw latents of the right shape, which costs the same
    memory in the denoiser and keeps the probe fast.
    """
    import torch

    recipe, batch = pipe.recipe, request["batch_size"]
    with pipe.meter.owning("latents"):
        if request["cache_latents"] or not heaviest:
            return recipe.inputs.randn(recipe.latent_shape(side, side, frames, batch))
    with torch.no_grad():
        latents = recipe.encode_images(pipe.parts["vae"], recipe.pixels(side, side, frames, batch)).detach()
    pipe.meter.claim("latents", latents)
    return latents


def _optimizer(request: dict, pipe, trained: list[str]):
    """The job's optimizer as AI Toolkit builds it (see optimizers.py), over the trained parameters."""
    from fitfinder import optimizers  # torch: only in the child, never where a request is built
    from fitfinder.models._lokr import STARTS_AT_ZERO

    # peft's B starts at zero, and a LoKr's larger factor (or its second half)
    zero_at_start = [param for name in trained for param_name, param in pipe.parts[name].named_parameters()
                     if param.requires_grad and (".lora_B." in param_name or param_name.endswith(STARTS_AT_ZERO))]
    return optimizers.build(request["optimizer"], pipe.trainable_parameters(trained), request["lr"],
                            request.get("optimizer_params"), zero_at_start)


def _ema(pipe, request: dict):
    """train.ema_config.use_ema: a shadow of every trained parameter (see optimizers.Ema), or None."""
    if request.get("ema_decay") is None:
        return None
    from fitfinder import optimizers  # torch: only in the child

    with pipe.meter.owning("ema"):
        ema = optimizers.Ema(pipe.trainable_parameters(request["trained"]), request["ema_decay"])
    pipe.meter.replay_repeated_updates(ema=ema)  # the estimate's: each layout's update and copy runs once
    return ema


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


def _result_line(result: ProbeResult, request: ProbeRequest) -> bytes:
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
    if log_path:  # never through a link or into a FIFO planted at its name (files.open_own)
        fd = files.open_own(log_path, truncate=True)
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


if __name__ == "__main__":
    main()
