"""The project's job files of AI Toolkit's examples (examples/aitk/): each reads, and each says truly
whether fitfinder can estimate and probe its model today."""

import pytest

from fitfinder import models, trainers
from fitfinder.trainers import aitoolkit_job
from fitfinder.errors import ConfigError
from tests.conftest import EXAMPLES, assert_one_clean_line, run_cli, supports_line

AITK_COMMIT = "27a03a91f23eb1b757d5ec2e80ee3e129cfcc350"

# Every training example of AI Toolkit's config/examples/ at that commit (train_slider.example.yml
# trains an SD 1.5 slider without a dataset, and extract, generate and mod_lora_scale train nothing),
# and one job per arch of its UI that has no example (video, Z-Image, FLUX.2, HiDream E1): the shipped
# architecture each resolves to.
SUPPORTED = {
    "train_lora_flux_24gb": "flux-dev", "modal_train_lora_flux_24gb": "flux-dev",
    "ui_flux": "flux-dev", "ui_flux_lokr": "flux-dev",
    "train_lora_flux_schnell_24gb": "flux-schnell", "modal_train_lora_flux_schnell_24gb": "flux-schnell",
    "train_lora_flex_24gb": "flex1-alpha",
    "train_lora_wan21_14b_24gb": "wan21-14b", "train_lora_wan21_1b_24gb": "wan21-1.3b",
    "train_lora_wan22_14b_24gb": "wan22-14b",
    "ui_wan21_i2v": "wan21-i2v-14b", "ui_wan22_14b_i2v": "wan22-i2v-14b", "ui_wan22_5b": "wan22-ti2v-5b",
    "train_full_fine_tune_flex": "flex1-alpha",
    "train_lora_flux_kontext_24gb": "flux-kontext-dev",
    "train_lora_flex2_24gb": "flex2-preview",
    "train_lora_chroma_24gb": "chroma",
    "train_lora_sd35_large_24gb": "sd35-large",
    "train_lora_lumina": "lumina2", "train_full_fine_tune_lumina": "lumina2",
    "ui_zimage_turbo": "zimage-turbo",
    "ui_ltx2": "ltx2",
    "train_lora_hidream_48": "hidream-i1-full", "ui_hidream_e1": "hidream-e1-1",
    "ui_nucleus_image": "nucleus-image",
    "ui_flux2": "flux2-dev", "ui_flux2_klein_4b": "flux2-klein-4b", "ui_flux2_klein_9b": "flux2-klein-9b",
    "train_lora_qwen_image_24gb": "qwen-image", "train_lora_qwen_image_edit_32gb": "qwen-image-edit",
    "train_lora_qwen_image_edit_2509_32gb": "qwen-image-edit-2509",
    "ui_sd15": "sd15",
    "ui_anima": "anima",
}
# Known to fitfinder, with an architecture config, but no family module yet: what the CLI says.
NOT_YET = {
    "train_lora_omnigen2_24gb": ("model.arch 'omnigen2'", "omnigen2"),
}
# Jobs that train an adapter (Redux), neither a LoRA nor the denoiser: refused by the job file's checks.
NO_LORA = {
    "train_flex_redux": ["adapter: fitfinder probes LoRA jobs and full fine-tunes, not adapter training"],
}


def test_every_job_file_is_listed_once_with_its_outcome():
    stems = sorted(path.stem for path in EXAMPLES.glob("*.yaml"))
    assert stems == sorted([*SUPPORTED, *NOT_YET, *NO_LORA])


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.stem)
def test_every_job_file_names_the_ai_toolkit_source_it_carries(path):
    header = " ".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    source = "ui/src/app/jobs/new/options.tsx" if path.stem.startswith("ui_") else f"{path.stem}.yaml"
    assert source in header and "ostris/ai-toolkit" in header
    if path.stem not in ("train_lora_flux_24gb", "train_lora_wan22_14b_24gb"):  # written before the commit was named
        assert f"commit {AITK_COMMIT}" in header


@pytest.mark.parametrize("stem", sorted(SUPPORTED))
def test_jobs_of_supported_families_give_a_model_spec_of_their_shipped_architecture(stem):
    job = aitoolkit_job.load(EXAMPLES / f"{stem}.yaml")
    assert trainers.architecture_spec(job)["arch_name"] == SUPPORTED[stem]
    job.settings = job.settings.with_options(weights="random")
    spec = trainers.model_spec(job)
    assert (spec["family"], spec["arch_name"], spec["weights"]) == (
        models.known_archs()[SUPPORTED[stem]]["family"], SUPPORTED[stem], "random")


@pytest.mark.parametrize("stem", sorted(NOT_YET))
def test_jobs_of_families_to_come_read_and_are_told_so_in_one_line(stem, tmp_path):
    path = EXAMPLES / f"{stem}.yaml"
    aitoolkit_job.load(path)  # the job file itself is fine
    model, family = NOT_YET[stem]
    done = run_cli("estimate", str(path), "--vram", "24GiB", cwd=tmp_path)
    assert_one_clean_line(done, f"fitfinder: error: {path}: config.process[0].model: fitfinder knows {model} but "
                                f"cannot probe the {family} family yet; " + supports_line())


@pytest.mark.parametrize("stem", sorted(NO_LORA))
def test_jobs_without_a_lora_are_refused_by_the_job_file_checks(stem):
    with pytest.raises(ConfigError) as raised:
        aitoolkit_job.load(EXAMPLES / f"{stem}.yaml")
    problems = [problem.removeprefix("config.process[0].") for problem in raised.value.problems]
    assert len(problems) == len(NO_LORA[stem])
    assert all(problem.startswith(start) for problem, start in zip(problems, NO_LORA[stem]))


@pytest.mark.slow
@pytest.mark.parametrize("stem, tiny", [("train_lora_flux_schnell_24gb", "flux-schnell-tiny"),
                                        ("train_lora_flex_24gb", "flux-tiny")])
def test_schnell_and_flex_jobs_probe_through_the_flux_family_on_a_tiny_arch(stem, tiny, tmp_path):
    import json

    job = aitoolkit_job.load(EXAMPLES / f"{stem}.yaml")
    job.set("model.name_or_path", tiny)
    job.set("datasets[0].resolution", [64, 96, 128])
    job.set("sample.width", 128)
    job.set("sample.height", 128)
    path = tmp_path / "job.yaml"
    path.write_text(job.dumps() + "fitfinder:\n  weights: random\n")
    done = run_cli("probe", str(path), "--vram", "1GiB", "--json", cwd=tmp_path,
                   FITFINDER_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "ok"
    assert list(result["phases"]) == ["load", "text_encoder", "latents", "sample", "train", "last_sample"]
