"""The probe follows AI Toolkit wherever memory moves (docs/fidelity.md has the table)."""

import os

import pytest

from fitfinder import models, probe, trainers
from fitfinder.trainers.aitoolkit import _preview_size, layer_offloading
from tests.conftest import sweep, tiny_job

MiB = 2**20


def _mlp_stack(blocks: int, width: int):
    """`blocks` frozen bf16 MLP blocks (up to 4x `width`, gelu, down, residual), seeded so every
    call builds the same weights: the stack the quantization and offloading checks measure."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    return torch.nn.ModuleList(Mlp() for _ in range(blocks)).to(torch.bfloat16).requires_grad_(False)


# -- item 1: 8-bit with optimum-quanto, whose layers let checkpointing free their inputs -----------
def _checkpointed_blocks(qtype: str | None, blocks: int = 8, width: int = 256):
    """Live bytes after a checkpointed forward of `blocks` MLP blocks (a LoRA on every Linear), and
    the bytes of their weights, counted by the sim meter's tracker."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from torch.utils.checkpoint import checkpoint

    from fitfinder.probe.meters import StorageTracker, inner_tensors, tensors_of
    from fitfinder.models._weights import quantize

    stack = _mlp_stack(blocks, width)
    if qtype:
        assert quantize(stack, qtype) == 2 * blocks
    stack = inject_adapter_in_model(LoraConfig(r=8, target_modules=["up", "down"]), stack)
    x = torch.randn(4, 512, width, dtype=torch.bfloat16, requires_grad=True)
    tracker = StorageTracker()
    with tracker:
        for tensor in tensors_of(stack, x):
            tracker.add(tensor)
        held = tracker.live_bytes
        y = x
        for block in stack:
            y = checkpoint(block, y, use_reentrant=False)
        after_forward = tracker.live_bytes - held
        y.float().square().mean().backward()
    weights = sum(t.untyped_storage().nbytes() for layer in stack.modules() if hasattr(layer, "base_layer")
                  for held in tensors_of(layer.base_layer) for t in inner_tensors(held))
    return after_forward, weights


@pytest.mark.parametrize("qtype", sweep(["qfloat8", "qint8"], kept={"qfloat8"}))
def test_checkpointed_8_bit_blocks_keep_no_more_than_plain_ones(qtype):
    """bitsandbytes' Linear8bitLt kept every layer's input out of checkpointing's sight (+40 MiB on
    these 8 blocks); quanto's linear saves it with save_for_backward, so checkpointing frees it."""
    plain, plain_weights = _checkpointed_blocks(None)
    quantized, quantized_weights = _checkpointed_blocks(qtype)
    assert quantized_weights < plain_weights * 0.51  # one byte a weight and a scale a row, not two
    assert quantized <= plain + (plain_weights - quantized_weights)
    assert quantized == plain  # here exactly: the block outputs, nothing else


def test_quanto_weights_count_their_inner_tensors():
    import torch

    from fitfinder.probe.meters import StorageTracker, tensors_of
    from fitfinder.models._weights import quantize

    layer = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=False, dtype=torch.bfloat16))
    quantize(layer, "qfloat8")
    tracker = StorageTracker()
    for tensor in tensors_of(layer):
        tracker.add(tensor)
    # float8 [256, 512] + a bf16 scale per row + quanto's two scalar scales (input, output)
    assert tracker.live_bytes == 256 * 512 + 256 * 2 + 2 * 2
    assert type(layer[0]).__name__ == "QLinear"


# -- item 2: AI Toolkit's own grouped formats ------------------------------------------------------
@pytest.mark.parametrize("qtype, packed", [("uint4", 0.5), ("uint3", 3 / 8), ("uint2", 0.25), ("uint7", 7 / 8)])
def test_grouped_formats_hold_the_bytes_ai_toolkit_holds(qtype, packed):
    """Codes packed into power-of-two shards, a bf16 scale and a uint8 zero point per 64 weights:
    uint4 is 0.5 + 3/64 = 0.547 bytes per weight."""
    import torch

    from fitfinder.probe.meters import tensors_of
    from fitfinder.models._weights import GroupedLinear, quantize

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16))
    original = layer[0].weight.detach().clone()
    assert quantize(layer, qtype + "|ostris/accuracy_recovery_adapters/x.safetensors") == 1
    assert isinstance(layer[0], GroupedLinear)
    weights = 256 * 128
    assert sum(t.untyped_storage().nbytes() for t in tensors_of(layer)) == weights * packed + weights / 64 * 3
    error = (layer[0].dequantized() - original).abs().max().item()
    assert error <= (original.max() - original.min()).item() / (2 ** int(qtype[-1]) - 1)  # within a step


def test_a_layer_that_is_no_whole_number_of_groups_stays_as_it_is():
    import torch

    from fitfinder.models._weights import quantize

    layer = torch.nn.Sequential(torch.nn.Linear(96, 64, dtype=torch.bfloat16))
    assert quantize(layer, "uint4") == 0 and type(layer[0]) is torch.nn.Linear


# -- items 3, 7: which parts are quantized with what; the LoRA in fp32 ------------------------------
def test_t5_and_umt5_take_model_qtype_clip_and_sdxl_are_never_quantized():
    from fitfinder.models._pipeline import _quantization

    settings = {"quantize": 4, "quant_type": "uint4", "quantize_te": 4, "quant_type_te": "uint4"}
    flux, sdxl, wan = models.FAMILIES["flux"], models.FAMILIES["sdxl"], models.FAMILIES["wan21"]
    assert [_quantization(flux, part, settings) for part in flux.parts] == ["uint4", None, "uint4", None]
    assert [_quantization(sdxl, part, settings) for part in sdxl.parts] == [None, None, None, None]
    assert [_quantization(wan, part, settings) for part in wan.parts] == ["uint4", "uint4", None]
    job = tiny_job("flux", {"model.quantize": True, "model.qtype": "qint8", "model.qtype_te": "uint4"})
    request = probe.request_for(job, 3, "sim", None)
    assert (request["quant_type"], request["quant_type_te"], request["quantize_te"]) == ("qint8", "qint8", 8)


def test_the_lora_trains_in_fp32_whatever_the_training_dtype(run_tiny):
    """A bf16 job: the LoRA's weights (and so its gradients and optimizer state) are fp32."""
    import torch

    from fitfinder.probe import meters

    request = probe.request_for(tiny_job("flux", {"train.dtype": "bf16"}), 1, "sim", None)
    pipe = models.load_pipeline(request["model"], request, meters.SimMeter(None))
    trained = pipe.trainable_parameters(["transformer"])
    assert trained and {p.dtype for p in trained} == {torch.float32}
    assert pipe.parts["transformer"].x_embedder.weight.dtype == torch.bfloat16


# -- items 6, 11: where the text encoders are ------------------------------------------------------
def test_the_caching_pass_holds_the_encoders_alone_and_unloaded_encoders_come_back_for_previews():
    flux = models.FAMILIES["flux"]
    encoders = {"text_encoder", "text_encoder_2"}
    base = {"low_vram": False, "cache_latents": True, "trained": ["transformer"]}
    cache, unload = {**base, "text_encoder": "cache"}, {**base, "text_encoder": "unload"}
    assert probe.resident("text_encoder", cache, flux) == encoders
    assert probe.resident("sample", cache, flux) == {"transformer", "vae"}
    assert probe.resident("text_encoder", unload, flux) == encoders | {"transformer", "vae"}
    assert probe.resident("train", unload, flux) == {"transformer"}
    assert probe.resident("last_sample", unload, flux) == encoders | {"transformer", "vae"}


def test_a_dataset_that_caches_text_embeddings_caches_them(tmp_path):
    job = tiny_job("flux", {"datasets[0].cache_text_embeddings": True})
    assert probe.request_for(job, 3, "sim", None)["text_encoder"] == "cache"


def test_previews_with_unloaded_encoders_hold_them_again(run_tiny):
    unload = run_tiny("flux", {"train.unload_text_encoder": True})
    cache = run_tiny("flux", {"train.cache_text_embeddings": True})
    assert unload["status"] == cache["status"] == "ok"
    assert unload["phases"]["last_sample"] > cache["phases"]["last_sample"]
    assert unload["phases"]["train"] == cache["phases"]["train"]


# -- item 4: EMA -----------------------------------------------------------------------------------
def test_ema_holds_an_fp32_copy_of_the_lora_and_clones_it_around_previews(run_tiny):
    plain = run_tiny("flux", {"model.quantize": True})
    ema = run_tiny("flux", {"model.quantize": True, "train.ema_config": {"use_ema": True}})
    assert plain["status"] == ema["status"] == "ok"
    # a preview holds the shadow and the stored weights: twice the LoRA; the shadow is made with the
    # optimizer, before any caching (BaseSDTrainProcess.setup_ema), so the phases before it hold one
    lora = (ema["phases"]["sample"] - plain["phases"]["sample"]) // 2
    assert lora > 0 and ema["phases"]["last_sample"] - plain["phases"]["last_sample"] == 2 * lora
    for phase in ("text_encoder", "latents"):
        assert ema["phases"][phase] - plain["phases"][phase] == lora, phase
    assert ema["phases"]["load"] >= plain["phases"]["load"]


# -- item 8: the allocator -------------------------------------------------------------------------
def test_probes_run_under_the_users_allocator_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    probe.ProbeRunner(timeout_s=5)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


# -- item 9: the largest preview ------------------------------------------------------------------
def test_the_largest_preview_wins_from_samples_and_prompt_flags():
    job = tiny_job("flux", {"sample.width": 256, "sample.height": 256,
                            "sample.prompts": ["a cat --w 384 --h 320", "a dog"],
                            "sample.samples": [{"prompt": "wide", "width": 512, "height": 192}]})
    assert _preview_size(job) == (384, 320)
    job.set("sample.samples", [{"prompt": "big", "width": 512, "height": 512}])
    assert _preview_size(job) == (512, 512)
    assert probe.request_for(job, 3, "sim", None)["sample"]["width"] == 512


def test_a_preview_in_the_middle_of_an_accumulation_holds_the_gradients(run_tiny):
    """gradient_accumulation_steps counts a step per micro-batch, so a preview can find gradients;
    gradient_accumulation accumulates inside one step, so none is alive between steps."""
    import torch

    from fitfinder.probe import meters

    steps = run_tiny("flux", {"train.gradient_accumulation_steps": 2})
    inside = run_tiny("flux", {"train.gradient_accumulation": 2})
    assert steps["status"] == inside["status"] == "ok"
    request = probe.request_for(tiny_job("flux"), 1, "sim", None)
    pipe = models.load_pipeline(request["model"], request, meters.SimMeter(None))
    lora = sum(p.numel() * 4 for p in pipe.trainable_parameters(["transformer"]))
    assert all(p.dtype == torch.float32 for p in pipe.trainable_parameters(["transformer"]))
    assert steps["phases"]["last_sample"] - inside["phases"]["last_sample"] == lora


# -- item 10: layer offloading (AI Toolkit's MemoryManager block swap) -----------------------------
OFFLOAD = {"train.gradient_checkpointing": True, "model.layer_offloading": True}


def _offloaded_blocks(share: float, blocks: int = 8, width: int = 256):
    """Peak live bytes of a checkpointed forward and backward through `blocks` MLP blocks (a LoRA
    on every Linear) with `share` of the layers offloaded, and the bytes of the offloaded weights."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from torch.utils.checkpoint import checkpoint

    from fitfinder.models import _offload
    from fitfinder.probe import meters

    stack = _mlp_stack(blocks, width)
    meter = meters.SimMeter(None)
    with meter.tracker:
        meter.register(stack)
        rings = _offload.Rings(_offload.ring_depth())
        _offload.attach(stack, share, meter, rings)
        stack = inject_adapter_in_model(LoraConfig(r=8, target_modules=["up", "down"]), stack)
        meter.register(stack)
        x = torch.randn(4, 512, width, dtype=torch.bfloat16, requires_grad=True)
        meter.tracker.peak_bytes = meter.tracker.live_bytes
        y = x
        for block in stack:
            y = checkpoint(block, y, use_reentrant=False)
        y.float().square().mean().backward()
        peak = meter.tracker.peak_bytes
    offloaded = [layer for layer in stack.modules() if getattr(layer, "offloaded", False)]
    weight_bytes = sum(p.untyped_storage().nbytes() for layer in offloaded for p in layer.parameters(recurse=False))
    largest = max((sum(p.untyped_storage().nbytes() for p in layer.parameters(recurse=False)) for layer in offloaded),
                  default=0)
    return peak, weight_bytes, largest


@pytest.mark.exhaustive  # test_a_share_of_0_is_no_offloading_... runs the offloading by default
def test_offloaded_layers_lower_the_peak_by_their_weights_less_the_copies_in_the_rings():
    """AI Toolkit keeps an offloaded layer's weight in host memory and copies it to the device for
    the forward and again for the backward, into rings of AI_TOOLKIT_OFFLOAD_DEPTH (4) slots; the
    LoRA, the input the autograd function saves and everything not offloaded stay on the device."""
    from fitfinder.models import _offload

    resident, none_offloaded, _ = _offloaded_blocks(0.0)
    full, weights, largest = _offloaded_blocks(1.0)
    half, half_weights, _ = _offloaded_blocks(0.5)
    depth = _offload.ring_depth()
    assert none_offloaded == 0 and abs(2 * half_weights - weights) < weights / 100  # half the layers (biases differ)
    # lighter by the offloaded weights at most, and by all of them but the rings' copies (forward,
    # backward, and the one being made) at least
    assert weights - (2 * depth + 1) * largest <= resident - full <= weights
    assert resident - full > weights / 3
    assert full < half < resident


def test_a_share_of_0_is_no_offloading_byte_for_byte_and_more_offloading_is_lighter(run_tiny):
    off = run_tiny("wan21", {"train.gradient_checkpointing": True})
    zero = run_tiny("wan21", {**OFFLOAD, "model.layer_offloading_transformer_percent": 0.0,
                              "model.layer_offloading_text_encoder_percent": 0.0})
    half = run_tiny("wan21", {**OFFLOAD, "model.layer_offloading_transformer_percent": 0.5,
                              "model.layer_offloading_text_encoder_percent": 0.5})
    full = run_tiny("wan21", OFFLOAD)  # AI Toolkit's default share: 1.0
    assert off["status"] == zero["status"] == half["status"] == full["status"] == "ok"
    assert zero["phases"] == off["phases"]
    for phase in ("text_encoder", "sample", "train", "last_sample"):
        assert full["phases"][phase] < half["phases"][phase] < off["phases"][phase], phase


def test_the_weights_of_offloaded_layers_stay_in_host_memory_in_every_phase():
    """The sim meter counts the device: after load, the parts hold exactly the offloaded weights less."""
    from fitfinder.probe import meters

    def placed(changes):
        request = probe.request_for(tiny_job("wan21", changes), 1, "sim", None)
        meter = meters.SimMeter(None)
        with meter.tracker:
            pipe = models.load_pipeline(request["model"], request, meter)
            live = meter.live_bytes
        return pipe, live

    _, resident = placed({"train.gradient_checkpointing": True})
    pipe, offloaded = placed(OFFLOAD)
    assert pipe.offloaded == {"transformer", "text_encoder"}
    host = sum(p.untyped_storage().nbytes() for name in pipe.offloaded for layer in pipe.parts[name].modules()
               if getattr(layer, "offloaded", False) for p in layer.parameters(recurse=False))
    assert host > 0 and resident - offloaded == host
    # norms and the LoRA stay: no offloaded layer sits under a norm, none is a LoRA layer
    for name in pipe.offloaded:
        for module_name, layer in pipe.parts[name].named_modules():
            if getattr(layer, "offloaded", False):
                assert "lora_" not in module_name and "norm" not in module_name


def test_families_whose_loader_never_offloads_ignore_the_keys_and_have_no_knob():
    """FLUX.1 loads through toolkit/stable_diffusion_model.py, which never reads layer_offloading."""
    from fitfinder import space as spaces

    flux = tiny_job("flux", OFFLOAD)
    assert probe.request_for(flux, 3, "sim", None)["layer_offloading"] == {"denoiser": 0.0, "text_encoder": 0.0}
    assert "layer_offloading" not in spaces.build(flux).by_name
    assert "layer_offloading" in spaces.build(tiny_job("wan21")).by_name


@pytest.mark.parametrize("family", ["qwen_image", "zimage"])
def test_an_encoder_offloaded_in_host_memory_never_brings_its_offloaded_layers_to_the_device(family, monkeypatch):
    """QwenImageModel.load_model, ZImageModel.load_model: MemoryManager.attach on the text encoder
    before `text_encoder.to(device)` and before `quantize`, so its managed layers are quantized on the
    CPU and only its embeddings and norms come: no moment of the load holds more than what stays on
    the device after it. Attached after (as the probe did), the bf16 encoder came first."""
    from dataclasses import replace

    changes = {"model.quantize": True, "model.quantize_te": True, **OFFLOAD}
    pipe, meter = _loaded(family, changes)
    assert pipe.offloaded == {"transformer", "text_encoder"}
    assert meter.phases["load"]["peak_reserved"] == meter.live_bytes
    family_now = models.FAMILIES[family]
    attached_after = {part: replace(where, offloaded_on_host="never") for part, where in family_now.placement.items()}
    monkeypatch.setitem(models.FAMILIES, family, replace(family_now, placement=attached_after))
    _, before = _loaded(family, changes)
    assert before.live_bytes == meter.live_bytes
    assert before.phases["load"]["peak_reserved"] > meter.phases["load"]["peak_reserved"]


@pytest.mark.slow
def test_an_encoder_offloaded_in_part_in_host_memory_estimates_to_the_sim_meters_bytes():
    """Half of Qwen2.5-VL's layers offloaded: those quantized in host memory, the rest on the device."""
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    changes = {"model.quantize": True, "model.quantize_te": True, **OFFLOAD,
               "model.layer_offloading_text_encoder_percent": 0.5}
    runner = probe.ProbeRunner(timeout_s=300)
    request = probe.request_for(tiny_job("qwen_image", changes), 3, "sim", None)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


def test_the_offloading_knob_writes_ai_toolkits_own_keys(tmp_path):
    from fitfinder.trainers import aitoolkit_job
    from fitfinder import space as spaces
    from fitfinder.results.report import export_best

    job = tiny_job("wan21")
    space = spaces.build(job)
    knob = space.by_name["layer_offloading"]
    assert knob.candidates == (1.0, 0.75, 0.5, 0.25, 0.0) and knob.desired == 0.0 and knob.role == "speed"
    assert spaces.SPEED_ORDER[-1] == "layer_offloading"
    written = export_best(job, space, {**space.desired(), "layer_offloading": 0.5}, tmp_path, [])
    best = aitoolkit_job.load(written)
    assert best.get("model.layer_offloading") is True
    assert best.get("model.layer_offloading_transformer_percent") == 0.5
    assert best.get("model.layer_offloading_text_encoder_percent") == 0.5
    assert layer_offloading(best, models.FAMILIES["wan21"]) == {"denoiser": 0.5, "text_encoder": 0.5}
    on = tiny_job("wan21", OFFLOAD)
    turned_off = spaces.build(on).apply(on, {**spaces.build(on).desired(), "layer_offloading": 0.0})
    assert turned_off.get("model.layer_offloading") is False
    assert probe.request_for(turned_off, 3, "sim", None)["layer_offloading"]["denoiser"] == 0.0


# -- output preservation (issue 34, item 3) ------------------------------------------------------
@pytest.mark.slow
def test_output_preservation_holds_a_second_prediction_until_the_backward_and_estimates_to_the_same_bytes():
    """SDTrainer.train_single_accumulation with blank_prompt_preservation (or diff_output_preservation):
    a prior prediction without gradients, the network off, then the step's prediction and the
    preservation prediction, both with gradients, through one backward."""
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    runner = probe.ProbeRunner(timeout_s=300)
    plain = runner.run(probe.request_for(tiny_job("flux"), 3, "sim", None))
    request = probe.request_for(tiny_job("flux", {"train.blank_prompt_preservation": True}), 3, "sim", None)
    kept, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert plain["status"] == kept["status"] == fake["status"] == "ok", (kept.get("error"), fake.get("error"))
    # the train phase holds the second graph; the encoders' phase the preservation prompt
    assert kept["phases"]["train"] > plain["phases"]["train"]
    assert kept["phases"]["text_encoder"] > plain["phases"]["text_encoder"]
    assert kept["phases"]["load"] == plain["phases"]["load"]
    measured = {phase: stats["peak_allocated"] for phase, stats in kept["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


def test_output_preservation_is_refused_as_ai_toolkit_refuses_it():
    from fitfinder.errors import UserError

    for changes, said in (({"train.diff_output_preservation": True}, "requires a trigger_word"),
                          ({"train.diff_output_preservation": True, "train.blank_prompt_preservation": True,
                            "trigger_word": "sks"}, "together")):
        with pytest.raises(UserError) as refused:
            probe.request_for(tiny_job("flux", changes), 1, "sim", None)
        assert said in str(refused.value) and "\n" not in str(refused.value)
    assert probe.request_for(tiny_job("flux", {"train.diff_output_preservation": True, "trigger_word": "sks"}),
                             1, "sim", None)["preservation"] is True


# -- the accuracy-recovery adapter (issue 34, item 4) ----------------------------------------------
def test_a_recovery_adapters_rank_and_layers_are_read_from_its_file_or_assumed(tmp_path):
    """quantize_model: the rank is the first lora_A weight's rows, the layers the keys' prefixes."""
    import torch
    from safetensors.torch import save_file

    from fitfinder.trainers.aitoolkit import RECOVERY_RANK_ASSUMED, recovery_adapter

    adapter = tmp_path / "ara.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)}, str(adapter))
    qwen = models.FAMILIES["qwen_image"]
    read = recovery_adapter(tiny_job("qwen_image", {"model.quantize": True, "model.qtype": f"uint3|{adapter}"}), qwen)
    assert read == {"rank": 4, "layers": ["transformer_blocks.0.attn.to_q"], "read": True, "path": str(adapter)}
    absent = {"model.quantize": True, "model.qtype": "uint3|me/repo/no.safetensors"}
    assumed = recovery_adapter(tiny_job("qwen_image", absent), qwen)
    assert assumed["rank"] == RECOVERY_RANK_ASSUMED and not assumed["read"]
    # FLUX.1's loader (stable_diffusion_model.py) quantizes without quantize_model: no adapter
    assert recovery_adapter(tiny_job("flux", {"model.quantize": True, "model.qtype": f"uint3|{adapter}"}),
                            models.FAMILIES["flux"]) is None


@pytest.mark.slow
def test_a_recovery_adapter_is_on_the_device_in_bf16_with_gradients_and_untrained(tmp_path):
    """quantize_model with an adapter: the LoRA on the device in the model's dtype, requiring gradients
    (they appear at the first backward and stay: no optimizer holds it), its layers quantized with the
    qtype and the others left in the model's dtype (uint8, which UIntXQuantizer refuses)."""
    import torch

    from optimum.quanto.nn import QLinear

    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    # 8-bit: the tiny arch's layers are no whole number of uint3's groups of 64
    changes = {"model.quantize": True, "model.qtype": "qfloat8|me/repo/absent.safetensors", "train.dtype": "bf16"}
    pipe, meter = _loaded("qwen_image", changes)
    recovery = pipe.recovery_parameters(["transformer"])
    trained = pipe.trainable_parameters(["transformer"])
    assert recovery and {p.dtype for p in recovery} == {torch.bfloat16} and all(p.requires_grad for p in recovery)
    assert {p.dtype for p in trained} == {torch.float32} and not {id(p) for p in recovery} & {id(p) for p in trained}
    assert all(p.untyped_storage()._cdata in meter.tracker.live for p in recovery)
    layers = dict(pipe.parts["transformer"].named_modules())
    assert isinstance(layers["transformer_blocks.0.attn.to_q.base_layer"], QLinear)
    assert type(layers["proj_out"]) is torch.nn.Linear  # outside the adapter: never quantized
    # the probe and the estimate in fp32 (in bf16 quanto's qfloat8 leaves the tiny Qwen-Image 32 bytes
    # apart in five phases, adapter or not, as it did before the adapter)
    changes = {**changes, "train.dtype": "fp32"}
    runner = probe.ProbeRunner(timeout_s=300)
    request = probe.request_for(tiny_job("qwen_image", changes), 3, "sim", None)
    plain = runner.run(probe.request_for(tiny_job("qwen_image", {**changes, "model.qtype": "qfloat8"}), 3, "sim", None))
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert plain["status"] == sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    assert all(sim["phases"][phase] > plain["phases"][phase] for phase in plain["phases"])
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


# -- layers AI Toolkit keeps unquantized (issue 34, item 5) ---------------------------------------
@pytest.mark.parametrize(("family", "kept", "quantized"), [
    ("wan22_5b", ["condition_embedder.text_embedder.linear_1", "proj_out"], "blocks.0.attn1.to_q"),
    ("zimage", ["t_embedder.mlp.0", "cap_embedder.1", "all_x_embedder.2-1", "all_final_layer.2-1.linear"],
     "layers.0.attention.to_q"),
])
def test_the_layers_a_loader_keeps_in_full_precision_stay_unquantized(family, kept, quantized):
    """get_quantization_exclude_modules (Wan225bModel, Wan2214bModel; toolkit/models/v2/z_image.py),
    passed by quantize_model and OstrisModelMixin.quantize_ to `quantize` as its exclude patterns."""
    import torch

    pipe, _ = _loaded(family, {"model.quantize": True})
    layers = dict(pipe.parts["transformer"].named_modules())
    assert type(layers[f"{quantized}.base_layer"]).__name__ == "QLinear"
    for name in kept:
        assert type(layers.get(f"{name}.base_layer", layers[name])) is torch.nn.Linear, name


# -- torchao's float8 and int8 (issue 34, item 6) -------------------------------------------------
def test_torchao_8_bit_layers_keep_their_weight_in_the_models_dtype_for_the_backward():
    """torchao 0.10 (AI Toolkit's pin): float8 runs F.linear(x, w.dequantize()), int8 mm(x, w.t().to(x.dtype)):
    autograd keeps that weight; quanto's linear function keeps the 8-bit one, which is resident anyway."""
    import torch

    from fitfinder.models._weights import quantize
    from fitfinder.probe.meters import StorageTracker

    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    held = {}
    for qtype in ("qfloat8", "float8", "qint8", "int8"):
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(256, 1024, dtype=torch.bfloat16)).requires_grad_(False)
        quantize(layer, qtype)
        tracker = StorageTracker()
        with tracker:
            y = layer(x)
            held[qtype] = tracker.live_bytes - y.untyped_storage().nbytes()
    weight = 256 * 1024 * 2
    assert held["float8"] - held["qfloat8"] == weight
    assert held["int8"] - held["qint8"] >= weight


def test_qfloat8_is_torchaos_float8_under_layer_offloading_and_with_z_images_training_adapter():
    """toolkit/config_modules.py ModelConfig (layer_offloading, any family, both qtypes, a qtype of
    exactly 'qfloat8'); z_image.py load_model (assistant_lora_path, model.qtype only)."""
    from fitfinder.trainers.aitoolkit import quant_types

    flux, zimage = models.FAMILIES["flux"], models.FAMILIES["zimage"]
    assert quant_types(tiny_job("flux"), flux) == ("qfloat8", "qfloat8")
    assert quant_types(tiny_job("flux", {"model.layer_offloading": True}), flux) == ("float8", "float8")
    assert quant_types(tiny_job("flux", {"model.layer_offloading": True, "model.qtype": "qfloat8|a/b/c"}),
                       flux) == ("qfloat8", "qfloat8")
    assert quant_types(tiny_job("zimage", {"model.assistant_lora_path": "a/b/c.safetensors"}), zimage) == (
        "float8", "qfloat8")
    assert quant_types(tiny_job("zimage", {"model.layer_offloading": True}), zimage) == ("float8", "float8")


@pytest.mark.slow
def test_a_torchao_float8_job_estimates_to_the_sim_meters_bytes():
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    changes = {"model.quantize": True, "model.qtype": "float8", "train.dtype": "bf16"}
    runner = probe.ProbeRunner(timeout_s=300)
    request = probe.request_for(tiny_job("flux", changes), 3, "sim", None)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


# -- the smaller divergences (issue 34, item 7) ------------------------------------------------------
def test_qwen_image_captions_are_encoded_up_to_1024_tokens():
    """QwenImageModel.get_prompt_embeds: encode_prompt's max_sequence_length (1024) and the tokenizer's
    tokenizer_max_length (1024) past the template; the probe encodes the longest caption a job can have."""
    assert trainers.architecture_spec(tiny_job("qwen_image", name="Qwen/Qwen-Image"))["arch"]["text_seq_len"] == 1024


def test_flux_brings_t5_to_the_device_before_clip_and_the_vae_last():
    """stable_diffusion_model.py load_model (is_flux): T5 is loaded and quantized on the device, then CLIP;
    the VAE reaches the device at the end of load_model, and BaseSDTrainProcess.run sends it back."""
    import torch

    from fitfinder.probe import meters

    request = probe.request_for(tiny_job("flux", {"model.quantize": True}), 1, "sim", None)
    meter, arrived = meters.SimMeter(None), []
    to_device = meter.to_device

    def recorded(obj):
        if isinstance(obj, torch.nn.Module) and type(obj).__name__ not in arrived:
            arrived.append(type(obj).__name__)
        return to_device(obj)

    meter.to_device = recorded
    with meter:
        pipe = models.load_pipeline(request["model"], request, meter)
    assert arrived[:4] == ["FluxTransformer2DModel", "T5EncoderModel", "CLIPTextModel", "AutoencoderKL"]
    assert "vae" not in pipe.on_device


def test_a_datasets_own_batch_size_is_the_batch_and_the_batch_knob_writes_it():
    """toolkit/data_loader.py get_dataloader_from_datasets (b96476a8): a dataset's batch_size overrides
    train.batch_size; fitfinder probes one batch size and refuses datasets that differ, in one line."""
    from fitfinder.trainers import aitoolkit_job
    from fitfinder import space as spaces
    from fitfinder.errors import ConfigError

    job = tiny_job("flux", {"datasets[0].batch_size": 2})
    assert probe.request_for(job, 1, "sim", None)["batch_size"] == 2
    space = spaces.build(job)
    lighter = space.apply(job, {**space.desired(), "batch": 1})
    assert lighter.get("datasets[0].batch_size") == 1 and lighter.accumulation == 2
    mixed = tiny_job("flux", {"datasets[0].batch_size": 2}, more_datasets=[
        {"folder_path": "/data/more", "resolution": [256], "batch_size": 4}])
    with pytest.raises(ConfigError) as refused:
        aitoolkit_job.loads(mixed.dumps(), "<mixed batches>")
    assert "datasets[*].batch_size: these datasets batch by 2, 4" in str(refused.value)


@pytest.mark.slow
def test_a_first_sample_section_adds_its_own_preview_before_training(run_tiny):
    """BaseSDTrainProcess: `first_sample:` is a SampleConfig of its own (its defaults, not sample's),
    rendered before training even with skip_first_sample."""
    first = {"width": 320, "height": 320, "sample_steps": 20}
    request = probe.request_for(tiny_job("flux", {"first_sample": first, "train.skip_first_sample": True}),
                                1, "sim", None)
    assert request["first_sample"]["width"] == 320 and request["first_sample"]["guidance_scale"] == 7
    plain, with_first = run_tiny("flux"), run_tiny("flux", {"first_sample": first})
    skipped = run_tiny("flux", {"first_sample": first, "train.skip_first_sample": True})
    assert plain["status"] == with_first["status"] == skipped["status"] == "ok"
    assert with_first["phases"]["sample"] > plain["phases"]["sample"]
    assert skipped["phases"]["sample"] == with_first["phases"]["sample"]


# -- item 2: quanto's qint4 in quanto's own layout, on fake tensors too -----------------------------
def _qint4_block_peaks(meter):
    """Each phase's peak for three qint4 layers (bf16, whole groups of 128: TinyGemm's layout) quantized,
    then a forward and a backward to the input through them (quanto's backward rebuilds each weight),
    on `meter`; and the layers' weight type."""
    import torch

    from fitfinder.models._weights import quantize

    with meter:
        with meter.phase("load"):
            torch.manual_seed(0)
            block = torch.nn.Sequential(torch.nn.Linear(512, 1024, dtype=torch.bfloat16), torch.nn.GELU(),
                                        torch.nn.Linear(1024, 512, dtype=torch.bfloat16), torch.nn.GELU(),
                                        torch.nn.Linear(512, 1024, dtype=torch.bfloat16)).requires_grad_(False)
            # the third layer repeats the first's shape: the estimate copies its layout (_weights._like)
            assert quantize(block, "qint4", meter.repeated) == 3
            assert type(block[4].weight) is type(block[0].weight)
            weight_type = type(block[0].weight).__name__
        with meter.phase("train"):
            x = torch.randn(2, 64, 512, dtype=torch.bfloat16, requires_grad=True)
            block(x).float().square().mean().backward()
            del x
    peaks = {name: stats.get("peak_live", stats["peak_allocated"]) for name, stats in meter.phases.items()}
    return peaks, weight_type


def test_qint4_runs_as_quanto_lays_it_out_and_the_estimate_counts_its_bytes():
    """quanto picks TinyGemm's layout for these layers (half a byte a weight, a bf16 scale and midpoint
    per 128); the estimate, on fake tensors, holds the sim meter's bytes in every phase."""
    import torch

    from fitfinder.models._weights import quantize
    from fitfinder.probe import meters
    from fitfinder.probe.overhead import GpuOverhead

    # Once outside the meters, as in a probe's preloaded server: a process's first quantization makes
    # quanto's cached constants (320 bytes the sim meter counts, fake mode does not), and under pytest
    # its first-use imports left frames holding the bf16 weights alive (+2 MiB; not so in a script).
    quantize(torch.nn.Sequential(torch.nn.Linear(256, 128, dtype=torch.bfloat16)), "qint4")
    sim, sim_type = _qint4_block_peaks(meters.SimMeter(None))
    estimated, estimated_type = _qint4_block_peaks(meters.EstimateMeter(None, GpuOverhead.none().as_dict()))
    assert sim_type == estimated_type == "TinyGemmWeightQBitsTensor"
    assert estimated == sim


def test_a_qint4_weight_holds_half_a_byte_and_a_scale_and_midpoint_per_128():
    import torch

    from fitfinder.models._weights import quantize
    from fitfinder.probe.meters import inner_tensors, tensors_of

    layer = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=False, dtype=torch.bfloat16))
    quantize(layer, "qint4")
    weights = 256 * 512
    held = sum(t.untyped_storage().nbytes() for tensor in tensors_of(layer[0].weight) for t in inner_tensors(tensor))
    assert held == weights // 2 + weights // 128 * 2 * 2


