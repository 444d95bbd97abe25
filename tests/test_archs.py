"""Every shipped architecture config builds with its real classes at the published sizes.

Each part of each `archs/*.json` is built on the `meta` device (no memory, seconds) with the
diffusers or transformers class its pipeline uses, and its parameter count is held to the count
recorded here, which docs/models.md compares with the published figure. A family that has no
module yet (issues 15 and 16) names its classes here, so its configs are checked before it exists.
"""

import functools
import importlib
import json

import pytest

from fitfinder import models

# The class of every part, by family: the families of models.FAMILIES, and those still to come.
CLASSES = {
    "flux_kontext": {"transformer": "diffusers.FluxTransformer2DModel"},
    "flex2": {"transformer": "diffusers.FluxTransformer2DModel"},
    "chroma": {"transformer": "diffusers.ChromaTransformer2DModel", "text_encoder": "transformers.T5EncoderModel"},
    "hidream": {"transformer": "diffusers.HiDreamImageTransformer2DModel",
                "text_encoder": "transformers.CLIPTextModelWithProjection",
                "text_encoder_2": "transformers.CLIPTextModelWithProjection",
                "text_encoder_3": "transformers.T5EncoderModel", "text_encoder_4": "transformers.LlamaForCausalLM"},
    "qwen_image": {"transformer": "diffusers.QwenImageTransformer2DModel",
                   "text_encoder": "transformers.Qwen2_5_VLForConditionalGeneration",
                   "vae": "diffusers.AutoencoderKLQwenImage"},
    "sd3": {"transformer": "diffusers.SD3Transformer2DModel",
            "text_encoder": "transformers.CLIPTextModelWithProjection",
            "text_encoder_2": "transformers.CLIPTextModelWithProjection",
            "text_encoder_3": "transformers.T5EncoderModel"},
    "lumina2": {"transformer": "diffusers.Lumina2Transformer2DModel", "text_encoder": "transformers.Gemma2Model"},
    "flux2": {"transformer": "diffusers.Flux2Transformer2DModel", "vae": "diffusers.AutoencoderKLFlux2"},
    "zimage": {"transformer": "diffusers.ZImageTransformer2DModel", "text_encoder": "transformers.Qwen3ForCausalLM"},
    "wan21_i2v": {"transformer": "diffusers.WanTransformer3DModel", "text_encoder": "transformers.UMT5EncoderModel",
                  "image_encoder": "transformers.CLIPVisionModel", "vae": "diffusers.AutoencoderKLWan"},
    "wan22_i2v": {"transformer": "diffusers.WanTransformer3DModel", "transformer_2": "diffusers.WanTransformer3DModel",
                  "text_encoder": "transformers.UMT5EncoderModel", "vae": "diffusers.AutoencoderKLWan"},
    "wan22_5b": {"transformer": "diffusers.WanTransformer3DModel", "text_encoder": "transformers.UMT5EncoderModel",
                 "vae": "diffusers.AutoencoderKLWan"},
    "ltx2": {"transformer": "diffusers.LTX2VideoTransformer3DModel",
             "connectors": "diffusers.pipelines.ltx2.connectors.LTX2TextConnectors",
             "text_encoder": "transformers.Gemma3ForConditionalGeneration",
             "vae": "diffusers.AutoencoderKLLTX2Video", "audio_vae": "diffusers.AutoencoderKLLTX2Audio",
             "vocoder": "diffusers.pipelines.ltx2.vocoder.LTX2Vocoder"},
}
_FLUX1_REST = {"text_encoder": "transformers.CLIPTextModel", "text_encoder_2": "transformers.T5EncoderModel",
               "vae": "diffusers.AutoencoderKL"}
for _family in ("flux_kontext", "flex2"):
    CLASSES[_family].update(_FLUX1_REST)
