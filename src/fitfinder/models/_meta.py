"""Plain meta modules, and parameters made without an op: what the real build and the fake one share.

`_weights` makes quantized layers on meta (`plain_meta`) and gives them a weight of a tensor
subclass (`parameter`); `_fake` builds whole parts and LoRAs on meta the same way before it
materializes them as fake tensors. Both import this module, which imports neither.
"""

from __future__ import annotations

import contextlib

import torch


def parameter(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """`torch.nn.Parameter(tensor, requires_grad)` for a tensor just made, of a tensor subclass (a
    fake tensor, a quantized weight around fake ones).

    For a subclass, Parameter makes no Parameter: it detaches the tensor and flags the copy
    `_is_param` (torch/nn/parameter.py, `Parameter.__new__`). The detach is an op through the fake
    mode, some 0.1-0.3 ms each, thousands of times an estimate; a tensor made just now has no
    history to detach from, so it is flagged itself. Plain tensors go through Parameter as usual.
    """
    if type(tensor) is torch.Tensor:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    assert tensor.grad_fn is None, "only a tensor without history is a parameter without a detach"
    tensor.requires_grad_(requires_grad)
    tensor._is_param = True
    return tensor


@contextlib.contextmanager
def plain_meta():
    """Plain meta tensors: no dispatch mode sees what is made here (neither the fake mode, whose
    tensors cannot be cast in place, nor the tracker: meta tensors are no memory), and nothing
    is initialised (`_no_init`)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("meta"), _no_init():
        yield


# torch.nn.init's fills, which layers' constructors and peft's LoRA initialisation call.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's fills as no-ops: a meta tensor has no values to fill, and the fills cost a
    FLUX.1 estimate about 0.7 s of its load (peft's gaussian LoRA init, every Linear's kaiming
    init). Code that imported a fill by name still calls the real one, which changes nothing either.
    Not transformers' `no_init_weights`, which does the same: its fills return None where torch's
    return the tensor, and it lives in another module in transformers 4 (which pyproject allows)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _unfilled)
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def _unfilled(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor

