"""The one OOM classifier: exceptions and log text -> OOM or not, config or environment, and where."""

import time

import pytest
import torch

from fitfinder import oom

GiB, MiB = 2**30, 2**20

# PyTorch >= 2.2, with another process on the card.
NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
       "23.64 GiB of which 0 bytes is free. Process 2231 has 20.87 GiB memory in use. Including non-PyTorch memory, "
       "this process has 2.74 GiB memory in use. Of the allocated memory 2.50 GiB is allocated by PyTorch, and "
       "100.00 MiB is reserved by PyTorch but unallocated.")
# PyTorch 2.1 printed "capacty".
TYPO = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.15 GiB. GPU 0 has a total capacty of "
        "23.69 GiB of which 912.00 MiB is free. Including non-PyTorch memory, this process has 22.79 GiB memory in "
        "use. Of the allocated memory 21.50 GiB is allocated by PyTorch, and 1000.00 MiB is reserved by PyTorch but "
        "unallocated.")
# PyTorch before 2.1.
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 146.00 MiB (GPU 0; 8.00 GiB total capacity; 7.25 GiB "
       "already allocated; 0 bytes free; 7.50 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
       "memory try setting max_split_size_mb to avoid fragmentation.")


@pytest.mark.parametrize("text, numbers", [
    (NEW, dict(tried_bytes=20 * MiB, total_bytes=int(23.64 * GiB), free_bytes=0, process_bytes=int(2.74 * GiB),
               reserved_bytes=int(2.5 * GiB) + 100 * MiB, unallocated_bytes=100 * MiB,
               other_process_bytes=int(20.87 * GiB))),
    (TYPO, dict(tried_bytes=int(1.15 * GiB), total_bytes=int(23.69 * GiB), free_bytes=912 * MiB,
                process_bytes=int(22.79 * GiB), reserved_bytes=int(21.5 * GiB) + 1000 * MiB,
                unallocated_bytes=1000 * MiB, other_process_bytes=None)),
    (OLD, dict(tried_bytes=146 * MiB, total_bytes=8 * GiB, free_bytes=0, process_bytes=None,
               reserved_bytes=int(7.5 * GiB), unallocated_bytes=int(7.5 * GiB) - int(7.25 * GiB),
               other_process_bytes=None)),
], ids=["pytorch>=2.2", "pytorch-2.1-capacty", "pytorch<2.1"])
def test_the_numbers_of_every_message_format(text, numbers):
    verdict = oom.classify(text)
    assert verdict.is_oom and verdict.marker == "CUDA out of memory"
    assert {key: getattr(verdict, key) for key in numbers} == numbers


def test_memory_held_outside_this_process_is_the_environment_whatever_the_config():
    verdict = oom.classify(NEW, conservative=False)
    assert verdict.kind == "environment"
    assert verdict.outside_bytes == int(23.64 * GiB) - int(2.74 * GiB)
    assert "held outside this process" in verdict.reason


def test_a_full_card_held_by_this_process_is_the_config():
    verdict = oom.classify(TYPO, conservative=True)
    assert verdict.kind == "config" and verdict.reason is None


@pytest.mark.parametrize("text", [OLD, "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                       "`cublasCreate(handle)`"], ids=["0 bytes free", "cublas"])
def test_nothing_free_is_the_environment_only_at_a_conservative_config(text):
    assert oom.classify(text, conservative=False).kind == "config"
    verdict = oom.classify(text, conservative=True)
    assert verdict.kind == "environment" and "conservative configuration" in verdict.reason


def test_a_card_occupied_at_start_is_the_environment():
    verdict = oom.classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
                           occupied_at_start=True)
    assert (verdict.is_oom, verdict.kind, verdict.reason) == (
        True, "environment", "the card was already occupied when the job started")


@pytest.mark.parametrize("marker", [m for m, _ in oom.OOM_MARKERS])
def test_every_known_string_is_an_oom(marker):
    verdict = oom.classify(f"something failed: {marker} (details)")
    assert (verdict.is_oom, verdict.marker) == (True, marker)


def test_an_exception_is_classified_with_its_phase_from_the_traceback():
    import torch

    def sample():  # the name AI Toolkit's sampling method has
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity "
                                     "of 24.00 GiB of which 1.00 GiB is free.")

    try:
        sample()
    except torch.OutOfMemoryError as exc:
        verdict = oom.classify(exc, conservative=True)
    assert (verdict.is_oom, verdict.kind, verdict.phase) == (True, "config", "sample")
    assert (verdict.tried_bytes, verdict.free_bytes, verdict.total_bytes) == (4 * GiB, GiB, 24 * GiB)