for _family, _parts in (("chroma", ("vae",)), ("hidream", ("vae",)), ("sd3", ("vae",)), ("lumina2", ("vae",)),
                        ("zimage", ("vae",))):
    CLASSES[_family].update({part: "diffusers.AutoencoderKL" for part in _parts})
CLASSES["flux2"]["text_encoder"] = "transformers.Mistral3ForConditionalGeneration"
# FLUX.2 klein's text encoder is Qwen3, not Mistral: the arch config says which by its keys.
QWEN3_TEXT_ENCODER = "transformers.Qwen3ForCausalLM"


def class_of(stem: str, arch: dict, part: str) -> type:
    family = arch["family"]
    if family in models.FAMILIES:
        name = models.FAMILIES[family].classes[part]
    elif family == "flux2" and part == "text_encoder" and "text_config" not in arch["parts"][part]:
        name = QWEN3_TEXT_ENCODER
    else:
        name = CLASSES[family][part]
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


@functools.lru_cache(maxsize=None)
def _built_parameters(class_name: str, config_json: str) -> int:
    import torch

    module_name, _, name = class_name.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    with torch.device("meta"):
        if cls.__module__.startswith("transformers"):
            module = cls(cls.config_class(**json.loads(config_json)))
        else:
            module = cls.from_config(json.loads(config_json))
    return sum(p.numel() for p in module.parameters())


def meta_parameters(stem: str, part: str) -> int:
    """The part built on `meta` from the shipped config with its real class: its parameter count.

    Parts shared by several archs (CLIP-L, T5-XXL, the FLUX.1 VAE) are built once.
    """
    arch = models.known_archs()[stem]
    cls = class_of(stem, arch, part)
    return _built_parameters(f"{cls.__module__}.{cls.__name__}", json.dumps(arch["parts"][part], sort_keys=True))


FULL_SIZE = sorted(stem for stem in models.known_archs() if not stem.endswith("-tiny"))

