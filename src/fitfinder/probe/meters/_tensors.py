"""Where the meters find tensors: an op's outputs, a model's modules and members, the tensors an
object holds, and the plain tensors inside a tensor subclass.

Written for speed: the meters walk whole models and every op's outputs thousands of times an
estimate, so `submodules`, `members` and `tensors_returned` skip what `Module.named_modules` and
the pytree walk build on the way.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only


def tensors_returned(out: Any) -> Iterator[torch.Tensor]:
    """The tensors an op returned. Most ops return one tensor or a flat tuple of them: those skip
    the pytree walk, a good share of the per-op cost under FakeTensorMode."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None for o in out):
        yield from (o for o in out if o is not None)
    else:
        found: list[torch.Tensor] = []
        tree_map_only(torch.Tensor, found.append, out)
        yield from found


def submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module.modules()`, in its order, each once: without the names `Module.named_modules` builds
    for every module on the way, recursively. The meters walk whole models (placing a part, each
    block's replay key) thousands of times an estimate; this walk takes under half the time
    (timed while profiling)."""
    found, seen, stack = [], set(), [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        stack.extend(child for child in reversed(current._modules.values()) if child is not None)
    return found


def members(modules: list[torch.nn.Module], table: str = "_parameters") -> list[torch.Tensor]:
    """The parameters (or `_buffers`) of `submodules(...)` as `Module.parameters()` (`buffers()`)
    gives them: in order, each once."""
    found, seen = [], set()
    for module in modules:
        for tensor in getattr(module, table).values():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(tensor)
    return found


def tensors_of(*objects: Any) -> Iterator[torch.Tensor]:
    """Every tensor held by modules (parameters, grads, buffers; not the weights of offloaded
    layers), optimizers (state) or given directly."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            modules = submodules(obj)
            for param in members(modules):
                if getattr(param, "_is_memory_managed", False):
                    continue  # an offloaded layer's weight, in host memory (models/_offload.py)
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from members(modules, "_buffers")
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from tensors_of(*obj)
        elif isinstance(obj, dict):
            yield from tensors_of(*obj.values())


def inner_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors inside a tensor subclass such as quanto's quantized weights (`_data` and
    `_scale`, each maybe a subclass again): the wrapper itself holds no memory."""
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    for name in tensor.__tensor_flatten__()[0]:
        yield from inner_tensors(getattr(tensor, name))
