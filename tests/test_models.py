"""Model families: which family a job names, the shipped architectures, reading archs without torch."""

import json
import subprocess
import sys

import pytest

from fitfinder import models, trainers
from fitfinder.trainers import aitoolkit
from fitfinder.errors import UserError
from tests.conftest import DEMO, EXAMPLES, cli_env, supports_line, tiny_job


@pytest.mark.parametrize("changes, family", [
    ({"model.arch": "flux"}, "flux"),
    ({"model.arch": "sdxl"}, "sdxl"),
    ({"model.arch": "wan21"}, "wan21"),
    ({"model.arch": "wan21:14b"}, "wan21"),  # the UI's arch:variant form
    ({"model.arch": "wan21_14b"}, "wan21"),
    ({"model.arch": "wan22_14b"}, "wan22"),
    ({"model.arch": "sd3"}, "sd3"),
    ({"model.arch": "lumina2"}, "lumina2"),
    ({"model.arch": "zimage:turbo"}, "zimage"),
])
def test_family_from_model_arch(changes, family):
    assert aitoolkit.family_of(tiny_job("flux", changes)) == family


@pytest.mark.parametrize("model, family", [
    ({"name_or_path": "/models/mine", "is_flux": True}, "flux"),
    ({"name_or_path": "/models/mine", "is_xl": True}, "sdxl"),
    ({"name_or_path": "black-forest-labs/FLUX.1-dev"}, "flux"),  # a shipped architecture's name
    ({"name_or_path": "stabilityai/stable-diffusion-xl-base-1.0"}, "sdxl"),
    ({"name_or_path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"}, "wan21"),
    ({"name_or_path": "/models/my-wan2.2-finetune"}, "wan22"),  # the name says it
    ({"name_or_path": "/models/mine", "is_v3": True}, "sd3"),
    ({"name_or_path": "/models/mine", "is_lumina2": True}, "lumina2"),
    ({"name_or_path": "stabilityai/stable-diffusion-3.5-large"}, "sd3"),
    ({"name_or_path": "Tongyi-MAI/Z-Image-Turbo"}, "zimage"),
    ({"arch": "wan21_i2v:14b480p"}, "wan21_i2v"),  # the UI's name:variant form
    ({"name_or_path": "Wan-AI/Wan2.2-I2V-A14B-Diffusers"}, "wan22_i2v"),
    ({"name_or_path": "/models/my-wan2.2-ti2v-finetune"}, "wan22_5b"),  # ti2v is no A14B
    ({"arch": "sd15"}, "sd15"),  # the UI's SD 1.5
    ({"arch": "sd1"}, "sd15"),  # AI Toolkit's ModelConfig name for it
    ({"name_or_path": "runwayml/stable-diffusion-v1-5"}, "sd15"),
])
def test_family_from_flags_or_name(model, family):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == family


def test_an_unknown_model_is_one_line_listing_the_families_without_a_relabelling_hint():
    job = tiny_job("flux")
    job.process["model"] = {"name_or_path": "/models/something"}
    with pytest.raises(UserError) as raised:
        aitoolkit.family_of(job)
    assert str(raised.value) == (
        "<tiny flux job>: config.process[0].model: fitfinder does not support the model /models/something "
        "(neither model.arch, an is_* flag nor its name says which it is); " + supports_line())


@pytest.mark.parametrize("model, told", [
    ({"arch": "omnigen2"}, "model.arch 'omnigen2' but cannot probe the omnigen2 family yet"),
    ({"arch": "ltx2.3"}, "model.arch 'ltx2.3' but cannot probe the ltx2.3 family yet"),
    ({"arch": "krea2:turbo"}, "model.arch 'krea2:turbo' but cannot probe the krea2 family yet"),
    ({"name_or_path": "/models/mine", "is_pixart": True}, "model.is_pixart but cannot probe the pixart family yet"),
])
def test_a_model_fitfinder_knows_but_cannot_probe_yet_is_named_with_its_family(model, told):
    job = tiny_job("flux")
    job.process["model"] = model
    with pytest.raises(UserError) as raised:
        aitoolkit.family_of(job)
    assert str(raised.value) == (f"<tiny flux job>: config.process[0].model: fitfinder knows {told}; "
                                 + supports_line())


