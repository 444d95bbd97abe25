"""The optimizers of `train.optimizer`, built as AI Toolkit builds them, so their state is its state.

AI Toolkit's `toolkit/optimizer.py` (commit 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350) picks the
library and the defaults: torch's Adam/AdamW with eps 1e-6; bitsandbytes' Adam8bit, AdamW8bit
and Lion8bit (8-bit moments with an fp32 scale per 256 elements, 32-bit ones for tensors under 4096
elements); lion-pytorch's Lion; prodigyopt's Prodigy (lr 1.0 below 0.1, eps 1e-6); and its own
Adafactor with relative_step, scale_parameter and warmup_init false unless the job sets them.
`train.optimizer_params` goes to the constructor as AI Toolkit passes it, so the keys that change
the state (adafactor's beta1, adamw's amsgrad, bitsandbytes' min_8bit_size,
prodigy's betas and slice_p) change it here too.

State per trained element, lightest first (the order of `space.OPTIMIZERS`): adafactor keeps factored fp32 second
moments (a row and a column per matrix, a full copy only for vectors); lion8bit one byte; the
8-bit Adams two bytes; lion one moment in the parameter's dtype; Adam/AdamW two; prodigy four
(its two moments, `s` and the initial weights `p0`).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

def build(name: str, params: list, lr: float, optimizer_params: dict | None = None,
          zero_params: list | None = None) -> torch.optim.Optimizer:
    """`name` as `trainers.aitoolkit_job.optimizer_name` gives it; the arguments AI Toolkit would pass.
    `zero_params`: parameters that start at zero (a LoRA's B), which Prodigy keeps no p0 of."""
    extra = dict(optimizer_params or {})
    if name in ("adam8bit", "adamw8bit", "lion8bit"):
        import bitsandbytes as bnb

        cls = {"adam8bit": bnb.optim.Adam8bit, "adamw8bit": bnb.optim.AdamW8bit, "lion8bit": bnb.optim.Lion8bit}[name]
        return cls(params, lr=lr, **({} if name == "lion8bit" else {"eps": 1e-6}), **extra)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=float(lr), eps=1e-6, **extra)
    if name == "lion":
        from lion_pytorch import Lion

        return Lion(params, lr=lr, **extra)
    if name == "prodigy":
        from prodigyopt import Prodigy

        return _readable_on_fakes(Prodigy(params, lr=lr if lr >= 0.1 else 1.0, eps=1e-6, **extra), zero_params or [])
    if name == "adafactor":
        for key in ("relative_step", "scale_parameter", "warmup_init"):
            extra.setdefault(key, False)
        return Adafactor(params, lr=float(lr), **extra)
    raise ValueError(f"unknown optimizer {name!r}")


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with the memory of AI Toolkit's `toolkit/optimizers/adafactor.py`.

    Its state is fp32 whatever the parameter's dtype: a row and a column of second moments for
    every tensor of two or more dimensions, a full one for vectors, a full first moment only with
    beta1. Each step works on one parameter at a time in fp32 (the gradient, a copy of a bf16
    weight, the update) and writes bf16/fp16 weights back with stochastic rounding. Parameters
    that are not fp32 get their gradients moved into `_accum_grad` after each backward (AI
    Toolkit's stochastic gradient accumulation), which holds the same bytes as `.grad`.
    """

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False,
                 stochastic_accumulation=True, stochastic_rounding=True):
        if lr is not None and relative_step:
            raise ValueError("adafactor: a manual lr cannot be combined with relative_step: true")
        if warmup_init and not relative_step:
            raise ValueError("adafactor: warmup_init: true needs relative_step: true")
        defaults = {"lr": lr, "eps": eps, "clip_threshold": clip_threshold, "decay_rate": decay_rate,
                    "beta1": beta1, "weight_decay": weight_decay, "scale_parameter": scale_parameter,
                    "relative_step": relative_step, "warmup_init": warmup_init}
        super().__init__(params, defaults)
        self.stochastic_rounding = stochastic_rounding
        self.accumulates = False
        if stochastic_accumulation:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.requires_grad and param.dtype != torch.float32:
                        self.accumulates = True
                        param.register_post_accumulate_grad_hook(_accumulate_gradient)

    @torch.no_grad()
    def step(self, closure=None):
        if self.accumulates:  # the accumulated gradients become the ones to apply
            for group in self.param_groups:
                for param in group["params"]:
                    if hasattr(param, "_accum_grad"):
                        param.grad = param._accum_grad
                        del param._accum_grad
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.requires_grad:
                    self._update(param, group)

    def _update(self, param: torch.Tensor, group: dict) -> None:
        grad = param.grad.float()
        state = self.state[param]
        factored = grad.dim() >= 2
        if not state:
            state["step"] = 0
            if group["beta1"] is not None:
                state["exp_avg"] = torch.zeros_like(grad)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1]).to(grad)
                state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:]).to(grad)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
        weight = param if param.dtype == torch.float32 else param.clone().float()
        state["step"] += 1
        state["RMS"] = _rms(weight)
        lr = _learning_rate(group, state)
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        eps = group["eps"][0] if isinstance(group["eps"], (tuple, list)) else group["eps"]
        update = grad ** 2 + eps
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
            col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
            row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = torch.mul(row_factor, col.unsqueeze(-2).rsqrt()).mul_(grad)
        else:
            state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
            update = state["exp_avg_sq"].rsqrt().mul_(grad)
        update.div_((_rms(update) / group["clip_threshold"]).clamp_(min=1.0)).mul_(lr)
        if group["beta1"] is not None:
            update = state["exp_avg"].mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
        if group["weight_decay"]:
            weight.add_(weight, alpha=-group["weight_decay"] * lr)
        weight.add_(-update)
        if param.dtype != torch.float32:
            _write_rounded(param, weight, self.stochastic_rounding)


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.norm(2) / (tensor.numel() ** 0.5)


def _learning_rate(group: dict, state: dict):
    step_size = group["lr"]
    if group["relative_step"]:
        floor = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
        step_size = min(floor, 1.0 / math.sqrt(state["step"]))
    scale = max(group["eps"][1], state["RMS"]) if group["scale_parameter"] else 1.0
    return scale * step_size


def _accumulate_gradient(param: torch.Tensor) -> None:
    """Sum micro-batch gradients in fp32 and round back stochastically (bf16 sums lose small updates)."""
    if hasattr(param, "_accum_grad"):
        total = param._accum_grad.clone().float()
        total.add_(param.grad.float())
        _write_rounded(param._accum_grad, total, True)
        del total
    else:
        param._accum_grad = param.grad.clone()
    del param.grad


def _write_rounded(target: torch.Tensor, source: torch.Tensor, stochastic: bool) -> None:
    """fp32 `source` into a bf16 or fp16 `target` with random rounding, else a plain copy.

    bf16: random low 16 bits added to fp32's bit pattern, then cut (one int32 temporary); fp16:
    uniform noise at fp16's last mantissa bit, rounded (fp32 temporaries), as AI Toolkit does."""
    if not stochastic or target.dtype not in (torch.bfloat16, torch.float16):
        target.copy_(source)
        return
    if target.dtype == torch.float16:
        factor = 2.0 ** (23 - 10)  # fp32 keeps 13 more mantissa bits than fp16
        noise = torch.rand_like(source) - 0.5
        rounded = torch.round(source * factor + noise)
        target.copy_(rounded / factor)
        del noise, rounded
        return
    noisy = torch.randint_like(source, dtype=torch.int32, low=0, high=1 << 16)
    noisy.add_(source.view(dtype=torch.int32)).bitwise_and_(-65536)
    target.copy_(noisy.view(dtype=torch.float32))
    del noisy


def _readable_on_fakes(optimizer: torch.optim.Optimizer, zero_params: list) -> torch.optim.Optimizer:
    """prodigyopt's Prodigy with its value reads answered on fake tensors (the estimate).

    Prodigy reads values on the host (`if p.any()` decides whether it keeps a copy p0 of the
    weights, `.item()` its step size), which fake tensors cannot answer. The state depends on the
    first only: `p.any()` answers False for `zero_params` (a LoRA's B starts at zero, measured:
    the sim meter holds no p0 for it) and True otherwise; every other read answers 1, so the step
    takes its full path, as a real step with real gradients does.
    """
    step = optimizer.step

    def stepped(closure=None):
        from torch._subclasses.fake_tensor import FakeTensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(isinstance(p, FakeTensor) for p in params):
            return step(closure)
        with _FakeScalars({id(p) for p in zero_params}):
            return step(closure)

    optimizer.step = stepped
    return optimizer


class _FakeScalars(TorchDispatchMode):
    """A fake tensor read as a Python number answers 1 (True for booleans), but `any()` of a
    parameter known to be zero answers False."""

    def __init__(self, zero_ids: set[int]):
        super().__init__()
        self.zero_ids = zero_ids
        self.false_answers: list[torch.Tensor] = []  # held, so that their ids stay theirs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if any(args[0] is answer for answer in self.false_answers):
                return False
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.any.default and id(args[0]) in self.zero_ids:
            self.false_answers = [result]
        return result


class Ema:
    """The memory of AI Toolkit's `toolkit/ema.py` (train.ema_config.use_ema).

    A shadow copy of every trained parameter in its own dtype, made with the optimizer. After
    each optimizer step the shadow moves towards the weights one parameter at a time in fp32 (a
    bf16 shadow: fp32 copies of it and of the weight, their difference, rounded back). A preview
    stores the weights (another copy) and renders with the shadow; AI Toolkit restores the
    weights afterwards but keeps the stored copy until the next preview replaces it, and builds
    the new copy before the old one goes.
    """

    def __init__(self, params: list, decay: float):
        self.params = list(params)
        self.decay = decay
        with torch.no_grad():  # a clone under no_grad has no history: no detach needed (one op, not two)
            self.shadow = [param.clone() for param in self.params]
        self.stored: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self) -> None:
        for shadow, param in zip(self.shadow, self.params):
            self.update_one(shadow, param)

    def update_one(self, shadow: torch.Tensor, param: torch.Tensor) -> None:
        """One parameter's step (the estimate meter replays repeats of a layout: meters.RepeatedUpdates)."""
        shadow_fp32 = shadow.float()  # the shadow itself when it is fp32
        weight_fp32 = param if param.dtype == torch.float32 else param.to(torch.float32)
        difference = shadow_fp32 - weight_fp32
        difference.mul_(1.0 - self.decay)
        shadow_fp32.sub_(difference)
        del difference, weight_fp32
        if shadow.dtype != torch.float32:
            _write_rounded(shadow, shadow_fp32, True)

    @contextlib.contextmanager
    def swapped_in(self):
        """The shadow in the weights for a preview; the stored copy outlives it (AI Toolkit's)."""
        with torch.no_grad():
            self.stored = [self.copy_of(param) for param in self.params]
            for shadow, param in zip(self.shadow, self.params):
                self.write(param, shadow)
        yield
        with torch.no_grad():
            for stored, param in zip(self.stored, self.params):
                self.write(param, stored)

    # One tensor each, so that the estimate meter can replay repeats of a layout (meters.RepeatedUpdates).
    def copy_of(self, param: torch.Tensor) -> torch.Tensor:
        return param.clone()

    def write(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.data.copy_(source.data)
