"""A `.safetensors` file's header: tensor names, dtypes and shapes, never a weight.

kohya's trainers take single checkpoint files (flux1-dev.safetensors, t5xxl_fp8_e4m3fn.safetensors,
qwen_image_bf16.safetensors), not diffusers folders. The format: 8 bytes little-endian, the length
of a JSON header; the header maps each tensor name to {dtype, shape, data_offsets}. Reading it costs
one small read, however large the file.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 << 20  # the format's own limit

# safetensors dtype names -> fitfinder's.
DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8", "F8_E5M2": "fp8_e5m2"}


@dataclass(frozen=True)
class Header:
    path: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)

    def has(self, prefix: str) -> bool:
        return any(name.startswith(prefix) or f".{prefix}" in name for name in self.tensors)

    def count_blocks(self, prefix: str) -> int:
        """How many numbered blocks `prefix.N.` hold tensors (double_blocks.18. -> 19)."""
        pattern = re.compile(rf"(?:^|\.){re.escape(prefix)}\.(\d+)\.")
        numbers = {int(m.group(1)) for name in self.tensors for m in [pattern.search(name)] if m}
        return max(numbers) + 1 if numbers else 0

    @property
    def weight_dtype(self) -> str:
        """The dtype most of the weights' elements are in."""
        counts: Counter = Counter()
        for dtype, shape in self.tensors.values():
            size = 1
            for dim in shape:
                size *= dim
            counts[dtype] += size
        name = counts.most_common(1)[0][0] if counts else "BF16"
        return DTYPES.get(name, name.lower())


def read(path: str | Path) -> Header | None:
    """The header of an existing .safetensors file, or None when there is no such file (or it is no
    safetensors file: a folder, a .pth)."""
    path = Path(path).expanduser()
    if not path.is_file():
        return None
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if not 0 < length <= MAX_HEADER_BYTES:
                return None
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError):
        return None
    tensors = {name: (str(info["dtype"]), tuple(info["shape"])) for name, info in header.items()
               if name != "__metadata__" and isinstance(info, dict) and "dtype" in info}
    return Header(str(path), tensors)


def dtype_from_name(name: str) -> str | None:
    """The dtype a checkpoint's file name says (`t5xxl_fp8_e4m3fn.safetensors`, `..._bf16...`)."""
    lowered = Path(str(name)).name.lower()
    if re.search(r"fp8|float8|e4m3", lowered):
        return "fp8"
    for dtype in ("bf16", "fp16", "fp32"):
        if dtype in lowered:
            return dtype
    return None
