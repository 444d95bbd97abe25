"""The estimate: the probe's recipe on fake tensors; exact against the sim meter, and at full size."""

import importlib.util
import math
import os

import pytest

from fitfinder import probe
from fitfinder.trainers import aitoolkit_job
from fitfinder.probe import estimate, meters
from fitfinder.probe.meters import _fake_mode
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import DEMO, EXAMPLES, ROOT

MiB, GiB = 2**20, 2**30
ALL_PHASES = ["load", "text_encoder", "latents", "sample", "train", "last_sample"]


def _benchmark():
    """benchmarks/estimate_accuracy.py: the configurations and the comparison live there, once."""
    spec = importlib.util.spec_from_file_location("estimate_accuracy", ROOT / "benchmarks" / "estimate_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runner():
    return probe.ProbeRunner(timeout_s=600)


# -- the meter ---------------------------------------------------------------------------------
def test_the_meter_rounds_as_the_caching_allocator_and_adds_the_overhead():
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    overhead = GpuOverhead(context_bytes=500 * MiB, workspace_bytes=8 * MiB, fragmentation=0.1, source="test")
    estimating = meters.EstimateMeter(None, overhead.as_dict())
    with estimating:
        with estimating.phase("load"):
            kept = [torch.empty(1000, dtype=torch.uint8), torch.empty(1), torch.empty(0)]
        with estimating.phase("train"):
            transient = torch.empty(3 * MiB + 1, dtype=torch.uint8)
            del transient
    assert all(isinstance(t, FakeTensor) for t in kept)  # no memory was taken
    load, train = estimating.phases["load"], estimating.phases["train"]
    # 1000 B -> 1024, 4 B -> 512, an empty tensor -> nothing; then the workspace, the fragmentation, the context
    assert load["peak_live"] == 1004
    blocks = 1024 + 512 + 8 * MiB
    assert load["peak_allocated"] == blocks + 500 * MiB
    assert load["peak_reserved"] == blocks + math.ceil(blocks * 0.1) + 500 * MiB
    assert train["peak_live"] == 1004 + 3 * MiB + 1
    assert train["peak_allocated"] == blocks + 3 * MiB + 512 + 500 * MiB
    assert estimating.outside_bytes == 500 * MiB


def test_the_meter_counts_real_tensors_made_where_values_are_needed():
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    estimating = meters.EstimateMeter(None, GpuOverhead.none().as_dict())
    with estimating:
        with estimating.phase("train"):
            with estimating.concrete():
                code_book = torch.linspace(-1, 1, 256)  # what bitsandbytes builds with .tolist()
                values = code_book.tolist()
            scaled = code_book * 2  # mixing it with fake tensors is allowed
    assert not isinstance(code_book, FakeTensor) and len(values) == 256 and isinstance(scaled, FakeTensor)
    assert estimating.phases["train"]["peak_live"] == 2 * 256 * 4


def test_the_estimate_answers_each_op_with_the_layout_fake_tensor_mode_gives():
    """The counting mode keys its cache of op answers on each fake input's layout in one tuple, not
    FakeTensorMode's metadata record: inputs that differ in one field of the layout (offset,
    storage size, strides, dtype, gradients, conjugation, memory format) must not share an answer.
    And it makes a new output from the cache in one step: the same tensor as FakeTensorMode's."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def answers(mode) -> list:
        with mode:
            base = torch.empty(4, 6)
            complex_ = torch.empty(4, 6, dtype=torch.complex64)
            inputs = [base, torch.empty(8, 6)[:4], torch.empty(8, 6)[4:],  # offset, storage size
                      torch.empty(6, 4).t(), torch.empty(4, 6, requires_grad=True),
                      torch.empty(4, 6, dtype=torch.int64), complex_, complex_.conj(), torch.empty(2, 3, 4, 5),
                      torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)]
            ops = [lambda t: t * 2, lambda t: t * 2.0, lambda t: t.sum(0), lambda t: t.reshape(-1),
                   lambda t: t[1:], lambda t: t.contiguous(), lambda t: t.clone(), lambda t: t.unsqueeze(0)]
            found = []
            for tensor in inputs:
                for op in ops:
                    for _ in range(2):  # the second from the cache
                        out = op(tensor)
                        found.append((tuple(out.shape), out.stride(), out.dtype, out.storage_offset(),
                                      out.requires_grad, out.is_conj(), out.untyped_storage().nbytes(),
                                      out.untyped_storage()._cdata == tensor.untyped_storage()._cdata,
                                      type(out).__name__, out.device, out.fake_mode is mode))
        return found

    expected = answers(FakeTensorMode(allow_non_fake_inputs=True))
    counting = _fake_mode.counting_fake_mode(meters.AllocatorTracker())
    assert type(counting)._prep_args_for_hash is _fake_mode._key_by_layout  # this torch takes the layout key
    assert type(counting)._get_output_tensor_from_cache_entry is _fake_mode._new_output_from_cache  # and new outputs
    hits = FakeTensorMode.cache_hits
    assert answers(counting) == expected
    assert FakeTensorMode.cache_hits - hits >= 64  # the answers came from the counting mode's keys


def test_the_meters_walks_give_what_modules_parameters_and_buffers_give():
    """The meters' walks without names (meters.submodules, meters.members) keep torch's order and give
    each module and tensor once: a module held twice and a parameter tied across blocks included."""
    import torch

    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)) for _ in range(3))
    blocks.append(blocks[0][1])  # a module held twice
    blocks[2][0].weight = blocks[1][0].weight  # a tied parameter
    blocks[1].register_buffer("codes", torch.zeros(2))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), blocks, torch.nn.BatchNorm1d(4))
    modules = meters.submodules(model)
    assert modules == list(model.modules())
    assert meters.members(modules) == list(model.parameters())
    assert meters.members(modules, "_buffers") == list(model.buffers())


_DIRECT_ANSWERS_CROSSCHECKED = """
import collections, json
import torch._dynamo.config
from fitfinder import probe
from fitfinder.models import FAMILIES
from fitfinder.probe import estimate
from fitfinder.probe.meters import _fake_mode
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import tiny_job

_fake_mode.CROSSCHECK_DIRECT_OPS = True
torch._dynamo.config.fake_tensor_cache_crosscheck_enabled = True  # FakeTensorMode's check of its cache hits
checked, crosscheck = collections.Counter(), _fake_mode._crosscheck

def counted(out, expected, func, args):
    crosscheck(out, expected, func, args)
    checked[str(func)] += 1

_fake_mode._crosscheck = counted
statuses = {}
for family in FAMILIES:
    job = tiny_job(family, {"model.quantize": True})
    request = estimate.as_estimate(probe.request_for(job, 3, "sim", None), GpuOverhead.none())
    result = estimate.InProcess(600).run(request)
    statuses[family] = [result["status"], (result.get("error") or "")[-400:]]
print(json.dumps({"statuses": statuses, "checked": checked}))
"""


@pytest.mark.slow
@pytest.mark.exhaustive  # every op of every family's recipe: 8 minutes; test_every_phase_of_35_... checks the bytes
def test_the_ops_the_counting_mode_answers_itself_or_from_the_cache_get_fake_tensor_modes_answers():
    """The counting mode answers new empty tensors and views itself (_fake_mode._DIRECT_OPS): with its
    crosscheck on, each answer is held to FakeTensorMode's own for the same op (sizes, strides,
    offset, storage size and which input's storage it shares, device, dtype, flags). It also makes
    the cache's outputs its own way and caches quanto's matmul: with FakeTensorMode's crosscheck
    of cache hits on, each hit is held to what the op gives run afresh. Through a tiny 8-bit
    estimate of every family: loading, quantizing, previews and a training step."""
    found = _in_a_fresh_interpreter(_DIRECT_ANSWERS_CROSSCHECKED)
    failed = {family: status for family, status in found["statuses"].items() if status[0] != "ok"}
    assert not failed
    assert found["checked"]["aten.empty_strided.default"] > 1_000 and found["checked"]["aten.detach.default"] > 100
    assert len(found["checked"]) >= 8, found["checked"]  # most kinds of direct answer met


# -- against the sim meter ---------------------------------------------------------------------
@pytest.mark.slow
def test_every_phase_of_35_tiny_configurations_matches_the_sim_meter(runner):
    bench = _benchmark()
    rows = bench.measure_accuracy(bench.ACCURACY_CONFIGS, runner)
    families = {row["config"]: row["family"] for row in rows}
    assert len(families) >= 30 and set(families.values()) == {"flux", "sdxl", "wan21", "wan22"}
    assert {row["phase"] for row in rows} == set(ALL_PHASES)
    worst = max(rows, key=lambda row: abs(row["error"]))
    assert abs(worst["error"]) <= bench.MAX_ERROR, worst


# -- full size ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("quantize", [False, True])
def test_flux_dev_at_512_fits_24_gib_only_with_the_8_bit_base(runner, quantize):
    """AI Toolkit's 24 GB Flux example quantizes the base: without it the job cannot fit."""
    found = estimate.run(_benchmark().flux_dev_job(quantize), runner, GpuOverhead())
    assert found.fits is quantize and found.budget_bytes == 24 * GiB
    assert list(found.phases) == ALL_PHASES and found.peak_bytes == max(found.phases.values())
    if quantize:  # the peak is the bf16 transformer on the card before its layers are quantized
        assert found.peak_bytes < 24 * GiB and found.first_phase_over(24 * GiB) is None
        assert max(found.phases, key=found.phases.get) == "load"
    else:  # 12 billion bf16 weights and T5-XXL: out of memory as soon as everything is loaded
        assert found.peak_bytes > 30 * GiB and found.first_phase_over(24 * GiB) == "load"
    assert found.max_rss_bytes < 1.5 * GiB


@pytest.mark.slow
def test_the_wan22_example_runs_through_the_estimate(runner):
    job = aitoolkit_job.load(EXAMPLES / "train_lora_wan22_14b_24gb.yaml")
    job.settings.vram_bytes = 24 * GiB
    found = estimate.run(job, runner, GpuOverhead())
    assert found.arch_name == "wan22-14b" and list(found.phases) == ALL_PHASES
    assert found.fits  # the 24 GB example: 4-bit experts, one on the card at a time, text embeddings cached
    # low_vram: the experts stay on the CPU (Wan2214bModel); UMT5 comes in bf16 and is quantized there
    assert 10 * GiB < found.phase_stats["load"]["peak_live"] < 11 * GiB
    assert found.phases["train"] > 10 * GiB  # one 14B expert at 4 bit, UMT5 gone, activations of 1024 px


# -- the request -------------------------------------------------------------------------------
def test_an_estimate_is_one_primed_step_and_one_denoising_step_of_the_probe_request():
    job = aitoolkit_job.load(DEMO)
    request = probe.request_for(job, 20, "sim", job.settings.vram_bytes)
    request["fault"] = "hang"
    estimated = estimate.as_estimate(request, GpuOverhead())
    assert (estimated["meter"], estimated["steps"], estimated["prime_optimizer"]) == ("estimate", 1, True)
    assert estimated["sample"] == {**request["sample"], "steps": 1}
    assert "fault" not in estimated and estimated["overhead"] == GpuOverhead().as_dict()
    same = {k: v for k, v in request.items() if k not in ("meter", "steps", "sample", "fault")}
    assert {k: estimated[k] for k in same} == same


def test_an_estimate_needs_no_weights_only_the_architecture():
    job = aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")  # pretrained weights, not downloaded
    request = estimate.request_for(job, GpuOverhead())
    assert request["model"]["arch_name"] == "flux-dev" and request["model"]["path"] is None


# -- identical blocks run once ------------------------------------------------------------------
def _stack(kind: str, count: int = 4):
    """A stack of identical blocks: an MLP whose output is new ("plain"), one that hands an input
    on as T5 hands on its position bias ("pass"), one that fills in a list argument as Wan's VAE
    fills its causal cache ("list"), one that joins a text stream to its input and returns the two
    as slices of one storage, as FLUX's single block does ("split")."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x, bias=None, cache=None):
            if kind == "split":  # bias is the text stream here
                joined = torch.cat([bias, x])
                out = joined + self.down(torch.nn.functional.gelu(self.up(joined)))
                return out[:len(bias)], out[len(bias):]
            out = x + self.down(torch.nn.functional.gelu(self.up(x)))
            if cache is not None:
                cache.append(out * 2)
            return (out, bias) if kind == "pass" else out

    return torch.nn.ModuleList(Mlp() for _ in range(count))


def _run_stack(kind: str, replay: bool):
    import torch

    estimating = meters.EstimateMeter(None, GpuOverhead.none().as_dict())
    with estimating:
        with estimating.phase("load"):
            blocks = _stack(kind)
        replaying = estimating.replay_repeated_blocks(blocks) if replay else None
        with estimating.phase("sample"), torch.no_grad():
            x, bias, cache = torch.empty(8, 64), torch.empty(8, 8), [] if kind == "list" else None
            if kind == "split":
                bias = torch.empty(3, 64)
            for block in blocks:
                out = block(x, bias, cache) if kind != "plain" else block(x)
                if kind == "split":
                    bias, x = out
                    assert bias.untyped_storage()._cdata == x.untyped_storage()._cdata  # replayed as made
                x = out[0] if kind == "pass" else x if kind == "split" else out
            shape = tuple(x.shape)
        with estimating.phase("train"):  # gradients on: every block runs
            y = torch.empty(8, 64, requires_grad=True)
            text = torch.empty(3, 64, requires_grad=True)
            for block in blocks:
                if kind == "split":
                    text, y = block(y, text)
                else:
                    y = block(y)[0] if kind == "pass" else block(y)
            y.sum().backward()
    stats = {name: {k: v for k, v in entry.items() if k != "seconds"} for name, entry in estimating.phases.items()}
    return stats, shape, (replaying.replayed if replaying else 0), cache


@pytest.mark.parametrize("kind", ["plain", "pass", "split"])
def test_identical_blocks_are_replayed_with_the_same_peaks(kind):
    replayed_stats, shape, replayed, _ = _run_stack(kind, replay=True)
    run_stats, run_shape, _, _ = _run_stack(kind, replay=False)
    assert replayed == 3  # the first block runs, the three after it are replayed
    assert replayed_stats == run_stats and shape == run_shape == (8, 64)


def test_a_block_that_fills_in_a_list_argument_always_runs():
    stats, _, replayed, cache = _run_stack("list", replay=True)
    assert replayed == 0 and len(cache) == 4
    assert stats == _run_stack("list", replay=False)[0]


def _in_a_fresh_interpreter(script: str, *args: str, **env: str):
    """What `script` prints last, as JSON, run by a Python of its own (this one's imports and
    caches left behind; src, the checkout and benchmarks/ importable), with `env` added."""
    import json
    import subprocess
    import sys

    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(str(ROOT / path) for path in ("src", ".", "benchmarks"))}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


_DEEP_ESTIMATE = """
import json, sys
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
from checkpointed_replay import widened  # benchmarks/

# six blocks a stack: the first, three replayed, the last two
request = widened(sys.argv[1], json.loads(sys.argv[2]), 6)
result = estimate.InProcess(600).run(estimate.as_estimate(request, GpuOverhead.none()))
print(json.dumps({key: result.get(key) for key in ("status", "error", "phase_stats", "replayed")}))
"""


def _deep_tiny_estimate(family: str, changes: dict, replay: bool) -> dict:
    """The tiny job with six blocks in each stack, estimated in a fresh process (the replay's
    switch is read from the environment)."""
    import json

    result = _in_a_fresh_interpreter(_DEEP_ESTIMATE, family, json.dumps(changes),
                                     FITFINDER_REPLAY_CHECKPOINTED="1" if replay else "0")
    assert result["status"] == "ok", result["error"]
    result["phase_stats"] = {phase: {key: value for key, value in stats.items() if key != "seconds"}
                             for phase, stats in result["phase_stats"].items()}
    return result


_ESTIMATES_IN_ONE_PROCESS = """
import gc, json
from fitfinder import probe
from fitfinder.probe import estimate
from fitfinder.probe.overhead import GpuOverhead
from tests.conftest import tiny_job

request = estimate.as_estimate(probe.request_for(tiny_job("flux", {"model.quantize": True}), 3, "sim", None),
                               GpuOverhead.none())
phases, tracked = [], []
for _ in range(4):
    phases.append(estimate.InProcess(600).run(request)["phases"])
    tracked.append(gc.get_freeze_count() + len(gc.get_objects()))
print(json.dumps({"phases": phases, "tracked": tracked}))
"""


@pytest.fixture(scope="module")
def estimates_in_one_process() -> dict:
    """Four estimates of a tiny 8-bit FLUX job in one fresh interpreter: each one's phases, and the
    objects the collector tracks (frozen or not) after each."""
    return _in_a_fresh_interpreter(_ESTIMATES_IN_ONE_PROCESS)


def test_the_first_estimate_in_a_process_counts_what_the_next_one_counts(estimates_in_one_process):
    """quanto's first 8-bit quantize imports a module that makes two index tensors (host constants,
    16 KiB): made inside the meter they counted as device memory of the process's first estimate
    only, so --search and tiers, which estimate many times in one process, disagreed with it."""
    first, second = estimates_in_one_process["phases"][:2]
    assert set(first) == set(ALL_PHASES) and first == second


def test_what_an_estimate_froze_goes_back_to_the_collector_at_the_next(estimates_in_one_process):
    """The estimate meter freezes what survives each phase's collection (its pipeline), which is
    garbage in reference cycles when the estimate ends: were it left frozen, every estimate of
    --search or tiers would keep the last one's pipeline for good (about 14,000 objects for this
    tiny job, each time). The next estimate gives it back to the collector."""
    tracked = estimates_in_one_process["tracked"]
    assert tracked[3] - tracked[1] < 1_000, tracked


def _without_owners(phase_stats: dict) -> dict:
    return {phase: {key: value for key, value in stats.items() if key not in ("owners", "host_owners", "peak_host")}
            for phase, stats in phase_stats.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "changes", "replays"), [
    ("flux", {"model.quantize": True, "train.gradient_accumulation": 2}, 4),  # 8-bit weights, gradients kept
    ("wan22", {"train.optimizer": "adamw8bit"}, 2),  # two experts; the estimate's one step trains one
])
def test_checkpointed_blocks_are_replayed_in_training_with_the_same_peaks(family, changes, replays):
    replayed = _deep_tiny_estimate(family, changes, replay=True)
    run = _deep_tiny_estimate(family, changes, replay=False)
    # Every phase's peaks, device and host tensors, to the byte (peak_host adds the process's own
    # resident memory, measured, which two processes never share to the byte). Who holds the peak is
    # split alike in total only: a replay's rise is the activations' (what the block made), where the
    # run hands a block's gradients to their owner as each is accumulated.
    assert _without_owners(replayed["phase_stats"]) == _without_owners(run["phase_stats"])
    for phase, stats in run["phase_stats"].items():
        assert sum(replayed["phase_stats"][phase]["owners"].values()) == sum(stats["owners"].values())
    # Per stack of six: the first block runs (its inputs need no gradient), the second is measured
    # forward, the fifth backward, the sixth runs; the third and fourth are replayed. FLUX.1 has two
    # stacks (double and single blocks), Wan one.
    assert replayed["replayed"]["CheckpointedBlocks"] == replays
    assert "CheckpointedBlocks" not in run["replayed"]


def _optimizer_and_ema_steps(optimizer_name: str, replay: bool):
    """Two optimizer steps, each with an EMA update, then a preview's swap, over 18 LoRA-like tensors."""
    import torch

    from fitfinder import optimizers

    estimating = meters.EstimateMeter(None, GpuOverhead.none().as_dict())
    with estimating:
        with estimating.phase("load"):
            params = [torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16))
                      for _ in range(6) for shape in [(64, 4096), (4096, 64), (96,)]]
            ema = optimizers.Ema(params, 0.99)
        with estimating.phase("train"):
            with estimating.concrete():  # bitsandbytes builds its code books from values
                optimizer = optimizers.build(optimizer_name, params, 1e-4)
            replaying = [estimating.replay_repeated_updates(ema=ema),
                         estimating.replay_repeated_updates(optimizer)] if replay else []
            for _ in range(2):
                for param in params:
                    param.grad = torch.zeros_like(param)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ema.update()
        with estimating.phase("sample"), ema.swapped_in():
            pass
        held = sorted(estimating.tracker.live.values())
    stats = {name: {k: v for k, v in entry.items() if k != "seconds"} for name, entry in estimating.phases.items()}
    steps = [state["step"] for state in optimizer.state.values() if isinstance(state.get("step"), int)]  # not torch's
    return stats, held, steps, sum(updates.replayed for updates in replaying)


@pytest.mark.parametrize("optimizer_name", ["adamw8bit", "adafactor", "adamw"])
def test_updates_of_the_same_layout_are_replayed_with_the_same_peaks(optimizer_name):
    _optimizer_and_ema_steps(optimizer_name, False)  # bitsandbytes keeps two small tensors from its first use
    replayed_stats, replayed_held, replayed_steps, replayed = _optimizer_and_ema_steps(optimizer_name, True)
    run_stats, run_held, run_steps, _ = _optimizer_and_ema_steps(optimizer_name, False)
    assert replayed_stats == run_stats and replayed_held == run_held and replayed_steps == run_steps
    # 18 tensors of 3 layouts: the first of each layout runs, every other is replayed. The EMA:
    # 15 + 18 updates, 15 copies and 15 + 18 writes at the swap (in, then back). bitsandbytes:
    # 15 + 18 steps (its state is made before each first update_step). The others: not hooked.
    assert replayed == 81 + (33 if optimizer_name == "adamw8bit" else 0)
