"""A stand-in for kohya sd-scripts' flux_train_network.py in fitfinder's tests: a trainer fitfinder did
not write, driven as sd-scripts is.

    python tests/trainers/kohya_like.py --config_file JOB.toml [--option value ...]

reads its arguments as sd-scripts does (library/train_util.py read_config_from_file: the config
TOML's tables flattened, the command line over them), its datasets from `dataset_config`, and
trains a LoRA of the tiny FLUX.1 that the options name, in NetworkTrainer.train's order and with
its log lines (each says where sd-scripts prints it; commit 48d368fa): load the parts, cache latents
and text-encoder outputs where the options ask (to .npz files next to the images with *_to_disk),
`running training`, the sample_at_first preview, `max_train_steps` steps under a `steps` bar (an
OOM is not caught: sd-scripts stops), a preview every `sample_every_n_steps`, the save into
`output_dir`.

The model: `pretrained_model_name_or_path`, `ae`, `clip_l` and `t5xxl` name diffusers folders of a
tiny random FLUX.1 (the tests build one; sd-scripts would read single .safetensors files), loaded
with diffusers and transformers and moved to the device; the LoRA is peft's. It imports nothing of
fitfinder. Prompts are hashed into the vocabulary (no tokenizer in the tiny folders),
`t5xxl_max_token_length` ids for T5 (512 by default, as flux_train_network.py for dev).
"""

from __future__ import annotations

import math
import os
import sys
import tomllib
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import tiny_flux  # beside this script (tests/trainers/tiny_flux.py)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


def log(message: str) -> None:
    """sd-scripts' logging: a level and the message, on stderr (library/utils.py setup_logging)."""
    print(f"INFO     {message}", file=sys.stderr, flush=True)


def read_arguments(argv: list[str]) -> dict:
    """--config_file's TOML flattened, then the command line's `--name value` and switches over it."""
    command: dict = {}
    index = 0
    while index < len(argv):
        name = argv[index].removeprefix("--")
        if index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            command[name], index = argv[index + 1], index + 2
        else:
            command[name], index = True, index + 1
    options: dict = {}
    if command.get("config_file"):
        log(f"Loading settings from {command['config_file']}...")  # read_config_from_file
        for key, value in tomllib.loads(Path(command["config_file"]).read_text()).items():
            options.update(value if isinstance(value, dict) else {key: value})
    return {**options, **command}


def main(argv: list[str]) -> None:
    Trainer(read_arguments(argv)).train()


