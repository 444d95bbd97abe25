"""A stand-in for AI Toolkit's run.py in fitfinder's tests: a trainer fitfinder did not write.

    python tests/trainers/aitk_like.py JOB.yaml

trains a LoRA of the diffusers Flux pipeline folder that the job's `model.name_or_path` names, in
AI Toolkit's order and with its lines (each print says where AI Toolkit prints it; commit 27a03a91):
load the parts, add the LoRA and the optimizer, cache text embeddings and latents where the datasets
ask, the baseline preview, the training steps under a progress bar named after the job (an OOM in a
step skips the batch, four in a row stop the run), the final save, the last preview. It reads the
job with PyYAML and imports nothing of fitfinder: its memory is its own (the images are read by
data-loader workers, every module is moved with `.to(device)`, prompts are encoded each step).

The tiny folders of the tests hold no tokenizer: a prompt's words are hashed into the vocabulary,
as many ids as the folder's tokenizer_2/tokenizer_config.json says (AI Toolkit would tokenize).

Test hook: AITK_LIKE_WORKER_SCRATCH_BYTES=N makes each data-loader worker hold a tensor of N bytes
while it loads an item (a worker is not the trainer's main process and must not be metered).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

import tiny_flux  # beside this script (tests/trainers/tiny_flux.py)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


def main(argv: list[str]) -> None:
    config = yaml.safe_load(Path(argv[0]).read_text())
    name = config["config"]["name"]
    print(f"# Running job: {name}")  # jobs/BaseJob.py run
    process = config["config"]["process"][0]
    Trainer(name, process).run()


class Trainer:
    def __init__(self, name: str, process: dict):
        self.name, self.process = name, process
        self.train = process.get("train") or {}
        self.sample_config = process.get("sample") or {}
        self.datasets = process.get("datasets") or []
        wanted = str(process.get("device", "cuda:0"))
        self.device = torch.device(wanted if wanted.startswith("cuda") and torch.cuda.is_available() else "cpu")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.train.get("dtype", "fp32")),
                                                                          torch.float32)
        self.save_root = Path(process["training_folder"]) / name
        self.steps = int(self.train.get("steps", 1000))
        torch.manual_seed(0)

    # -- BaseSDTrainProcess.run, in outline ------------------------------------------------------------
    def run(self) -> None:
        self.load()
        self.add_lora()
        batches = self.data()
        if not self.train.get("disable_sampling") and not self.train.get("skip_first_sample"):
            print("Generating baseline samples before training")  # BaseSDTrainProcess.run
            self.sample(0)
        self.loop(batches)
        self.save()
        if not self.train.get("disable_sampling"):
            self.sample(self.steps)  # BaseSDTrainProcess.run, after the loop
        print("")

    def load(self) -> None:
        from diffusers.models import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        folder = Path(self.process["model"]["name_or_path"])
        print("Loading Flux model")  # toolkit/stable_diffusion_model.py load_model (is_flux)
        print("Loading transformer")
        self.transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer", torch_dtype=self.dtype)
        self.transformer.to(self.device, self.dtype)
        print("Loading VAE")
        self.vae = AutoencoderKL.from_pretrained(folder / "vae", torch_dtype=self.dtype).to(self.device)
        print("Loading T5")
        self.t5 = T5EncoderModel.from_pretrained(folder / "text_encoder_2", dtype=self.dtype).to(self.device)
        print("Loading CLIP")
        self.clip = CLIPTextModel.from_pretrained(folder / "text_encoder", dtype=self.dtype).to(self.device)
        for part in (self.transformer, self.vae, self.t5, self.clip):
            part.requires_grad_(False)
        self.t5_length = _max_length(folder / "tokenizer_2", 512)
        self.scale = self.vae.config.scaling_factor
        self.shift = self.vae.config.shift_factor or 0.0

    def add_lora(self) -> None:
        from peft import LoraConfig

        network = self.process.get("network") or {}
        rank = int(network.get("linear", 16))
        targets = [name for name, module in self.transformer.named_modules()
                   if isinstance(module, torch.nn.Linear) and "transformer_blocks." in name]
        self.transformer.add_adapter(LoraConfig(r=rank, lora_alpha=float(network.get("linear_alpha", rank)),
                                                target_modules=targets))
        if self.train.get("gradient_checkpointing", True):
            self.transformer.enable_gradient_checkpointing()
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=float(self.train.get("lr", 1e-4)))

    # -- the datasets (toolkit/data_loader.py, dataloader_mixins.py) ------------------------------------
    def data(self):
        items = [(image, int(resolution)) for dataset in self.datasets for image in _images(dataset)
                 for resolution in _resolutions(dataset)]
        if self.train.get("cache_text_embeddings"):
            for dataset in self.datasets:
                print(f"Caching text_embeddings for {dataset['folder_path']}")  # cache_text_embeddings
            self.cached_prompts = {image: self.encode([tiny_flux.caption(image)]) for image, _ in items}
            del self.t5, self.clip  # toolkit/unloader.py: the encoders go for good
            gc.collect()
        self.cached_latents = {}
        if any(d.get("cache_latents") or d.get("cache_latents_to_disk") for d in self.datasets):
            for dataset in self.datasets:
                print(f"Caching latents for {dataset['folder_path']}")  # cache_latents_all_latents
            for image, resolution in items:
                latents = self.encode_images(tiny_flux.pixels(image, resolution).unsqueeze(0))
                self.cached_latents[(image, resolution)] = latents
                if any(d.get("cache_latents_to_disk") for d in self.datasets):
                    cache = image.parent / "_latent_cache"  # next to the image, as AI Toolkit keeps it
                    cache.mkdir(exist_ok=True)
                    torch.save(latents, cache / f"{image.stem}_{resolution}.pt")
        batch_size = int(self.train.get("batch_size", 1))
        workers = int(self.datasets[0].get("num_workers", 2)) if self.datasets else 0
        return Batches(items, batch_size, workers)

    # -- encoding --------------------------------------------------------------------------------------
    def encode(self, captions: list[str]) -> dict:
        return tiny_flux.encode(self.clip, self.t5, self.t5_length, captions, self.device, self.dtype)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            latents = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.sample()
        return (latents - self.shift) * self.scale

    def prompts_for(self, images: list[Path]) -> dict:
        if self.train.get("cache_text_embeddings"):
            cached = [self.cached_prompts[image] for image in images]
            return {key: torch.cat([c[key] for c in cached]) for key in cached[0]}
        return self.encode([tiny_flux.caption(image) for image in images])

    # -- the loop ----------------------------------------------------------------------------------------
    def loop(self, batches: "Batches") -> None:
        accumulation = max(1, int(self.train.get("gradient_accumulation_steps", 1)))
        bar = tqdm(total=self.steps, desc=self.name, leave=True, file=sys.stderr)  # ToolkitProgressBar
        consecutive_oom = 0
        for step in range(self.steps):
            images, resolution, pixels = batches.next()
            try:
                loss = self.train_step(images, resolution, pixels, accumulation)
            except torch.OutOfMemoryError:
                # BaseSDTrainProcess.run: skip the batch; more than three in a row ends the run
                consecutive_oom += 1
                if consecutive_oom > 3:
                    raise RuntimeError("OOM during training step 3 times in a row, aborting training")
                self.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                print("")
                print("################################################")
                print(f"# OOM during training step, skipping batch {consecutive_oom}/3 #")
                print("################################################")
                print("")
                loss = None
            else:
                consecutive_oom = 0
            if loss is not None and (step + 1) % accumulation == 0:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if loss is not None:
                bar.set_postfix_str(f"lr: {self.optimizer.param_groups[0]['lr']:.1e} loss: {loss:.3e}")
            bar.update(1)
        bar.close()

    def train_step(self, images: list[Path], resolution: int, pixels: torch.Tensor, accumulation: int) -> float:
        cached = [self.cached_latents.get((image, resolution)) for image in images]
        latents = torch.cat(cached) if all(c is not None for c in cached) else self.encode_images(pixels)
        cond = self.prompts_for(images)
        noise = torch.randn_like(latents)
        t = torch.rand(latents.shape[0], device=self.device, dtype=self.dtype)
        sigmas = t.view(-1, 1, 1, 1)
        noisy = (1 - sigmas) * latents + sigmas * noise
        prediction = self.predict(noisy, t, cond)
        loss = torch.nn.functional.mse_loss(prediction.float(), (noise - latents).float()) / accumulation
        loss.backward()
        return float(loss.detach())

    def predict(self, latents: torch.Tensor, t: torch.Tensor, cond: dict, guidance: float = 1.0) -> torch.Tensor:
        return tiny_flux.predict(self.transformer, latents, t, cond, guidance)

    # -- previews and the save -------------------------------------------------------------------------
    def sample(self, step: int) -> None:
        """Each preview: Euler steps of the flow at its size, then the VAE decode, saved as an image."""
        from PIL import Image

        folder = self.save_root / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        items = self.sample_config.get("samples") or [{"prompt": p} for p in self.sample_config.get("prompts", [])]
        steps = int(self.sample_config.get("sample_steps", 20))
        for index in tqdm(range(len(items)), desc="Generating Images", leave=False, file=sys.stderr):
            item = items[index]
            width = int(item.get("width", self.sample_config.get("width", 512))) // 16 * 16
            height = int(item.get("height", self.sample_config.get("height", 512))) // 16 * 16
            cond = self.encode([str(item.get("prompt", ""))]) if hasattr(self, "t5") else self._cached_prompt()
            guidance = float(self.sample_config.get("guidance_scale", 4))
            pixels = tiny_flux.preview(self.transformer, self.vae, cond, width, height, steps, guidance, self.device,
                                       self.dtype, self.shift, self.scale)
            Image.fromarray(pixels).save(folder / f"{step:09d}_{index}.png")

    def _cached_prompt(self) -> dict:
        return next(iter(self.cached_prompts.values()))

    def save(self) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        self.save_root.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(self.transformer).items()}
        save_file(weights, self.save_root / f"{self.name}.safetensors")
        (self.save_root / "config.json").write_text(json.dumps(self.process, default=str))


# -- the images -------------------------------------------------------------------------------------
class Batches:
    """Batches of one resolution each (AI Toolkit's buckets), read by data-loader workers, in a shuffled
    order that starts again when it runs out."""

    def __init__(self, items: list[tuple[Path, int]], batch_size: int, workers: int):
        by_resolution: dict[int, list[Path]] = {}
        for image, resolution in items:
            by_resolution.setdefault(resolution, []).append(image)
        self.batches = [(resolution, images[i:i + batch_size]) for resolution, images in by_resolution.items()
                        for i in range(0, len(images), batch_size)]
        generator = torch.Generator().manual_seed(0)
        self.batches = [self.batches[i] for i in torch.randperm(len(self.batches), generator=generator)]
        self.workers = workers
        self.iterator = iter(())

    def next(self):
        try:
            return next(self.iterator)
        except StopIteration:
            loader = torch.utils.data.DataLoader(_Items(self.batches), batch_size=None, num_workers=self.workers)
            self.iterator = iter(loader)
            return next(self.iterator)


class _Items(torch.utils.data.Dataset):
    def __init__(self, batches):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        resolution, images = self.batches[index]
        scratch = int(os.environ.get("AITK_LIKE_WORKER_SCRATCH_BYTES", "0"))
        held = torch.ones(scratch, dtype=torch.uint8) if scratch else None
        pixels = torch.stack([tiny_flux.pixels(image, resolution) for image in images])
        del held
        return images, resolution, pixels


def _images(dataset: dict) -> list[Path]:
    folder = Path(dataset["folder_path"])
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)


def _resolutions(dataset: dict) -> list[int]:
    resolution = dataset.get("resolution", 512)
    return [int(r) for r in (resolution if isinstance(resolution, list) else [resolution])]


def _max_length(tokenizer_folder: Path, default: int) -> int:
    try:
        length = json.loads((tokenizer_folder / "tokenizer_config.json").read_text())["model_max_length"]
        return int(length) if 0 < int(length) <= default else default
    except (OSError, ValueError, KeyError, TypeError):
        return default


if __name__ == "__main__":
    main(sys.argv[1:])
