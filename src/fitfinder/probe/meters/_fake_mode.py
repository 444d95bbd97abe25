"""The estimate's fake-tensor mode: FakeTensorMode, counting every op's outputs on a tracker.

`counting_fake_mode` makes it. The rest is how it stays fast where FakeTensorMode's own Python
is slow, each an internal of this torch it follows only where `fake_internals_known` says it
can: its cache keys built from a tensor's layout in one tuple, cached outputs made in one step,
new empty tensors and views answered by the meta kernels directly, `_unsafe_view` answered as
`view`, quanto's ops cached (`benchmarks/fake_dispatch.py` times each).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch._subclasses import fake_tensor  # imported by torch itself
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fitfinder.probe.meters._tensors import tensors_returned
from fitfinder.probe.meters._tracker import AllocatorTracker


def counting_fake_mode(tracker: AllocatorTracker):
    """A FakeTensorMode that hands the outputs of every op to `tracker` (unless paused).

    One Python mode per op instead of two (a tracker mode above the fake mode): about a third
    faster, since every op, down to the device queries autograd makes, passes through each.
    Only the outermost op counts: FakeTensorMode runs some ops as decompositions into others,
    whose intermediates a GPU kernel never allocates and a tracker above it never sees.
    Non-fake inputs are allowed: small constants made from Python values (code books, noise
    schedules) mix with the fake weights, as they would with real ones.
    """
    # Queries (device, sizes, strides) answered straight from the fake tensor, as FakeTensorMode's
    # dispatch answers them first: autograd and the linear kernels ask for devices 100,000 times
    # a training step, each a trip through Python.
    queries = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {})

    class _CountingFakeMode(FakeTensorMode):
        same_as = _same_fake_ops()  # op -> the op it is answered as
        direct = _DIRECT_OPS if fake_internals_known() else {}  # op -> its direct answer

        def __init__(self) -> None:
            super().__init__(allow_non_fake_inputs=True)
            self.depth = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            query = queries.get(func)
            if query is not None:
                return query(args)
            func, kwargs = self.same_as.get(func, func), kwargs or {}
            out = None
            answer = self.direct.get(func)
            if answer is not None and self.shape_env is None:
                out = answer(self, func, args, kwargs)
                if out is not None and CROSSCHECK_DIRECT_OPS:
                    _crosscheck(out, self.fake_answer(func, types, args, kwargs), func, args)
            if out is None:
                out = self.fake_answer(func, types, args, kwargs)
            if self.depth == 0:
                add = tracker.add_host if tracker.paused else tracker.add
                if isinstance(out, torch.Tensor):  # most ops: no generator for those
                    add(out)
                else:
                    for tensor in tensors_returned(out):
                        add(tensor)
            return out

        def fake_answer(self, func, types, args, kwargs):
            """FakeTensorMode's answer; the ops it runs inside (decompositions) are not counted."""
            self.depth += 1
            try:
                return self.dispatch(func, types, args, kwargs)
            finally:
                self.depth -= 1

    if fake_internals_known():
        _CountingFakeMode._prep_args_for_hash = _key_by_layout
        _CountingFakeMode._get_output_tensor_from_cache_entry = _new_output_from_cache
        _CountingFakeMode._validate_cache_key = _cacheable_quanto_ops
        _CountingFakeMode.cacheable_quanto_ops = _quanto_cacheable()
    return _CountingFakeMode()


def _cacheable_quanto_ops(mode, func, args, kwargs) -> None:
    """FakeTensorMode's `_validate_cache_key`, with quanto's two functional ops cacheable.

    The mode caches no operator from outside torch (it cannot know whether its output depends on
    more than its inputs' layouts), so every quantized layer's matmul (`quanto::qbytes_mm`, 227
    times in a FLUX.1-dev estimate) ran quanto's Python on meta tensors
    (`benchmarks/fake_dispatch.py`: 372 -> 37 us). Both compute from their inputs' sizes and
    dtypes alone (optimum/quanto/library/qbytes_mm.py, quantize.py) and make a new tensor; the
    mode's own checks of what it caches (no alias of an input, a fake output) still run on their
    outputs.
    """
    if func not in mode.cacheable_quanto_ops:
        FakeTensorMode._validate_cache_key(mode, func, args, kwargs)


def _quanto_cacheable() -> frozenset:
    """quanto's cacheable ops, where optimum.quanto registered them (it is imported by then)."""
    names = ("qbytes_mm", "quantize_symmetric")
    return frozenset(getattr(torch.ops.quanto, name).default for name in names if hasattr(torch.ops.quanto, name))