class Trainer:
    def __init__(self, args: dict):
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(args.get("mixed_precision")),
                                                                          torch.float32)
        self.steps = int(args.get("max_train_steps", 1600))  # train_util.py: --max_train_steps default
        self.output = Path(args.get("output_dir") or ".")
        torch.manual_seed(0)

    # -- NetworkTrainer.train, in outline ----------------------------------------------------------
    def train(self) -> None:
        self.items = self.dataset()
        if self.args.get("max_train_epochs") is not None:  # "override steps. steps for N epochs"
            self.steps = int(self.args["max_train_epochs"]) * math.ceil(len(self.items) / self.batch_size)
        self.load()
        self.cache_latents()
        self.cache_text_encoder_outputs()
        self.add_lora()
        print("running training / 学習開始", flush=True)  # accelerator.print
        self.sample(0)  # "For --sample_at_first"
        self.loop()
        self.save()

    def load(self) -> None:
        from diffusers.models import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        log("Building Flux model dev from BFL checkpoint")  # library/flux_utils.py load_flow_model
        log(f"Loading state dict from {self.args['pretrained_model_name_or_path']}")
        self.flux = FluxTransformer2DModel.from_pretrained(self.args["pretrained_model_name_or_path"],
                                                           torch_dtype=self.dtype).to(self.device)
        log("Building CLIP-L")  # flux_utils.load_clip_l
        self.clip = CLIPTextModel.from_pretrained(self.args["clip_l"], dtype=self.dtype).to(self.device)
        log("Building T5XXL")  # flux_utils.load_t5xxl
        self.t5 = T5EncoderModel.from_pretrained(self.args["t5xxl"], dtype=self.dtype).to(self.device)
        log("Building AutoEncoder")  # flux_utils.load_ae
        self.ae = AutoencoderKL.from_pretrained(self.args["ae"], torch_dtype=self.dtype).to(self.device)
        for part in (self.flux, self.clip, self.t5, self.ae):
            part.requires_grad_(False)
        self.t5_length = int(self.args.get("t5xxl_max_token_length") or 512)

    # -- the dataset (library/config_util.py, train_util.py) ---------------------------------------
    def dataset(self) -> list[tuple[Path, int]]:
        config = tomllib.loads(Path(self.args["dataset_config"]).read_text())
        general = config.get("general") or {}
        items = []
        for dataset in config["datasets"]:
            resolution = dataset.get("resolution", general.get("resolution", self.args.get("resolution", 512)))
            side = int(resolution[0] if isinstance(resolution, list) else resolution)
            self.batch_size = int(dataset.get("batch_size", general.get("batch_size", 1)))
            for subset in dataset.get("subsets") or []:
                folder = Path(subset["image_dir"])
                items += [(image, side) for image in sorted(folder.iterdir()) if image.suffix in IMAGE_EXTENSIONS]
        return items

    def cache_latents(self) -> None:
        self.latents: dict = {}
        if not (self.args.get("cache_latents") or self.args.get("cache_latents_to_disk")):
            return
        log("caching latents with caching strategy.")  # train_util.DatasetGroup.new_cache_latents
        for image, side in self.items:
            latents = self.encode_images(tiny_flux.pixels(image, side).unsqueeze(0))
            self.latents[image] = latents
            if self.args.get("cache_latents_to_disk"):  # strategy_flux.get_latents_npz_path: next to the image
                np.savez(image.with_name(f"{image.stem}_{side:04d}x{side:04d}_flux.npz"),
                         latents=latents.float().cpu().numpy())

    def cache_text_encoder_outputs(self) -> None:
        self.cached: dict = {}
        if not self.args.get("cache_text_encoder_outputs"):
            return
        log("move text encoders to gpu")  # flux_train_network.py cache_text_encoder_outputs_if_needed
        log("caching Text Encoder outputs with caching strategy.")  # train_util.new_cache_text_encoder_outputs
        for image, _ in self.items:
            self.cached[image] = self.encode([tiny_flux.caption(image)])
            if self.args.get("cache_text_encoder_outputs_to_disk"):  # get_outputs_npz_path
                np.savez(image.with_name(f"{image.stem}_flux_te.npz"),
                         t5=self.cached[image]["encoder_hidden_states"].float().cpu().numpy())
        if self.args.get("sample_prompts"):
            log(f"cache Text Encoder outputs for sample prompt: {self.args['sample_prompts']}")
            self.cached["sample"] = self.encode([_prompt(self.args["sample_prompts"])[0]])
        del self.clip, self.t5  # the trainer keeps them off the card from here on

    def add_lora(self) -> None:
        from peft import LoraConfig

        rank = int(self.args.get("network_dim") or 4)
        targets = [name for name, module in self.flux.named_modules()
                   if isinstance(module, torch.nn.Linear) and "transformer_blocks." in name]
        self.flux.add_adapter(LoraConfig(r=rank, lora_alpha=float(self.args.get("network_alpha") or 1),
                                         target_modules=targets))
        if self.args.get("gradient_checkpointing"):
            self.flux.enable_gradient_checkpointing()
        self.params = [p for p in self.flux.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=float(self.args.get("learning_rate") or 1e-4))

    # -- encoding ------------------------------------------------------------------------------------
    def encode(self, captions: list[str]) -> dict:
        return tiny_flux.encode(self.clip, self.t5, self.t5_length, captions, self.device, self.dtype)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            latents = self.ae.encode(pixels.to(self.device, self.dtype)).latent_dist.sample()
        return (latents - (self.ae.config.shift_factor or 0.0)) * self.ae.config.scaling_factor

    # -- the loop ------------------------------------------------------------------------------------
    def loop(self) -> None:
        accumulation = max(1, int(self.args.get("gradient_accumulation_steps") or 1))
        bar = tqdm(range(self.steps), smoothing=0, desc="steps", file=sys.stderr)  # NetworkTrainer.train
        step = 0
        while step < self.steps:
            for start in range(0, len(self.items), self.batch_size):
                batch = self.items[start:start + self.batch_size]
                for _ in range(accumulation):
                    loss = self.train_step(batch, accumulation)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                bar.update(1)
                step += 1
                bar.set_postfix(avr_loss=loss)
                self.sample(step)
                if step >= self.steps:
                    break
        bar.close()

    def train_step(self, batch: list[tuple[Path, int]], accumulation: int) -> float:
        latents = torch.cat([self.latents[image] if image in self.latents
                             else self.encode_images(tiny_flux.pixels(image, side).unsqueeze(0))
                             for image, side in batch])
        cond = [self.cached[image] if image in self.cached else self.encode([tiny_flux.caption(image)])
                for image, _ in batch]
        cond = {key: torch.cat([c[key] for c in cond]) for key in cond[0]}
        noise = torch.randn_like(latents)
        t = torch.rand(latents.shape[0], device=self.device, dtype=self.dtype)
        sigmas = t.view(-1, 1, 1, 1)
        prediction = self.predict((1 - sigmas) * latents + sigmas * noise, t, cond)
        loss = torch.nn.functional.mse_loss(prediction.float(), (noise - latents).float()) / accumulation
        loss.backward()
        return float(loss.detach())

    def predict(self, latents: torch.Tensor, t: torch.Tensor, cond: dict, guidance: float = 1.0) -> torch.Tensor:
        return tiny_flux.predict(self.flux, latents, t, cond, guidance)

    # -- previews and the save -----------------------------------------------------------------------
    def sample(self, step: int) -> None:
        """train_util.sample_images_common's rule, then flux_train_utils.sample_image_inference in outline:
        Euler steps of the flow at the prompt's --w x --h for --s steps, the AE's decode, a PNG."""
        every_steps, every_epochs = self.args.get("sample_every_n_steps"), self.args.get("sample_every_n_epochs")
        if step == 0 and not self.args.get("sample_at_first"):
            return
        if step > 0 and (every_epochs is not None or every_steps is None or step % int(every_steps) != 0):
            return  # an epoch rule samples at an epoch's end, which this stand-in never reaches in a probe
        if not self.args.get("sample_prompts"):
            return
        from PIL import Image

        log("")
        log(f"generating sample images at step / サンプル画像生成 ステップ: {step}")
        prompt, width, height, steps = _prompt(self.args["sample_prompts"])
        cond = self.cached.get("sample") or self.encode([prompt])
        pixels = tiny_flux.preview(self.flux, self.ae, cond, width, height, steps, 3.5, self.device, self.dtype,
                                   self.ae.config.shift_factor or 0, self.ae.config.scaling_factor,
                                   bar=lambda levels: tqdm(levels, file=sys.stderr))  # flux_train_utils.denoise's bar
        (self.output / "sample").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(self.output / "sample" / f"{self.args.get('output_name', 'last')}_{step:06d}.png")

    def save(self) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        self.output.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(self.flux).items()}
        save_file(weights, self.output / f"{self.args.get('output_name', 'last')}.safetensors")
        log("model saved.")  # NetworkTrainer.train, after the loop


# -- the files ------------------------------------------------------------------------------------
def _prompt(path: str) -> tuple[str, int, int, int]:
    """The prompt file's first prompt and its --w --h --s (train_util.line_to_prompt_dict; flux's
    defaults 512x512 and 20 steps), the size rounded down to 16 as sample_image_inference does."""
    line = next(line for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#"))
    prompt, *parts = line.split(" --")
    options = dict(part.strip().partition(" ")[::2] for part in parts)
    return (prompt.strip(), int(options.get("w", 512)) // 16 * 16, int(options.get("h", 512)) // 16 * 16,
            int(options.get("s", 20)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
