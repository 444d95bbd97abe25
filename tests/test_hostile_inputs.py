"""The hostile-input corpus: every case is refused with exit code 2 and one line on stderr that
starts with `fitfinder: error:`, no traceback, nothing on stdout, and nothing written (the folder
it runs in, the input files included, is byte for byte what it was: no studies/, no results/).

Cases run in-process through `cli.main`, the entry point `fitfinder` itself calls (an import
of torch per case would take minutes); a few at the end run as real processes to prove the
wiring. docs/reliability.md ("Hostile input") lists the classes.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from fitfinder import cli
from tests.conftest import DEMO, ROOT, assert_one_clean_line, run_cli

GOOD = DEMO.read_text()
BODY = GOOD.split("---\n", 1)[1]  # the demo without its `---` line, to put more YAML above it
NAME = "demo_flux_lora"
LOG = (ROOT / "tests" / "logs" / "aitk_flux_3_times_in_a_row.log").read_text()


def edit(old: str, new: str, text: str = GOOD) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def sample(extra: str) -> str:
    """The demo with more keys under `sample:` (its previews)."""
    return edit("        sample_steps: 20\n", f"        sample_steps: 20\n        {extra}\n")


def dataset(extra: str) -> str:
    return edit('          caption_ext: "txt"\n', f'          caption_ext: "txt"\n          {extra}\n')


def bomb(levels: int = 9) -> str:
    """An alias bomb: 10 ** `levels` values from a dozen lines."""
    lines = ["bomb0: &b0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"bomb{i}: &b{i} [" + ", ".join([f"*b{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@dataclass
class Case:
    argv: list[str]
    expected: str  # in the one line
    files: dict[str, str | bytes] = field(default_factory=dict)
    setup: Callable[[Path], Callable[[], None] | None] | None = None
    seconds: float | None = None  # must be refused this quickly (a hang is the bug)


CASES: dict[str, Case] = {}


def job(name: str, text: str | bytes, expected: str, *args: str, command: str = "search", seconds=None) -> None:
    CASES[name] = Case([command, "job.yaml", *args], expected, {"job.yaml": text}, seconds=seconds)


def key(name: str, text: str, path: str, expected: str) -> None:
    """A bad value at `path` (under config.process[0]) of the demo job."""
    job(name, text, f"config.process[0].{path}: expected {expected}")


# -- the file itself: size, encoding, YAML -------------------------------------------------------
job("not_yaml", "job: [unclosed\n  config: {", "job.yaml: not valid YAML")
job("tab_indent", "config:\n\tname: x\n", "job.yaml: not valid YAML (line 2)")
job("duplicate_key", edit("job: extension", "job: extension\njob: other"), "found duplicate key")
job("nul_byte", edit('type: "lora"', 'type: "lo\x00ra"'), "not valid YAML: unacceptable character #x0000")
job("empty_file", "", "top level: expected a mapping")
job("top_level_list", "- job\n- config\n", "top level: expected a mapping")
job("top_level_scalar", "hello\n", "top level: expected a mapping")
job("over_1_mib", GOOD + "# padding\n" * 120_000, "job.yaml: larger than 1 MiB", seconds=1)
job("invalid_utf8_name", edit('name: "demo_flux_lora"', 'name: "caf\udce9"').encode("utf-8", "surrogateescape"),
    "job.yaml: not UTF-8 text (byte 0xe9 on line 6)")
job("utf16_file", GOOD.encode("utf-16"), "job.yaml: not UTF-8 text (byte 0xff on line 1)")
job("alias_bomb_network", bomb() + edit('        type: "lora"\n', '        type: "lora"\n        extra: *b9\n', BODY),
    "job.yaml: more than 10000 values once its aliases (*name) are expanded", seconds=1)
job("alias_bomb_candidates", bomb() + edit("    quantize: [none]\n", "    rank: *b9\n    quantize: [none]\n", BODY),
    "job.yaml: more than 10000 values once its aliases", seconds=1)
job("alias_bomb_as_key", bomb() + "? *b9\n: 1\n" + BODY, "job.yaml: not valid YAML", seconds=1)
job("alias_string_bomb", f'big: &big "{"x" * 900_000}"\n' + edit("    quantize: [none]\n", "    rank: ["
                                                                 + ", ".join(["*big"] * 9000)
                                                                 + "]\n    quantize: [none]\n", BODY),
    "job.yaml: more than 2 MiB of text once its aliases (*name) are expanded", seconds=5)  # ruamel: ~1 s/MiB
job("undefined_alias", edit("linear: 32", "linear: *nowhere"),
    "job.yaml: not valid YAML (line 13): found undefined alias 'nowhere'")
job("nested_60_deep", BODY + "deep: " + "[" * 60 + "]" * 60 + "\n", "nested more than 50 levels")
job("nested_100000_deep", "deep: " + "[" * 100_000, "job.yaml: nested more than 50 levels deep", seconds=1)
job("nested_20000_dashes", "- " * 20_000 + "x\n", "job.yaml: not valid YAML: nested too deeply", seconds=1)
job("integer_5000_digits", edit("linear: 32", "linear: " + "9" * 5000), "job.yaml: not valid YAML: Exceeds the limit")

# -- the job's shape ---------------------------------------------------------------------------
job("no_config", "job: extension\n", "config: missing")
job("no_process", "job: extension\nconfig:\n  name: x\n", "config.process: missing")
job("empty_process", "job: extension\nconfig:\n  name: x\n  process: []\n", "config.process: missing or empty")
job("process_a_string", "job: extension\nconfig:\n  name: x\n  process: [train]\n",
    "config.process[0]: expected a mapping")
job("no_name", edit('  name: "demo_flux_lora"\n', ""), "config.name: missing")
job("name_300_chars", edit('name: "demo_flux_lora"', f'name: "{"n" * 300}"'), "300 characters, at most 100")
job("network_a_string", edit('      network:\n        type: "lora"\n        linear: 32\n        linear_alpha: 32\n',
                             "      network: lora\n"), "config.process[0].network: expected a mapping, got 'lora'")
job("datasets_a_mapping", edit("      datasets:\n        - folder_path", "      datasets:\n          folder_path"),
    "config.process[0].datasets: missing or empty")
job("no_rank", edit("        linear: 32\n        linear_alpha: 32\n", ""), "network.linear: missing")

# -- wrong types and insane numbers, key by key --------------------------------------------------
key("rank_negative", edit("linear: 32", "linear: -8"), "network.linear", "a positive integer (at most 4096)")
key("rank_zero", edit("linear: 32", "linear: 0"), "network.linear", "a positive integer")
key("rank_text", edit("linear: 32", "linear: abc"), "network.linear", "a positive integer")
key("rank_huge", edit("linear: 32", "linear: 1000000"), "network.linear", "a positive integer (at most 4096)")
key("rank_fraction", edit("linear: 32", "linear: 1.5"), "network.linear", "a positive integer")
key("rank_bool", edit("linear: 32", "linear: true"), "network.linear", "a positive integer")
key("alpha_nan", edit("linear_alpha: 32", "linear_alpha: .nan"), "network.linear_alpha", "a number above 0")
key("alpha_inf", edit("linear_alpha: 32", "linear_alpha: .inf"), "network.linear_alpha", "a number above 0")
key("conv_rank_text", edit("linear_alpha: 32", "linear_alpha: 32\n        conv: abc"), "network.conv",
    "null or an integer from 0 to 4096")
key("conv_alpha_negative", edit("linear_alpha: 32", "linear_alpha: 32\n        conv: 16\n        conv_alpha: -1"),
    "network.conv_alpha", "a number above 0")
key("alpha_negative", edit("linear_alpha: 32", "linear_alpha: -1"), "network.linear_alpha", "a number above 0")
key("resolution_text", edit("resolution: [ 256, 384, 512 ]", "resolution: [ 256, big, 512 ]"),
    "datasets[0].resolution", "a positive integer or a non-empty list")
key("resolution_empty", edit("resolution: [ 256, 384, 512 ]", "resolution: []"), "datasets[0].resolution",
    "a positive integer or a non-empty list")
key("resolution_1e400", edit("resolution: [ 256, 384, 512 ]", "resolution: 1e400"), "datasets[0].resolution",
    "a positive integer")
key("resolution_huge", edit("resolution: [ 256, 384, 512 ]", "resolution: [256, 100000]"), "datasets[0].resolution",
    "a positive integer or a non-empty list of positive integers (pixels, at most 16384), got [256, 100000]")
key("resolution_negative", edit("resolution: [ 256, 384, 512 ]", "resolution: -256"), "datasets[0].resolution",
    "a positive integer")
key("frames_zero", dataset("num_frames: 0"), "datasets[0].num_frames", "a positive integer (at most 10000)")
key("frames_ten_million", dataset("num_frames: 10000000"), "datasets[0].num_frames", "a positive integer")
key("num_repeats_many", dataset('num_repeats: "many"'), "datasets[0].num_repeats", "a positive integer")
key("bucket_tolerance_zero", dataset("bucket_tolerance: 0"), "datasets[0].bucket_tolerance", "a positive integer")
key("folder_path_number", edit('folder_path: "/path/to/images/folder"', "folder_path: 5"),
    "datasets[0].folder_path", "a text")
key("caption_ext_list", edit('caption_ext: "txt"', "caption_ext: []"), "datasets[0].caption_ext", "a text")
key("cache_latents_yes", edit("cache_latents_to_disk: true", 'cache_latents_to_disk: "yes"'),
    "datasets[0].cache_latents_to_disk", "true or false")
job("batch_ten_billion", edit("batch_size: 4", "batch_size: 10000000000"),
    "config.process[0].train.batch_size: expected a positive integer (at most 10000)", seconds=1)
key("batch_zero", edit("batch_size: 4", "batch_size: 0"), "train.batch_size", "a positive integer")
key("batch_text", edit("batch_size: 4", 'batch_size: "4"'), "train.batch_size", "a positive integer")
key("batch_fraction", edit("batch_size: 4", "batch_size: 4.5"), "train.batch_size", "a positive integer")
key("accumulation_negative", edit("gradient_accumulation_steps: 1", "gradient_accumulation_steps: -1"),
    "train.gradient_accumulation_steps", "a positive integer")
job("both_accumulations", edit("gradient_accumulation_steps: 1", "gradient_accumulation_steps: 2\n"
                               "        gradient_accumulation: 2"), "AI Toolkit refuses it together")
key("checkpointing_text", edit("gradient_checkpointing: false", 'gradient_checkpointing: "no"'),
    "train.gradient_checkpointing", "true or false")
key("lr_text", edit("lr: 1e-4", 'lr: "abc"'), "train.lr", "a number above 0 and at most 10")
key("lr_nan", edit("lr: 1e-4", "lr: .nan"), "train.lr", "a number above 0")
key("lr_inf", edit("lr: 1e-4", "lr: .inf"), "train.lr", "a number above 0")
key("lr_1e400", edit("lr: 1e-4", "lr: 1e400"), "train.lr", "a number above 0")
key("lr_negative", edit("lr: 1e-4", "lr: -1e-4"), "train.lr", "a number above 0")
key("steps_zero", edit("steps: 2000", "steps: 0"), "train.steps", "a positive integer")
key("dtype_fp64", edit("dtype: fp32", "dtype: fp64"), "train.dtype", "one of bf16, fp16, fp32")
key("optimizer_sgd", edit('optimizer: "adamw"', "optimizer: sgd"), "train.optimizer", "one of adafactor, adam, adamw")
key("quantize_text", edit("is_flux: true", 'is_flux: true\n        quantize: "true"'), "model.quantize",
    "true or false")
key("qtype_int3", edit("is_flux: true", "is_flux: true\n        qtype: int3"), "model.qtype", "one of qfloat8")
job("arch_unknown_model", edit("is_flux: true", "arch: not_a_model"),
    "config.process[0].model.arch: fitfinder does not support the model 'not_a_model'; it supports: ")
key("model_name_number", edit('name_or_path: "fitfinder/flux-tiny"', "name_or_path: 5"), "model.name_or_path",
    "a text")
key("offload_half", edit("is_flux: true", 'is_flux: true\n        layer_offloading: true\n'
                         '        layer_offloading_transformer_percent: "half"'),
    "model.layer_offloading_transformer_percent", "a number from 0 to 1")
key("offload_text", edit("is_flux: true", 'is_flux: true\n        layer_offloading: "on"'),
    "model.layer_offloading", "true or false")
key("sample_width_zero", edit("width: 256", "width: 0"), "sample.width", "a positive integer (at most 16384)")
key("sample_height_text", edit("height: 256", "height: big"), "sample.height", "a positive integer")
key("sample_steps_billion", edit("sample_steps: 20", "sample_steps: 1000000000"), "sample.sample_steps",
    "a positive integer (at most 10000)")
key("guidance_negative", sample("guidance_scale: -1"), "sample.guidance_scale", "a number from 0 to 100")
key("seed_text", sample('seed: "abc"'), "sample.seed", "an integer from")
key("prompts_a_number", sample("prompts: 5"), "sample.prompts", "a list of prompts (texts)")
key("prompts_nested", sample("prompts: [[a, b]]"), "sample.prompts", "a list of prompts (texts)")
key("negative_prompt_number", sample("neg: 5"), "sample.neg", "a text")
key("walk_seed_text", sample('walk_seed: "yes"'), "sample.walk_seed", "true or false")
job("missing_model_folder", edit("  weights: random     #", "  weights: pretrained  #",
                                 edit('name_or_path: "fitfinder/flux-tiny"', 'name_or_path: "/nonexistent/flux"')),
    "model '/nonexistent/flux' is neither a local folder nor in the Hugging Face cache")
job("unknown_model_family", edit("is_flux: true", "quantize: false", edit('"fitfinder/flux-tiny"', '"someone/model"')),
    "fitfinder does not support the model someone/model (neither model.arch, an is_* flag nor its name says")

# -- the `fitfinder:` section ----------------------------------------------------------------------
VRAM = "vram: 13.2MiB"
job("vram_inf", edit(VRAM, "vram: .inf"), "fitfinder.vram: must be a finite size, got inf")
job("vram_nan", edit(VRAM, "vram: .nan"), "fitfinder.vram: must be a finite size, got nan")
job("vram_1e400", edit(VRAM, "vram: 1e400"), "fitfinder.vram: must be a finite size")
job("vram_bananas", edit(VRAM, "vram: 24 bananas"), "fitfinder.vram: '24 bananas' is not a size")
job("vram_half_byte", edit(VRAM, "vram: 0.5"), "fitfinder.vram: must be between 1 MiB and 1 PiB, got 0.5")
job("vram_negative", edit(VRAM, "vram: -1GiB"), "fitfinder.vram: '-1GiB' is not a size")
job("vram_list", edit(VRAM, "vram: [24GiB]"), "fitfinder.vram: expected a size such as 24GiB, got ['24GiB']")
job("vram_exabyte", edit(VRAM, "vram: 1000000TiB"), "fitfinder.vram: must be between 1 MiB and 1 PiB")
job("margin_nan", edit(VRAM, VRAM + "\n  margin: .nan"), "fitfinder.margin: must be between 0.0 and 0.9, got nan")
job("margin_too_big", edit(VRAM, VRAM + "\n  margin: 0.95"), "fitfinder.margin: must be between 0.0 and 0.9")
job("margin_text", edit(VRAM, VRAM + "\n  margin: lots"), "fitfinder.margin: expected a number, got 'lots'")
job("probe_timeout_inf", edit(VRAM, VRAM + "\n  probe_timeout: .inf"),
    "fitfinder.probe_timeout: must be between 1 and 86400, got inf")
job("probe_timeout_zero", edit(VRAM, VRAM + "\n  probe_timeout: 0"), "fitfinder.probe_timeout: must be between")
job("trials_zero", edit(VRAM, VRAM + "\n  trials: 0"), "fitfinder.trials: must be between 1 and 100000")
job("probe_steps_1e400", edit(VRAM, VRAM + "\n  probe_steps: 1e400"),
    "fitfinder.probe_steps: must be between 1 and 100000, got inf")
job("unknown_setting", edit(VRAM, VRAM + "\n  turbo: true"), "fitfinder.turbo: unknown key")
job("weights_maybe", edit("weights: random", "weights: maybe"), "fitfinder.weights: expected `random` or `pretrained`")
job("sample_size_0x0", edit("sample_size: [256x256]", 'sample_size: ["0x0"]'),
    "fitfinder.candidates.sample_size: expected sizes such as 512x512 (each side from 1 to 16384), got ['0x0']")
job("sample_size_superscript", edit("sample_size: [256x256]", 'sample_size: ["²x²"]'),
    "fitfinder.candidates.sample_size: expected sizes such as 512x512")
job("candidate_rank_text", edit("quantize: [none]", "quantize: [none]\n    rank: [abc]"),
    "fitfinder.candidates.rank: expected ranks from 1 to 4096, got ['abc']")
job("candidate_rank_zero", edit("quantize: [none]", "quantize: [none]\n    rank: [0]"),
    "fitfinder.candidates.rank: expected ranks from 1 to 4096")
job("candidate_rank_bool", edit("quantize: [none]", "quantize: [none]\n    rank: [true]"),
    "fitfinder.candidates.rank: expected ranks")
job("candidate_batch_not_divisor", edit("quantize: [none]", "quantize: [none]\n    batch: [3]"),
    "fitfinder.candidates.batch: expected batch sizes that divide the effective batch 4")
job("candidate_bucket_zero", edit("quantize: [none]", "quantize: [none]\n    buckets: [[0]]"),
    "fitfinder.candidates.buckets: expected bucket lists of positive integers")
job("candidate_unknown_knob", edit("quantize: [none]", "quantize: [none]\n    speed: [fast]"),
    "fitfinder.candidates.speed: unknown knob")
job("candidates_a_list", edit("  candidates:         #", "  candidates: [rank]\n  ignored:            #"),
    "fitfinder.candidates: expected a mapping of knob name to a list, got ['rank']")
job("priorities_unknown", edit(VRAM, VRAM + "\n  priorities: [speed]"), "fitfinder.priorities: unknown knob 'speed'")

# -- command-line options --------------------------------------------------------------------------
job("option_vram_401_digits", GOOD, "--vram: '100000000000000000000000000000000000... is not a size",
    "--vram", "1" + "0" * 400)
job("option_vram_inf", GOOD, "--vram: 'inf' is not a size", "--vram", "inf")
job("option_vram_nan", GOOD, "--vram: 'nan' is not a size", "--vram", "nan")
job("option_vram_1e400", GOOD, "--vram: '1e400' is not a size", "--vram", "1e400")
job("option_vram_half_byte", GOOD, "--vram: must be between 1 MiB and 1 PiB, got '0.5'", "--vram", "0.5")
job("option_vram_1kib_impossible_budget", GOOD, "--vram: must be between 1 MiB and 1 PiB", "--vram", "1KiB")
job("option_vram_empty", GOOD, "--vram: '' is not a size", "--vram", "")
job("option_timeout_nan", GOOD, "--timeout: must be positive, got nan", "--timeout", "nan")
job("option_timeout_inf", GOOD, "--timeout: must be positive, got inf", "--timeout", "inf")
job("option_timeout_negative", GOOD, "--timeout: must be positive, got -1.0", "--timeout", "-1")
job("option_timeout_a_year", GOOD, "--timeout: must be between 1 and 86400", "--timeout", "31536000")
job("option_margin_nan", GOOD, "--margin: must be between 0 and 0.9, got nan", "--margin", "nan")
job("option_margin_2", GOOD, "--margin: must be between 0 and 0.9, got 2.0", "--margin", "2")
job("option_trials_zero", GOOD, "--trials: must be positive, got 0", "--trials", "0")
job("option_trials_text", GOOD, "Invalid value for '--trials'", "--trials", "abc")
job("option_probe_steps_million", GOOD, "--probe-steps: must be between 1 and 100000", "--probe-steps", "1000000")
job("option_unknown", GOOD, "No such option: --turbo", "--turbo")
job("option_gpu_injection", GOOD, "--gpu: expected device indexes such as 0 or 0,1,2,3, got '0;rm -rf /'",
    "--gpu", "0;rm -rf /")
job("option_gpu_twice", GOOD, "--gpu: each device once, got '0,0'", "--gpu", "0,0")
job("option_workers_zero", GOOD, "--workers: must be at least 1, got 0", "--workers", "0")
job("option_study_300_chars", GOOD, "300 characters, at most 100", "--study", "s" * 300)
job("estimate_card_and_no_overhead", GOOD, "--card and --no-overhead contradict each other", "--card", "x",
    "--no-overhead", command="estimate")
job("estimate_vram_nan", GOOD, "--vram: 'nan' is not a size", "--vram", "nan", command="estimate")
job("estimate_timeout_nan", GOOD, "--timeout: must be positive, got nan", "--timeout", "nan", command="estimate")
job("probe_steps_zero", GOOD, "--steps: must be positive, got 0", "--steps", "0", command="probe")
CASES["job_file_missing"] = Case(["search", "nowhere.yaml"], "nowhere.yaml: no such file")
CASES["job_path_with_newline"] = Case(["search", "a\nfitfinder: error: forged.yaml"],
                                      "a\\nfitfinder: error: forged.yaml: no such file")
CASES["job_file_a_folder"] = Case(["search", "."], ".: is a folder")
CASES["job_file_dev_zero"] = Case(["search", "/dev/zero"], "/dev/zero: not a regular file")


def _link(target: str, at: str = "job.yaml"):
    def setup(folder: Path):
        (folder / at).symlink_to(target)

    return setup


CASES["job_file_dangling_link"] = Case(["search", "job.yaml"], "job.yaml: no such file", setup=_link("gone.yaml"))


def _fifo(folder: Path):
    os.mkfifo(folder / "job.yaml")


CASES["job_file_fifo"] = Case(["search", "job.yaml"], "job.yaml: not a regular file", setup=_fifo)

# -- diagnose's log: only a regular file is read (a FIFO blocked the read forever; /dev/zero was read
# until MemoryError)
CASES["diagnose_log_dev_zero"] = Case(["diagnose", "/dev/zero"], "/dev/zero: not a regular file", seconds=2)
CASES["diagnose_log_fifo"] = Case(["diagnose", "train.log"], "train.log: not a regular file", seconds=2,
                                  setup=lambda folder: os.mkfifo(folder / "train.log"))
CASES["diagnose_log_a_folder"] = Case(["diagnose", "."], ".: is a folder", seconds=2)
CASES["diagnose_log_dangling_link"] = Case(["diagnose", "train.log"], "train.log: no such file",
                                           setup=_link("gone.log", "train.log"))
CASES["diagnose_log_link_to_dev_zero"] = Case(["diagnose", "train.log"], "train.log: not a regular file", seconds=2,
                                              setup=_link("/dev/zero", "train.log"))


# -- the environment: output folders that cannot be written ----------------------------------------
def read_only(path: Path) -> Callable[[], None]:
    """Make the folder `path` read-only, keeping what it holds: chmod for a user, a read-only bind
    mount of it onto itself for root (whom permissions do not stop). Returns the undo."""
    path.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    for command in (["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,ro,bind", str(path)]):
        done = subprocess.run(command, capture_output=True)
        if done.returncode != 0:
            if command[1] != "--bind":
                subprocess.run(["umount", str(path)])
            pytest.skip(f"root without a read-only mount: {done.stderr.decode()[:100]}")
    return lambda: subprocess.run(["umount", str(path)], check=True)


def _results_a_file(folder: Path):
    (folder / "results").write_text("not a folder\n")


def _studies_a_file(folder: Path):
    (folder / "studies").write_text("not a folder\n")


CASES["results_is_a_file"] = Case(["search", "job.yaml"], f"--results-dir results/{NAME}: results is a file, not "
                                  "a folder", {"job.yaml": GOOD}, setup=_results_a_file)
CASES["results_dangling_link"] = Case(["search", "job.yaml"], f"--results-dir results/{NAME}: results is a link to "
                                      "/nonexistent/results, which does not exist", {"job.yaml": GOOD},
                                      setup=_link("/nonexistent/results", "results"))
CASES["results_read_only"] = Case(["search", "job.yaml"], f"--results-dir results/{NAME}: results is not writable",
                                  {"job.yaml": GOOD}, setup=lambda folder: read_only(folder / "results"))
CASES["results_dir_under_a_file"] = Case(["search", "job.yaml", "--results-dir", "job.yaml/out"],
                                         "--results-dir job.yaml/out/demo_flux_lora: job.yaml is a file",
                                         {"job.yaml": GOOD})
CASES["studies_is_a_file"] = Case(["search", "job.yaml"], "--studies-dir studies: studies is a file, not a folder",
                                  {"job.yaml": GOOD}, setup=_studies_a_file)
CASES["search_its_own_winner"] = Case(["search", f"results/{NAME}/best.yaml"],
                                      f"results/{NAME}/best.yaml is where this search writes its winner",
                                      {f"results/{NAME}/best.yaml": GOOD})
CASES["diagnose_o_read_only"] = Case(["diagnose", "train.log", "--job", "job.yaml", "-o", "ro/fixed.yaml"],
                                     "ro/fixed.yaml: cannot write it (", {"job.yaml": GOOD, "train.log": LOG},
                                     setup=lambda folder: read_only(folder / "ro"))
CASES["diagnose_o_under_a_file"] = Case(["diagnose", "train.log", "--job", "job.yaml", "-o", "job.yaml/fixed.yaml"],
                                        "job.yaml/fixed.yaml: cannot write it (", {"job.yaml": GOOD, "train.log": LOG})
CASES["diagnose_no_log"] = Case(["diagnose", "nowhere.log"], "nowhere.log: no such file")
CASES["diagnose_o_without_job"] = Case(["diagnose", "train.log", "-o", "x.yaml"], "-o: needs --job",
                                       {"train.log": LOG})
CASES["report_name_escapes"] = Case(["report", "../../etc/x"], "../../etc/x: not a study name")
CASES["export_name_escapes"] = Case(["export", "../outside"], "../outside: not a study name",
                                    {"outside/best.yaml": GOOD})
CASES["report_unknown_study"] = Case(["report", "nothing"], "no study 'nothing' in studies/")

# -- issue 35: the input among the outputs; links and FIFOs planted under results/ and studies/ ----------
OUT = f"results/{NAME}"
CASES["job_is_the_summary"] = Case(["search", f"{OUT}/summary.json"],  # it was replaced by the summary
                                   f"{OUT}/summary.json is {OUT}/summary.json, which this command writes",
                                   {f"{OUT}/summary.json": GOOD})
CASES["job_is_a_probe_log"] = Case(["search", f"{OUT}/probes/trial-0000.log"],  # it was emptied by the first probe
                                   f"{OUT}/probes/trial-0000.log is {OUT}/probes/trial-0000.log, which this command",
                                   {f"{OUT}/probes/trial-0000.log": GOOD})
CASES["job_is_tiers_json"] = Case(["tiers", f"{OUT}/tiers.json"], f"{OUT}/tiers.json, which this command writes",
                                  {f"{OUT}/tiers.json": GOOD})
CASES["job_is_a_tier_job"] = Case(["tiers", f"{OUT}/tiers/24gib.yaml", "--write"],
                                  f"{OUT}/tiers/24gib.yaml, which this command writes",
                                  {f"{OUT}/tiers/24gib.yaml": GOOD})


def _hard_link(at: str):
    def setup(folder: Path):
        (folder / at).parent.mkdir(parents=True, exist_ok=True)
        os.link(folder / "job.yaml", folder / at)

    return setup


def _planted(at: str, target: str):
    """A link at `at` (under the folder) to `target`, its folders made; `target` may not exist."""
    def setup(folder: Path):
        (folder / at).parent.mkdir(parents=True, exist_ok=True)
        (folder / at).symlink_to(target)

    return setup


def _fifo_at(at: str):
    def setup(folder: Path):
        (folder / at).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(folder / at)

    return setup


def _folder_at(at: str):
    return lambda folder: (folder / at).mkdir(parents=True)


def _file_at(at: str):
    def setup(folder: Path):
        (folder / at).parent.mkdir(parents=True, exist_ok=True)
        (folder / at).write_text("not a folder\n")

    return setup


CASES["job_hard_linked_as_a_probe_log"] = Case(["search", "job.yaml"],
                                               f"job.yaml is {OUT}/probes/trial-0000.log (a hard link to {OUT}/probes/",
                                               {"job.yaml": GOOD}, setup=_hard_link(f"{OUT}/probes/trial-0000.log"))
CASES["job_hard_linked_as_the_report"] = Case(["search", "job.yaml"], f"(a hard link to {OUT}/report.html)",
                                              {"job.yaml": GOOD}, setup=_hard_link(f"{OUT}/report.html"))
CASES["job_linked_from_the_summary"] = Case(["search", "job.yaml"], f"{OUT}/summary.json is a link (to ../../job",
                                            {"job.yaml": GOOD}, setup=_planted(f"{OUT}/summary.json", "../../job.yaml"))
# A link planted where fitfinder writes: the probe's log was opened with O_TRUNC through it (its
# target emptied), the lock created its target; a FIFO as the lock made the search wait forever.
CASES["probe_log_a_link_outside"] = Case(["search", "job.yaml"], f"{OUT}/probes/trial-0000.log is a link (to "
                                         "../../../victim.txt)", {"job.yaml": GOOD, "victim.txt": "keep me\n"},
                                         setup=_planted(f"{OUT}/probes/trial-0000.log", "../../../victim.txt"))
CASES["probes_a_link_outside"] = Case(["search", "job.yaml"], f"{OUT}/probes is a link (to ../../elsewhere)",
                                      {"job.yaml": GOOD, "elsewhere/keep.txt": "x\n"},
                                      setup=_planted(f"{OUT}/probes", "../../elsewhere"))
CASES["results_name_a_link_outside"] = Case(["search", "job.yaml"], f"{OUT} is a link (to ../elsewhere)",
                                            {"job.yaml": GOOD, "elsewhere/keep.txt": "x\n"},
                                            setup=_planted(OUT, "../elsewhere"))
CASES["probe_log_a_fifo"] = Case(["search", "job.yaml"], f"{OUT}/probes/trial-0000.log is not a regular file",
                                 {"job.yaml": GOOD}, setup=_fifo_at(f"{OUT}/probes/trial-0000.log"), seconds=5)
CASES["study_lock_a_link"] = Case(["search", "job.yaml"], f"studies/{NAME}.db.lock is a link (to ../made.txt)",
                                  {"job.yaml": GOOD}, setup=_planted(f"studies/{NAME}.db.lock", "../made.txt"))
CASES["study_lock_a_fifo"] = Case(["search", "job.yaml"], f"studies/{NAME}.db.lock is not a regular file",
                                  {"job.yaml": GOOD}, setup=_fifo_at(f"studies/{NAME}.db.lock"), seconds=5)
CASES["study_db_a_link"] = Case(["search", "job.yaml"], f"studies/{NAME}.db is a link (to ../other.db)",
                                {"job.yaml": GOOD}, setup=_planted(f"studies/{NAME}.db", "../other.db"))
CASES["study_journal_a_link"] = Case(["search", "job.yaml"], f"studies/{NAME}.db-journal is a link",
                                     {"job.yaml": GOOD}, setup=_planted(f"studies/{NAME}.db-journal", "../j"))
# Refused before the first probe, not after every one of them ran:
CASES["best_yaml_a_folder"] = Case(["search", "job.yaml"], f"{OUT}/best.yaml is a folder, where fitfinder writes",
                                   {"job.yaml": GOOD}, setup=_folder_at(f"{OUT}/best.yaml"))
CASES["probes_a_file"] = Case(["search", "job.yaml"], f"{OUT}/probes is a file, where fitfinder keeps a folder",
                              {"job.yaml": GOOD}, setup=_file_at(f"{OUT}/probes"))
CASES["tiers_results_read_only"] = Case(["tiers", "job.yaml"], f"--results-dir results/{NAME}: results is not "
                                        "writable", {"job.yaml": GOOD},
                                        setup=lambda folder: read_only(folder / "results"), seconds=5)
CASES["tiers_folder_a_file"] = Case(["tiers", "job.yaml", "--write"], f"{OUT}/tiers is a file", {"job.yaml": GOOD},
                                    setup=_file_at(f"{OUT}/tiers"))
CASES["tiers_json_a_fifo"] = Case(["tiers", "job.yaml"], f"{OUT}/tiers.json is not a regular file",
                                  {"job.yaml": GOOD}, setup=_fifo_at(f"{OUT}/tiers.json"), seconds=5)
for card in ("nan", "inf", "1e300", "1e-300", "0"):  # tracebacks, and a card of 0 bytes
    job(f"tiers_cards_{card}", GOOD, f"--cards: sizes in GiB must be between 1/1024 (1 MiB) and 1048576 (1 PiB), got "
        f"{card}", "--cards", card, command="tiers")


# -- issue 35: a study storage that is not one ----------------------------------------------------------
def _someone_elses_db(folder: Path):
    with sqlite3.connect(folder / "someone_elses.db") as db:
        db.execute("CREATE TABLE customers (id INTEGER)")


CASES["storage_a_foreign_database"] = Case(["search", "job.yaml", "--storage", "sqlite:///someone_elses.db"],
                                           "someone_elses.db is not an Optuna study database", {"job.yaml": GOOD},
                                           setup=_someone_elses_db)  # Optuna added its 13 tables to it
CASES["studies_db_a_foreign_database"] = Case(["search", "job.yaml"], f"studies/{NAME}.db is not an Optuna study",
                                              {"job.yaml": GOOD, f"studies/{NAME}.db": b"SQLite format 3\0junk"})
for url in ("sqlite:///", "sqlite://", "sqlite:///:memory:"):  # a study that ends with the search
    job(f"storage_in_memory_{url.count('/')}{'m' if 'memory' in url else ''}", GOOD,
        f"--storage {url}: an in-memory SQLite study ends with the search and cannot be resumed", "--storage", url)


# -- issue 35: a local model folder's files (bounded work whatever they say) ------------------------------
FLUX_TINY = ROOT / "src" / "fitfinder" / "archs" / "flux-tiny.json"
LOCAL = edit("  weights: random     #", "  weights: pretrained  #",
             edit('name_or_path: "fitfinder/flux-tiny"', 'name_or_path: "model"'))


def _model_folder(transformer: str | None = None, kind: str = "file"):
    """The tiny Flux as a diffusers folder `model/` (its parts' config.json, no weights), with the
    transformer's config.json replaced by `transformer` (text), a folder or a FIFO."""
    import json

    def setup(folder: Path):
        for part, config in json.loads(FLUX_TINY.read_text())["parts"].items():
            (folder / "model" / part).mkdir(parents=True)
            (folder / "model" / part / "config.json").write_text(json.dumps(config))
        config = folder / "model" / "transformer" / "config.json"
        if kind == "folder":
            config.unlink()
            config.mkdir()
        elif kind == "fifo":
            config.unlink()
            os.mkfifo(config)
        elif transformer is not None:
            config.write_text(transformer)

    return setup


def _transformer_with(key: str, value: str) -> str:
    import json

    config = json.loads(FLUX_TINY.read_text())["parts"]["transformer"]
    config[key] = "@"
    return json.dumps(config).replace('"@"', value)


CONFIG = "model/transformer/config.json"
for name, setup, expected, command in (
        ("million_layers", _model_folder(_transformer_with("num_layers", "1000000")),  # an hour, before
         "num_layers: expected a number of layers, a whole number from 0 to 1024, got 1000000", "estimate"),
        ("million_layers_search", _model_folder(_transformer_with("num_single_layers", "1000000")),
         "num_single_layers: expected a number of layers", "search"),
        ("not_json", _model_folder("this is not JSON\n"), "not valid JSON (Expecting value", "estimate"),
        ("a_list", _model_folder("[1, 2]"), "expected a JSON object ({...}), got list [1, 2]", "estimate"),
        ("a_folder", _model_folder(kind="folder"), "is a folder, not a JSON file", "search"),
        ("a_fifo", _model_folder(kind="fifo"), "not a regular file (a FIFO or a device)", "estimate"),
        ("nan_heads", _model_folder(_transformer_with("num_attention_heads", "NaN")), "not valid JSON (NaN is not",
         "estimate"),
        ("zero_heads", _model_folder(_transformer_with("num_attention_heads", "0")),
         "num_attention_heads: expected a size, a whole number from 1 to 1048576, got 0", "estimate"),
        ("negative_width", _model_folder(_transformer_with("attention_head_dim", "-4")),
         "attention_head_dim: expected a size, a whole number from 1 to 1048576, got -4", "search"),
        ("fractional_width", _model_folder(_transformer_with("joint_attention_dim", "31.5")),
         "joint_attention_dim: expected a size, a whole number from 1 to 1048576, got 31.5", "estimate"),
        ("huge_list", _model_folder(_transformer_with("axes_dims_rope", str([4] * 5000))),
         "axes_dims_rope: a list of 5000 entries, at most 1024", "estimate"),
        ("over_16_mib", _model_folder("{" + " " * (17 << 20) + "}"), "larger than 16 MiB", "estimate")):
    CASES[f"model_config_{name}"] = Case([command, "job.yaml"], f"{CONFIG}: {expected}", {"job.yaml": LOCAL},
                                         setup=setup, seconds=10)


# -- export: a best.yaml edited by hand --------------------------------------------------------------
BEST = f"results/{NAME}/best.yaml"
for name, text, expected in (
        ("seed_text", sample('seed: "abc"\n        prompts: ["a fox"]'), "sample.seed: expected an integer"),
        ("prompts_a_number", sample("prompts: 5"), "sample.prompts: expected a list of prompts"),
        ("num_repeats_many", dataset('num_repeats: "many"'), "datasets[0].num_repeats: expected a positive integer"),
        ("offload_half", edit("is_flux: true", 'is_flux: true\n        layer_offloading: true\n'
                              '        layer_offloading_transformer_percent: "half"'),
         "model.layer_offloading_transformer_percent: expected a number from 0 to 1, got 'half'"),
        ("bucket_tolerance_zero", dataset("bucket_tolerance: 0"), "datasets[0].bucket_tolerance: expected a positive"),
        ("lr_text", edit("lr: 1e-4", 'lr: "abc"'), "train.lr: expected a number above 0")):
    CASES[f"export_{name}"] = Case(["export", NAME], f"{BEST}: 1 problem: config.process[0].{expected}", {BEST: text})
CASES["export_into_read_only_results"] = Case(["export", NAME], f"results/{NAME}/kohya.toml: cannot write it (",
                                              {BEST: GOOD}, setup=lambda folder: read_only(folder / "results" / NAME))
CASES["export_format_unknown"] = Case(["export", NAME, "--format", "onetrainer"], "--format: expected kohya")
CASES["export_no_winner"] = Case(["export", NAME], f"{BEST}: no such file")


# -- the dashboard ----------------------------------------------------------------------------------
CASES["dashboard_foreign_database"] = Case(["dashboard", "sqlite:///someone_elses.db", "--port", "0"],
                                           "sqlite:///someone_elses.db: not an Optuna study database",
                                           setup=_someone_elses_db)
CASES["dashboard_foreign_file"] = Case(["dashboard", "someone_elses.db", "--port", "0"],
                                       "someone_elses.db: not an Optuna study database", setup=_someone_elses_db)
CASES["dashboard_missing_url"] = Case(["dashboard", "sqlite:///new.db"],
                                      "sqlite:///new.db: no such file; give --create")
CASES["dashboard_unreachable_server"] = Case(["dashboard", "postgresql://fitfinder@127.0.0.1:1/none"],
                                             "postgresql://fitfinder@127.0.0.1:1/none: cannot open it (")
CASES["dashboard_unknown_driver"] = Case(["dashboard", "nosuchdb://host/x"], "nosuchdb://host/x: cannot open it (")
CASES["dashboard_bad_port"] = Case(["dashboard", "--port", "70000"], "--port: must be between 0 and 65535")
CASES["dashboard_no_study"] = Case(["dashboard"], "no studies in studies/")


# -- the runner ---------------------------------------------------------------------------------------
def snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder` and what it is: a file's digest, a link's target, a folder."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            relative = str(path.relative_to(folder))
            if path.is_symlink():
                seen[relative] = "-> " + os.readlink(path)
            elif path.is_dir():
                seen[relative] = "folder"
            elif path.is_file():
                seen[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                seen[relative] = "special"
    return seen


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 80


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_is_one_line_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITFINDER_DEBUG", raising=False)
    for relative, content in case.files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    undo = case.setup(tmp_path) if case.setup else None
    try:
        before = snapshot(tmp_path)
        started = time.monotonic()
        with pytest.raises(SystemExit) as exited:
            cli.main(case.argv)
        seconds = time.monotonic() - started
        after = snapshot(tmp_path)
    finally:
        if undo:
            undo()
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exited.value.code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("fitfinder: error: ") and case.expected in lines[0], lines[0]
    # Short enough to read at once; the longest is an unknown model's, which lists the 24 families.
    assert len(lines[0]) < 500 and "Traceback" not in err and out == ""
    assert after == before  # nothing written: no studies/, no results/, the inputs as they were
    if case.seconds is not None:
        assert seconds < case.seconds, f"{seconds:.2f} s"


# -- a few as real processes: the same line from the installed entry point ------------------------------
@pytest.mark.parametrize("name", ["alias_bomb_network", "option_vram_401_digits", "option_trials_text",
                                  "results_is_a_file"])
def test_hostile_input_as_a_process(name, tmp_path):
    case = CASES[name]
    for relative, content in case.files.items():
        (tmp_path / relative).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    if case.setup:
        case.setup(tmp_path)
    before = snapshot(tmp_path)
    assert_one_clean_line(run_cli(*case.argv, cwd=tmp_path, timeout=60), case.expected)
    assert snapshot(tmp_path) == before


# -- result files: the umask's mode, and a full disk in one line ----------------------------------
def test_result_files_take_the_mode_the_umask_gives(tmp_path):
    """mkstemp makes 0600 files; written through it, results were unreadable by the group under umask 022."""
    from fitfinder import files, space
    from fitfinder.trainers import aitoolkit_job
    from fitfinder.results import report

    job = aitoolkit_job.load(DEMO)
    old = os.umask(0o022)
    try:
        files.write_atomic(tmp_path / "plain.txt", "x\n")
        built = space.build(job)
        best = report.export_best(job, built, built.lightest(), tmp_path / "results", ["a fact"])
        os.umask(0o077)
        files.write_atomic(tmp_path / "private.txt", "x\n")
    finally:
        os.umask(old)
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == 0o644
    assert best.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "private.txt").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.rglob(".*")] == []  # no temporary file left behind


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path):
    from fitfinder import files
    from fitfinder.errors import UserError

    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, which only root can mount")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs here: {mounted.stderr.decode()[:100]}")
    try:
        with pytest.raises(UserError) as caught:
            files.write_atomic(small / "report.html", "x" * 1_000_000)
        left = list(small.iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert str(caught.value) == f"{small / 'report.html'}: cannot write it (No space left on device)"
    assert left == []


def test_the_checks_refuse_nothing_a_real_job_holds():
    """The LoRA jobs of AI Toolkit's examples, the demo, an empty `neg:` or `trigger_word:` (null), a learning
    rate PyYAML reads as text ("1e-4"), and seed -1 still load."""
    from fitfinder.trainers import aitoolkit_job

    for path in [DEMO, *sorted((ROOT / "examples" / "aitk").glob("*lora*.yaml"))]:
        aitoolkit_job.load(path)
    job = aitoolkit_job.loads(sample("neg:\n        seed: -1").replace("lr: 1e-4", 'lr: "1e-4"')
                          .replace("      training_folder:", "      trigger_word:\n      training_folder:"), "job.yaml")
    assert (job.get("sample.neg"), job.get("trigger_word"), job.get("sample.seed"), job.get("train.lr")) == \
        (None, None, -1, "1e-4")


def test_the_batch_divisors_take_square_root_steps():
    """`batch_size: 10000000000` hung the divisor loop; the job check refuses it now, and the loop
    itself gives the same divisors as counting up, in sqrt(n) steps."""
    from fitfinder.trainers.aitoolkit import divisors_of

    assert all(divisors_of(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 2000))
    started = time.monotonic()
    assert divisors_of(10**10)[-3:] == [2_500_000_000, 5_000_000_000, 10**10]
    assert time.monotonic() - started < 1


# -- issue 35: bounded work, and files opened so that nothing planted there is followed --------------
def test_a_job_with_thousands_of_prompts_or_processes_is_applied_at_once():
    """Every probe applies its point to a copy of the job (space.apply); ruamel's own deep copy is
    quadratic in a list's length (1000 prompts: 27 s; issue 35's 9000 prompts and 9900 `process`
    entries stalled a search). The copy shares what the point does not change (copy-on-write):
    the base file and its comments stay as they were."""
    from fitfinder import space
    from fitfinder.trainers import aitoolkit_job

    prompts = "        prompts:\n" + "".join(f'          - "a photo number {i}"  # {i}\n' for i in range(3000))
    processes = "".join(f"    - other{i}\n" for i in range(3000))
    for text in (sample(prompts.strip()), GOOD.replace("\nmeta:", "\n" + processes + "meta:")):
        job = aitoolkit_job.loads(text, "job.yaml")
        built = space.build(job)
        started = time.monotonic()
        lightest, desired = built.apply(job, built.lightest()), built.apply(job, built.desired())
        seconds = time.monotonic() - started
        assert seconds < 1, f"{seconds:.1f} s"  # copy-on-write: milliseconds; a deep copy: minutes
        assert (lightest.get("train.batch_size"), desired.get("train.batch_size"), job.get("train.batch_size")) \
            == (1, 4, 4)
    written = lightest.dumps()  # the last job: its 3000 other processes kept, comments too
    assert written.count("    - other") == 3000 and "(buckets; the largest is the memory peak)" in written
    assert job.dumps() == aitoolkit_job.loads(text, "job.yaml").dumps()  # the base file as it was read


def test_a_copy_never_writes_through_a_plain_mapping_set_from_python():
    """A mapping set from Python (`job.set("train.ema_config", {...})`) is a plain dict, not a
    ruamel node: a copy that changes a key below it changes its own, never the base's (the base
    job's EMA was switched off by one probe's point, and every later probe inherited it)."""
    from fitfinder.trainers import aitoolkit_job

    job = aitoolkit_job.loads(GOOD, "job.yaml")
    job.set("train.ema_config", {"use_ema": True, "ema_decay": 0.99})
    first, second = job.copy(), job.copy()
    first.set("train.ema_config.use_ema", False)
    assert (job.get("train.ema_config.use_ema"), first.get("train.ema_config.use_ema"),
            second.get("train.ema_config.use_ema")) == (True, False, True)


def test_a_probe_log_is_never_written_through_a_link_a_fifo_or_a_second_name(tmp_path):
    """What the probe's child does with its log (recipe.child_main): the link's target, the FIFO
    and the hard-linked file are left as they were; a log of its own is emptied and reused."""
    from fitfinder import files

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tmp_path / "link.log").symlink_to(victim)
    os.link(victim, tmp_path / "second_name.log")
    os.mkfifo(tmp_path / "fifo.log")
    refused = {}
    for name in ("link.log", "second_name.log", "fifo.log"):
        started = time.monotonic()
        with pytest.raises(OSError) as raised:
            files.open_own(tmp_path / name, truncate=True)
        refused[name] = raised.value
        assert time.monotonic() - started < 1  # a FIFO with no reader is refused, not waited on
    assert victim.read_text() == "keep me\n"
    assert "(a hard link)" in str(refused["second_name.log"])
    (tmp_path / "own.log").write_text("an older probe's output\n")
    fd = files.open_own(tmp_path / "own.log", truncate=True)
    os.write(fd, b"new\n")
    os.close(fd)
    assert (tmp_path / "own.log").read_text() == "new\n"


def test_a_bounded_read_ends_on_dev_zero_a_fifo_and_a_folder(tmp_path):
    from fitfinder import files
    from fitfinder.errors import UserError

    os.mkfifo(tmp_path / "fifo")
    for path, expected in (("/dev/zero", "not a regular file"), (tmp_path / "fifo", "not a regular file"),
                           (tmp_path, "is a folder")):
        with pytest.raises(UserError) as raised:
            files.read_bounded(path, 1 << 20)
        assert expected in str(raised.value)
    (tmp_path / "big").write_bytes(b"x" * (2 << 20))
    with pytest.raises(UserError) as raised:
        files.read_bounded(tmp_path / "big", 1 << 20)
    assert "larger than 1 MiB" in str(raised.value)


def test_every_shipped_architecture_passes_the_model_folder_checks():
    """The caps on a model folder's config.json (models._checked_part) refuse no real model: every
    shipped architecture, full-size ones included, is within them."""
    from fitfinder import models

    problems = {(stem, part): models._checked_part(config) for stem, arch in models.known_archs().items()
                for part, config in arch["parts"].items()}
    assert {key: problem for key, problem in problems.items() if problem} == {}