@functools.cache
def fake_internals_known() -> bool:
    """Whether FakeTensorMode's internals are those the counting mode's own keys, outputs and direct
    answers follow: its key builder appends to a list (torch 2.13 here), where older ones returned a
    tuple (`_prep_args_for_hash(self, args)`). Another keeps the mode's own ways."""
    return "result" in inspect.signature(FakeTensorMode._prep_args_for_hash).parameters


def _same_fake_ops() -> dict:
    """Ops FakeTensorMode makes with the very function of a cacheable op: answered as that op.

    `aten._unsafe_view` (matmul's and linear's reshape of their fresh output, 395 times in a
    FLUX.1-dev estimate) is `aten.view` to the fake mode (torch/_subclasses/fake_impls.py, one
    `_view_meta` registered for both): the same view of the same storage. But the mode never
    caches `_unsafe_view` (autograd does not treat it as a view, so a cached copy could not say
    what it aliases), and runs its reshape checks each time; as `aten.view` it is a cache hit
    that remakes the view (`benchmarks/fake_dispatch.py`: 121 -> 34 us). Only where this torch
    registers one function for both: another torch keeps the mode's own way.
    """
    from torch._subclasses import fake_impls

    implementations, aten = fake_impls.op_implementations_dict, torch.ops.aten
    view = implementations.get(aten.view.default)
    if view is None or implementations.get(aten._unsafe_view.default) is not view:
        return {}
    return {aten._unsafe_view.default: aten.view.default}


# Ops the counting mode answers itself, as FakeTensorMode would: a new empty tensor (the
# materialized and quantized weights, the replays' outputs, the optimizers' state) or a view of
# one input (detach, transpose, slices). Counted while profiling, some 14,000 of a FLUX.1-dev
# estimate's 27,000 ops. FakeTensorMode answers each from its cache (its key, its entry, its
# remaking of the output) or, the first time, through Python reference code; the meta kernels make
# the same tensor in C++ (`benchmarks/fake_dispatch.py`: a detach 31 -> 23 us). Not `aten.view`:
# for a size-1 dimension the mode's reference code gives another stride than the meta kernel.
# Each answers None where it is not sure (an input that is not a plain fake tensor of the mode, an
# argument it does not know), and the mode's own way takes over. CROSSCHECK_DIRECT_OPS holds each
# answer to FakeTensorMode's (tests/test_estimate.py, a tiny estimate of every family).
CROSSCHECK_DIRECT_OPS = False


def _plain_fake(mode, tensor) -> bool:
    return (type(tensor) is FakeTensor and tensor.fake_mode is mode and tensor.constant is None
            and tensor.layout is torch.strided and not tensor.is_conj() and not tensor.is_neg())


def _meta_over(tensor: FakeTensor, shape, stride, offset: int, dtype=None, requires_grad=False) -> torch.Tensor:
    """A plain meta tensor of `shape` and `stride` over the fake tensor's own (meta) storage: its
    twin for a meta kernel to read, or a view of it (call with the mode's dispatch off)."""
    empty = torch.empty_strided(shape, stride, dtype=dtype or tensor.dtype, device="meta", requires_grad=requires_grad)
    return empty.set_(tensor.untyped_storage(), offset, shape, stride)


def _made_directly(mode, func, args, kwargs) -> FakeTensor | None:
    """A new empty tensor of given sizes: FakeTensorMode's `constructors` (torch/_subclasses/
    fake_impls.py) makes it on meta and puts it on the requested device, by default the CPU. (Not
    `zeros` or the `_like`s: their meta kernels take longer than the mode's cache hit.)"""
    if (kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory")
            or set(kwargs) - _FACTORY_KWARGS or not all(type(arg) in (list, tuple) for arg in args)):
        return None
    with torch._C._DisableTorchDispatch():
        made = func(*args, **{**kwargs, "device": _META})
    return FakeTensor(mode, made, kwargs.get("device") or _CPU)


def _viewed_directly(mode, func, args, kwargs) -> FakeTensor | None:
    """A view of one plain fake tensor, by arguments that are no tensors: the meta kernel's view
    of its storage, on its device, as FakeTensorMode's view outputs are."""
    base = args[0]
    if kwargs or not _plain_fake(mode, base) or any(isinstance(a, torch.Tensor) for a in args[1:]):
        return None
    with torch._C._DisableTorchDispatch():
        view = func(_meta_over(base, base.shape, base.stride(), base.storage_offset()), *args[1:])
    return FakeTensor(mode, view, base.fake_device)


