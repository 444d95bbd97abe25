"""diagnose: the guides' table applied to a job file, and reading logs as users have them."""

import re
from pathlib import Path

import pytest

from fitfinder import diagnose
from fitfinder.trainers import aitoolkit_job
from fitfinder.errors import UserError

LOGS = Path(__file__).parent / "logs"

JOB = """\
# my Flux LoRA (comments must survive)
job: extension
config:
  name: style_flux_v2
  process:
    - type: sd_trainer
      network:
        type: lora
        linear: 32          # rank
        linear_alpha: 32
      datasets:
        - folder_path: /data/style_refs
          resolution: [512, 768, 1024]   # buckets
      train:
        batch_size: 2
        gradient_accumulation_steps: 2
        gradient_checkpointing: false   # off: faster
      model:
        name_or_path: black-forest-labs/FLUX.1-dev
        quantize: true
      sample:
        width: 1024
        height: 1024
"""


def _job(tmp_path: Path, text: str = JOB, **edits: str) -> Path:
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def _diagnose(log: str, job_path: Path | None = None):
    job = aitoolkit_job.load(job_path) if job_path else None
    return diagnose.diagnose(diagnose.read_log(LOGS / log), job, log)


@pytest.mark.parametrize("edits, lever, changes", [
    ({}, "checkpointing", [("train.gradient_checkpointing", False, True)]),
    ({"gradient_checkpointing: false": "gradient_checkpointing: true"}, "batch",
     [("train.batch_size", 2, 1), ("train.gradient_accumulation_steps", 2, 4)]),
    ({"gradient_checkpointing: false": "gradient_checkpointing: true", "batch_size: 2": "batch_size: 1"},
     "bucket", [("datasets[0].resolution", [512, 768, 1024], [512, 768])]),
    ({"gradient_checkpointing: false": "gradient_checkpointing: true", "batch_size: 2": "batch_size: 1",
      "[512, 768, 1024]": "[512]"}, "low_vram", [("model.low_vram", False, True)]),
], ids=["checkpointing first", "then batch 1 keeping the effective batch", "then the largest bucket",
        "then low_vram (quantize is on)"])
def test_steps_1_10_walks_the_image_rollback_order(tmp_path, edits, lever, changes):
    answer = _diagnose("aitk_flux_3_times_in_a_row.log", _job(tmp_path, **edits))
    assert (answer.row, answer.lever, answer.changes) == ("steps_1_10", lever, changes)


def test_a_single_bucket_steps_down_instead_of_vanishing(tmp_path):
    job = _job(tmp_path, **{"gradient_checkpointing: false": "gradient_checkpointing: true",
                            "batch_size: 2": "batch_size: 1", "[512, 768, 1024]": "1024"})
    answer = _diagnose("aitk_flux_3_times_in_a_row.log", job)
    assert answer.changes == [("datasets[0].resolution", 1024, 768)]


def test_a_video_job_gives_up_frames_first(tmp_path):
    job = _job(tmp_path, **{"resolution: [512, 768, 1024]": "resolution: [512]\n          num_frames: 81"})
    answer = _diagnose("aitk_flux_3_times_in_a_row.log", job)
    assert (answer.lever, answer.changes) == ("frames", [("datasets[0].num_frames", 81, 41)])
    assert answer.cause.startswith("too many frames per clip")


def test_when_every_lever_is_taken_it_says_so_and_points_to_search(tmp_path):
    answer = _diagnose("aitk_flux_load_quantizing.log",
                       _job(tmp_path, **{"quantize: true": "quantize: true\n        low_vram: true"}))
    assert (answer.row, answer.lever, answer.changes) == ("load", None, [])
    assert answer.first_change.startswith("none left") and "fitfinder search" in answer.next_step


