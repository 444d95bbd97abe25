"""LoKr as AI Toolkit trains it (`network.type: lokr`): each adapted layer's update is the Kronecker
product of two small factors.

AI Toolkit (commit 27a03a91): toolkit/models/lokr.py `LokrModule` (LyCORIS' LoKr, with a forward of
its own), `factorization`; toolkit/config_modules.py `NetworkConfig` (`lokr_full_rank`, true by
default, sets linear, linear_alpha, conv and conv_alpha to 9999999999; `lokr_factor`, -1 by default:
the most even split); toolkit/lora_special.py `LoRASpecialNetwork` (LokrModule for every layer its
create_modules picks, the same layers as a LoRA's, `factor` from lokr_factor), and
BaseSDTrainProcess.run (`network.force_to(device, torch.float32)`: the factors train in fp32).

What a layer holds and computes, rule by rule:

- A layer of `out` x `in` splits each side in two factors (`factorization`): out = out_l * out_k,
  in = in_m * in_n. `w1` is (out_l, in_m); the larger factor is `w2`, (out_k, in_n), when the dim
  reaches half of max(out_k, in_n), else `w2_a` (out_k, dim) times `w2_b` (dim, in_n). At full rank
  (dim 9999999999) it is always `w2`. A convolution does the same over its channels, `w2` carrying
  the kernel. A scalar `alpha` buffer as LokrModule registers it.
- A Linear layer's forward (LokrModule._call_forward_fast_linear) never builds the full update: the
  base layer's output first, then the input, viewed as (in_m, in_n), through `w2` (or `w2_b`, then
  `w2_a`) and `w1`, in the base output's dtype (the fp32 factors cast to it), the update scaled and
  added to the base output.
- A convolution's forward (LokrModule._call_forward, the "legacy path") builds the full update,
  kron(w1, w2) * scale in fp32, casts it to the weight's dtype, adds it to the weight and convolves
  with that weight.

What the probe does differently: the network's multiplier (a per-batch tensor AI Toolkit averages
at every call) is the number 1.0; the ops and their tensors are the same.
"""

from __future__ import annotations

import math

import torch

# NetworkConfig: lokr_full_rank sets every dim and alpha to this.
FULL_RANK = 9999999999


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """`dimension` split in two factors as toolkit/models/lokr.py `factorization` splits it: (factor,
    dimension / factor) as they come when `factor` divides it; otherwise the divisors walked upward
    while the first stays below the second and at most `factor` (any, with -1), the pair returned
    smaller first. (Its stop on a growing sum compares with the first pair's, 1 + dimension, which no
    pair of divisors passes.)"""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    limit = dimension if factor == -1 else factor
    first, second = 1, dimension
    while first < second:
        candidate = first + 1
        while dimension % candidate:
            candidate += 1
        if candidate > limit:
            break
        first, second = candidate, dimension // candidate
    return min(first, second), max(first, second)


