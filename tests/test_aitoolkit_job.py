
import pytest

from fitfinder import files
from fitfinder.trainers import aitoolkit_job
from fitfinder.errors import ConfigError, UserError
from tests.conftest import DEMO, EXAMPLES


def test_reads_ai_toolkit_reference_jobs_with_their_defaults():
    flux = aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")
    assert flux.name == "flux_dev_lora_24gb"
    assert flux.get("network.linear") == 16
    assert flux.get("datasets[*].resolution") == [[512, 768, 1024]]
    assert flux.get("model.quantize") is True
    assert flux.get("sample.num_frames") == 1  # left out: AI Toolkit's default
    assert flux.get("model.low_vram") is False
    assert flux.accumulation_key == "train.gradient_accumulation_steps"
    wan = aitoolkit_job.load(EXAMPLES / "train_lora_wan22_14b_24gb.yaml")
    assert wan.get("model.arch") == "wan22_14b"
    assert wan.accumulation_key == "train.gradient_accumulation"


def test_a_comment_the_new_value_contradicts_is_marked_as_about_the_old_one():
    job = aitoolkit_job.load(DEMO)
    job.set("train.gradient_checkpointing", True)
    job.set("train.batch_size", 4)  # unchanged: its comment, if any, stays as it is
    job.set("sample.width", 256)
    text = job.dumps()
    assert "gradient_checkpointing: true   # fitfinder: was false (off: faster, but needs the most memory)" in text
    assert "width: 256  # previews: denoising, then the VAE decode at this size" in text
    job.set("train.gradient_checkpointing", False)  # and back: the first value stays the one named
    assert "# fitfinder: was false (off: faster" in job.dumps()


def test_set_by_path_keeps_comments_and_order(tmp_path):
    job = aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")
    job.set("datasets[*].resolution", [512, 768])
    job.set("train.batch_size", 2)
    job.set("sample.num_frames", 1)  # a key the file did not have
    out = job.write(tmp_path / "out.yaml", ["header line"])
    text = out.read_text()
    assert text.startswith("# header line\n---\n")
    # a changed key's comment spoke of its old value: kept, marked as about that value
    assert "resolution: [512, 768]" in text
    assert "# fitfinder: was [512, 768, 1024] (three buckets: the largest decides the train peak)" in text
    assert "batch_size: 2" in text
    assert "# recompute activations: slower, far lighter" in text
    again = aitoolkit_job.load(out)
    assert again.get("datasets[0].resolution") == [512, 768]
    assert again.get("sample.num_frames") == 1
    keys = list(again.process["train"].keys())
    assert keys.index("batch_size") < keys.index("steps")


def test_fitfinder_section_is_read_and_left_out_of_the_written_file(tmp_path):
    job = aitoolkit_job.load(DEMO)
    assert job.settings.weights == "random"
    assert job.settings.vram_bytes > 0
    assert job.settings.margin == 0.05 and job.settings.probe_steps == 20
    text = job.dumps()
    assert "fitfinder:" not in text.split("meta:")[1]


def test_command_line_options_win_over_the_file():
    job = aitoolkit_job.load(DEMO)
    merged = job.settings.with_options(margin=0.1, probe_steps=None)
    assert merged.margin == 0.1
    assert merged.probe_steps == job.settings.probe_steps


def test_every_problem_is_reported_at_once_with_its_key_path():
    text = DEMO.read_text().replace("linear: 32", "linear: -4").replace("batch_size: 4", "batch_size: zero")
    text = text.replace("\n  vram: ", "\n  colour: blue\n  vram: ")
    with pytest.raises(ConfigError) as caught:
        aitoolkit_job.loads(text, "bad.yaml")
    problems = caught.value.problems
    assert len(problems) == 3
    assert any(p.startswith("fitfinder.colour: unknown key") for p in problems)
    assert any(p.startswith("config.process[0].network.linear: expected a positive integer") for p in problems)
    assert any(p.startswith("config.process[0].train.batch_size: expected a positive integer") for p in problems)


def test_refuses_to_write_over_its_input(tmp_path):
    source = tmp_path / "job.yaml"
    source.write_text(DEMO.read_text())
    job = aitoolkit_job.load(source)
    with pytest.raises(UserError):
        job.write(source)
    assert source.read_text() == DEMO.read_text()


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    files.write_atomic(tmp_path / "a" / "b.txt", "hello")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.txt"]