def _crosscheck(out: FakeTensor, expected, func, args) -> None:
    """A direct answer is what FakeTensorMode answers: the same tensor, on the same device, over
    the same input's storage (a view) or a new one (a factory)."""
    def described(tensor):
        storage = tensor.untyped_storage()
        aliased = [i for i, arg in enumerate(args)
                   if isinstance(arg, torch.Tensor) and arg.untyped_storage()._cdata == storage._cdata]
        return (type(tensor), tensor.fake_device, tensor.dtype, tensor.shape, tensor.stride(),
                tensor.storage_offset(), storage.nbytes(), tensor.requires_grad, tensor.is_inference(), aliased)

    if type(expected) is not FakeTensor or described(out) != described(expected):
        raise AssertionError(f"{func} answered directly as {described(out)}, by FakeTensorMode as "
                             f"{described(expected) if type(expected) is FakeTensor else expected!r}")


_aten = torch.ops.aten
_FACTORY_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})
_CPU, _META = torch.device("cpu"), torch.device("meta")
_DIRECT_OPS = {
    **dict.fromkeys([_aten.empty_strided.default, _aten.empty.memory_format], _made_directly),
    **dict.fromkeys([_aten.detach.default, _aten.t.default, _aten.transpose.int,
                     _aten.permute.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default,
                     _aten.as_strided.default, _aten.slice.Tensor, _aten.select.int], _viewed_directly),
}


# Arguments an op's cache key holds as they are, with their type (1 and 1.0 make different dtypes).
_PLAIN_ARGUMENTS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                              torch.memory_format})
_FAKE_LAYOUT = "fake tensor"  # marks a fake tensor's layout tuple in a cache key


def _key_by_layout(mode, result: list, args, *rest) -> None:
    """FakeTensorMode's `_prep_args_for_hash` for the estimate's counting mode: the cache key of an
    op, as FakeTensorMode makes it, with a fake tensor's layout read in one tuple.

    Its own way builds a metadata record per tensor argument and flattens it field by field, half
    of a cache hit's time (`benchmarks/fake_dispatch.py`: an add 86 -> 40 us, its key 45 -> 7 us). The tuple holds
    everything that record does but what the shape and strides decide (the memory format) or the
    layout does (sparsity), so the same ops share a key. `rest`: the key state and the objects
    hashed by id, as this torch passes them on.
    """
    if mode.shape_env is not None or isinstance(args, dict):  # symbolic sizes; kwargs
        return FakeTensorMode._prep_args_for_hash(mode, result, args, *rest)
    if isinstance(args, (list, tuple)):
        result.append(type(args))
        result.append(len(args))
    for arg in args:
        kind = type(arg)
        if kind in _PLAIN_ARGUMENTS:
            result.append(kind)
            result.append(arg)
        elif kind is FakeTensor and arg.fake_mode is mode and arg.constant is None and arg.layout is torch.strided:
            result.append(_FAKE_LAYOUT)
            result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                           arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                           arg.is_inference(), arg.is_quantized))
        elif kind is list or kind is tuple:
            _key_by_layout(mode, result, arg, *rest)
        else:  # anything else (a symbolic int, a function, a foreign tensor) as FakeTensorMode keys it
            FakeTensorMode._prep_args_for_hash(mode, result, (arg,), *rest)


def _new_output_from_cache(mode, state, entry, key, func, args) -> FakeTensor | None:
    """FakeTensorMode's `_get_output_tensor_from_cache_entry` for the estimate's counting mode: an
    output answered from the cache, as FakeTensorMode makes it, in one step when it is a new tensor.

    Most cache hits are ops that make a new tensor, or a view of an input, of sizes known in
    advance (not in place, no symbolic sizes, no conjugate or negative bit, strided). For those
    FakeTensorMode reads each size through a checker of symbolic values and makes the meta tensor
    (for a view, set onto the input's storage) under its kernel-invocation context; here it is made
    with the mode's dispatch off and wrapped as it wraps it (`benchmarks/fake_dispatch.py`: an add
    41 -> 32 us, a linear 109 -> 93 us). Everything else goes through FakeTensorMode's own code.
    """
    metadata = entry.metadata
    if (metadata is None or entry.inplace_idx is not None or mode.shape_env is not None
            or metadata.layout is not torch.strided or metadata.is_conj or metadata.is_neg):
        return FakeTensorMode._get_output_tensor_from_cache_entry(mode, state, entry, key, func, args)
    viewed = None
    if entry.view_idx is not None:  # a view: the same sizes over its input's storage
        viewed = args[entry.view_idx]
        if not (isinstance(func, torch._ops.OpOverload) and func.is_view and type(viewed) is FakeTensor):
            return FakeTensorMode._get_output_tensor_from_cache_entry(mode, state, entry, key, func, args)
    with torch._C._DisableTorchDispatch():
        if viewed is None:
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, device="meta",
                                        requires_grad=metadata.requires_grad)
        else:
            empty = _meta_over(viewed, metadata.shape, metadata.stride, metadata.storage_offset, metadata.dtype,
                               metadata.requires_grad)
    return FakeTensor(mode, empty, metadata.device)
