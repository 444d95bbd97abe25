"""Wan 2.2 TI2V 5B: the frames knob walks its own VAE's ladder (clips the Wan 2.2 VAE encodes whole)."""

from fitfinder import models
from fitfinder.trainers import aitoolkit_job
from fitfinder import space as spaces
from tests.conftest import EXAMPLES


def test_the_frames_knobs_of_a_wan22_5b_job_walk_the_wan22_vae_ladder():
    job = aitoolkit_job.load(EXAMPLES / "ui_wan22_5b.yaml")  # previews of 121 frames, AI Toolkit's UI default
    job.set("datasets[0].num_frames", 121)
    knobs = {knob.name: knob for knob in spaces.build(job).knobs}
    assert knobs["frames"].candidates == (1, 5, 13, 29, 61, 121)
    assert knobs["sample_frames"].candidates == (1, 5, 13, 29, 61, 121)
    vae = models.known_archs()["wan22-ti2v-5b"]["parts"]["vae"]
    assert vae["scale_factor_temporal"] == models.FAMILIES["wan22_5b"].frame_step == 4


def test_each_rung_is_a_clip_the_wan22_vae_encodes_whole_into_its_latent_frames():
    import diffusers
    import torch

    from fitfinder.models._common import Inputs
    from fitfinder.models.wan22_5b import Recipe

    arch = models.known_archs()["wan22_5b-tiny"]
    recipe = Recipe(arch, Inputs(torch.device("cpu"), torch.float32, 0, 32))
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan.from_config(arch["parts"]["vae"]).eval()
    for frames in (1, 5, 9, 13):  # 4k+1: the first frame alone, then every 4 in one latent frame
        with torch.no_grad():
            latents = recipe.encode_images(vae, recipe.pixels(64, 64, frames, 1))
        assert tuple(latents.shape) == recipe.latent_shape(64, 64, frames, 1) == (1, 48, (frames - 1) // 4 + 1, 4, 4)
    assert recipe.divisor == 32  # 16x smaller sides and 2x2 patches (Wan225bModel.get_bucket_divisibility)