def test_a_qint4_job_probes_and_estimates_to_the_same_bytes():
    """A whole tiny Flux job with base and T5 in qint4 (peft's LoRA on quanto's layers): the estimate
    equals the sim meter in every phase."""
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    runner = probe.ProbeRunner(timeout_s=300)
    request = probe.request_for(tiny_job("flux", {"model.quantize": True, "model.qtype": "qint4"}), 3, "sim", None)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    assert sim["status"] == fake["status"] == "ok", (sim.get("error"), fake.get("error"))
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured


# -- item 5: low_vram and each part's placement, as each family's loader does it ---------------------
LOAD_ONLY = ["flux", "sd3", "wan21", "wan22_5b", "hidream", "flux2", "flux2_klein"]


@pytest.mark.slow
@pytest.mark.parametrize("family", LOAD_ONLY)
def test_low_vram_lowers_the_load_and_the_previews_it_claims_and_every_part_is_on_the_device_after(family, run_tiny):
    """FLUX.1 and SD3 (load_model: the transformer quantized in host memory, then moved; T5 in bf16
    and quantized on the device beside it), Wan 2.1 and 2.2 5B (the transformer parked on the CPU
    while UMT5 is quantized), HiDream (Llama and the transformer parked until T5 is quantized),
    FLUX.2 and Klein (the transformer waits, the encoder goes back to the CPU until it encodes):
    low_vram never raises the load peak (tiny encoders can leave it where it was); every later phase
    holds what it holds without low_vram, but the previews of Wan 2.1 and 2.2 5B, whose preview
    pipelines move UMT5 and the VAE off under low_vram (Family.low_vram_moves claims them): lower or
    the same."""
    eight_bit = {"model.quantize": True, "model.quantize_te": True, "train.ema_config": {"use_ema": True}}
    plain, low = run_tiny(family, eight_bit), run_tiny(family, {**eight_bit, "model.low_vram": True})
    assert plain["status"] == low["status"] == "ok", (plain["error"], low["error"])
    assert low["phases"]["load"] <= plain["phases"]["load"]
    assert list(low["phases"]) == list(plain["phases"])
    claimed = models.FAMILIES[family].low_vram_moves
    for phase in list(plain["phases"])[1:]:
        # but 16 KiB that quanto allocates once per process at its first quantization: counted when
        # that one runs on the device, not when it runs in host memory (measured: the same 16 KiB
        # in every family, and none once a process has quantized before)
        lowered = plain["phases"][phase] - low["phases"][phase]
        assert 0 <= lowered and (phase in claimed or lowered <= 16 * 1024), phase


