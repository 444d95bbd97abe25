"""LTX-2 (Lightricks/LTX-2, 19B): one audio-video transformer; Gemma 3 12B's hidden states of every
layer, through the text connectors, as the prompt; video latents 32x smaller in space and 8x in time
(clips of 8k+1 frames), audio latents beside them; flow matching; true CFG in previews.

AI Toolkit: extensions_built_in/diffusion_models/ltx2/ltx2.py (LTX2Model; commit 27a03a91). Its
point releases (`ltx2.3`: LTX23Model, a 22B transformer from a single ComfyUI file; `ltx2.5`:
LTX25Model, Gemma 4 and pre-quantized ConvRot files) are other architectures: no arch here yet.
"""

from __future__ import annotations

from fitfinder.models._family import Family, Placement

# Parts (LTX2Model.load_model): the transformer, quantized with model.qtype (quantize_model), parked on
# the CPU with low_vram until the first prediction moves it (get_noise_prediction); Gemma 3 with its
# vision tower set to None, quantized with model.qtype_te in host memory (`quantize` right after
# from_pretrained), then offloaded and moved to the device; the connectors, the video VAE,
# the audio VAE and the vocoder in the training dtype, unquantized. The connectors run in every
# prediction on the transformer's device, and a preview moves the whole pipeline to the device
# (generate_single_image: pipeline.to), where the audio VAE and vocoder stay: all three follow the
# transformer. LoRA (self.target_lora_modules = ["LTX2VideoTransformer3DModel"], transformer_only by
# default in toolkit/lora_special.py with get_transformer_block_names() == ["transformer_blocks"]):
# every Linear of the 48 blocks, the audio and audio-video cross-attention layers included.
FAMILY = Family(
    name="ltx2",
    denoisers=("transformer",),
    text_encoders=("text_encoder",),
    classes={"transformer": "diffusers.LTX2VideoTransformer3DModel",
             "connectors": "diffusers.pipelines.ltx2.connectors.LTX2TextConnectors",
             "text_encoder": "transformers.Gemma3ForConditionalGeneration",
             "vae": "diffusers.AutoencoderKLLTX2Video", "audio_vae": "diffusers.AutoencoderKLLTX2Audio",
             "vocoder": "diffusers.pipelines.ltx2.vocoder.LTX2Vocoder"},
    lora_blocks=r"transformer_blocks\.\d+\..*",
    arch_values=("ltx2",),
    name_hints=("ltx2",),
    video=True,
    frame_step=8,  # generate_single_image: "frames must be divisible by 8 then + 1"
    quantized_text_encoders=("text_encoder",),
    layer_offloading=True,
    recovery_adapter=True,  # quantize_model (toolkit/util/quantize.py) reads qtype's adapter
    te_qtype_key="qtype_te",  # load_model: quantize(text_encoder, weights=get_qtype(model_config.qtype_te))
    text_seq_len=1024,  # get_prompt_embeds' max_length, and pad_embeds' target: the connectors see 1024 tokens
    tokenizer="tokenizer",
    others=("connectors", "audio_vae", "vocoder"),
    # encode_images and generate_single_image tile the VAE frame-wise under low_vram (Recipe.encode_images, decode).
    low_vram_in_recipe=frozenset({"latents", "sample", "train", "last_sample"}),
    dropped={"text_encoder": ("model.vision_tower",)},  # load_model: text_encoder.model.vision_tower = None
    # LTX2Model.load_model: the transformer is quantized by quantize_model and left on the CPU while
    # Gemma 3 is read into host memory, quantized there and moved to the device; then it comes ("leave
    # it on cpu for now" with low_vram: BaseSDTrainProcess.run moves the unet to the device right
    # after). The connectors, audio VAE and vocoder go where it goes. Under layer_offloading both are
    # attached in host memory, after quantizing and before `.to(device)`.
    placement={"transformer": Placement(quantized_on="host", after_load="waits", offloaded_on_host="always"),
               "text_encoder": Placement(quantized_on="host", offloaded_on_host="always"),
               **{part: Placement(follows="transformer") for part in ("connectors", "audio_vae", "vocoder")}},
)

# Frames per second of AI Toolkit's LTX-2 datasets and previews (the UI's default; dataset fps).
FPS = 24


