"""The probe's process boundary: one JSON request in, exactly one JSON result line out.

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

RESULT_STATUSES = ("ok", "oom", "error", "timeout")