def _loaded(family: str, changes: dict):
    """A tiny job's pipeline loaded on the sim meter, and the meter (its load phase's peak read back)."""
    from fitfinder.probe import meters

    request = probe.request_for(tiny_job(family, changes), 1, "sim", None)
    meter = meters.SimMeter(None)
    with meter, meter.phase("load"):
        pipe = models.load_pipeline(request["model"], request, meter)
    return pipe, meter


def _bf16_bytes(module) -> int:
    return sum(2 * param.numel() for param in module.parameters())


def _frozen_bytes(module) -> int:
    """The bytes of a part's own weights (a quantized one's inner tensors), its LoRA left out."""
    from fitfinder.probe.meters import inner_tensors

    held = [*(p for p in module.parameters() if not p.requires_grad), *module.buffers()]
    return sum(inner.untyped_storage().nbytes() for tensor in held for inner in inner_tensors(tensor))


def test_flux_with_low_vram_holds_the_quantized_transformer_and_bf16_t5_together_at_load():
    """stable_diffusion_model.py load_model (is_flux): the 8-bit transformer is on the device when
    T5 arrives in bf16 to be quantized there; after load every part is on the device but the VAE,
    which BaseSDTrainProcess.run sends to the CPU (`vae.to('cpu')`)."""
    plain, plain_meter = _loaded("flux", {"model.quantize": True})
    pipe, meter = _loaded("flux", {"model.quantize": True, "model.low_vram": True})
    assert pipe.on_device == plain.on_device == set(pipe.family.parts) - {"vae"}
    # at T5's quantization the 8-bit transformer (its LoRA comes later), CLIP and T5 in bf16 are on the
    # device together
    together = _frozen_bytes(pipe.parts["transformer"]) + _frozen_bytes(pipe.parts["text_encoder"]) + \
        _bf16_bytes(pipe.parts["text_encoder_2"])
    assert meter.phases["load"]["peak_reserved"] >= together
    # without low_vram the bf16 transformer itself was on the device: a higher load
    assert plain_meter.phases["load"]["peak_reserved"] > meter.phases["load"]["peak_reserved"]


