"""Weights of one part: read from a diffusers folder, or random from an architecture config; quantized.

Random weights of a small part are saved once under the cache and then read with
`from_pretrained`, exactly as real weights are; a large part (a full-size architecture) is built
in host memory in its dtype without initialisation costs and filled with small random values.
Either way the result is what `from_pretrained` gives: the same classes, dtypes (including the
modules a class keeps in fp32) and shapes, so the same memory.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from fitfinder.models import FAMILIES, cache_dir
from fitfinder.models._meta import parameter, plain_meta

# Random parts up to this size (fp32) are saved once and read back like real weights.
SAVE_RANDOM_UP_TO_BYTES = 512 * 2**20


def part_class(family: str, part: str) -> type:
    library, _, name = FAMILIES[family].classes[part].rpartition(".")  # "diffusers.pipelines.ltx2.vocoder.X" too
    return getattr(importlib.import_module(library), name)


def build_part(spec: dict, part: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    """One part with the job's weights, in `dtype`, frozen, in eval mode.

    Weights read from files land in host memory (the caller moves them, as trainers do); a large
    random part is made directly on `device`, which gives the device the same bytes in seconds
    instead of minutes.
    """
    cls = part_class(spec["family"], part)
    if spec["path"] is not None:
        module = _from_pretrained(cls, Path(spec["path"]) / part, dtype)
    else:
        config = spec["arch"]["parts"][part]
        if _fp32_bytes(cls, config) <= SAVE_RANDOM_UP_TO_BYTES:
            module = _from_pretrained(cls, _saved_random(cls, spec["arch_name"], part, config), dtype)
        else:
            module = _built_random(cls, config, dtype, torch.device(device))
    module.requires_grad_(False)
    return module.eval()


def _is_diffusers(cls: type) -> bool:
    return cls.__module__.startswith("diffusers")


def _from_pretrained(cls: type, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    # diffusers names the argument torch_dtype, transformers 5 names it dtype.
    dtype_argument = {"torch_dtype": dtype} if _is_diffusers(cls) else {"dtype": dtype}
    return cls.from_pretrained(folder, local_files_only=True, **dtype_argument)


def _construct(cls: type, config: dict) -> torch.nn.Module:
    if _is_diffusers(cls):
        return cls.from_config(config)
    return cls(cls.config_class(**config))


def _fp32_bytes(cls: type, config: dict) -> int:
    with torch.device("meta"):
        module = _construct(cls, config)
    return 4 * sum(p.numel() for p in module.parameters())


def _saved_random(cls: type, arch_name: str, part: str, config: dict) -> Path:
    """Random weights saved once under the cache (keyed by the config), then read like real ones."""
    digest = hashlib.sha256(json.dumps([cls.__name__, config], sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "random" / arch_name / f"{part}-{digest}"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        torch.manual_seed(0)
        _construct(cls, config).save_pretrained(tmp)
        try:
            os.rename(tmp, folder)  # atomic; a concurrent probe may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _built_random(cls: type, config: dict, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A full-size part without reading or initialising 20 GB: the classes and dtypes from_pretrained gives."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real
        module = _construct(cls, config)
    module.to(dtype)
    keep_in_fp32(module, dtype)
    pools: dict[torch.dtype, torch.Tensor] = {}
    made: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                data = _random_like(param, pools, device)
                made[id(param)] = torch.nn.Parameter(data, requires_grad=False)
            submodule._parameters[name] = made[id(param)]
    return module


RANDOM_POOL_SIZE = 1 << 22


def _random_like(param: torch.Tensor, pools: dict, device: torch.device) -> torch.Tensor:
    """Small random values, tiled from one pool per dtype: drawing 12 billion normals one by one
    takes minutes on a CPU, copying takes seconds, and memory is all a probe needs them for."""
    if param.dtype not in pools:
        generator = torch.Generator().manual_seed(0)
        pool = torch.empty(RANDOM_POOL_SIZE, dtype=param.dtype).normal_(0.0, 0.02, generator=generator)
        pools[param.dtype] = pool.to(device)
    pool = pools[param.dtype]
    data = torch.empty(param.shape, dtype=param.dtype, device=device)
    flat = data.view(-1)
    for start in range(0, flat.numel(), pool.numel()):
        count = min(pool.numel(), flat.numel() - start)
        flat[start:start + count].copy_(pool[:count])
    return data


def keep_in_fp32(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast back to fp32 what from_pretrained keeps in fp32 after a cast to `dtype`: diffusers
    always, transformers only under fp16. A name in `_keep_in_fp32_modules` is a module (with its
    buffers) or a parameter (Wan's `scale_shift_table`), wherever it sits in the tree."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    if dtype == torch.float32 or not keep or (not _is_diffusers(type(module)) and dtype != torch.float16):
        return
    for name, submodule in module.named_modules():
        if name and any(k in name.split(".") for k in keep):
            submodule.float()
    for name, param in module.named_parameters():
        if any(k in name.split(".") for k in keep):
            param.data = param.data.float()


# -- quantization ---------------------------------------------------------------------------------
# AI Toolkit's qtype names (toolkit/util/quantize.py, get_qtype; AI Toolkit commit 27a03a91) -> how
# the probe quantizes: optimum-quanto for its q* types; torchao's float8/int8 weight-only types hold
# the same bytes (one per weight and a scale per row) as quanto's and run torchao's forward
# (models/_torchao.py TorchaoLinear); AI Toolkit's own
# grouped uint2..uint7 (toolkit/util/uintx_quant.py) as `GroupedLinear`. quanto's qint4 is quanto's
# own, in the layout quanto picks (TinyGemm for bf16 layers of whole groups of 128 on CPUs and recent
# GPUs; `_give_quanto_a_fake_path` lets the estimate follow it). torchao's int4 runs as a grouped layer
# of TinyGemm's bytes (4 bits, groups of 128, a bf16 scale and shift per group). nf4 and fp4 are no
# AI Toolkit names; the probe reads them as uint4.
QUANTO_TYPES = {"qfloat8": "qfloat8", "qfloat8_e4m3fn": "qfloat8", "float8": "qfloat8", "float8_e4m3fn": "qfloat8",
                "fp8": "qfloat8", "qint8": "qint8", "int8": "qint8", "qint4": "qint4"}
GROUPED_TYPES = {**{f"uint{bits}": (bits, 64, "zero_point") for bits in range(2, 8)},
                 "int4": (4, 128, "shift"), "nf4": (4, 64, "zero_point"), "fp4": (4, 64, "zero_point")}


def quantize(module: torch.nn.Module, qtype: str, repeated=None, only=None, exclude=()) -> int:
    """Every nn.Linear quantized as AI Toolkit quantizes it, in place, where its weight lives.

    AI Toolkit's `quantize` swaps each Linear for its quantized module and `freeze` then replaces
    each full-precision weight by its quantized copy, one layer after the other: the transient is
    one layer. The same happens here layer by layer. As quanto's own loop does, a diffusers model's
    fp32-kept modules stay as they are (Wan casts its timestep to the dtype of its time embedder).
    `repeated` is the meter's (see meters.EstimateMeter.repeated): on fake tensors, a layer of a
    shape already quantized is made by copying that layer's layout instead of running the ops.
    `only`: the layer names to quantize, of those it would (None: all); `exclude`: fnmatch patterns
    of layer names it leaves in full precision, as AI Toolkit's `quantize` matches its `exclude`.
    Returns the number of layers quantized.
    """
    base = qtype.split("|")[0].strip().lower()
    if base == "uint8":  # UIntXQuantizer.can_quantize refuses every layer (toolkit/util/uintx_quant.py)
        return 0
    kept = (getattr(module, "_keep_in_fp32_modules", None) or []) if _is_diffusers(type(module)) else []
    # AI Toolkit's grouped formats leave a layer whose input is no whole number of groups as it is
    # (UIntXQuantizer.can_quantize).
    group = GROUPED_TYPES[base][1] if base in GROUPED_TYPES else 1
    names = [name for name, child in module.named_modules()
             if type(child) is torch.nn.Linear and not any(k in name.split(".") for k in kept)
             and child.in_features % group == 0 and (only is None or name in only)
             and not any(fnmatch.fnmatch(name, pattern) for pattern in exclude)]
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        linear = getattr(parent, child_name)
        weight = linear.weight
        key = (base, tuple(weight.shape), weight.dtype, weight.device, linear.bias is not None)

        def make(linear=linear, key=key):
            layer = _quantized(linear, base)
            _LAYOUTS[key] = _layout(layer)
            return layer

        if repeated is None:
            quantized = make()
        else:
            quantized = repeated(("quantize", key), make, lambda linear=linear, key=key: _like(_LAYOUTS[key], linear))
        setattr(parent, child_name, quantized.train(linear.training))
        del linear
    return len(names)


# AI Toolkit's torchao names (toolkit/util/quantize.py torchao_qtypes): quanto's bytes, torchao's forward.
TORCHAO_TYPES = {"float8": "qfloat8", "int8": "qint8"}


def _quantized(linear: torch.nn.Linear, base: str) -> torch.nn.Module:
    if base in TORCHAO_TYPES:
        from fitfinder.models._torchao import TorchaoLinear  # quanto's import, only where it quantizes

        return _quanto_linear(linear, TORCHAO_TYPES[base], TorchaoLinear)
    if base in QUANTO_TYPES:
        return _quanto_linear(linear, QUANTO_TYPES[base])
    return GroupedLinear.from_linear(linear, *GROUPED_TYPES[base])


# A quantized layer's class and tensor layouts (as meta tensors, which hold no memory) by the
# quantized layer's key: what `_like` copies.
_LAYOUTS: dict[tuple, tuple] = {}


def _layout(layer: torch.nn.Module) -> tuple:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        if isinstance(layer, GroupedLinear):
            described = (GroupedLinear, layer.in_features, layer.out_features, layer.bits, layer.group, layer.offset,
                         layer.weight_dtype)
            return described, {name: _meta(getattr(layer, name)) for name in ("packed", "scale", "zero")}
        names, context = layer.weight.__tensor_flatten__()
        inner = {name: _meta(getattr(layer.weight, name)) for name in names}
        scales = {name: _meta(getattr(layer, name)) for name in ("input_scale", "output_scale")}
        described = (type(layer), layer.weight_qtype, type(layer.weight), context, layer.weight.size(),
                     layer.weight.stride())
        return described, {**inner, **scales}


def _meta(tensor: torch.Tensor):
    """A tensor's layout as meta tensors; a subclass (quanto's packed 4-bit codes) as its class,
    its inner tensors' layouts and its flatten context, so `_empty_like` makes it again."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, context = tensor.__tensor_flatten__()
        inner = {name: _meta(getattr(tensor, name)) for name in names}
        return type(tensor), inner, context, tensor.size(), tensor.stride()
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _like(layout: tuple, linear: torch.nn.Linear) -> torch.nn.Module:
    """A quantized layer of a recorded layout, with fresh tensors and `linear`'s bias: what
    quantizing `linear` makes, without computing it (the estimate's repeats)."""
    described, templates = layout
    device = linear.weight.device
    fresh = {name: _empty_like(template, device) for name, template in templates.items()}
    if described[0] is GroupedLinear:
        layer = GroupedLinear(*described[1:], None, linear.bias)
        for name, tensor in fresh.items():
            layer.register_buffer(name, tensor, persistent=False)
        return layer
    cls, qtype, weight_cls, context, size, stride = described
    with plain_meta():  # its meta Linear without the kaiming fills (_meta._no_init)
        layer = cls.qcreate(linear, qtype, device="meta")
    layer.input_scale, layer.output_scale = fresh.pop("input_scale"), fresh.pop("output_scale")
    weight = weight_cls.__tensor_unflatten__(fresh, context, size, stride)
    layer.weight, layer.bias = parameter(weight, requires_grad=False), linear.bias
    return layer


