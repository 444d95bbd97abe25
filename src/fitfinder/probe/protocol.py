"""The probe's process boundary: one JSON request in, exactly one JSON result line out.

Both halves are plain dicts (they cross a pipe as JSON); `ProbeRequest` and `ProbeResult` type
them for the readers on each side, and every module calls them by these names (`request`,
`probe_result`). The request is built in one place, `probe.request.request_for` (an estimate
rewrites three of its fields: `probe.estimate.as_estimate`).
"""

from __future__ import annotations

import sys
from typing import Any, Literal, Optional, get_args

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict

Status = Literal["ok", "oom", "error", "timeout"]
Phase = Literal["load", "text_encoder", "latents", "sample", "train", "last_sample"]
Meter = Literal["sim", "cuda", "estimate"]
TextEncoderMode = Literal["keep", "cache", "unload"]
Purpose = Literal["", "base", "rollback", "quality", "speed", "confirm"]  # which stage of the plan asked
Verdict = Literal["fit", "nofit"]  # the planner's reading of a result against the limit (None: says nothing)

RESULT_STATUSES: tuple[str, ...] = get_args(Status)


class SampleSettings(TypedDict):
    first: bool  # the preview before training (not with skip_first_sample or disable_sampling)
    last: bool  # the preview after training (not with disable_sampling)
    width: int
    height: int
    frames: int
    steps: int  # denoising steps: at most request.SAMPLE_STEPS
    guidance_scale: float


class TrainerRecipe(TypedDict):
    """A kohya trainer's own recipe (fitfinder.trainers: sd_scripts.recipe, musubi_tuner.recipe),
    followed by models/_kohya.py and recipe.resident in place of AI Toolkit's placement."""

    name: str  # sd-scripts | musubi-tuner
    script: str
    weights: dict[str, str]  # part -> a dtype, "fp8" (cast, upcast per layer) or "fp8_scaled" (musubi's)
    residency: dict[str, list[str]]  # phase -> the parts on the device
    decode: list[str]  # the parts a preview's decode brings on top
    autocast: Optional[str]  # every forward under torch.autocast in this dtype, or None
    swapped: dict[str, int]  # block list -> how many of its last blocks keep their weights in host memory
    lora_input_cast: bool  # peft's cast of a layer's input to the adapter's dtype (kohya's LoRA has none)
    text_batch: int  # captions per step of the text encoders' caching pass
    latent_batch: int  # images per step of the latents' caching pass
    lora_blocks: NotRequired[str]  # the trainer's LoRA targets (a regex of module names), where not the family's
    lora_convs: NotRequired[bool]  # ... and whether its 1x1 convolutions are among them
    scaled: NotRequired[dict[str, list[str]]]  # scaled fp8's targets and excluded module names (musubi's per model)
    previews_by: NotRequired[str]  # the one denoiser a preview runs (musubi's Wan 2.2: its low-noise model)


