"""The estimate's replays: repeated work on fake tensors measured once, then made again without its ops.

On fake tensors an op costs the same whatever its values, so identical work repeats identical
allocations. Each replay runs the first instance, measures how far it raised the tracker's peaks
(`PeakWindow`) and what it made, and replays a repeat only where that is exact:

- `RepeatedBlocks`: identical blocks under no_grad (previews, text encoding);
- `CheckpointedBlocks`: identical gradient-checkpointed blocks of a training step, forward and backward;
- `RepeatedUpdates`: per-parameter optimizer and EMA updates of the same layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

from fitfinder.probe.meters._tensors import inner_tensors, members, submodules, tensors_returned
from fitfinder.probe.meters._tracker import AllocatorTracker


class RepeatedBlocks:
    """Identical blocks run once under no_grad; their repeats replay what the first one did.

    A transformer is a stack of blocks with the same shapes (FLUX.1-dev: 19 double and 38 single
    blocks; T5-XXL: 24 layers), and on fake tensors each op costs the same whatever its values,
    so an inference pass (a preview, text encoding) repeats the same ops, allocations and frees
    once per block. The first block of each kind (same class, same parameter shapes and dtypes,
    same argument shapes) runs and is measured: its peak over the live bytes it started from, and
    its outputs. The next identical block makes that peak again over what is live then, and
    returns new fake outputs of the same shapes -- the tracker's counts are what running it would
    give, without its ops. A block is only replayed when that is exact: its outputs are fresh
    storages of its own making (or views of them, made again as such views: `_Layouts`), or
    inputs handed on, and it left nothing else alive. With gradients on (training, where the
    graph must exist), while tensors are made in host memory, or with module hooks, blocks run.
    """

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.traces: dict[tuple, Any] = {}  # key -> (peak rises, output structure, output layouts) or None
        self.replayed = 0

    def install(self, *parts: torch.nn.Module) -> None:
        for part in parts:
            for stack in part.modules():
                if isinstance(stack, torch.nn.ModuleList):
                    for block in stack:
                        self._wrap(block)

    def _wrap(self, block: torch.nn.Module) -> None:
        if any(getattr(module, "offloaded", False) for module in submodules(block)):
            return  # its offloaded layers' copies outlive it in the staging rings (models/_offload.py)
        forward = block.forward

        def replayed(*args, **kwargs):
            key = None if torch.is_grad_enabled() or self.tracker.paused else self._key(block, args, kwargs)
            if key is None or block._forward_hooks or block._forward_pre_hooks:
                return forward(*args, **kwargs)
            if key not in self.traces:
                out, self.traces[key] = self._record(forward, args, kwargs)
                return out
            trace = self.traces[key]
            return forward(*args, **kwargs) if trace is None else self._replay(trace, args, kwargs)

        block.forward = replayed

    def _key(self, block, args, kwargs) -> tuple | None:
        live = self.tracker.live
        modules = submodules(block)
        params = tuple((tuple(t.shape), t.dtype, t.untyped_storage()._cdata in live)
                       for held in [*members(modules), *members(modules, "_buffers")] for t in inner_tensors(held))
        signature = _signature((args, tuple(sorted(kwargs.items()))))
        return None if signature is None else (type(block), params, signature)

    def _record(self, forward, args, kwargs):
        tracker = self.tracker
        before = set(tracker.live)
        window = tracker.window()
        out = forward(*args, **kwargs)
        rise = window.close()
        inputs = list(tensors_returned((args, kwargs)))
        made: list[torch.Tensor] = []

        def describe(tensor: torch.Tensor):
            for index, given in enumerate(inputs):
                if tensor is given:  # passed through (T5 hands its position bias on)
                    return _Given(index)
            made.append(tensor)
            return _Made(tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)

        structure = tree_map_only(torch.Tensor, describe, out)
        # The outputs it made, as storages and views of them: FLUX's single block returns its text
        # and image streams as two slices of one storage (diffusers' FluxSingleTransformerBlock),
        # which a replay makes again the same way, so its 38 blocks replay in a preview too.
        layouts = _Layouts.of(made)
        own = (layouts is not None and not before.intersection(layouts.keys)
               and tracker.live_bytes - window.live == sum(layouts.sizes))
        return out, ((rise, structure, layouts) if own else None)

    def _replay(self, trace, args, kwargs):
        rise, structure, layouts = trace
        self.replayed += 1
        self.tracker.reach(rise)
        inputs = list(tensors_returned((args, kwargs)))
        made = iter(layouts.make())
        return tree_map_only((_Made, _Given), lambda d: next(made) if isinstance(d, _Made) else d.make(inputs),
                             structure)


class CheckpointedBlocks:
    """Identical gradient-checkpointed blocks of a training step: a few run, the rest replay.

    AI Toolkit turns checkpointing on with the denoiser's own `enable_gradient_checkpointing()`
    (jobs/process/BaseSDTrainProcess.py, run), as the recipe does (models/_pipeline.py). Under
    diffusers' checkpointing every module with a `gradient_checkpointing` flag calls
    `_gradient_checkpointing_func(block, *args)`, torch.utils.checkpoint with `use_reentrant=False`
    (ModelMixin.enable_gradient_checkpointing, diffusers 0.42), so a block's forward keeps nothing of its own
    but its outputs: autograd's saved tensors become placeholders, and the checkpoint frame keeps
    the block's inputs for the recomputation. Its backward recomputes the forward, keeps what the
    backward needs, and leaves the gradients of its inputs and of its LoRA parameters. On fake
    tensors each op costs the same whatever the values, so a stack of identical blocks pays for
    the same allocations once per block, twice over (forward, then recompute and backward): half
    of a FLUX.1-dev estimate.

    For each ModuleList of blocks (FLUX.1-dev: 19 double and 38 single blocks), the first block of
    each kind runs and its forward is measured (its peak over the live bytes at its start, and its
    outputs; FLUX's first double block takes inputs that need no gradient, so its second is);
    the one before the last runs, and its backward is measured, from the first of its nodes to
    the last (`_BackwardMark`: identities around it): its peak over the
    live bytes at the start, the gradients of its inputs, and which LoRA parameters it gave a new
    `.grad`. The last block always runs: its outputs feed other layers (or none: FLUX's last
    single block's text stream), so its backward starts differently. Every block in between, of
    the same kind (`_key`: class, parameter layouts and gradients, argument layouts), replays
    both through `_Replayed`: its forward makes the recorded peak over what is live then, and
    new outputs of the recorded layouts, and holds the inputs as the checkpoint frame does; its
    backward, which autograd runs after the measured block's (a stack goes back from its last
    block, so the one before the last is the first of its kind to go back), makes the measured
    peak over what is live then, new input gradients of the recorded layouts, and its own LoRA
    parameters' gradients.

    Exact where used, and used only there: checkpointing on, gradients on, nothing made in host
    memory, no module hooks, no offloaded layer (its copies outlive it in the staging rings), no
    list or dict argument, no trainable parameter but LoRA's (peft's `lora_` names), every output
    a storage of its own that needs a gradient, nothing else left alive by the forward, and every
    input that needs a gradient an output of the block before it in the same list (so its
    gradient is the block's alone, delivered as the measured block delivered it). The measured
    backward must have left only its input gradients and new LoRA gradients, freed only the
    gradients it was given and the inputs the frame held, and received gradients of the layouts
    a replay receives; a replay checks that, and refuses loudly (never guesses) when not.
    """

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.forwards: dict[tuple, Any] = {}  # key -> (peak rises, output structure, output layouts) or None
        self.backwards: dict[tuple, Any] = {}  # key -> _BackwardTrace or None
        self.places: dict[int, tuple[int, int, int]] = {}  # id(block) -> (id of its list, index, length)
        self.last_outputs: dict[int, tuple[int, list]] = {}  # id(list) -> (index, weak refs to its outputs)
        self.pending: dict[tuple, int] = {}  # key -> replays whose backward waits for a measurement
        self.replayed = 0

    def install(self, *parts: torch.nn.Module) -> None:
        for part in parts:
            for stack in part.modules():
                if isinstance(stack, torch.nn.ModuleList):
                    for index, block in enumerate(stack):
                        self.places[id(block)] = (id(stack), index, len(stack))
            for module in part.modules():
                checkpoint = getattr(module, "_gradient_checkpointing_func", None)
                if checkpoint is not None and getattr(module, "gradient_checkpointing", False):
                    module._gradient_checkpointing_func = self._wrap(checkpoint)

    def _wrap(self, checkpoint):
        def checkpointed(block, *args, **kwargs):
            place = self.places.get(id(block))
            key = self._key(block, args) if place is not None and not kwargs else None
            chained = key is not None and self._chained(place, args)
            if not chained:
                return self._remember(place, checkpoint(block, *args, **kwargs))
            _, index, length = place
            needing = any(t.requires_grad for t in tensors_returned(args))
            if index == length - 2 and self.pending.get(key) and key not in self.backwards and needing:
                out = self._measure_backward(checkpoint, block, args, key)
            elif index < length - 2 and key not in self.forwards:
                out = self._measure_forward(checkpoint, block, args, key)
            elif (index < length - 2 and self.forwards[key] is not None
                  and self.backwards.get(key, True) is not None and needing):  # not known to be inexact
                out = self._replay_forward(block, args, key)
            else:
                out = checkpoint(block, *args)
            return self._remember(place, out)

        return checkpointed

    def _remember(self, place, out):
        if place is not None:  # weakly: holding a block's outputs would keep their memory
            self.last_outputs[place[0]] = (place[1], [weakref.ref(t) for t in tensors_returned(out)])
        return out

    def _chained(self, place, args) -> bool:
        """Every input that needs a gradient is an output of the block before it in the same list."""
        stack, index, _ = place
        previous, outputs = self.last_outputs.get(stack, (None, []))
        needing = [t for t in tensors_returned(args) if t.requires_grad]
        return index == 0 or (previous == index - 1 and all(any(ref() is t for ref in outputs) for t in needing))

    def _key(self, block, args) -> tuple | None:
        tracker = self.tracker
        if not torch.is_grad_enabled() or tracker.paused:
            return None
        params, trained = [], []
        for name, param in block.named_parameters():
            if param.requires_grad:
                if "lora_" not in name:
                    return None  # a full fine-tune's weight: its gradient is not measured here
                trained.append(param)
            params.append(tuple((tuple(t.shape), t.dtype, t.untyped_storage()._cdata in tracker.live)
                                for t in inner_tensors(param)))
        modules = submodules(block)
        if any(getattr(module, "offloaded", False) or _hooked(module) for module in modules):
            return None
        grads = tuple(None if p.grad is None else _layout_of(p.grad) for p in trained)
        buffers = tuple((tuple(t.shape), t.dtype) for t in members(modules, "_buffers"))
        signature = _signature(args)
        return None if signature is None else (type(block), tuple(params), buffers, grads, signature)

    def _measure_forward(self, checkpoint, block, args, key):
        """Run the checkpointed block and record its forward, if a replay of it can be exact."""
        tracker = self.tracker
        births = tracker.births
        window = tracker.window()
        out = checkpoint(block, *args)
        rise = window.close()
        made = list(tensors_returned(out))
        layouts = _Layouts.of(made)
        # Exact only when the forward left nothing alive but its outputs, on storages of their own
        # (FLUX's single block returns two slices of one), each needing a gradient; the checkpoint
        # frame holds the inputs, alive before it too.
        own = (layouts is not None and tracker.made_since(births).issuperset(layouts.keys)
               and tracker.live_bytes - window.live == sum(layouts.sizes)
               and all(t.requires_grad and t.dtype.is_floating_point for t in made))
        structure = tree_map_only(torch.Tensor, lambda t: _Made(tuple(t.shape), t.stride(), t.dtype, t.device), out)
        self.forwards[key] = (rise, structure, layouts) if own else None
        return out

    def _replay_forward(self, block, args, key):
        """The block's forward without its ops: see `_Replayed`."""
        structure = self.forwards[key][1]
        inputs = list(tensors_returned(args))
        trained = _trained(block)
        made = iter(_Replayed.apply(self, key, len(inputs), trained, *inputs, *trained))
        self.pending[key] = self.pending.get(key, 0) + 1
        self.replayed += 1
        return tree_map_only(_Made, lambda _: next(made), structure)

    def _measure_backward(self, checkpoint, block, args, key):
        """Run the checkpointed block between two markers that measure its backward (`_BackwardTrace`)."""
        trace = _BackwardTrace(self, key, _trained(block))
        inputs = list(tensors_returned(args))
        needing = [index for index, tensor in enumerate(inputs) if tensor.requires_grad]
        trace.inputs = [(index, inputs[index].untyped_storage()._cdata) for index in needing]
        trace.input_count = len(inputs)
        trace.input_keys = {tensor.untyped_storage()._cdata for tensor in inputs}
        ended = dict(zip((id(inputs[index]) for index in needing),
                         _BackwardMark.apply(trace.ended, *(inputs[index] for index in needing))))
        out = checkpoint(block, *tree_map_only(torch.Tensor, lambda t: ended.get(id(t), t), args))
        outputs = [t for t in tensors_returned(out) if t.requires_grad]
        started = dict(zip((id(t) for t in outputs), _BackwardMark.apply(trace.started, *outputs)))
        return tree_map_only(torch.Tensor, lambda t: started.get(id(t), t), out)


class _BackwardTrace:
    """The backward of one checkpointed block, from its first node to its last, as a replay makes it
    again: the peak over the live bytes at its start, the layouts of the gradients it received and
    of those it returned, the LoRA parameters it gave a new gradient. `_exact()` keeps it in the
    blocks' `backwards` only when what it left and freed is what a replay leaves and frees."""

    def __init__(self, blocks: CheckpointedBlocks, key: tuple, trained: list):
        self.blocks, self.key, self.trained = blocks, key, trained
        self.inputs: list[tuple[int, int]] = []  # (flat index, storage) of each input that needs a gradient
        self.input_count = 0
        self.input_keys: set[int] = set()

    def started(self, grads) -> None:
        tracker = self.blocks.tracker
        self.incoming = _Layouts.of(grads)
        self.incoming_keys = {g.untyped_storage()._cdata for g in grads if g is not None}
        self.before = dict(tracker.live)
        self.births = tracker.births
        self.grads_before = [None if p.grad is None else p.grad.untyped_storage()._cdata for p in self.trained]
        self.window = tracker.window()

    def ended(self, grads) -> None:
        self.rise = self.window.close()
        self.blocks.backwards[self.key] = self if self._exact(grads) else None

    def _exact(self, grads) -> bool:
        """What the block left: its input gradients (storages of their own, or a gradient it was given
        handed on) and new LoRA gradients; what it freed: gradients it was given and inputs only the
        checkpoint frame held. A replay frees those two the same way (autograd drops the gradients
        it passed to the replay, and the replay's saved inputs, as soon as it returns)."""
        tracker = self.blocks.tracker
        live = tracker.live
        self.grads = _Layouts.of(grads)
        if self.incoming is None or self.grads is None or any(g is None for g in grads):
            return False
        made = tracker.made_since(self.births)  # by birth: a new storage may have a freed one's address
        freed = {key for key in self.before if key not in live or key in made}
        grad_keys = set(self.grads.keys)
        handed_on = (grad_keys - made) & self.incoming_keys
        new_params, self.new_grads = set(), []
        for param, before in zip(self.trained, self.grads_before):
            after = None if param.grad is None else param.grad.untyped_storage()._cdata
            if before is not None and (after != before or after in made):
                return False  # a gradient replaced rather than added to in place
            made_here = before is None and after is not None  # (a layer the block does not use gets none)
            if made_here and (after not in made or not _owns_storage(param.grad)):
                return False
            self.new_grads.append(_layout_of(param.grad) if made_here else None)
            if made_here:
                new_params.add(after)
        self.grad_indices = [index for index, _ in self.inputs]
        return ({key for key in made if live[key]} == (grad_keys - handed_on) | new_params
                and {key for key in freed if self.before[key]} <= self.incoming_keys | self.input_keys
                and self.incoming_keys - handed_on <= freed)


class _BackwardMark(torch.autograd.Function):
    """Identity on tensors whose backward calls `reached(grads)` as it passes: around a measured
    block's outputs, just before its first node (`_BackwardTrace.started`); around its inputs, just
    after its last (`_BackwardTrace.ended`)."""

    @staticmethod
    def forward(ctx, reached, *tensors):
        ctx.reached = reached
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as without it
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.reached(grads)
        return (None, *grads)


class _Replayed(torch.autograd.Function):
    """A checkpointed block replayed: the allocations of its forward and of its backward, no ops.

    Forward: the measured peak over what is live now, then outputs of the measured layouts; the
    inputs are saved, as the checkpoint frame saves them (`_NoopSaveInputs`), until the backward.
    Backward: the measured peak over what is live now, then gradients of the measured layouts for
    the inputs and for the LoRA parameters the measured block gave one. Those are made after the
    peak is raised, without raising it further: in the block they were made while it ran, inside
    the measured peak, and the gradients it was given and the inputs it saved, still alive here,
    are dropped by autograd the moment this returns, before anything else is allocated.
    """

    @staticmethod
    def forward(ctx, blocks, key, input_count, trained, *tensors):
        rise, _, layouts = blocks.forwards[key]
        blocks.tracker.reach(rise)
        ctx.blocks, ctx.key, ctx.input_count, ctx.trained = blocks, key, input_count, trained
        ctx.save_for_backward(*tensors[:input_count])
        ctx.set_materialize_grads(False)
        return tuple(layouts.make())

    @staticmethod
    def backward(ctx, *grads):
        trace = ctx.blocks.backwards.get(ctx.key)
        if trace is None or _Layouts.of(grads) != trace.incoming:
            raise RuntimeError("fitfinder: a replayed checkpointed block has no exact measurement of its "
                               "backward (set FITFINDER_REPLAY_CHECKPOINTED=0 and report it)")
        tracker = ctx.blocks.tracker
        tracker.reach(trace.rise)
        peaks = tracker.peaks()
        made = dict(zip(trace.grad_indices, trace.grads.make()))
        input_grads = [made.get(index) for index in range(ctx.input_count)]
        for param, layout in zip(ctx.trained, trace.new_grads):
            if layout is not None:
                param.grad = _empty_like_layout(layout)
        tracker.restore(peaks)
        return (None, None, None, None, *input_grads, *(None for _ in ctx.trained))


@dataclass(frozen=True)
class _Layouts:
    """Tensors as storages and views of them: what `make()` builds again, fresh, without their values.

    `views`: per tensor (None for a missing gradient), its storage's index, shape, stride, offset,
    dtype and device; `sizes`: each storage's bytes. Comparable, so a replay can check that it
    receives what the measured block received. `keys` (the measured storages) do not compare.
    """

    views: tuple
    sizes: tuple
    keys: tuple = field(compare=False, default=())

    @classmethod
    def of(cls, tensors) -> "_Layouts | None":
        """None when some tensor is not plain, or does not fit its storage's size in its own dtype."""
        keys: list[int] = []
        views, sizes = [], []
        for tensor in tensors:
            if tensor is None:
                views.append(None)
                continue
            if is_traceable_wrapper_subclass(tensor):
                return None
            storage = tensor.untyped_storage()
            if storage._cdata not in keys:
                if storage.nbytes() % tensor.element_size():
                    return None
                keys.append(storage._cdata)
                sizes.append(storage.nbytes())
            views.append((keys.index(storage._cdata), tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
                          tensor.dtype, tensor.device))
        for index, size in enumerate(sizes):  # one dtype per storage: it is made as one tensor of it
            if len({view[4] for view in views if view is not None and view[0] == index}) != 1:
                return None
        return cls(tuple(views), tuple(sizes), tuple(keys))

    def make(self) -> list:
        storages: dict[int, torch.Tensor] = {}
        made = []
        for view in self.views:
            if view is None:
                made.append(None)
                continue
            index, shape, stride, offset, dtype, device = view
            if index not in storages:
                storages[index] = torch.empty(self.sizes[index] // dtype.itemsize, dtype=dtype, device=device)
            made.append(storages[index].as_strided(shape, stride, offset))
        return made


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def _trained(block: torch.nn.Module) -> list[torch.Tensor]:
    """The block's parameters that train (its LoRA's), in `Module.parameters()` order."""
    return [param for param in members(submodules(block)) if param.requires_grad]


def _layout_of(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _empty_like_layout(layout: tuple) -> torch.Tensor:
    shape, stride, dtype, device = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _owns_storage(tensor: torch.Tensor) -> bool:
    """A plain tensor whose storage is its own, just large enough: what `_empty_like_layout` makes."""
    return (not is_traceable_wrapper_subclass(tensor) and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == _strided_nbytes(tensor))


class RepeatedUpdates:
    """Per-parameter updates that change tensors in place run once per layout; repeats replay them.

    An optimizer step over a LoRA (FLUX.1-dev: 988 tensors of a few dozen shapes) runs the same
    ops once per tensor, and so does the EMA after it; on fake tensors those ops cost ~40-100 us each
    whatever the values, and a training step's optimizer and EMA were a fifth of its estimate.
    The first update of each key (the parameter's and its gradient's layouts, its state's, the
    settings) runs and is measured: its peak over the live bytes it started from. A repeat makes
    that peak again over what is live then, and runs `skipped` for what it changes in Python (a
    step counter). Only updates that leave the live storages exactly as they found them are
    replayed -- the same storages of the same sizes (bitsandbytes' update_step writes its 8-bit
    moments in place); one that makes or replaces a tensor (a state's first step, Adafactor's
    RMS) always runs.

    Hooked per instance: bitsandbytes' `update_step(group, p, gindex, pindex)`, which its
    `Optimizer8bit.step` calls for each parameter with a gradient, and `optimizers.Ema`'s
    `update_one(shadow, param)`.
    """

    def __init__(self, tracker: AllocatorTracker):
        self.tracker = tracker
        self.traces: dict[tuple, Any] = {}  # key -> peak rises (an update), (peak rises, layout) (a copy), or None
        self.replayed = 0

    def install(self, optimizer=None, ema=None) -> None:
        if hasattr(optimizer, "update_step") and hasattr(optimizer, "get_config"):  # bitsandbytes
            self._wrap_bitsandbytes(optimizer)
        if ema is not None:
            self._wrap_ema(ema)

    def _wrap_ema(self, ema) -> None:
        update_one, copy_of, write = ema.update_one, ema.copy_of, ema.write

        def updated(shadow, param):
            key = ("ema update", ema.decay, self._layout(shadow), self._layout(param))
            self.run(key, lambda: update_one(shadow, param), lambda: None)

        def written(target, source):
            key = ("ema write", self._layout(target), self._layout(source))
            self.run(key, lambda: write(target, source), lambda: None)

        ema.update_one, ema.write = updated, written
        ema.copy_of = lambda param: self.made(("ema copy", self._layout(param)), lambda: copy_of(param))

    def _wrap_bitsandbytes(self, optimizer) -> None:
        update_step = optimizer.update_step

        def stepped(group, p, gindex, pindex):
            state = optimizer.state[p]
            config = optimizer.get_config(gindex, pindex, group)
            key = ("bitsandbytes", type(optimizer), repr(sorted(config.items())), self._layout(p),
                   self._layout(p.grad), tuple((name, self._layout(value)) for name, value in state.items()
                                              if isinstance(value, torch.Tensor)))

            def counted():  # what update_step does besides the ops: `state["step"] += 1`
                state["step"] += 1

            self.run(key, lambda: update_step(group, p, gindex, pindex), counted)

        optimizer.update_step = stepped

    def _layout(self, tensor: torch.Tensor | None) -> tuple | None:
        if tensor is None:
            return None
        if is_traceable_wrapper_subclass(tensor):
            return (type(tensor), tuple(self._layout(inner) for inner in inner_tensors(tensor)))
        storage = tensor.untyped_storage()
        return (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device,
                storage.nbytes(), storage._cdata in self.tracker.live, tensor.requires_grad)

    def run(self, key: tuple, update, skipped) -> None:
        tracker = self.tracker
        key = (key, tracker.paused > 0)
        if key in self.traces:
            trace = self.traces[key]
            if trace is None:
                update()
                return
            self.replayed += 1
            tracker.reach(trace)
            skipped()
            return
        before = dict(tracker.live)
        window = tracker.window()
        update()
        rise = window.close()
        in_place = tracker.live == before and tracker.allocated_bytes == window.allocated
        self.traces[key] = rise if in_place else None

    def made(self, key: tuple, make) -> torch.Tensor:
        """`make()`, which returns one new tensor (a copy); a repeat of `key` makes a fresh fake tensor
        of the same layout instead, with the same peak. Replayed only when the first call's tensor
        was a storage of its own, just large enough, and nothing else stayed alive or went."""
        tracker = self.tracker
        key = (key, tracker.paused > 0)
        trace = self.traces.get(key, ())
        if trace is None:
            return make()
        if trace:
            self.replayed += 1
            rise, layout = trace
            tracker.reach(rise)
            return _empty_like_layout(layout)
        before = dict(tracker.live)
        window = tracker.window()
        out = make()
        rise = window.close()
        storage = out.untyped_storage()
        own = (_owns_storage(out) and storage._cdata not in before
               and tracker.live == {**before, storage._cdata: storage.nbytes()})
        self.traces[key] = (rise, _layout_of(out)) if own else None
        return out


@dataclass(frozen=True)
class _Made:
    """An output a block made: replayed as a new fake tensor of the same layout."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    def make(self, inputs: list) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class _Given:
    """An output that is one of the block's inputs, handed on."""

    index: int

    def make(self, inputs: list) -> torch.Tensor:
        return inputs[self.index]


def _signature(value: Any) -> Any:
    """A hashable description of a block's arguments (tensors by shape, stride and dtype), or None
    when an argument is something else than tensors, numbers, strings and tuples of them. Lists
    and dicts are refused: a block may fill them in (Wan's VAE keeps its causal cache in a list),
    which a replay would not do."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value) is tuple:
        items = tuple(_signature(v) for v in value)
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def _strided_nbytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()