def test_an_oom_type_without_a_known_message_is_still_an_oom():
    class OutOfMemoryError(RuntimeError):  # the sim meter raises torch's type with its own message
        pass

    verdict = oom.classify(OutOfMemoryError("budget exceeded: 6.1 MiB live > 5.8 MiB"))
    assert (verdict.is_oom, verdict.kind, verdict.marker) == (True, "config", "OutOfMemoryError")


def test_anything_else_is_not_an_oom():
    verdict = oom.classify(ValueError("mat1 and mat2 shapes cannot be multiplied (2x4096 and 3072x3072)"))
    assert (verdict.is_oom, verdict.kind, verdict.message) == (
        False, "not_oom", "ValueError: mat1 and mat2 shapes cannot be multiplied (2x4096 and 3072x3072)")


@pytest.mark.parametrize("frames, phase", [
    (["main", "log_validation", "from_pretrained", "to"], "sample"),  # a validation that loads a pipeline
    (["run", "hook_train_loop", "train_single_accumulation", "encode_prompt", "forward"], "text_encoder"),
    (["train", "backward", "_engine_run_backward"], "train"),
    (["run", "load_model", "quantize_model", "to"], "load"),
    (["main", "forward", "linear"], None),
    (["train", "cache_text_encoder_outputs_if_needed", "to", "_apply"], "text_encoder"),  # whose weights moved
    (["<module>", "cuda", "_apply", "<lambda>"], "load"),  # model.cuda() in a plain script
    (["start", "setup_train_device", "transformer_to", "to", "_apply", "convert"], "load"),  # OneTrainer
    (["main", "enable_block_swap", "prepare_block_swap_training", "weights_to_device"], "load"),  # diffusion-pipe
    (["main", "train", "train_step", "get_loss_dict", "forward"], "train"),
    (["main", "new_cache_latents", "submit_batch", "cache_batch_latents", "encode"], "latents"),
])
def test_the_phase_a_traceback_names(frames, phase):
    assert oom.phase_of_frames(frames) == phase


@pytest.mark.parametrize("frames, files, phase", [
    # A forward under a training script's function is a training step; at module level it says nothing.
    (["<module>", "main", "__call__", "forward"], ["train.py", "train.py", "module.py", "model.py"], "train"),
    (["<module>", "_cuda", "handler"], ["train.py", "_utils.py", "dataloader.py"], None),
    # A process that only caches: its script names the phase, whatever it was loading.
    (["<module>", "main", "load_ideogram4_text_encoder", "_prepare_qwen3_vl_fp8_state_dict"],
     [r"E:\musubi-tuner\ideogram4_cache_text_encoder_outputs.py", "x.py", "utils.py", "utils.py"], "text_encoder"),
    (["<module>", "main", "encode_datasets", "encode"], ["cache_latents.py", "cache_latents.py", "x.py", "vae.py"],
     "latents"),
])
def test_the_phase_from_the_files_of_the_frames(frames, files, phase):
    assert oom.phase_of_frames(frames, files) == phase


def test_frames_are_read_from_every_traceback_format():
    text = "\n".join([
        '  File "/x/train.py", line 9, in main',
        '[rank0]:   File "/x/engine.py", line 389, in train_batch',
        '[2024-09-18 08:19:51] [INFO] File "C:\\x\\runpy.py", line 86, in _run_code',
        "│ C:\\kohya_ss\\train_network.py:252 in train                      │",
    ])
    assert oom.frames_of_text(text) == (["main", "train_batch", "_run_code", "train"],
                                        ["/x/train.py", "/x/engine.py", "C:\\x\\runpy.py",
                                         "C:\\kohya_ss\\train_network.py"])