def _empty_like(template, device) -> torch.Tensor:
    if isinstance(template, tuple):  # a subclass, see _meta
        cls, inner, context, size, stride = template
        return cls.__tensor_unflatten__({name: _empty_like(t, device) for name, t in inner.items()}, context, size,
                                        stride)
    return torch.empty_strided(template.shape, template.stride(), dtype=template.dtype, device=device)


def _quanto_linear(linear: torch.nn.Linear, qtype_name: str, cls: type | None = None) -> torch.nn.Module:
    """quanto's QLinear (or `cls`, a subclass) around the layer's weight, frozen (its weight quantized).

    quanto's `QLinear.from_module` moves the new module with `Module.to`, which fake tensors (the
    estimate's) refuse; the module is made on meta here instead and given the layer's tensors, which
    is what that move amounts to. The quantization itself is quanto's, on real or fake tensors.
    """
    from optimum import quanto
    from optimum.quanto.nn import QLinear

    _give_quanto_a_fake_path()
    weight = linear.weight
    with plain_meta():
        layer = (cls or QLinear).qcreate(linear, getattr(quanto, qtype_name), device="meta")
    layer.input_scale = torch.ones((), dtype=weight.dtype, device=weight.device)
    layer.output_scale = torch.ones((), dtype=weight.dtype, device=weight.device)
    layer.weight, layer.bias = weight, linear.bias
    layer.freeze()
    layer.weight.requires_grad_(False)  # freeze() makes a new Parameter; the base stays frozen
    return layer


