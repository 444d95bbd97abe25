"""Layer offloading: AI Toolkit's block swap (`model.layer_offloading`), as its MemoryManager does it.

What AI Toolkit does (toolkit/memory_management/manager.py `MemoryManager.attach` and
manager_modules.py `LinearLayerMemoryManager`, `_BouncingLinearFn`; AI Toolkit commit 27a03a91),
called by a family's loader on the transformer with `layer_offloading_transformer_percent` and on
the text encoder with `layer_offloading_text_encoder_percent` (both default 1.0, "0 is off",
toolkit/config_modules.py ModelConfig), after the part is loaded and quantized:

- Each Linear layer (by class name: Linear, QLinear, ...) is offloaded with probability `percent`
  (`random.random() > offload_percent` skips it): its weight and bias move to pinned host memory
  and stay there. Everything else stays with the part on the device: norms, embeddings, biases of
  layers not offloaded, buffers, the LoRA (AI Toolkit's network is attached after, and apart).
  A module whose class name holds "Norm" (or is a norm, embedding or Conv3d) is kept resident with
  everything under it: `memory_managed_to` moves it, its Linear children included, whenever the
  part is placed, which the device presets do at every phase.
- The layer's forward copies its weight (and bias) to the device into a ring of `depth` slots
  (AI_TOOLKIT_OFFLOAD_DEPTH, 4 by default, at least 2), one ring per device shared by every
  offloaded part: a slot keeps its weight alive until the layer `depth` calls later reuses it, and
  the new copy is made before the old one goes. A quantized weight crosses in its own bytes and is
  dequantized there to the activations' dtype; the slot keeps the dequantized one.
- The backward copies the weight again into a second ring of the same depth. The autograd function
  saves the layer's input on the device whatever needs a gradient (a plain frozen linear would not).
- `MemoryManager.free` (toolkit/unloader.py, cached text embeddings) drops the device's rings.
- With layer_offloading, ModelConfig turns `qfloat8` into torchao's `float8` (config_modules.py,
  trainers.aitoolkit.quant_types): an offloaded layer crosses in its 8-bit bytes and is dequantized on the
  device, whichever library quantized it; a layer left on the device runs torchao's forward
  (models/_torchao.py).

What the probe does differently: it picks the layers evenly instead of at random (every layer
where round-down(k * percent) steps up: the same share, the same from run to run, so the estimate
meets the same layers as the sim meter); conv layers and AI Toolkit's own grouped 4-bit layers
(`GroupedLinear`, which AI Toolkit bounces with `OstrisLinearLayerMemoryManager`) stay resident;
a full fine-tune (no LoRA: the base weights train, and AI Toolkit stages their gradients through a
third ring to the host) is probed without offloading.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# manager.py's LINEAR_MODULES, without OstrisLinear (see above); torchao keeps a layer's class Linear,
# which the probe's torchao layer is not by name (models/_torchao.py).
LINEAR_CLASSES = ("Linear", "LoRACompatibleLinear", "QLinear", "TorchaoLinear")
# manager.py's UNMANAGED_MODULES and UNMANAGED_MODULES_INCLUDES: kept on the device with all they hold.
RESIDENT_CLASSES = ("LayerNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm", "InstanceNorm1d",
                    "InstanceNorm2d", "InstanceNorm3d", "Embedding", "EmbeddingBag", "RNNBase", "LSTM", "GRU",
                    "RNN", "Conv3d")
RESIDENT_NAME_PARTS = ("RotaryEmbedding", "Norm", "RotaryPosEmbed")


def ring_depth() -> int:
    """manager_modules.py PIPELINE_DEPTH: AI_TOOLKIT_OFFLOAD_DEPTH (default 4), at least 2 slots."""
    return max(2, int(os.environ.get("AI_TOOLKIT_OFFLOAD_DEPTH", "4")))


class Rings:
    """The device's staging slots (manager_modules.py `_get_device_state`): forward weights and
    biases, backward weights; each slot holds its copy until reused."""

    def __init__(self, depth: int):
        self.depth = depth
        self.slots = {"forward": [None] * depth, "backward": [None] * depth}
        self.clocks = {"forward": 0, "backward": 0}

    def keep(self, ring: str, held) -> None:
        """Put `held` in the ring's next slot; what the slot held before is freed now, after the new copy."""
        index = self.clocks[ring]
        self.clocks[ring] = (index + 1) % self.depth
        self.slots[ring][index] = held

    def clear(self) -> None:
        for ring in self.slots:
            self.slots[ring] = [None] * self.depth


def offloadable(part: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers AI Toolkit's attach may offload, in its walk order (modules in definition order),
    without those under a module it keeps resident."""
    layers, kept = [], set()
    for module in part.modules():
        if id(module) in kept:
            continue
        name = type(module).__name__
        if name in RESIDENT_CLASSES or any(text in name for text in RESIDENT_NAME_PARTS):
            kept.update(id(inner) for inner in module.modules())
        elif name in LINEAR_CLASSES and isinstance(module, torch.nn.Linear):
            layers.append(module)
    return layers


def chosen(layers: list, percent: float) -> list:
    """`percent` of the layers, spread evenly (AI Toolkit draws each with that probability)."""
    if percent >= 1:
        return list(layers)
    return [layer for k, layer in enumerate(layers) if int((k + 1) * percent) > int(k * percent)]


def attach(part: torch.nn.Module, percent: float, meter, rings: Rings) -> int:
    """Offload `percent` of the part's layers: their weights to host memory, their forward through
    the rings. Returns how many layers went. Call it before the LoRA is added, as AI Toolkit does."""
    layers = chosen(offloadable(part), percent) if percent > 0 else []
    attach_layers(part, layers, meter, rings)
    return len(layers)


def attach_layers(part: torch.nn.Module, layers: list, meter, rings: Rings) -> None:
    """Offload these layers of the part (`attach`'s choice, or its choice made before the layers
    were quantized in place, as AI Toolkit's attach runs before torchao swaps a managed layer's weight)."""
    for layer in layers:
        for name in ("weight", "bias"):
            param = layer._parameters.get(name)
            if param is None:
                continue
            if meter.kind == "cuda":  # a new parameter: a quantized weight ignores `param.data = ...`
                param = torch.nn.Parameter(param.detach().to("cpu"), requires_grad=param.requires_grad)
                layer._parameters[name] = param
            else:  # to pinned host memory, as the MemoryManager pins it
                meter.to_host(param, pinned=True)
            # AI Toolkit's mark (BaseLayerMemoryManager.attach): the meters count no marked
            # parameter as the device's (meters.tensors_of), and the part's `to` leaves it be.
            param._is_memory_managed = True
        layer.forward = _bounced(layer, meter, rings)
        layer.offloaded = True
    if layers:
        part.to = _managed_to(part)


def _managed_to(part: torch.nn.Module):
    """MemoryManager.memory_managed_to: the part moves, its offloaded weights stay in host memory."""
    original = part.to

    def to(*args, **kwargs):
        held = [(module, name, param) for module in part.modules() for name, param in module._parameters.items()
                if getattr(param, "_is_memory_managed", False)]
        for module, name, _ in held:
            del module._parameters[name]
        try:
            return original(*args, **kwargs)
        finally:
            for module, name, param in held:
                module._parameters[name] = param

    return to


def _bounced(layer: torch.nn.Linear, meter, rings: Rings):
    """LinearLayerMemoryManager's forward: a call with only the input goes through the rings."""
    original = layer.forward

    def forward(x, *args, **kwargs):
        if args or kwargs:
            return original(x, *args, **kwargs)
        return _Bounce.apply(x, layer.weight, layer.bias, meter, rings)

    return forward


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def staged(tensor: torch.Tensor | None, meter, dtype: torch.dtype) -> torch.Tensor | None:
    """A host tensor's copy on the device (`_materialize_linear_weight`): a quantized weight
    crosses in its own bytes and is dequantized there to `dtype`; a plain one keeps its dtype."""
    if tensor is None:
        return None
    if not is_traceable_wrapper_subclass(tensor):
        return tensor.to(meter.device, copy=True)
    if meter.kind == "cuda":
        weight = tensor.to(meter.device).dequantize()
    else:  # the sim meter and the estimate count the quantized bytes crossing, then the dequantized weight
        crossed = [inner.clone() for inner in _inner_tensors(tensor)]
        weight = tensor.dequantize()
        del crossed
    return weight if weight.dtype == dtype else weight.to(dtype)


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a quantized weight (a tensor subclass, such as quanto's) holds its bytes in."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    return [inner for name in tensor.__tensor_flatten__()[0] for inner in _inner_tensors(getattr(tensor, name))]


class _Bounce(torch.autograd.Function):
    """manager_modules.py `_BouncingLinearFn` on the device path: the weight comes to the device for
    the forward and again for the backward; the input is saved on the device."""

    @staticmethod
    def forward(ctx, x, weight, bias, meter, rings):
        dtype = _compute_dtype(x)
        weight_here, bias_here = staged(weight, meter, dtype), staged(bias, meter, dtype)
        rings.keep("forward", (weight_here, bias_here))
        out = torch.nn.functional.linear(x, weight_here, bias_here)
        del weight_here, bias_here
        ctx.save_for_backward(x)
        ctx.host = (weight, bias, meter, rings, dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight, bias, meter, rings, dtype = ctx.host
        weight_here = staged(weight, meter, dtype)
        rings.keep("backward", weight_here)
        grad_input = grad_out.to(dtype) @ weight_here
        del weight_here
        return grad_input.to(grad_out.dtype), None, None, None, None