class ProbeRequest(TypedDict):
    """Everything a probe needs, read from the job file with AI Toolkit's defaults."""

    model: dict[str, Any]  # trainers.model_spec (or trainers.architecture_spec for an estimate)
    dtype: str
    quantize: Optional[int]  # bits of the base model's weights, None: not quantized
    quant_type: str  # AI Toolkit's qtype name (see models._weights.quantize)
    recovery_adapter: NotRequired[Optional[dict[str, Any]]]  # qtype's accuracy-recovery adapter: rank, layers, read
    quantize_te: Optional[int]
    quant_type_te: str
    low_vram: bool
    layer_offloading: NotRequired[dict[str, float]]  # share of layers offloaded: "denoiser", "text_encoder"
    text_encoder: TextEncoderMode
    cache_latents: bool
    shapes: list[list[int]]  # [resolution, frames] pairs the datasets train on
    batch_size: int
    accumulation: int
    gradient_checkpointing: bool
    rank: Optional[int]  # None: a full fine-tune, which adds the two filters below
    alpha: Optional[float]
    only_if_contains: NotRequired[list[str]]
    ignore_if_contains: NotRequired[list[str]]
    lora_ignore: NotRequired[list[str]]  # a LoRA's network_kwargs.ignore_if_contains: layers it leaves out
    conv_rank: NotRequired[Optional[int]]  # network.conv: the rank of the LoRA on larger convolutions (UNets)
    conv_alpha: NotRequired[Optional[float]]
    network_type: NotRequired[str]  # lora (default), lokr or locon: how the LoRA is built (models._pipeline)
    lokr_factor: NotRequired[int]  # network.lokr_factor: a LoKr's factor (-1: most even)
    optimizer: str
    optimizer_params: dict[str, Any]
    ema_decay: Optional[float]  # None without EMA
    preservation: NotRequired[bool]  # diff_output_ or blank_prompt_preservation: a prior and a second prediction
    validation: NotRequired[dict[str, int]]  # train.validation_config: resolution and batch (the sigmas)
    lr: float
    trained: list[str]  # the denoisers that get a LoRA, or train whole
    switch_every: int  # two-expert models
    sample: SampleSettings
    first_sample: NotRequired[SampleSettings]  # `first_sample:`'s own preview before training
    preview_holds_gradients: bool
    steps: int
    meter: Meter
    budget_bytes: Optional[int]
    ram_bytes: NotRequired[int]  # the host's budget: the sim meter raises MemoryError past it (--ram)
    gpu: int
    seed: int
    tiled_preview_decode: NotRequired[bool]  # previews decode with the VAE tiled (Family.tiled_preview_decode)
    prime_optimizer: NotRequired[bool]  # the optimizer's state made before the first step (the estimate)
    overhead: NotRequired[dict[str, Any]]  # the estimate meter's GPU overhead model (probe.overhead)
    fault: NotRequired[str]  # a test hook's injected failure (probe.faults)
    trainer: NotRequired[TrainerRecipe]  # a kohya job's: its trainer's recipe (fitfinder.trainers)
    trainer_run: NotRequired[dict[str, Any]]  # the user's trainer runs it: dialect, command words (probe.trainer)
    trainer_job: NotRequired[dict[str, Any]]  # the point's job as that trainer's dialect writes it (probe.dialects)


class PhaseStats(TypedDict, total=False):
    peak_allocated: int
    peak_reserved: int
    seconds: float
    peak_live: int  # estimate: the tensor bytes alone


class ProbeResult(TypedDict, total=False):
    """The child's one result line; the runner makes one that says why when there is none."""

    status: Status
    phase: Optional[Phase]  # the phase that ran out of memory (or failed), None when ok
    peak_bytes: Optional[int]
    phases: dict[str, int]  # phase -> peak bytes
    phase_stats: dict[str, PhaseStats]
    seconds_per_step: Optional[float]  # medians per shape (recipe.step_timing)
    timing_noise: float  # the timing's relative noise
    step_seconds: list[float]  # each step's, by the meter's step clock
    step_wall_seconds: list[float]
    steps_run: Optional[int]
    error: Optional[str]
    traceback: str  # an error that is not an out-of-memory
    oom_kind: Optional[str]  # oom.classify: config, environment or host (the machine's RAM ran out)
    meter: str  # the meter, described
    budget_bytes: Optional[int]
    ram_bytes: Optional[int]  # the request's host budget
    host_phases: dict[str, int]  # phase -> host peak bytes (the process and its host tensors)
    outside_bytes: Optional[int]  # cuda: memory outside PyTorch's allocator (in every peak); estimate: the context
    replayed: dict[str, int]  # estimate: blocks and updates replayed instead of run, by kind (meters.EstimateMeter)
    max_rss_bytes: int  # host memory of the probe process at its highest
    cpu_seconds: float
    wall_seconds: float  # the runner's clock, start to result
    estimated: bool  # the search's pre-screen decided it on an estimate (search.estimated.Prescreen)
    trainer_run: dict[str, Any]  # a trainer probe: its command, exit code, where its phases came from (probe.trainer)
    estimate: dict[str, Any]  # a trainer probe: the estimate of the same point, phase by phase (probe.trainer)