@pytest.mark.parametrize("model, family", [
    ({"arch": "flex1"}, "flux"),  # AI Toolkit's ModelConfig turns flex1 into flux
    ({"name_or_path": "black-forest-labs/FLUX.1-schnell", "is_flux": True}, "flux"),
    ({"name_or_path": "ostris/Flex.1-alpha"}, "flux"),
    ({"name_or_path": "/models/my-flex1-finetune"}, "flux"),
])
def test_flux_1_variants_resolve_to_the_flux_family(model, family):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == family


@pytest.mark.parametrize("model, family", [
    ({"arch": "flux_kontext"}, "flux_kontext"),
    ({"name_or_path": "black-forest-labs/FLUX.1-Kontext-dev"}, "flux_kontext"),
    ({"name_or_path": "/models/flux1-kontext-dev-finetune"}, "flux_kontext"),  # kontext outweighs flux
    ({"arch": "flex2"}, "flex2"),
    ({"name_or_path": "/models/my-flex2-finetune"}, "flex2"),
    ({"arch": "chroma"}, "chroma"),
    ({"name_or_path": "lodestones/Chroma1-HD"}, "chroma"),
])
def test_flux_derived_models_resolve_to_their_own_families(model, family):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == family


@pytest.mark.parametrize("model", [{"arch": "hidream"}, {"name_or_path": "HiDream-ai/HiDream-I1-Full"},
                                   {"name_or_path": "/models/my-hidream-i1-finetune"}])
def test_hidream_resolves_by_arch_shipped_name_and_name_hint(model):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == "hidream"


@pytest.mark.parametrize("model", [{"arch": "hidream_e1"}, {"name_or_path": "HiDream-ai/HiDream-E1-1"},
                                   {"name_or_path": "HiDream-ai/HiDream-E1-Full"},
                                   {"name_or_path": "/models/my-hidream-e1-finetune"}])
def test_hidream_e1_resolves_by_arch_shipped_name_and_name_hint_not_as_hidream_i1(model):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == "hidream_e1"


@pytest.mark.parametrize("model, family", [
    ({"arch": "flux2"}, "flux2"), ({"name_or_path": "black-forest-labs/FLUX.2-dev"}, "flux2"),
    ({"name_or_path": "/models/my-flux2-finetune"}, "flux2"),
    ({"arch": "flux2_klein_4b"}, "flux2_klein"), ({"arch": "flux2_klein_9b"}, "flux2_klein"),
    ({"name_or_path": "black-forest-labs/FLUX.2-klein-base-9B"}, "flux2_klein"),
    ({"name_or_path": "/models/my-flux2-klein-finetune"}, "flux2_klein"),
])
def test_flux2_and_klein_resolve_to_their_families(model, family):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == family


@pytest.mark.parametrize("model, family", [
    ({"arch": "qwen_image"}, "qwen_image"), ({"arch": "qwen_image:2512"}, "qwen_image"),
    ({"arch": "qwen_image_edit"}, "qwen_image_edit"), ({"arch": "qwen_image_edit_plus"}, "qwen_image_edit_plus"),
    ({"name_or_path": "Qwen/Qwen-Image"}, "qwen_image"), ({"name_or_path": "Qwen/Qwen-Image-Edit"}, "qwen_image_edit"),
    ({"name_or_path": "Qwen/Qwen-Image-Edit-2509"}, "qwen_image_edit_plus"),
    ({"name_or_path": "/models/my-qwen-image-edit-2509-finetune"}, "qwen_image_edit_plus"),  # the longest hint
])
def test_qwen_image_and_its_edit_models_resolve_to_their_families(model, family):
    job = tiny_job("flux")
    job.process["model"] = model
    assert aitoolkit.family_of(job) == family