@pytest.mark.parametrize("family", ["zimage", "qwen_image", "ltx2"])
def test_a_transformer_quantized_in_host_memory_waits_there_while_the_encoder_is_quantized(family, monkeypatch):
    """Z-Image, Qwen-Image and LTX-2 (load_model; quantize_model): the transformer reaches the device
    after the text encoder was quantized (on the device; LTX-2's Gemma 3 in host memory), low_vram or
    not, so the bf16 encoder never meets it: a lower load peak than AI Toolkit's shared placement
    (each part stays once loaded) gives."""
    from dataclasses import replace

    eight_bit = {"model.quantize": True, "model.quantize_te": True}
    peaks = {}
    for low_vram in (False, True):
        pipe, meter = _loaded(family, {**eight_bit, "model.low_vram": low_vram})
        assert pipe.on_device == set(pipe.family.parts) - {"vae"}  # BaseSDTrainProcess.run: vae.to('cpu')
        peaks[low_vram] = meter.phases["load"]["peak_reserved"]
    assert peaks[False] == peaks[True]
    monkeypatch.setitem(models.FAMILIES, family, replace(models.FAMILIES[family], placement={
        part: where for part, where in models.FAMILIES[family].placement.items() if part != "transformer"}))
    _, shared = _loaded(family, eight_bit)
    assert peaks[False] < shared.phases["load"]["peak_reserved"]


def test_ltx2_quantizes_gemma_3_in_host_memory(monkeypatch):
    """LTX2Model.load_model: `quantize(text_encoder, ...)` right after from_pretrained, on the CPU, then
    `text_encoder.to(device)`: the bf16 Gemma 3 never reaches the device (the transformer, quantized
    by quantize_model, waits in host memory meanwhile)."""
    from fitfinder.models import _pipeline
    from fitfinder.probe import meters

    meter, where, real = meters.SimMeter(None), {}, _pipeline.quantize

    def recorded(module, qtype, repeated=None, *args, **kwargs):
        where[type(module).__name__] = "host" if meter.tracker.paused else "device"  # inside meter.host()
        return real(module, qtype, repeated, *args, **kwargs)

    monkeypatch.setattr(_pipeline, "quantize", recorded)
    request = probe.request_for(tiny_job("ltx2", {"model.quantize": True, "model.quantize_te": True}), 1, "sim", None)
    with meter:
        models.load_pipeline(request["model"], request, meter)
    assert where == {"LTX2VideoTransformer3DModel": "host", "Gemma3ForConditionalGeneration": "host"}


def test_wan22_with_low_vram_holds_one_expert_and_only_while_it_predicts():
    """Wan2214bModel: the experts stay on the CPU after load (DualWanTransformer3DModel.to does
    nothing) and its forward swaps them: one on the device, in previews and training alone."""
    wan22 = models.FAMILIES["wan22"]
    low = {"low_vram": True, "text_encoder": "keep", "cache_latents": False,
           "trained": ["transformer", "transformer_2"]}
    assert probe.resident("text_encoder", low, wan22) == {"text_encoder", "vae"}
    assert probe.resident("latents", low, wan22) == {"text_encoder", "vae"}
    assert probe.resident("train", low, wan22, active="transformer_2") == {"transformer_2", "text_encoder", "vae"}
    assert probe.resident("train", {**low, "low_vram": False}, wan22) == {*wan22.denoisers, "text_encoder", "vae"}
    pipe, _ = _loaded("wan22", {"model.low_vram": True})
    assert pipe.on_device == {"text_encoder"}  # and the VAE to the CPU (BaseSDTrainProcess.run)


def _on_the_device(meter, tensors) -> bool:
    """Whether the sim meter counts every one of these tensors (each storage is live on its device)."""
    return all(tensor.untyped_storage()._cdata in meter.tracker.live for tensor in tensors)


def test_the_lora_stays_on_the_device_wherever_its_model_goes():
    """BaseSDTrainProcess.run: `network.force_to(device, torch.float32)` once; AI Toolkit's LoRA is a
    network of its own, so what moves a model later leaves it on the device: Wan 2.2's experts left in
    host memory under low_vram (DualWanTransformer3DModel), and the latent-caching pass, which holds the
    VAE alone ('cache_latents' preset)."""
    import torch

    pipe, meter = _loaded("wan22", {"model.low_vram": True})
    assert pipe.on_device == {"text_encoder"}
    lora = {name: pipe.trainable_parameters([name]) for name in pipe.family.denoisers}
    frozen = {name: [p for p in pipe.parts[name].parameters() if not p.requires_grad] for name in lora}
    assert all(lora.values()) and {p.dtype for params in lora.values() for p in params} == {torch.float32}
    assert _on_the_device(meter, lora["transformer"] + lora["transformer_2"])
    assert not any(_on_the_device(meter, [p]) for params in frozen.values() for p in params)
    request = probe.request_for(tiny_job("wan22", {"model.low_vram": True}), 1, "sim", None)
    with meter:
        pipe.place(probe.resident("train", request, pipe.family, active="transformer"))
        assert _on_the_device(meter, frozen["transformer"] + lora["transformer_2"])
        assert not any(_on_the_device(meter, [p]) for p in frozen["transformer_2"])
        pipe.place(probe.resident("latents", request, pipe.family))  # the caching pass (cache_latents_to_disk)
        assert pipe.on_device == {"vae"} and _on_the_device(meter, lora["transformer"] + lora["transformer_2"])