def _give_quanto_a_fake_path() -> None:
    """Let quanto's 4-bit weights be made from fake tensors (the estimate's), in quanto's own layouts.

    Every kernel quanto's qint4 calls has a fake-tensor path already: torch 2.13 gives
    `aten._convert_weight_to_int4pack(_for_cpu)` and `aten._weight_int4pack_mm(_for_cpu)` meta
    kernels, and quanto registers `quanto::quantize_affine` and `quanto::unpack` for every backend
    ("default"). What has none is Python, where quanto tells a plain tensor by `type(t) is
    torch.Tensor`, which a FakeTensor is not (optimum-quanto 0.2.7, tensor/weights/qbits.py and
    tinygemm/qbits.py): `WeightQBitsTensor.__init__` would keep one byte a code instead of half,
    `TinyGemmWeightQBitsTensor.__init__` asserts, and `TinyGemmQBitsLinearFunction.forward` would
    "dequantize" its plain input into an fp32 copy and compute in fp32 (measured: a bf16 layer's
    output came out fp32 on fake tensors, bf16 on real ones). Here fake tensors take the branch real
    ones take; real tensors go through quanto untouched.
    """
    from optimum.quanto.tensor.packed import PackedTensor
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor
    from optimum.quanto.tensor.weights.tinygemm import TinyGemmWeightQBitsTensor
    from optimum.quanto.tensor.weights.tinygemm.qbits import TinyGemmQBitsLinearFunction
    from torch._subclasses.fake_tensor import FakeTensor

    if getattr(WeightQBitsTensor.__init__, "fitfinder_fake_path", False):
        return
    plain_init, tinygemm_init = WeightQBitsTensor.__init__, TinyGemmWeightQBitsTensor.__init__
    tinygemm_linear = TinyGemmQBitsLinearFunction.forward

    def plain(self, qtype, axis, group_size, size, stride, data, scale, shift, requires_grad=False):
        if isinstance(data, FakeTensor):
            data = PackedTensor.pack(data, qtype.bits)
        plain_init(self, qtype, axis, group_size, size, stride, data, scale, shift, requires_grad)

    def tinygemm(self, qtype, axis, group_size, size, stride, data, scale_shift, requires_grad=False):
        if isinstance(data, FakeTensor):
            data, scale_shift = _tinygemm_layout(qtype, group_size, size, data, *scale_shift)
        tinygemm_init(self, qtype, axis, group_size, size, stride, data, scale_shift, requires_grad)

    def linear(ctx, input, other, bias):
        if isinstance(input, FakeTensor):  # a plain activation (quanto's quantized ones are no FakeTensor)
            return _tinygemm_linear(ctx, input, other, bias)
        return tinygemm_linear(ctx, input, other, bias)

    plain.fitfinder_fake_path = tinygemm.fitfinder_fake_path = True
    WeightQBitsTensor.__init__, TinyGemmWeightQBitsTensor.__init__ = plain, tinygemm
    TinyGemmQBitsLinearFunction.forward = staticmethod(linear)