class Recipe:
    """What LTX-2 computes; built by probe children (its methods import torch).

    `pipeline` (set by the Pipeline that builds it) lends the connectors, the audio VAE and the
    vocoder, and the job's low_vram, which switches the VAE to AI Toolkit's frame-wise tiles.
    """

    def __init__(self, arch: dict, inputs):
        parts = arch["parts"]
        vae, audio, transformer = parts["vae"], parts["audio_vae"], parts["transformer"]
        self.inputs = inputs
        self.pipeline = None
        self.spatial = int(vae.get("spatial_compression_ratio") or 32)
        self.temporal = int(vae.get("temporal_compression_ratio") or 8)
        self.latent_channels = int(vae["latent_channels"])
        self.divisor = 32  # LTX2Model.get_bucket_divisibility; the transformer's patch is 1x1
        self.text_seq_len = int(arch.get("text_seq_len", 1024))
        # Audio latents: (sample_rate / hop) mel frames a second, 4x fewer in latents (the audio VAE's
        # temporal compression), latent_channels x mel_bins/4 features per token (LTX2Pipeline).
        self.audio_latents_per_second = audio["sample_rate"] / audio["mel_hop_length"] / 4
        self.audio_shape = (int(audio["latent_channels"]), int(audio["mel_bins"]) // 4)
        self.audio_tokens_width = int(transformer["audio_in_channels"])

    # -- prompts: Gemma 3's hidden states of every layer, stacked (get_prompt_embeds) ---------------
    def encode_prompts(self, parts, batch) -> dict:
        import torch

        gemma = parts["text_encoder"]
        config = gemma.config.text_config
        ids = torch.randint(3, int(config.vocab_size) - 2, (batch, self.text_seq_len),
                            generator=self.inputs.generator, device=self.inputs.device)
        mask = torch.ones_like(ids)
        # The whole model is called, as AI Toolkit calls it: the LM head's logits are made too.
        out = gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(self.inputs.dtype)
        del out
        return {"text_embeds": states, "attention_mask": mask}

    # -- latents ---------------------------------------------------------------------------------
    def latent_frames(self, frames: int) -> int:
        """8k+1 frames -> k+1 latent frames (AI Toolkit rounds a preview's count down to 8k+1)."""
        return (max(frames, 1) - 1) // self.temporal + 1

    def latent_shape(self, height, width, frames, batch):
        return (batch, self.latent_channels, self.latent_frames(frames), height // self.spatial,
                width // self.spatial)

    def pixels(self, height, width, frames, batch):
        """A clip of 8k+1 frames: the VAE encodes no other length (AI Toolkit's loader does not round a
        dataset's num_frames and the encode fails; the probe takes the 8k+1 frames below it)."""
        frames = (self.latent_frames(frames) - 1) * self.temporal + 1
        return self.inputs.randn((batch, 3, frames, height, width)).clamp_(-1, 1)

    def _low_vram(self) -> bool:
        return bool(self.pipeline is not None and self.pipeline.settings.get("low_vram"))

    def encode_images(self, vae, pixels):
        """LTX2Model.encode_images: with low_vram, temporal tiles of 64 frames every 16 (it sets the
        decoding flag, which is the one diffusers' encoder reads), then mean/std normalization."""
        if self._low_vram():
            vae.tile_sample_min_num_frames, vae.tile_sample_stride_num_frames = 64, 16
            vae.use_framewise_decoding = vae.use_framewise_encoding = True
        try:
            latents = vae.encode(pixels).latent_dist.sample()
        finally:
            vae.use_framewise_decoding = vae.use_framewise_encoding = False
        mean, std = self._statistics(vae, latents)
        return (latents - mean) / std

    def _statistics(self, vae, latents):
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        return mean, vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)

    def decode(self, vae, latents):
        """LTX2Pipeline's end: the video through the VAE (frame-wise, 16-frame tiles every 8, with
        low_vram: generate_single_image), then the audio latents through the audio VAE and vocoder."""
        mean, std = self._statistics(vae, latents)
        if self._low_vram():
            vae.tile_sample_min_num_frames, vae.tile_sample_stride_num_frames = 16, 8
            vae.use_framewise_decoding = True
        try:
            video = vae.decode(latents * std + mean).sample
        finally:
            vae.use_framewise_decoding = False
        parts = self.pipeline.parts
        audio = self.inputs.randn((latents.shape[0], self.audio_shape[0], self._audio_frames(latents.shape[2]),
                                   self.audio_shape[1]))
        waveform = parts["vocoder"](parts["audio_vae"].decode(audio).sample)
        del audio, waveform
        return video

    def _audio_frames(self, latent_frames: int) -> int:
        """Audio latents of a clip's duration (get_noise_prediction: round(frames / fps * per second))."""
        frames = (latent_frames - 1) * self.temporal + 1
        return max(1, round(frames / FPS * self.audio_latents_per_second))

    # -- the transformer -------------------------------------------------------------------------
    def noisy_and_target(self, latents, noise, t):
        from fitfinder.models._common import flow_noisy_and_target

        return flow_noisy_and_target(latents, noise, t)

    def _connectors(self, cond: dict, batch: int):
        """LTX2Model.pad_embeds then the connectors, without gradients, on the transformer's device."""
        import torch

        from fitfinder.models._common import batched

        cond = batched(cond, batch)
        embeds, mask = cond["text_embeds"], cond["attention_mask"]
        missing = self.text_seq_len - embeds.shape[1]
        if missing > 0:  # left padding with zeros, masked out (AI Toolkit pads to 1024)
            embeds = torch.cat([embeds.new_zeros(batch, missing, embeds.shape[2]), embeds], dim=1)
            mask = torch.cat([mask.new_zeros(batch, missing), mask], dim=1)
        with torch.no_grad():
            return self.pipeline.parts["connectors"](embeds, mask.to(embeds.dtype), padding_side="left")

    def predict(self, denoiser, latents, t, cond, guidance_scale: float = 1.0):
        """LTX2Model.get_noise_prediction: video tokens (patch 1), audio tokens of the clip's duration
        (zeros when the batch has no soundtrack, as for the UI's single-frame buckets; a soundtrack's
        noisy latents are as many tokens), the connectors' two prompt streams, one call."""
        import torch

        batch, channels, frames, height, width = latents.shape
        video_text, audio_text, text_mask = self._connectors(cond, batch)
        tokens = latents.permute(0, 2, 3, 4, 1).reshape(batch, frames * height * width, channels)
        audio_frames = self._audio_frames(frames)
        audio = torch.zeros(batch, audio_frames, self.audio_tokens_width, device=latents.device, dtype=latents.dtype)
        with torch.no_grad():
            video_coords = denoiser.rope.prepare_video_coords(batch, frames, height, width, latents.device, fps=FPS)
            audio_coords = denoiser.audio_rope.prepare_audio_coords(batch, audio_frames, latents.device)
        timestep = (t * 1000).to(latents.dtype)
        video, audio = denoiser(
            hidden_states=tokens, audio_hidden_states=audio, encoder_hidden_states=video_text,
            audio_encoder_hidden_states=audio_text, timestep=timestep, sigma=timestep, audio_timestep=timestep,
            encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask, num_frames=frames,
            height=height, width=width, fps=FPS, audio_num_frames=audio_frames, video_coords=video_coords,
            audio_coords=audio_coords, use_cross_timestep=False, return_dict=False)
        video = video.reshape(batch, frames, height, width, channels).permute(0, 4, 1, 2, 3)
        if torch.is_grad_enabled():
            # AI Toolkit adds the audio loss (x audio_loss_multiplier) for video batches of do_audio
            # datasets (SDTrainer, batch.audio_pred); the probe's loss is the video's, so the audio
            # prediction joins it at weight zero: every audio layer's LoRA gets its gradient and its
            # optimizer state, as in audio training (an image batch leaves the last block's audio
            # layers without gradients: a few MB less at full size).
            video = video + 0 * audio.mean()
        return video

    def guided(self, denoiser, latents, t, cond, uncond, guidance_scale):
        """LTX2Pipeline: with guidance the negative and the positive prompt in one batch of two."""
        if guidance_scale <= 1:
            return self.predict(denoiser, latents, t, cond)
        import torch

        both = {key: torch.cat([uncond[key], cond[key]]) for key in cond}
        unconditional, conditional = self.predict(denoiser, torch.cat([latents, latents]), t.repeat(2), both).chunk(2)
        return unconditional + guidance_scale * (conditional - unconditional)