def test_an_unknown_arch_is_reported_by_the_job_file_without_a_relabelling_hint():
    from fitfinder.trainers import aitoolkit_job
    from fitfinder.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        aitoolkit_job.loads(tiny_job("flux", {"model.arch": "not_a_model"}).dumps())
    assert raised.value.problems == ["config.process[0].model.arch: fitfinder does not support the model "
                                     "'not_a_model'; " + supports_line()]


def test_the_wan22_reference_job_resolves_to_its_family_and_arch():
    from fitfinder.trainers import aitoolkit_job

    job = aitoolkit_job.load(EXAMPLES / "train_lora_wan22_14b_24gb.yaml")
    assert aitoolkit.family_of(job) == "wan22"
    stem, arch = aitoolkit.shipped_arch(job)
    assert stem == "wan22-14b" and arch["boundary_ratio"] == 0.875
    assert arch["parts"]["transformer"]["num_layers"] == arch["parts"]["transformer_2"]["num_layers"] == 40


def test_every_shipped_arch_describes_its_family_parts():
    archs = models.known_archs()
    assert {"flux-dev", "flux-tiny", "sdxl-base", "sdxl-tiny", "wan21-1.3b", "wan21-14b", "wan21-tiny",
            "wan22-14b", "wan22-tiny"} <= set(archs)
    for stem, arch in archs.items():
        if arch["family"] not in models.FAMILIES:
            continue  # a family still to come: tests/test_archs.py checks its parts
        family = models.FAMILIES[arch["family"]]
        assert set(arch["parts"]) == set(family.parts), stem
        assert arch["names"] and arch["description"] and arch["text_seq_len"] > 0


# Parameter counts of the published models (the parts' classes built from the shipped configs).
PUBLISHED = {
    ("flux-dev", "transformer"): 11_901_408_320, ("flux-dev", "text_encoder"): 123_060_480,
    ("flux-dev", "text_encoder_2"): 4_762_310_656, ("flux-dev", "vae"): 83_819_683,
    ("sdxl-base", "unet"): 2_567_463_684, ("sdxl-base", "text_encoder_2"): 694_659_840,
    ("sdxl-base", "vae"): 83_653_863,
    ("wan21-1.3b", "transformer"): 1_418_996_800, ("wan21-14b", "transformer"): 14_288_491_584,
    ("wan21-14b", "text_encoder"): 5_680_910_336, ("wan21-14b", "vae"): 126_892_531,
}


@pytest.mark.parametrize("stem, part", sorted(PUBLISHED))
def test_full_size_archs_have_the_published_sizes(stem, part):
    import torch

    from fitfinder.models._weights import _construct, part_class

    arch = models.known_archs()[stem]
    with torch.device("meta"):
        module = _construct(part_class(arch["family"], part), arch["parts"][part])
    assert sum(p.numel() for p in module.parameters()) == PUBLISHED[(stem, part)]