# Parameters of every part of every full-size arch, as the meta builds count them (docs/models.md).
COUNTED = {
    "anima/transformer": 1_956_405_248,
    "anima/text_encoder": 596_049_920,
    "anima/vae": 126_892_531,
    "anima/text_conditioner": 134_663_680,
    "chroma/transformer": 8_899_983_424,
    "chroma/text_encoder": 4_762_310_656,
    "chroma/vae": 83_819_683,
    "flex1-alpha/transformer": 8_163_264_064,
    "flex1-alpha/text_encoder": 123_060_480,
    "flex1-alpha/text_encoder_2": 4_762_310_656,
    "flex1-alpha/vae": 83_819_683,
    "flex2-preview/transformer": 8_163_669_568,
    "flex2-preview/text_encoder": 123_060_480,
    "flex2-preview/text_encoder_2": 4_762_310_656,
    "flex2-preview/vae": 83_819_683,
    "flux-dev/transformer": 11_901_408_320,
    "flux-dev/text_encoder": 123_060_480,
    "flux-dev/text_encoder_2": 4_762_310_656,
    "flux-dev/vae": 83_819_683,
    "flux-kontext-dev/transformer": 11_901_408_320,
    "flux-kontext-dev/text_encoder": 123_060_480,
    "flux-kontext-dev/text_encoder_2": 4_762_310_656,
    "flux-kontext-dev/vae": 83_819_683,
    "flux-schnell/transformer": 11_891_178_560,
    "flux-schnell/text_encoder": 123_060_480,
    "flux-schnell/text_encoder_2": 4_762_310_656,
    "flux-schnell/vae": 83_819_683,
    "flux2-dev/transformer": 32_223_281_152,
    "flux2-dev/text_encoder": 24_011_361_280,
    "flux2-dev/vae": 84_046_115,
    "flux2-klein-4b/transformer": 3_875_544_576,
    "flux2-klein-4b/text_encoder": 4_022_468_096,
    "flux2-klein-4b/vae": 84_046_115,
    "flux2-klein-9b/transformer": 9_078_581_248,
    "flux2-klein-9b/text_encoder": 8_190_735_360,
    "flux2-klein-9b/vae": 84_046_115,
    "hidream-i1-full/transformer": 17_105_733_184,
    "hidream-i1-full/text_encoder": 123_650_304,
    "hidream-i1-full/text_encoder_2": 694_659_840,
    "hidream-i1-full/text_encoder_3": 4_762_310_656,
    "hidream-i1-full/text_encoder_4": 8_030_261_248,
    "hidream-i1-full/vae": 83_819_683,
    # HiDream E1-1: I1 Full's configs (its archs/*.json says why), so I1 Full's counts.
    "hidream-e1-1/transformer": 17_105_733_184,
    "hidream-e1-1/text_encoder": 123_650_304,
    "hidream-e1-1/text_encoder_2": 694_659_840,
    "hidream-e1-1/text_encoder_3": 4_762_310_656,
    "hidream-e1-1/text_encoder_4": 8_030_261_248,
    "hidream-e1-1/vae": 83_819_683,
    "ltx2/transformer": 18_876_174_592,
    "ltx2/connectors": 1_431_475_200,
    "ltx2/text_encoder": 12_187_325_040,
    "ltx2/vae": 1_222_479_601,
    "ltx2/audio_vae": 53_248_146,
    "ltx2/vocoder": 55_592_802,
    "lumina2/transformer": 2_609_769_152,
    "lumina2/text_encoder": 2_614_341_888,
    "lumina2/vae": 83_819_683,
    "nucleus-image/transformer": 16_922_679_296,
    "nucleus-image/text_encoder": 8_767_123_696,
    "nucleus-image/vae": 126_892_531,
    "qwen-image-edit-2509/transformer": 20_430_401_088,
    "qwen-image-edit-2509/text_encoder": 8_292_166_656,
    "qwen-image-edit-2509/vae": 126_892_531,
    "qwen-image-edit/transformer": 20_430_401_088,
    "qwen-image-edit/text_encoder": 8_292_166_656,
    "qwen-image-edit/vae": 126_892_531,
    "qwen-image/transformer": 20_430_401_088,
    "qwen-image/text_encoder": 8_292_166_656,
    "qwen-image/vae": 126_892_531,
    "sd35-large/transformer": 8_056_627_520,
    "sd35-large/text_encoder": 123_650_304,
    "sd35-large/text_encoder_2": 694_659_840,
    "sd35-large/text_encoder_3": 4_762_310_656,
    "sd35-large/vae": 83_819_683,
    "sd15/unet": 859_520_964,
    "sd15/text_encoder": 123_060_480,
    "sd15/vae": 83_653_863,
    "sdxl-base/unet": 2_567_463_684,
    "sdxl-base/text_encoder": 123_060_480,
    "sdxl-base/text_encoder_2": 694_659_840,
    "sdxl-base/vae": 83_653_863,
    "wan21-1.3b/transformer": 1_418_996_800,
    "wan21-1.3b/text_encoder": 5_680_910_336,
    "wan21-1.3b/vae": 126_892_531,
    "wan21-14b/transformer": 14_288_491_584,
    "wan21-14b/text_encoder": 5_680_910_336,
    "wan21-14b/vae": 126_892_531,
    "wan21-i2v-14b/transformer": 16_394_878_784,
    "wan21-i2v-14b/text_encoder": 5_680_910_336,
    "wan21-i2v-14b/image_encoder": 630_766_080,
    "wan21-i2v-14b/vae": 126_892_531,
    "wan22-14b/transformer": 14_288_491_584,
    "wan22-14b/transformer_2": 14_288_491_584,
    "wan22-14b/text_encoder": 5_680_910_336,
    "wan22-14b/vae": 126_892_531,
    "wan22-i2v-14b/transformer": 14_288_901_184,
    "wan22-i2v-14b/transformer_2": 14_288_901_184,
    "wan22-i2v-14b/text_encoder": 5_680_910_336,
    "wan22-i2v-14b/vae": 126_892_531,
    "wan22-ti2v-5b/transformer": 4_999_787_712,
    "wan22-ti2v-5b/text_encoder": 5_680_910_336,
    "wan22-ti2v-5b/vae": 704_688_668,
    "zimage-turbo/transformer": 6_154_908_736,
    "zimage-turbo/text_encoder": 4_022_468_096,
    "zimage-turbo/vae": 83_819_683,
}