# -- the machine's RAM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "[Tue Apr 14 16:07:00 2026] Out of memory: Killed process 1067104 (python)",
    "Memory cgroup out of memory: oom-kill:constraint=CONSTRAINT_MEMCG",
    "loaded partially: 20160.00 MB loaded, lowvram patches: 0\nKilled",
    "MemoryError\nCould not save model. Check your disk space!",
    "RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.",
    "failed (exitcode: -9) local_rank: 0 (pid: 7522) of binary: /venv/bin/python3.12",
    "subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGKILL: 9>.",
])
def test_system_ram_running_out_is_a_host_oom(text):
    verdict = oom.classify(text)
    assert (verdict.is_oom, verdict.kind) == (True, "host")


@pytest.mark.parametrize("text", [
    "RuntimeError: DataLoader worker (pid 25902) is killed by signal: Segmentation fault.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",  # the card, not the host
    "Killed 3 zombie processes",
])
def test_what_is_not_the_host_running_out(text):
    assert oom.classify(text).kind != "host"


def test_a_probes_own_memory_error_is_the_host_running_out():
    # The host is a budget of its own (issue 32): the sim meter raises MemoryError past --ram, and the
    # search prunes a host failure by the knobs' host order, never the card's settings.
    verdict = oom.classify(MemoryError("host out of memory (simulated): tried to allocate 4.00 GiB"))
    assert verdict.is_oom and verdict.kind == "host"
    assert oom.classify(RuntimeError("Unable to allocate 4.00 GiB")).kind == "not_oom"


# -- a long line costs its length ------------------------------------------------------------------------
DIGITS = "9" * 20_000