def test_a_folder_that_is_not_a_pipeline_says_what_is_missing(tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("{}")
    with pytest.raises(UserError) as raised:
        models.arch_from_folder(tmp_path, "flux")
    assert "not a diffusers flux pipeline folder: no text_encoder/config.json" in str(raised.value)


def test_reading_archs_and_building_a_request_needs_no_torch():
    code = ("import sys, json; from fitfinder import models, probe; from fitfinder.trainers import aitoolkit_job; "
            "models.known_archs(); "
            f"request = probe.request_for(aitoolkit_job.load({str(DEMO)!r}), 20, 'sim', 2**30); "
            "print(json.dumps([request['model']['family'], 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["flux", False]


def test_a_lora_on_animas_text_conditioner_is_refused_not_estimated_short():
    family = models.FAMILIES["anima"]
    assert family.trained_denoisers(tiny_job("anima")) == ["transformer"]
    with pytest.raises(UserError) as raised:
        family.trained_denoisers(tiny_job("anima", {"model.model_kwargs": {"train_text_conditioner": True}}))
    assert "model_kwargs.train_text_conditioner" in str(raised.value)


def test_a_blank_qtype_as_the_ui_writes_for_anima_is_accepted_only_while_unused():
    from fitfinder.trainers import aitoolkit_job
    from fitfinder.errors import ConfigError

    blank = {"model.quantize": False, "model.quantize_te": False, "model.qtype": "", "model.qtype_te": ""}
    job = aitoolkit_job.loads(tiny_job("anima", blank).dumps())
    assert (job.quantize, job.quantize_te) == (False, False)
    with pytest.raises(ConfigError) as raised:
        aitoolkit_job.loads(tiny_job("anima", {**blank, "model.quantize_te": True}).dumps())
    assert [problem.split(":")[0] for problem in raised.value.problems] == [
        "config.process[0].model.qtype", "config.process[0].model.qtype_te"]


@pytest.mark.parametrize("name, gated", [("black-forest-labs/FLUX.1-dev", True), ("Wan-AI/Wan2.1-T2V-14B", False)])
def test_missing_weights_name_hf_download_and_say_when_the_model_is_gated(tmp_path, monkeypatch, name, gated):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(UserError) as raised:
        models.local_weights(name, "job.yaml")
    told = str(raised.value)
    assert f"download it first (`hf download {name}`" in told and "huggingface-cli" not in told
    assert ("it is gated: accept its terms on https://huggingface.co/" in told) is gated
    assert ("`hf auth login`" in told) is gated


def test_full_size_models_are_told_from_the_tiny_ones(tmp_path):
    from fitfinder.trainers import aitoolkit_job

    assert trainers.full_size(aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")) == (
        "black-forest-labs/FLUX.1-dev (flux-dev, flux)")
    assert trainers.full_size(aitoolkit_job.load(DEMO)) is None  # flux-tiny
    folder = tmp_path / "sdxl"  # a local folder: by the weights it holds
    (folder / "unet").mkdir(parents=True)
    with open(folder / "unet" / "diffusion_pytorch_model.safetensors", "wb") as weights:
        weights.truncate(models.SIM_WEIGHTS_LIMIT + 1)  # sparse: no disk used
    job = tiny_job("sdxl", {"model.name_or_path": str(folder)}, weights="pretrained")
    assert trainers.full_size(job) == f"{folder} (1 GiB of weights)"
    weights_file = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights_file.write_bytes(b"0" * 1000)
    assert trainers.full_size(job) is None


def test_the_load_note_names_the_parts_ai_toolkits_loader_quantizes_on_the_card():
    from fitfinder import space as spaces
    from fitfinder.trainers import aitoolkit_job
    from fitfinder.probe import estimate
    from fitfinder.probe.overhead import GpuOverhead

    job = aitoolkit_job.load(EXAMPLES / "train_lora_flux_24gb.yaml")
    space = spaces.build(job)
    lightest = estimate.request_for(space.apply(job, space.lightest()), GpuOverhead())
    # low_vram quantizes the transformer in host memory; T5 still comes in bf16 to be quantized on the card
    assert models.load_note(lightest) == ("text_encoder_2 (T5EncoderModel) comes onto the card whole in bf16 to be "
                                          "quantized there (uint4), as AI Toolkit's loader does (docs/fidelity.md)")
    as_written = estimate.request_for(job, GpuOverhead())
    assert models.load_note(as_written).startswith("transformer (FluxTransformer2DModel) and text_encoder_2 "
                                                   "(T5EncoderModel) come onto the card whole in bf16")
    assert models.load_note(estimate.request_for(aitoolkit_job.load(DEMO), GpuOverhead())) == ""  # nothing quantized