def test_the_job_file_decides_conservative_not_the_log(tmp_path):
    # The log's own config is conservative (environment); the job given says batch 2 without checkpointing.
    assert _diagnose("aitk_wan_cublas_conservative.log").kind == "environment"
    answer = _diagnose("aitk_wan_cublas_conservative.log", _job(tmp_path))
    assert (answer.kind, answer.row, answer.lever) == ("config", "steps_1_10", "checkpointing")


def test_environment_changes_nothing_in_the_job(tmp_path):
    job = _job(tmp_path)
    out = tmp_path / "fixed.yaml"
    answer = diagnose.run(LOGS / "aitk_flux_dirty_card.log", job, out)
    assert (answer.kind, answer.changes, answer.written) == ("environment", [], None)
    assert answer.first_change.startswith("do not relaunch")
    assert not out.exists() and any("nothing written" in note for note in answer.notes)


def test_run_writes_the_first_change_with_comments_and_a_header(tmp_path):
    job = _job(tmp_path)
    before = job.read_bytes()
    out = tmp_path / "fixed.yaml"
    answer = diagnose.run(LOGS / "aitk_flux_3_times_in_a_row.log", job, out)
    assert answer.written == str(out) and job.read_bytes() == before
    text = out.read_text()
    assert text.startswith("# fitfinder diagnose: the first change after the OOM in aitk_flux_3_times_in_a_row.log")
    assert "#   train.gradient_checkpointing: false -> true" in text
    assert re.search(r"gradient_checkpointing: true +# fitfinder: was false \(off: faster\)", text)
    assert "# rank" in text and "# buckets" in text
    assert aitoolkit_job.load(out).get("train.gradient_checkpointing") is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixed.yaml", "job.yaml"]  # no temporary file left


def test_the_answer_for_a_sample_oom_halves_the_preview(tmp_path):
    answer = _diagnose("kohya_flux_sample_step500.log", _job(tmp_path))
    assert (answer.row, answer.changes) == ("sample", [("sample.width", 1024, 512), ("sample.height", 1024, 512)])


@pytest.mark.parametrize("paths, message", [
    (("missing.log", None, None), "missing.log: no such file"),
    (("aitk_flux_dirty_card.log", None, "fixed.yaml"), "-o: needs --job"),
    (("aitk_flux_dirty_card.log", "job.yaml", "job.yaml"), "is the input job file"),
    (("aitk_flux_dirty_card.log", "job.yaml", "aitk_flux_dirty_card.log"), "is the log being read"),
])
def test_bad_paths_are_refused_before_anything_is_read(tmp_path, paths, message):
    log, job, out = paths
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "aitk_flux_dirty_card.log").write_text((LOGS / "aitk_flux_dirty_card.log").read_text())
    with pytest.raises(UserError) as caught:
        diagnose.run(tmp_path / log, tmp_path / job if job else None, tmp_path / out if out else None)
    assert message in str(caught.value)
    assert (tmp_path / "job.yaml").read_text() == JOB


def test_a_powershell_utf16_log_with_colours_reads_like_any_other(tmp_path):
    text = (LOGS / "kohya_sdxl_step3_torch20.log").read_text(encoding="utf-8")
    coloured = text.replace("running training", "\x1b[32mrunning training\x1b[0m")
    path = tmp_path / "train.log"
    path.write_bytes(b"\xff\xfe" + coloured.encode("utf-16-le"))
    assert diagnose.read_log(path) == text
    answer = diagnose.diagnose(diagnose.read_log(path), None, "train.log")
    assert (answer.kind, answer.step, answer.lever) == ("config", 3, "checkpointing")


def test_conservative_needs_every_setting_known_and_fails_on_any_known_heavy_one():
    assert diagnose.Settings("log", batch=1, checkpointing=True, buckets=[512, 768]).conservative() is True
    assert diagnose.Settings("log", batch=1, checkpointing=None, buckets=[512]).conservative() is None
    assert diagnose.Settings("log", batch=4, checkpointing=None, buckets=None).conservative() is False
    assert diagnose.Settings("log", batch=1, checkpointing=True, buckets=[512], frames=81).conservative() is False