def test_wan21_i2v_with_low_vram_sends_umt5_and_the_image_encoder_back_until_used():
    """Wan21I2V.load_model: UMT5 and the CLIP vision tower go to the CPU once loaded under low_vram;
    get_noise_prediction brings the tower at the first step. Without low_vram no preset moves it."""
    i2v = models.FAMILIES["wan21_i2v"]
    pipe, _ = _loaded("wan21_i2v", {"model.low_vram": True})
    assert pipe.on_device == {"transformer"}  # the VAE too goes to the CPU (BaseSDTrainProcess.run)
    request = {"low_vram": True, "text_encoder": "keep", "cache_latents": True, "trained": ["transformer"]}
    assert "image_encoder" not in probe.resident("sample", request, i2v)
    assert "image_encoder" in probe.resident("train", request, i2v)
    plain = {**request, "low_vram": False, "text_encoder": "cache"}
    assert all("image_encoder" in probe.resident(phase, plain, i2v)
               for phase in ("text_encoder", "latents", "sample", "train", "last_sample"))


def test_families_whose_loader_never_reads_low_vram_have_no_low_vram_knob():
    """SD 1.5, SDXL, Lumina 2, Chroma, Kontext, Flex.2 (never read it) and Z-Image (the same placement either
    way): low_vram moves no peak, so the search has no such knob for them. Qwen-Image places its parts
    the same either way too, but its previews tile the decode under low_vram (generate_single_image)."""
    from fitfinder import space as spaces

    for family in ("sd15", "sdxl", "lumina2", "chroma", "flux_kontext", "flex2", "zimage"):
        assert models.FAMILIES[family].low_vram_moves == frozenset(), family
        assert "low_vram" not in spaces.build(tiny_job(family)).by_name, family
    assert spaces.build(tiny_job("flux")).by_name["low_vram"].phases == {"load"}
    assert spaces.build(tiny_job("qwen_image")).by_name["low_vram"].phases == {"sample", "last_sample"}


def _preview_holdings(changes: dict) -> dict:
    """A tiny Wan 2.1 preview on the sim meter, read at each denoiser call and each VAE decoder call:
    the live bytes, the parts on the device, and whether the VAE decodes in tiles."""
    from fitfinder.probe import recipe

    pipe, meter = _loaded("wan21", changes)
    request = probe.request_for(tiny_job("wan21", changes), 1, "sim", None)
    seen = {"denoise": [], "decode": []}

    def reader(step, vae=None):
        return lambda module, args: seen[step].append(
            (meter.live_bytes, frozenset(pipe.on_device), vae.use_tiling if vae else None))

    pipe.parts["transformer"].register_forward_pre_hook(reader("denoise"))
    pipe.parts["vae"].decoder.register_forward_pre_hook(reader("decode", pipe.parts["vae"]))
    with meter:
        prompts = recipe._encode_text(pipe, request)
        with meter.phase("sample"):
            recipe._denoise_and_decode(pipe, request, prompts, request["sample"])
    seen["umt5"], seen["vae"] = _frozen_bytes(pipe.parts["text_encoder"]), _frozen_bytes(pipe.parts["vae"])
    seen["tiled"] = request["tiled_preview_decode"]
    return seen


@pytest.mark.slow
def test_wan21_previews_under_low_vram_hold_neither_umt5_nor_the_vae_while_denoising():
    """toolkit/models/wan21/wan21.py: under low_vram get_generation_pipeline builds
    AggressiveWanUnloadPipeline, whose __call__ sends the VAE and then UMT5 to the CPU before the
    denoising loop and brings the VAE back for the decode (the transformer stays); generate_single_image
    tiles that decode (use_vae_tiling). Without low_vram WanPipeline moves nothing and never tiles."""
    plain, low = _preview_holdings({}), _preview_holdings({"model.low_vram": True})
    assert {held for _, held, _ in low["denoise"]} == {frozenset({"transformer"})}
    assert {held for _, held, _ in low["decode"]} == {frozenset({"transformer", "vae"})}
    assert {held for _, held, _ in plain["denoise"] + plain["decode"]} == {frozenset({"transformer", "text_encoder",
                                                                                      "vae"})}
    # the same tensors but those parts' weights, call for call
    assert len(low["denoise"]) == len(plain["denoise"]) > 0 and len(low["decode"]) == len(plain["decode"]) > 0
    for (low_bytes, _, _), (plain_bytes, _, _) in zip(low["denoise"], plain["denoise"]):
        assert plain_bytes - low_bytes == low["umt5"] + low["vae"] > 0
    for (low_bytes, _, tiled), (plain_bytes, _, plain_tiled) in zip(low["decode"], plain["decode"]):
        assert plain_bytes - low_bytes == low["umt5"]
        assert (tiled, plain_tiled) == (True, False)
    assert (low["tiled"], plain["tiled"]) == (True, False)


@pytest.mark.slow
def test_a_tiled_preview_decode_estimates_to_the_sim_meters_bytes():
    """Wan 2.1 with low_vram and previews of 320 px, past diffusers' 256 px tiles (40 latents > 32):
    generate_single_image's tiled decode lowers the preview phases' peaks, and the estimate (fake
    tensors through diffusers' tiled_decode) counts what the sim meter counts, phase by phase."""
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    request = probe.request_for(tiny_job("wan21", {"model.low_vram": True, "sample.width": 320,
                                                   "sample.height": 320}), 2, "sim", None)
    assert request["tiled_preview_decode"]
    runner = probe.ProbeRunner(timeout_s=300)
    sim, fake = runner.run(request), runner.run(estimate.as_estimate(request, GpuOverhead.none()))
    untiled = runner.run({**request, "tiled_preview_decode": False})
    assert sim["status"] == fake["status"] == untiled["status"] == "ok", (sim["error"], fake["error"])
    measured = {phase: stats["peak_allocated"] for phase, stats in sim["phase_stats"].items()}
    assert {phase: stats["peak_live"] for phase, stats in fake["phase_stats"].items()} == measured
    for phase in ("sample", "last_sample"):  # the decode's activations a tile at a time (measured: -12%)
        assert measured[phase] < untiled["phase_stats"][phase]["peak_allocated"], phase