# Published sizes ("12B" on a model card, "4.76B" on a Hugging Face page): a figure with three
# significant digits must hold within 1%, a rounded one within half its last digit.
PUBLISHED = {
    "flux-dev/transformer": "11.9B", "flux-dev/text_encoder": "123M", "flux-dev/text_encoder_2": "4.76B",
    "flux-schnell/transformer": "12B", "flex1-alpha/transformer": "8B", "flex2-preview/transformer": "8B",
    "flux-kontext-dev/transformer": "12B", "chroma/transformer": "8.9B", "hidream-i1-full/transformer": "17B",
    "hidream-i1-full/text_encoder_2": "695M", "hidream-i1-full/text_encoder_4": "8.03B",
    "qwen-image/transformer": "20B", "qwen-image/text_encoder": "8.29B", "sd35-large/transformer": "8.1B",
    "lumina2/transformer": "2.6B", "lumina2/text_encoder": "2.61B", "flux2-dev/transformer": "32B",
    "flux2-dev/text_encoder": "24.0B", "flux2-klein-4b/transformer": "4B", "flux2-klein-4b/text_encoder": "4.02B",
    "flux2-klein-9b/transformer": "9B", "flux2-klein-9b/text_encoder": "8.19B", "zimage-turbo/transformer": "6B",
    "wan21-14b/transformer": "14B", "wan21-14b/text_encoder": "5.68B", "wan21-i2v-14b/image_encoder": "632M",
    "wan22-i2v-14b/transformer": "14B", "wan22-ti2v-5b/transformer": "5B", "ltx2/transformer": "19B",
    "ltx2/text_encoder": "12.2B", "sd15/unet": "860M", "sd15/text_encoder": "123M",
    "anima/transformer": "2B", "anima/text_encoder": "0.6B", "nucleus-image/transformer": "17B",
}


def test_every_shipped_arch_names_its_family_and_classes():
    for stem, arch in models.known_archs().items():
        family = arch["family"]
        expected = set(models.FAMILIES[family].parts) if family in models.FAMILIES else set(CLASSES[family])
        assert set(arch["parts"]) == expected, stem
        assert arch["names"] and arch["description"] and arch["text_seq_len"] > 0, stem


def test_every_full_size_part_is_counted():
    parts = [f"{stem}/{part}" for stem in FULL_SIZE for part in models.known_archs()[stem]["parts"]]
    assert sorted(COUNTED) == sorted(parts)


@pytest.mark.parametrize("stem", FULL_SIZE)
def test_full_size_parts_build_on_meta_at_the_counted_sizes(stem):
    counted = {part: meta_parameters(stem, part) for part in models.known_archs()[stem]["parts"]}
    assert counted == {part: COUNTED[f"{stem}/{part}"] for part in counted}


@pytest.mark.parametrize("key", sorted(PUBLISHED))
def test_counted_sizes_match_the_published_figures(key):
    figure = PUBLISHED[key]
    value, unit = float(figure[:-1]), {"B": 1e9, "M": 1e6}[figure[-1]]
    digits = len(figure[:-1].replace(".", "").lstrip("0"))
    tolerance = 0.01 * value * unit if digits >= 3 else 0.5 * 10 ** -(len(figure[:-1].partition(".")[2])) * unit
    assert abs(COUNTED[key] - value * unit) <= tolerance, (key, COUNTED[key], figure)