def test_the_table_rows_are_those_of_the_guides():
    assert [row.key for row in diagnose.ROWS.values()] == [
        "load", "text_encoder", "latents", "first_sample", "before_step_1", "steps_1_10", "sample", "later",
        "intermittent", "environment", "host"]
    for row in diagnose.ROWS.values():
        assert set(row.levers) | set(row.video_levers or ()) <= set(diagnose.LEVERS)


def test_the_documented_table_is_the_one_in_the_code():
    table = (Path(__file__).parents[1] / "docs" / "diagnose.md").read_text()
    for row in diagnose.ROWS.values():
        assert f"| {row.cause} |" in table, row.key


# -- the machine's RAM ----------------------------------------------------------------------------------
HOST_LOG = "onetrainer_save_memoryerror.log"  # OneTrainer#835: MemoryError saving, RAM and pagefile full


def test_host_ram_is_answered_with_ram_changes_never_a_gpu_setting():
    answer = _diagnose(HOST_LOG)
    assert (answer.kind, answer.row, answer.lever) == ("host", "host", "cache_to_disk")
    assert answer.first_change.startswith("cache latents to disk instead of holding them in system RAM")
    gpu_levers = {lever for row in diagnose.ROWS.values() if row.key != "host"
                  for lever in row.levers + (row.video_levers or ())}
    assert set(diagnose.ROWS["host"].levers) == {"cache_to_disk", "fewer_workers", "more_swap"}
    assert not set(diagnose.ROWS["host"].levers) & gpu_levers


@pytest.mark.parametrize("edits, lever, changes", [
    ({}, "cache_to_disk", [("datasets[0].cache_latents_to_disk", False, True)]),
    ({"resolution: [512, 768, 1024]   # buckets":
      "resolution: [512, 768, 1024]\n          cache_latents_to_disk: true"},
     "fewer_workers", [("datasets[0].num_workers", 2, 0)]),  # AI Toolkit's default is 2 workers
    ({"resolution: [512, 768, 1024]   # buckets":
      "resolution: [512, 768, 1024]\n          cache_latents_to_disk: true\n          num_workers: 0"},
     "more_swap", []),
], ids=["cache to disk first", "then no data-loader workers", "then swap: no job key to change"])
def test_host_walks_its_own_order_on_a_job(tmp_path, edits, lever, changes):
    answer = _diagnose(HOST_LOG, _job(tmp_path, **edits))
    assert (answer.row, answer.lever, answer.changes) == ("host", lever, changes)


def test_flags_in_the_log_decide_the_host_levers():
    text = (LOGS / HOST_LOG).read_text() + "\n--cache_latents_to_disk --max_data_loader_n_workers 8\n"
    answer = diagnose.diagnose(text, None, "x.log")
    assert (answer.lever, answer.first_change) == (
        "fewer_workers", "fewer data-loader workers: each holds its own copy of what it loads in RAM "
        "(dataloader threads: 1)")


# -- a log the rules cannot place ------------------------------------------------------------------------
def test_an_unplaced_oom_says_which_line_and_what_was_looked_at():
    bare = _diagnose("kohya_ss_flux_l40s_start.log")  # kohya_ss#2724: the message alone
    assert (bare.phase, bare.unplaced) == ("unknown", (
        'line 1 ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.00 MiB. GPU 0 has a total '
        'capacty of 44.53 GiB of which 15.25 MiB is free. Including no..."): no traceback frame around it, and no '
        "progress line before it names a phase (loading, caching, sampling, a training bar)"))
    framed = _diagnose("xflux_deepspeed_sigkill.log")  # x-flux#55: the launcher's traceback only
    assert framed.unplaced.startswith('line 1 ("E0818 12:39:45.949000') and \
        "none of the 6 traceback frames around it names a phase's work" in framed.unplaced
    assert _diagnose("aitk_flux2_quantizing_mistral.log").unplaced is None  # placed: no explanation
