"""The families built on FLUX.1's transformer (flux_kontext, flex2, chroma): what each hands its
denoiser, on the tiny archs, as AI Toolkit's models do (commit 27a03a91)."""

import pytest

from fitfinder import models, probe


def _recipe_and_denoiser(family: str):
    import diffusers
    import torch

    from fitfinder.models._common import Inputs

    arch = models.known_archs()[f"{family}-tiny"]
    cls = getattr(diffusers, models.FAMILIES[family].classes["transformer"].split(".")[1])
    torch.manual_seed(0)
    denoiser = cls.from_config(arch["parts"]["transformer"]).eval()
    return models.FAMILIES[family].recipe(arch, Inputs(torch.device("cpu"), torch.float32, 0, 8)), denoiser


def _predict_seeing(family: str, seen: list):
    """A prediction on 16x16 latents (64 tokens), recording what the transformer's x_embedder gets."""
    import torch

    recipe, denoiser = _recipe_and_denoiser(family)
    denoiser.x_embedder.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    latents = torch.randn(2, 16, 16, 16)
    text = {"encoder_hidden_states": torch.randn(1, 8, 32)}
    if family != "chroma":
        text["pooled_projections"] = torch.randn(1, 32)
    with torch.no_grad():
        return latents, recipe.predict(denoiser, latents, torch.full((2,), 0.5), text, guidance_scale=4.0)


@pytest.mark.parametrize("family, tokens_in", [
    ("flux_kontext", (2, 128, 64)),  # FluxKontextModel.get_noise_prediction: reference tokens after the noisy ones
    ("flex2", (2, 64, 196)),  # Flex2.condition_noisy_latents: 33 more channels, packed 2x2
    ("chroma", (2, 64, 64)),
])
def test_each_family_hands_its_transformer_what_ai_toolkit_hands_it(family, tokens_in):
    seen = []
    latents, prediction = _predict_seeing(family, seen)
    assert seen == [tokens_in]
    assert prediction.shape == latents.shape  # the noisy latents' prediction only


def test_chroma_gives_sdpa_a_boolean_mask_for_every_head():
    """Chroma.forward (chroma/src/model.py) hands SDPA (batch, heads, L, L); L = 8 text + 64 image tokens."""
    import torch

    masks = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append((tuple(attn_mask.shape), attn_mask.dtype))
        return original(*args, attn_mask=attn_mask, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = recording
    try:
        _predict_seeing("chroma", [])
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert masks and set(masks) == {((2, 4, 72, 72), torch.bool)}


def test_kontext_and_flex2_keep_the_vae_in_train_for_their_conditioning_image():
    """condition_noisy_latents moves the VAE to the device at every step, latents cached or not."""
    request = {"low_vram": False, "cache_latents": True, "trained": ["transformer"], "text_encoder": "keep"}
    for family in ("flux_kontext", "flex2"):
        assert "vae" in probe.resident("train", request, models.FAMILIES[family])
    for family in ("flux", "chroma"):
        assert "vae" not in probe.resident("train", request, models.FAMILIES[family])
