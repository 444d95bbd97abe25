"""Parts of a pipeline as fake tensors, for the estimate meter: full-size shapes, no memory.

Under FakeTensorMode every tensor has its shape, dtype, strides and storage size, and none
holds data, so the probe's own recipe runs a 12-billion-parameter model on a laptop and the
storage tracker counts the bytes a GPU would hold. What differs from the real build (`_weights`):

- A part is constructed on `meta` from its architecture config, with what `from_pretrained`
  keeps in fp32, and then every parameter and buffer is replaced by a fake tensor of the same
  shape and dtype ("materialized"). `nn.Module.to` cannot move a module of fake parameters (it
  swaps tensors, which fake ones refuse), so whole-module casts happen on meta first; a single
  parameter's `.data` can still be cast, as the probe casts the LoRA to the training dtype.
- The LoRA is added on meta the same way, cast as peft casts it, then materialized.
- No weights are read: a pretrained job's folder only lends its config files.

Code that needs real values (bitsandbytes builds AdamW8bit's code books with `.tolist()`)
runs under the meter's `concrete()`. Quantization needs none: quanto's and the grouped formats'
ops run on the fake weights themselves (`_weights.quantize`), so their byte sizes are the real ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fitfinder.models._meta import parameter, plain_meta
from fitfinder.models._weights import _construct, keep_in_fp32, part_class


def build_part(spec: dict, part: str, dtype: torch.dtype) -> torch.nn.Module:
    """One part from the job's architecture, in `dtype`, frozen, in eval mode, as fake tensors."""
    cls = part_class(spec["family"], part)
    config = spec["arch"]["parts"][part]
    with plain_meta():
        module = _construct(cls, config)
        module.to(dtype)
        keep_in_fp32(module, dtype)
    materialize(module)
    module.requires_grad_(False)
    return module.eval()


def read_whole(meter, spec: dict, part: str) -> None:
    """The host memory a part's weights file takes while it is read (the estimate's): diffusers and
    transformers read a safetensors file (a sharded checkpoint: a shard at a time) whole into host
    memory before the part takes its tensors (`load_state_dict`), so the largest file passes beside
    the part. Only for weights on disk; a random part is made in place."""
    if spec.get("path") is None:
        return
    files = list((Path(spec["path"]) / part).glob("*.safetensors"))
    largest = max((file.stat().st_size for file in files), default=0)
    if largest:
        with meter.host():
            read = torch.empty(largest, dtype=torch.uint8)
        del read


def add_adapter(denoiser: torch.nn.Module, lora_config, adapter_name: str = "default") -> None:
    """peft's LoRA as `add_adapter` leaves it: added on meta, cast as peft casts it, materialized.

    peft moves a new adapter next to its base layer (`Module.to`, which a fake parameter refuses)
    but leaves meta adapters alone; the cast it would have made, to the base layer's dtype when
    that is a floating one (peft's own `_get_base_layer_device_and_dtype` says which), is made
    here on meta, before the adapter becomes fake.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    with plain_meta():
        denoiser.add_adapter(lora_config, adapter_name=adapter_name)
        for layer in denoiser.modules():
            if not isinstance(layer, BaseTunerLayer):
                continue
            _, dtype = layer._get_base_layer_device_and_dtype(layer.get_base_layer())
            if dtype is None or not dtype.is_floating_point:
                continue
            for name in layer.adapter_layer_names:
                for param in getattr(layer, name).parameters():
                    if param.device.type == "meta" and param.dtype.is_floating_point:
                        param.data = param.data.to(dtype)
    materialize(denoiser)


def materialize(module: torch.nn.Module) -> None:
    """Every meta parameter and buffer replaced by a fake tensor made under the active fake mode.

    Made under the meter's tracker, the new tensors count as the meter says (nothing inside
    `meter.host()`). Tied parameters stay tied.
    """
    made: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        for table, is_parameter in ((submodule._parameters, True), (submodule._buffers, False)):
            for name, tensor in list(table.items()):
                if tensor is None or tensor.device.type != "meta":
                    continue
                if id(tensor) not in made:
                    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
                    made[id(tensor)] = parameter(empty, tensor.requires_grad) if is_parameter else empty
                table[name] = made[id(tensor)]
