"""What the tests' stand-in trainers (aitk_like.py, kohya_like.py) do alike with the tiny FLUX.1: the
transformer's call on packed latents, the text encoders on hashed prompts, an image as pixels, a
flow's Euler preview. Each stand-in keeps what its trainer does its own way (arguments, logs, the
order of its passes, caching). Like them it imports nothing of fitfinder; a stand-in runs as a
script from this folder, so it imports this module by its name.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch


def predict(transformer, latents: torch.Tensor, t: torch.Tensor, cond: dict, guidance: float = 1.0) -> torch.Tensor:
    """One transformer call on latents packed 2x2 into tokens (FluxPipeline, flux_utils.pack_latents)."""
    batch, channels, height, width = latents.shape
    device, dtype = latents.device, latents.dtype
    tokens = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    tokens = tokens.reshape(batch, (height // 2) * (width // 2), channels * 4)
    ids = torch.zeros(height // 2, width // 2, 3, device=device, dtype=dtype)
    ids[..., 1] += torch.arange(height // 2, device=device, dtype=dtype)[:, None]
    ids[..., 2] += torch.arange(width // 2, device=device, dtype=dtype)[None, :]
    text = cond["encoder_hidden_states"]
    embedded = (torch.full((batch,), guidance, device=device, dtype=dtype)
                if transformer.config.guidance_embeds else None)
    out = transformer(hidden_states=tokens, timestep=t, guidance=embedded,
                      pooled_projections=cond["pooled_projections"], encoder_hidden_states=text,
                      txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
                      img_ids=ids.reshape(-1, 3)).sample
    out = out.view(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return out.reshape(batch, channels, height, width)


def encode(clip, t5, t5_length: int, captions: list[str], device, dtype) -> dict:
    """CLIP's pooled output and T5's hidden states of the captions, hashed into their vocabularies."""
    with torch.no_grad():
        clip_ids = hashed_ids(captions, 77, clip.config.vocab_size, device)
        t5_ids = hashed_ids(captions, t5_length, t5.config.vocab_size, device)
        pooled = clip(input_ids=clip_ids).pooler_output
        text = t5(input_ids=t5_ids).last_hidden_state
    return {"pooled_projections": pooled.to(dtype), "encoder_hidden_states": text.to(dtype)}


def hashed_ids(captions: list[str], length: int, vocab: int, device) -> torch.Tensor:
    """Token ids without a tokenizer (the tiny folders have none): each word hashed into the vocabulary."""
    rows = []
    for caption in captions:
        words = caption.split()[:length - 1]
        ids = [zlib.crc32(word.encode()) % (vocab - 2) + 1 for word in words] + [vocab - 1]
        rows.append(ids + [0] * (length - len(ids)))
    return torch.tensor(rows, device=device)


def caption(image: Path) -> str:
    """The caption file beside the image, or none."""
    path = image.with_suffix(".txt")
    return path.read_text().strip() if path.exists() else ""


def pixels(image: Path, side: int) -> torch.Tensor:
    """The image center-cropped to a square of `side` (rounded down to 16), in [-1, 1]."""
    from PIL import Image

    side = side // 16 * 16
    with Image.open(image) as opened:
        picture = opened.convert("RGB")
        shorter = min(picture.size)
        left, top = (picture.width - shorter) // 2, (picture.height - shorter) // 2
        picture = picture.crop((left, top, left + shorter, top + shorter)).resize((side, side))
        data = torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8)
    return data.view(side, side, 3).permute(2, 0, 1).float() / 127.5 - 1


def preview(transformer, vae, cond: dict, width: int, height: int, steps: int, guidance: float, device, dtype,
            shift: float, scale: float, bar=iter):
    """A preview as uint8 pixels (height, width, 3): Euler steps of the flow from noise, then the VAE's
    decode (`bar` wraps the steps, for a trainer that draws a progress bar over them)."""
    with torch.no_grad():
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        latents = torch.randn(1, vae.config.latent_channels, height // factor, width // factor,
                              device=device, dtype=dtype)
        for level in bar(range(steps, 0, -1)):
            t = torch.full((1,), level / steps, device=device, dtype=dtype)
            latents = latents - predict(transformer, latents, t, cond, guidance) / steps
        image = vae.decode(latents / scale + shift).sample
    return ((image[0].float().clamp(-1, 1) + 1) * 127.5).permute(1, 2, 0).to(torch.uint8).cpu().numpy()