@pytest.mark.parametrize("line", [
    (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {DIGITS} GiB (GPU 0; {DIGITS} GiB total "
     f"capacity; {DIGITS} GiB already allocated; {DIGITS} MiB free; {DIGITS} GiB reserved in total by PyTorch)"),
    f"steps:  {DIGITS}%|##| {DIGITS}/{DIGITS} [00:01<00:02, 1.0it/s, avr_loss=0.1]",
    f'File "{DIGITS}", line {DIGITS}, in {DIGITS}\ntorch.OutOfMemoryError: CUDA out of memory.',
    DIGITS, "x " + "A" * 20_000, "%" * 20_000, "[" * 20_000,
], ids=["oom-message", "progress-bar", "frame", "digits", "word", "percents", "brackets"])
def test_a_20000_digit_line_is_read_in_linear_time(line):
    # Unbounded regexes took 6.6 s on the message and 28 s on the bar at this length (quadratic); now ~0.1 s.
    started = time.perf_counter()
    oom.scan_log(line + "\n")
    assert time.perf_counter() - started < 1.5


# -- whole logs ------------------------------------------------------------------------------------------
def test_tqdm_redraws_on_one_line_are_followed_to_the_last_step():
    bars = "\r".join(f"steps:  {n}%|#  | {n}/100 [00:0{n}<01:00, 1.0s/it, avr_loss=0.1]" for n in range(5))
    log = f"running training / 学習開始\n{bars}\n{NEW}\n"
    scan = oom.scan_log(log)
    assert [(e.line, e.phase, e.step, e.recovered) for e in scan.events] == [(3, "train", 5, False)]
    assert (scan.last_step, scan.total_steps) == (4, 100)


def test_an_oom_the_trainer_survived_is_recovered():
    log = "\n".join([
        "# Running job: myjob",
        "myjob:   1%|          | 10/1000 [00:10<16:30,  1.0s/it, lr: 1.0e-04 loss: 1.0e-01]",
        "# OOM during training step, skipping batch 1/3 #",
        "myjob:   1%|          | 11/1000 [00:12<16:30,  1.0s/it, lr: 1.0e-04 loss: 1.0e-01]",
        "myjob:   1%|          | 12/1000 [00:13<16:30,  1.0s/it, lr: 1.0e-04 loss: 1.0e-01]",
    ])
    [event] = oom.scan_log(log).events
    assert (event.line, event.step, event.recovered, event.skipped_batches) == (3, 11, True, 1)


def test_the_lines_of_one_failure_make_one_event():
    log = "\n".join([
        "steps:   0%|          | 2/1600 [00:09<2:08:32,  4.83s/it, avr_loss=0.108]",
        "Error running job: CUDA out of memory. Tried to allocate 20.00 MiB.",
        "Traceback (most recent call last):",
        '  File "/x/train.py", line 9, in backward',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
        "steps:   0%|          | 2/1600 [00:11<2:33:40,  5.77s/it, avr_loss=0.108]",  # tqdm's last redraw
    ])
    [event] = oom.scan_log(log).events
    assert (event.line, event.phase, event.step, event.recovered) == (2, "train", 3, False)


def test_a_log_without_an_oom_points_to_the_error_that_is_there():
    log = "\n".join([
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "KeyError: 'text_encoder_2'",
        "subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit status 1.",
    ])
    scan = oom.scan_log(log)
    assert (scan.events, scan.last_error, scan.last_error_line) == ((), "KeyError: 'text_encoder_2'", 3)


# -- progress lines of other trainers ---------------------------------------------------------------------
@pytest.mark.parametrize("bar, step", [
    ("step:  40%|████      | 10/25 [00:20<00:30,  2.0s/it, loss=0.1, smooth loss=0.09]", 11),  # OneTrainer
    ("Epoch 0:  29% 1034/3597 [51:02<2:06:30,  2.96s/it]", 1035),  # PyTorch Lightning, no bar (Colab)
    ("Epoch 1/134 - steps:   0%|          | 0/1600 [00:00<?, ?it/s]", 1),  # ComfyUI-FluxTrainer
    ("Train (loss 63.31) epoch 1:   3%|██        | 1/29 [00:23<11:10, 23.93s/it]", 2),  # a plain loop
    ("steps:   0% 0/2300 [00:01<?, ?it/s]", 1),  # kohya in Colab: no bar characters
    ("Loading checkpoint shards: 100%|##########| 3/3 [00:02<00:00,  1.31it/s]", None),
    ("Generating Images:   0%|          | 0/1 [00:00<?, ?it/s]", None),
    ("Valid (loss 53.34) epoch 1:   9%|██        | 1/11 [00:01<00:13,  1.33s/it]", None),
    (" 19%|█████████▉        | 14/74 [00:05<00:23,  2.57it/s]", None),  # caching latents: no name, no loss
])
def test_the_training_bars_of_other_trainers(bar, step):
    [event] = oom.scan_log(f"{bar}\n{NEW}\n").events
    assert event.step == step


def test_a_bar_redrawn_right_after_the_oom_gives_the_step_it_died_in():
    log = f"{NEW}\nsteps:   0% 0/2300 [00:01<?, ?it/s]\nTraceback (most recent call last):\n"
    [event] = oom.scan_log(log).events
    assert (event.phase, event.step, event.recovered) == ("train", 1, False)


def test_the_traceback_printed_after_the_message_is_read():
    log = "\n".join([
        "Error running job: CUDA error: out of memory",
        "========================================",
        "Traceback (most recent call last):",
        '  File "/ai-toolkit/run.py", line 96, in main',
        '  File "/ai-toolkit/toolkit/models/wan21/wan21.py", line 377, in load_wan_transformer',
        '  File "/ai-toolkit/toolkit/util/quantize.py", line 308, in quantize_model',
    ])
    [event] = oom.scan_log(log).events
    assert (event.phase, event.frames) == ("load", 3)


def test_every_marker_holds_one_of_the_keys_a_line_is_first_tested_for():
    # scan_log tries the markers only on a line holding one of OOM_KEYS: a marker without one would be missed.
    for marker, _ in oom.OOM_MARKERS + oom.HOST_MARKERS:
        assert any(key in marker for key in oom.OOM_KEYS), marker
    for line in ("Killed", "  Killed  ", "MemoryError", "DataLoader worker (pid 77) is killed by signal: Killed."):
        assert oom.host_marker(line) and any(key in line for key in oom.OOM_KEYS), line


# -- one line's phase, for a reader that follows a running trainer (issue 31's trainer probe) --------------
@pytest.mark.parametrize("line, phase", [
    # AI Toolkit (jobs/process/BaseSDTrainProcess.py, toolkit/dataloader_mixins.py)
    ("Loading Flux model", "load"),
    ("Quantizing Transformer", "load"),
    ("Caching latents for /data/set", "latents"),
    ("Caching text_embeddings for /data/set", "text_encoder"),
    ("Generating baseline samples before training", "sample"),
    ("Generating Images:   0%|          | 0/1 [00:00<?, ?it/s]", "sample"),
    ("my_lora:   1%|          | 10/1000 [00:10<16:30,  1.0s/it, lr: 1.0e-04 loss: 1.0e-01]", "train"),
    # kohya sd-scripts (library/train_util.py, flux_train_network.py), with its rich logger's prefix
    ("2024-09-06 10:53:11 INFO     load StableDiffusion checkpoint: /m/sdxl.safetensors   train_util.py:5201", "load"),
    ("                    INFO     Building Flux model dev from BFL checkpoint      flux_utils.py:101", "load"),
    ("                    INFO     caching latents with caching strategy.             train_util.py:1120", "latents"),
    ("                    INFO     move text encoders to gpu            flux_train_network.py:216", "text_encoder"),
    ("caching Text Encoder outputs...", "text_encoder"),
    ("generating sample images at step / サンプル画像生成 ステップ: 150", "sample"),
    ("running training / 学習開始", "train"),
    ("steps:  12%|#2        | 240/2000 [01:02<07:35,  3.86it/s, avr_loss=0.108]", "train"),
    # musubi-tuner (training/trainer_base.py, wan_train_network.py), Python logging's prefix
    ("INFO:musubi_tuner.hv_train_network:Loading DiT model from /m/wan.safetensors", "load"),
    ("INFO:musubi_tuner.wan_train_network:encoding with Text Encoder 1", "text_encoder"),
    # lines that mark nothing
    ("epoch 1/64", None),
    ("checking cache validity...", None),
    (" 19%|█████████▉        | 14/74 [00:05<00:23,  2.57it/s]", None),
    ("Traceback (most recent call last):", None),
])
def test_the_phase_one_line_marks(line, phase):
    assert oom.phase_of_line(line) == phase


def test_a_bar_named_for_the_ai_toolkit_job_is_training_given_the_name():
    bar = "my_lora:   1%|          | 10/1000 [00:10<16:30,  1.0s/it]"  # no loss in the postfix yet
    assert (oom.phase_of_line(bar), oom.phase_of_line(bar, job_name="my_lora")) == (None, "train")


# -- cuBLAS handle failures: memory at load, not after training made progress ---------------------------
CUBLAS_INIT = "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"


def test_a_cublas_handle_that_cannot_be_made_at_load_is_memory():
    log = "\n".join(["Loading Flux model", "Quantizing Transformer", "Traceback (most recent call last):",
                     '  File "/ai-toolkit/toolkit/stable_diffusion_model.py", line 613, in load_model', CUBLAS_INIT])
    [event] = oom.scan_log(log).events
    assert (event.verdict.kind, event.verdict.marker, event.phase, event.step) == (
        "config", "CUBLAS_STATUS_NOT_INITIALIZED", "load", None)


def test_a_cublas_handle_failure_after_training_steps_is_the_error_it_says():
    log = f"steps:   1%|#  | 20/2000 [00:40<1:06:00, 2.0s/it, avr_loss=0.1]\n{CUBLAS_INIT}\n"
    scan = oom.scan_log(log)
    assert (scan.events, scan.failure.error, scan.failure.step) == ((), CUBLAS_INIT, 21)
    assert not oom.classify(CUBLAS_INIT).is_oom and oom.classify(CUBLAS_INIT, before_training=True).is_oom


# -- a failure without an OOM: its phase from the frames, AI Toolkit's error line, a cut traceback ---------
def test_the_phase_of_any_error_comes_from_its_frames():
    log = "\n".join(["steps:  50%|#####     | 1000/2000 [20:00<20:00, 1.2s/it, avr_loss=0.1]",
                     "Traceback (most recent call last):",
                     '  File "/sd-scripts/train_network.py", line 1311, in train',
                     '  File "/sd-scripts/library/train_util.py", line 5247, in _load_target_model',
                     "OSError: [Errno 5] Input/output error"])
    failure = oom.scan_log(log).failure
    assert (failure.error, failure.line, failure.phase, failure.frame) == (
        "OSError: [Errno 5] Input/output error", 5, "load", "_load_target_model")


def test_ai_toolkits_error_line_is_the_error_of_the_traceback_after_it():
    log = "\n".join(["Generating baseline samples before training",
                     "Error running job: Expected all tensors to be on the same device",
                     "========================================", "Traceback (most recent call last):",
                     '  File "/ai-toolkit/run.py", line 96, in main'])
    failure = oom.scan_log(log).failure
    assert (failure.cut, failure.error, failure.line, failure.phase) == (
        False, "Expected all tensors to be on the same device", 2, "sample")


CUT = ["steps:   0%|          | 0/10000 [02:17<?, ?it/s, avr_loss=0.0563]Traceback (most recent call last):",
       '  File "/root/wan_train_network.py", line 447, in <module>', "    trainer.train(args)",
       '  File "/root/hv_train_network.py", line 1915, in train', "    accelerator.backward(loss)",
       '  File "/usr/lib/python3.10/site-packages/torch/autograd/graph.py", line 825, in _engine_run_backward',
       "    return Variable._execution_engine.run_backward(  # Calls into"]


def test_a_traceback_the_log_ends_inside_is_cut():
    failure = oom.scan_log("\n".join(CUT)).failure
    assert (failure.cut, failure.line, failure.phase, failure.step, failure.frame) == (
        True, 1, "train", 1, "_engine_run_backward")


@pytest.mark.parametrize("ending", ["RuntimeError: CUDA error: device-side assert triggered",
                                    "Press any key to continue . . ."])
def test_a_traceback_followed_by_its_error_or_other_output_is_not_cut(ending):
    failure = oom.scan_log("\n".join(CUT + [ending])).failure
    assert failure is None or not failure.cut


def test_a_cut_traceback_reads_the_call_on_its_last_source_line():
    # A rich box cut below `train`: the failing line (❱) was going into load_target_model.
    log = "\n".join(["╭──── Traceback (most recent call last) ────╮",
                     "│ /content/sd-scripts/train_network.py:168 in train │", "│                    │",
                     "│ ❱ 168 │   text_encoder, vae, unet, _ = train_util.load_target_model(args, we │"])
    failure = oom.scan_log(log).failure
    assert (failure.cut, failure.phase, failure.frame) == (True, "load", "load_target_model")


def _load_model_rewrapping(error: BaseException):
    """As diffusers' load_state_dict does: any failure reading a checkpoint becomes an OSError."""
    try:
        raise error
    except Exception:
        try:
            raise UnicodeDecodeError("utf-8", b"\xc0", 0, 1, "invalid start byte")
        except (UnicodeDecodeError, ValueError):
            raise OSError("Unable to load weights from checkpoint file for 'x.safetensors'") from None


def load_model(error: BaseException):  # a frame that names the load phase
    _load_model_rewrapping(error)


@pytest.mark.parametrize("error, kind", [
    (MemoryError("host out of memory (simulated): tried to allocate 288 KiB"), "host"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), "config"),
])
def test_an_oom_a_library_rewrapped_is_still_the_oom_with_its_phase(error, kind):
    try:
        load_model(error)
    except OSError as exc:
        verdict = oom.classify(exc)
    assert (verdict.is_oom, verdict.kind, verdict.phase) == (True, kind, "load")
    assert oom.classify(OSError("Unable to load weights from checkpoint file")).kind == "not_oom"


def test_an_oom_the_loader_swallowed_is_read_from_the_meter(tmp_path):
    # safetensors' loader answers a MemoryError in an allocation with a ValueError of its own, and
    # diffusers rewraps that as an OSError: nothing in the error says memory, the sim meter does.
    import safetensors.torch
    from diffusers.models.model_loading_utils import load_state_dict

    from fitfinder.probe.meters import _host
    from fitfinder.probe.meters.sim import SimMeter
    from fitfinder.probe.recipe import _verdict_on

    path = tmp_path / "weights.safetensors"
    safetensors.torch.save_file({f"w{i}": torch.zeros(256, 1024) for i in range(4)}, str(path))  # 4 MiB
    meter = SimMeter(None, ram_bytes=(_host.resident_bytes() or 0) + 2**20)
    with meter, meter.phase("load"), meter.host(), pytest.raises(Exception) as raised:
        load_state_dict(str(path))
    verdict, line = _verdict_on(raised.value, meter)
    assert not oom.classify(raised.value).is_oom  # the error itself names no memory
    assert (verdict.is_oom, verdict.kind) == (True, "host")
    assert line.startswith("MemoryError: host out of memory (simulated)") and "raised as" in line, line
