"""Weights of one part: read from a diffusers folder, or random from an architecture config; quantized.

Random weights of a small part are saved once under the cache and then read with
`from_pretrained`, exactly as real weights are; a large part (a full-size architecture) is built
in host memory in its dtype without initialisation costs and filled with small random values.
Either way the result is what `from_pretrained` gives: the same classes, dtypes (including the
modules a class keeps in fp32) and shapes, so the same memory.
"""

from __future__ import annotations

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

# Random parts up to this size (fp32) are saved once and read back like real weights.
SAVE_RANDOM_UP_TO_BYTES = 512 * 2**20


def part_class(family: str, part: str) -> type:
    library, name = FAMILIES[family].classes[part].split(".")
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
def quantize(module: torch.nn.Module, bits: int, compute_dtype: torch.dtype, quant_type: str = "nf4") -> int:
    """Swap every nn.Linear for its bitsandbytes 8-bit or 4-bit twin, in place, where its weight lives.

    Layer by layer, so the transient is one layer: the full-precision weight is freed as soon as
    its quantized twin exists. diffusers' BitsAndBytesConfig refuses to run without a GPU, so the
    swap is done here; `is_loaded_in_8bit`/`_4bit` tell peft to wrap the quantized layers. As that
    config does, a diffusers model's fp32-kept modules stay as they are (Wan casts its timestep to
    the dtype of its time embedder's first weight, which must stay a float).
    Returns the number of layers quantized.
    """
    kept = (getattr(module, "_keep_in_fp32_modules", None) or []) if _is_diffusers(type(module)) else []
    names = [name for name, child in module.named_modules()
             if type(child) is torch.nn.Linear and not any(k in name.split(".") for k in kept)]
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        linear = getattr(parent, child_name)
        setattr(parent, child_name, _quantized_twin(linear, bits, compute_dtype, quant_type))
        del linear
    if bits == 8:
        module.is_loaded_in_8bit = True
    else:
        module.is_loaded_in_4bit = True
    return len(names)


def _quantized_twin(linear: torch.nn.Linear, bits: int, compute_dtype: torch.dtype, quant_type: str):
    import bitsandbytes as bnb
    from bitsandbytes.functional import int8_vectorwise_quant, quantize_4bit

    weight, bias = linear.weight.data, linear.bias
    if bits == 8:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False,
                                    has_fp16_weights=False, device="meta")
        int8, scales, _ = int8_vectorwise_quant(weight.to(torch.float16))
        layer.weight = _parameter(bnb.nn.Int8Params, int8, has_fp16_weights=False, CB=int8, SCB=scales)
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=compute_dtype,
                                  quant_type=quant_type, device="meta")
        packed, state = quantize_4bit(weight, blocksize=64, quant_type=quant_type, quant_storage=torch.uint8,
                                      compress_statistics=True)
        layer.weight = _parameter(bnb.nn.Params4bit, packed, quant_state=state, blocksize=64, compress_statistics=True,
                                  quant_type=quant_type, quant_storage=torch.uint8, bnb_quantized=True, module=layer)
        # Keep the GPU's layout on a CPU: bitsandbytes would repack 4-bit weights for its CPU
        # inference kernels (other memory, and only for widths divisible by 64).
        layer.support_avx512bf16_for_cpu = False
    layer.bias = bias
    return layer.train(linear.training)


def _parameter(cls: type, data: torch.Tensor, **attributes) -> torch.nn.Parameter:
    """bitsandbytes' frozen parameter class around `data`.

    No tensor subclass can wrap a fake tensor (the estimate meter's): there the same tensors are
    held by a plain frozen Parameter that carries bitsandbytes' attributes (CB and SCB, or the
    quant_state), which is all its layers and peft's wrappers read. The bytes are the same.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(data, FakeTensor):
        return cls(data, requires_grad=False, **attributes)
    param = torch.nn.Parameter(data, requires_grad=False)
    for name, value in attributes.items():
        setattr(param, name, value)
    return param


# -- LoRA -----------------------------------------------------------------------------------------
def lora_targets(module: torch.nn.Module, pattern: str) -> list[str]:
    """Full names of the Linear layers (plain or quantized) the family's LoRA trains."""
    compiled = re.compile(pattern)
    return [name for name, child in module.named_modules()
            if isinstance(child, torch.nn.Linear) and compiled.fullmatch(name)]
