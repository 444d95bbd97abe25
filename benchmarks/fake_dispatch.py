"""What one op on fake tensors costs the estimate, with its layout key and new outputs and with
FakeTensorMode's own.

The estimate runs every op of a job on fake tensors under one counting FakeTensorMode
(`probe/meters/_fake_mode.py`, `counting_fake_mode`); nearly every op is answered from
FakeTensorMode's cache: a key is built per op, and the output made from the cache entry. The
counting mode keys a fake argument on one tuple of its layout (`_key_by_layout`), where
FakeTensorMode's own key builds a metadata record per argument and flattens it field by field;
and it makes a new output in one step (`_new_output_from_cache`). Some ops it answers without
the cache: new empty tensors and views in C++ (`_DIRECT_OPS`), `_unsafe_view` as the cached
`view` (`_same_fake_ops`), and it caches quanto's matmul (`_cacheable_quanto_ops`).
This times, in one process and side by side:

- ops:        a few ops of a transformer's training step on fake bf16 tensors (each once to fill
              the cache, then the best of 3 rounds of N calls), in the counting mode as the
              estimate runs it; without its direct answers (`_unsafe_view` as itself, quanto's
              matmul uncached); then
              also with FakeTensorMode's own outputs; and with its own key and outputs too;
- key:        the key of `add` alone, both ways;
- collection: a full `gc.collect()` after the libraries the estimate preloads are imported,
              with them frozen (`probe/_preload.py`) and not.

    python benchmarks/fake_dispatch.py [--calls 3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import time


def _best_of(rounds: int, calls: int, fn) -> float:
    """Microseconds per call, the best of `rounds` rounds of `calls` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


VARIANTS = ("estimate", "no direct", "own outputs", "own key+outputs")


def _mode(variant: str):
    """The estimate's counting mode; without its direct answers; with FakeTensorMode's own outputs
    too, or its own key and outputs too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fitfinder.probe.meters import AllocatorTracker, _fake_mode

    FakeTensorMode.cache.clear()  # shared by every mode: what one variant cached, another would hit
    mode = _fake_mode.counting_fake_mode(AllocatorTracker())
    cls = type(mode)  # a class of its own per mode
    if variant != "estimate":
        cls.direct, cls.same_as, cls.cacheable_quanto_ops = {}, {}, frozenset()
    if variant in ("own outputs", "own key+outputs"):
        cls._get_output_tensor_from_cache_entry = FakeTensorMode._get_output_tensor_from_cache_entry
    if variant == "own key+outputs":
        cls._prep_args_for_hash = FakeTensorMode._prep_args_for_hash
    return mode


def op_costs(calls: int) -> dict[str, dict[str, float]]:
    import optimum.quanto  # noqa: F401 - registers quanto's ops
    import torch
    from torch._subclasses.fake_tensor import _CacheKeyState

    costs: dict[str, dict[str, float]] = {}
    for label in VARIANTS:
        mode = _mode(label)
        with mode:
            x = torch.empty(4096, 3072, dtype=torch.bfloat16)
            w = torch.empty(3072, 3072, dtype=torch.bfloat16)
            b = torch.empty(3072, dtype=torch.bfloat16)
            codes, scales = torch.empty(3072, 3072, dtype=torch.int8), torch.empty(3072, 1, dtype=torch.bfloat16)
            ops = {"linear": lambda: torch.nn.functional.linear(x, w, b), "add": lambda: x + x,
                   "mul_ (in place)": lambda: x.mul_(2), "view": lambda: x.view(2, 2048, 3072),
                   "_unsafe_view": lambda: torch.ops.aten._unsafe_view(x, (2, 2048, 3072)),
                   "t (transpose)": lambda: w.t(), "detach": lambda: x.detach(),
                   "empty_strided": lambda: torch.empty_strided((4096, 3072), (3072, 1), dtype=torch.bfloat16),
                   "zeros (cached)": lambda: torch.zeros((3072, 3072), dtype=torch.bfloat16),
                   "quanto qbytes_mm": lambda: torch.ops.quanto.qbytes_mm(x, codes, scales)}
            costs[label] = {name: _best_of(3, calls, fn) for name, fn in ops.items()}
            add = torch.ops.aten.add.Tensor
            key = lambda: mode._cache_key(_CacheKeyState(None), add, (x, x), {})  # noqa: E731
            costs[label]["key of add"] = _best_of(3, calls, key)
    return costs


def collection_seconds() -> dict[str, float]:
    import fitfinder.probe._preload  # noqa: F401 - freezes what the imports made

    gc.unfreeze()
    started = time.perf_counter()
    gc.collect()
    unfrozen = time.perf_counter() - started
    gc.freeze()
    started = time.perf_counter()
    gc.collect()
    return {"not frozen": unfrozen, "frozen": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per round (3 rounds, the best)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    collections = collection_seconds()  # first: the preload's imports are what it measures
    costs = op_costs(args.calls)
    ours, theirs = costs[VARIANTS[0]], costs[VARIANTS[-1]]
    print("one op on fake tensors in the estimate's counting mode, us per call (best of 3 rounds)")
    print(f"{'op':<18}" + "".join(f"{variant:>17}" for variant in VARIANTS) + f"{'ratio':>8}")
    for name in ours:
        print(f"{name:<18}" + "".join(f"{costs[variant][name]:>17.1f}" for variant in VARIANTS)
              + f"{ours[name] / theirs[name]:>8.2f}")
    print(f"\na full collection after the preloaded imports: {collections['not frozen']:.3f} s not frozen, "
          f"{collections['frozen']:.3f} s frozen")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"us_per_call": costs, "collection_seconds": collections}, out, indent=2)


if __name__ == "__main__":
    main()