class Lokr(torch.nn.Module):
    """One layer's LoKr factors (fp32) and its forward; `base` is the layer it adapts (not a submodule:
    AI Toolkit's network holds its modules apart from the model)."""

    def __init__(self, base: torch.nn.Module, dim: int, alpha: float, factor: int):
        super().__init__()
        self.base = [base]
        conv = isinstance(base, torch.nn.Conv2d)
        out_features, in_features = (base.out_channels, base.in_channels) if conv else (base.out_features,
                                                                                         base.in_features)
        self.out_l, self.out_k = factorization(out_features, factor)
        self.in_m, self.in_n = factorization(in_features, factor)
        kernel = tuple(base.kernel_size) if conv else ()
        self.conv = conv
        fp32 = {"dtype": torch.float32}
        self.w1 = torch.nn.Parameter(torch.empty(self.out_l, self.in_m, **fp32))
        # LokrModule: the larger factor whole once the dim reaches half of its larger side (convolutions
        # without use_cp, the default, compare the same way)
        self.whole_w2 = dim >= max(self.out_k, self.in_n) / 2
        if self.whole_w2:
            self.w2 = torch.nn.Parameter(torch.empty(self.out_k, self.in_n, *kernel, **fp32))
        else:
            self.w2_a = torch.nn.Parameter(torch.empty(self.out_k, dim, **fp32))
            self.w2_b = torch.nn.Parameter(torch.empty(dim, self.in_n * math.prod(kernel), **fp32))
        # both factors whole: LokrModule uses scale 1 (alpha = dim)
        alpha = dim if not alpha or self.whole_w2 else alpha
        self.scale = float(alpha) / dim
        self.register_buffer("alpha", torch.tensor(alpha))
        torch.nn.init.kaiming_uniform_(self.w1, a=math.sqrt(5))
        if self.whole_w2:
            torch.nn.init.zeros_(self.w2)
        else:
            torch.nn.init.kaiming_uniform_(self.w2_a, a=math.sqrt(5))
            torch.nn.init.zeros_(self.w2_b)
        self.base_forward = base.forward

    active = True  # False: the network is off (`network.is_active`), the base layer alone runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.base_forward(x)
        return self._conv_forward(x) if self.conv else self._linear_forward(x)

    def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update through the factors, never the full matrix (LokrModule._call_forward_fast_linear)."""
        out_dtype = x.dtype
        base_out = self.base_forward(x)
        dtype = base_out.dtype
        inputs = (x if x.dtype == dtype else x.to(dtype)).unflatten(-1, (self.in_m, self.in_n))
        w1 = self.w1.to(dtype)
        if self.whole_w2:
            mixed = torch.einsum("...ms,ks->...mk", inputs, self.w2.to(dtype))
        else:
            low = torch.einsum("...ms,rs->...mr", inputs, self.w2_b.to(dtype))
            mixed = torch.einsum("...mr,kr->...mk", low, self.w2_a.to(dtype))
        update = torch.einsum("...mk,lm->...lk", mixed, w1 * self.scale).flatten(-2, -1)
        update = update * 1.0  # the network's multiplier
        return (base_out + update).to(out_dtype)

    def _conv_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The weight plus the full update, then the convolution (LokrModule._call_forward)."""
        base = self.base[0]
        weight = base.weight.data.detach()
        out_dtype = x.dtype
        # make_kron: a whole w2 carries the kernel, and w1 gains two axes to match; the product of w2's
        # two factors is (out_k, in_n * kernel), and the update is reshaped to the weight's shape after
        w1, w2 = (self.w1.unsqueeze(2).unsqueeze(2), self.w2) if self.whole_w2 else (self.w1, self.w2_a @ self.w2_b)
        update = torch.kron(w1, w2.contiguous()) * self.scale
        update = update.reshape(weight.shape).to(weight.dtype)
        if x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        merged = weight + update * 1.0  # the network's multiplier
        bias = None if base.bias is None else base.bias.data.detach().to(merged.dtype)
        out = torch.nn.functional.conv2d(x, merged.view(weight.shape), bias, base.stride, base.padding, base.dilation,
                                         base.groups)
        return out.to(out_dtype)


# The factor that starts at zero, whose update is zero at the start (Prodigy keeps no p0 of it).
STARTS_AT_ZERO = (".lora_lokr.w2", ".lora_lokr.w2_b")


def add(denoiser: torch.nn.Module, targets: list[str], conv_targets: list[str], dim: int, alpha: float,
        conv_dim: int | None, conv_alpha: float | None, factor: int) -> int:
    """A LoKr on each target layer (`conv_targets` at the conv dim), wrapping its forward as
    LokrModule.apply_to does. Each is registered under the layer as `lora_lokr`: its name holds
    `lora_`, as peft's adapters' do, so the parts of fitfinder that tell a LoRA's parameters by name
    (the estimate's replay of checkpointed blocks) take it for the adapter it is. Returns how many."""
    for name in targets + conv_targets:
        layer = denoiser.get_submodule(name)
        at_conv = name in conv_targets
        adapter = Lokr(layer, conv_dim if at_conv else dim, conv_alpha if at_conv else alpha, factor)
        layer.add_module("lora_lokr", adapter)
        layer.forward = adapter.forward
    return len(targets) + len(conv_targets)