def _tinygemm_layout(qtype, group_size: int, size, codes: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor):
    """TinyGemm's packed codes and its (groups, out, 2) scale-and-midpoint table, made with the same
    ops in the same order as quanto's TinyGemmWeightQBitsTensor makes them from grouped codes."""
    from optimum.quanto.tensor.grouped import ungroup
    from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

    packed = TinyGemmPackedTensor.pack(ungroup(codes, axis=0, orig_shape=size))
    out_features, in_features = size
    scale = scale.reshape(out_features, in_features // group_size, 1)
    shift = shift.reshape(out_features, in_features // group_size, 1)
    if not shift.dtype.is_floating_point:  # a zero point counts in codes
        shift = scale * shift
    # The kernel's offset is the middle of the range: -shift + 2**(bits-1) * scale.
    lowest = -shift
    half_range = 2 ** (qtype.bits - 1) * scale
    midpoint = lowest + half_range
    return packed, torch.cat([scale, midpoint], 2).transpose(0, 1).contiguous()


def _tinygemm_linear(ctx, input: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """TinyGemmQBitsLinearFunction.forward for a plain input: the input saved for the backward, one
    int4 matmul kernel (the CPU's or the GPU's, by the input's device), the bias added."""
    ctx.save_for_backward(input, weight)
    matmul = torch._weight_int4pack_mm_for_cpu if input.device.type == "cpu" else torch._weight_int4pack_mm
    rows = input.reshape(-1, input.shape[-1])
    output = matmul(rows, weight._data._data, weight._group_size, weight._scale_shift)
    output = output.reshape(input.shape[:-1] + (weight.shape[0],))
    return output if bias is None else output + bias


class GroupedLinear(torch.nn.Linear):
    """A Linear layer whose weight is held as grouped unsigned codes: AI Toolkit's uint2..uint7.

    Per group of `group` weights along the input: a scale in the weight's dtype and a zero point
    (uint8; or a shift in the weight's dtype as TinyGemm keeps it, for torchao's int4). Codes of
    `bits` bits are packed into power-of-two bit shards (uint3: a 2-bit and a 1-bit shard), as AI Toolkit's
    `toolkit/util/uintx_quant.py` packs them: uint4 is 0.5 + 3/64 = 0.547 bytes per weight. Its
    forward, as AI Toolkit's `UIntXQuantizer.forward`, rebuilds the weight outside autograd and calls
    `F.linear` with it, so autograd keeps the rebuilt weight for the backward (a checkpointed block
    frees it with the block).
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, offset: str,
                 dtype: torch.dtype, device, bias: torch.Tensor | None):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group, self.offset, self.weight_dtype = bits, group, offset, dtype
        self.register_parameter("weight", None)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, bits: int, group: int, offset: str) -> GroupedLinear:
        weight = linear.weight.data
        layer = cls(linear.in_features, linear.out_features, bits, group, offset, weight.dtype, weight.device,
                    linear.bias)
        with torch.no_grad():
            layer._quantize(weight)
        return layer

    def _quantize(self, weight: torch.Tensor) -> None:
        """Asymmetric per-group codes, computed in the weight's dtype as AI Toolkit computes them."""
        out_f, in_f = weight.shape
        groups = weight.reshape(out_f, in_f // self.group, self.group)
        low = torch.clamp(torch.amin(groups, dim=2), max=0)
        high = torch.clamp(torch.amax(groups, dim=2), min=0)
        top = (1 << self.bits) - 1
        scale = torch.clamp((high - low) / top, min=torch.finfo(torch.float32).eps)
        zero = torch.clamp(torch.round(-low / scale), 0, top)
        codes = torch.clamp(torch.round(groups / scale.unsqueeze(2)) + zero.unsqueeze(2), 0, top)
        self.register_buffer("packed", _pack(codes.to(torch.uint8).view(-1), self.bits), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero", zero.to(torch.uint8) if self.offset == "zero_point" else zero.to(scale.dtype),
                             persistent=False)

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes: where peft looks for a quantized layer's device."""
        return self.packed

    def dequantized(self) -> torch.Tensor:
        out_f, in_f = self.out_features, self.in_features
        codes = _unpack(self.packed, self.bits, out_f * in_f)
        weight = codes.view(out_f, in_f // self.group, self.group).to(self.scale.dtype)
        weight -= self.zero.to(self.scale.dtype).unsqueeze(2)
        weight *= self.scale.unsqueeze(2)
        return weight.view(out_f, in_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            weight = self.dequantized().to(x.dtype)
        return torch.nn.functional.linear(x, weight, self.bias)


def _shards(bits: int) -> list[int]:
    return [k for k in (8, 4, 2, 1) if bits & k]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `bits` bits -> one packed uint8 buffer, a power-of-two shard after the other."""
    shards, offset = [], 0
    for k in _shards(bits):
        values = (codes >> offset) & ((1 << k) - 1) if k != bits else codes
        per_byte = 8 // k
        values = torch.cat([values, values.new_zeros((-values.numel()) % per_byte)]).view(per_byte, -1)
        packed = values[0].clone()
        for j in range(1, per_byte):
            packed |= values[j] << (j * k)
        shards.append(packed)
        offset += k
    return torch.cat(shards) if len(shards) > 1 else shards[0]


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    codes, offset, start = None, 0, 0
    for k in _shards(bits):
        per_byte = 8 // k
        size = -(-count // per_byte)
        shard = packed[start:start + size]
        values = torch.empty(per_byte, size, dtype=torch.uint8, device=packed.device)
        for j in range(per_byte):
            torch.bitwise_right_shift(shard, j * k, out=values[j])
        values = values.bitwise_and_((1 << k) - 1).view(-1)[:count]
        codes = values if codes is None else codes.bitwise_or_(values.bitwise_left_shift_(offset))
        offset += k
        start += size
    return codes


# -- LoRA -----------------------------------------------------------------------------------------
def lora_targets(module: torch.nn.Module, pattern: str, convs: bool = False,
                 conv_rank: int | None = None) -> tuple[list[str], list[str]]:
    """Full names of the layers the family's LoRA trains at its rank, and of those it trains at
    `conv_rank`: Linear layers (plain or quantized); with `convs`, also 1x1 Conv2d layers at the
    rank, and the other Conv2d layers at `conv_rank` when it is set (toolkit/lora_special.py,
    LoRASpecialNetwork.create_modules: is_conv2d_1x1 takes lora_dim, a larger kernel conv_lora_dim)."""
    compiled = re.compile(pattern)
    at_rank, at_conv_rank = [], []
    for name, child in module.named_modules():
        if not compiled.fullmatch(name):
            continue
        if isinstance(child, torch.nn.Linear):
            at_rank.append(name)
        elif convs and isinstance(child, torch.nn.Conv2d):
            if child.kernel_size == (1, 1):
                at_rank.append(name)
            elif conv_rank:
                at_conv_rank.append(name)
    return at_rank, at_conv_rank
