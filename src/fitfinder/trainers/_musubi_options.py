"""musubi-tuner's argument parsers, option by option: each option's kind, default and the file:line of
its add_argument (kohya-ss/musubi-tuner, commit 30c658c4, 2026-06-24). Data only: musubi_tuner.py
composes each script's parser from these groups as its main() does (setup_parser_common, then the
script's own setup_parser), and each caching script's the same way.

Read from the source's add_argument calls (action store_true: a switch; nargs "*": a list; type int or
float; otherwise a string); lines the source leaves commented out (--full_bf16, --flow_shift) are no
options.
"""

from __future__ import annotations

from fitfinder.trainers._kohya import BOOL, FLOAT, INT, LIST, STR, Option

# training/parser_common.py setup_parser_common: what every musubi-tuner *_train_network.py takes
COMMON: dict[str, Option] = {
    "config_file": Option(STR, None, "src/musubi_tuner/training/parser_common.py:36"),
    "dataset_config": Option(STR, None, "src/musubi_tuner/training/parser_common.py:42"),
    "sdpa": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:51"),
    "flash_attn": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:56"),
    "sage_attn": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:61"),
    "xformers": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:66"),
    "flash3": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:71"),
    "split_attn": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:77"),
    "compile": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:86"),
    "compile_backend": Option(STR, 'inductor', "src/musubi_tuner/training/parser_common.py:91"),
    "compile_mode": Option(STR, 'default', "src/musubi_tuner/training/parser_common.py:97"),
    "compile_dynamic": Option(STR, None, "src/musubi_tuner/training/parser_common.py:104"),
    "compile_fullgraph": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:112"),
    "compile_cache_size_limit": Option(INT, None, "src/musubi_tuner/training/parser_common.py:117"),
    "cuda_allow_tf32": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:123"),
    "cuda_cudnn_benchmark": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:128"),
    "dynamo_backend": Option(STR, 'NO', "src/musubi_tuner/training/parser_common.py:134"),
    "dynamo_mode": Option(STR, None, "src/musubi_tuner/training/parser_common.py:142"),
    "dynamo_fullgraph": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:150"),
    "dynamo_dynamic": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:156"),
    "max_train_steps": Option(INT, 1600, "src/musubi_tuner/training/parser_common.py:164"),
    "max_train_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:165"),
    "max_data_loader_n_workers": Option(INT, 8, "src/musubi_tuner/training/parser_common.py:171"),
    "persistent_data_loader_workers": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:177"),
    "seed": Option(INT, None, "src/musubi_tuner/training/parser_common.py:182"),
    "gradient_checkpointing": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:183"),
    "gradient_checkpointing_cpu_offload": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:186"),
    "gradient_accumulation_steps": Option(INT, 1, "src/musubi_tuner/training/parser_common.py:191"),
    "mixed_precision": Option(STR, None, "src/musubi_tuner/training/parser_common.py:197"),
    "save_precision": Option(STR, None, "src/musubi_tuner/training/parser_common.py:204"),
    "logging_dir": Option(STR, None, "src/musubi_tuner/training/parser_common.py:215"),
    "log_with": Option(STR, None, "src/musubi_tuner/training/parser_common.py:221"),
    "log_prefix": Option(STR, None, "src/musubi_tuner/training/parser_common.py:228"),
    "log_tracker_name": Option(STR, None, "src/musubi_tuner/training/parser_common.py:231"),
    "wandb_run_name": Option(STR, None, "src/musubi_tuner/training/parser_common.py:237"),
    "log_tracker_config": Option(STR, None, "src/musubi_tuner/training/parser_common.py:243"),
    "wandb_api_key": Option(STR, None, "src/musubi_tuner/training/parser_common.py:249"),
    "log_config": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:255"),
    "ddp_timeout": Option(INT, None, "src/musubi_tuner/training/parser_common.py:259"),
    "ddp_gradient_as_bucket_view": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:265"),
    "ddp_static_graph": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:270"),
    "sample_every_n_steps": Option(INT, None, "src/musubi_tuner/training/parser_common.py:278"),
    "sample_at_first": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:284"),
    "sample_every_n_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:287"),
    "sample_prompts": Option(STR, None, "src/musubi_tuner/training/parser_common.py:293"),
    "optimizer_type": Option(STR, '', "src/musubi_tuner/training/parser_common.py:302"),
    "optimizer_args": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:309"),
    "learning_rate": Option(FLOAT, 2e-06, "src/musubi_tuner/training/parser_common.py:316"),
    "max_grad_norm": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:317"),
    "lr_scheduler": Option(STR, 'constant', "src/musubi_tuner/training/parser_common.py:326"),
    "lr_warmup_steps": Option(STR, 0, "src/musubi_tuner/training/parser_common.py:332"),
    "lr_decay_steps": Option(STR, 0, "src/musubi_tuner/training/parser_common.py:339"),
    "lr_scheduler_num_cycles": Option(INT, 1, "src/musubi_tuner/training/parser_common.py:346"),
    "lr_scheduler_power": Option(FLOAT, 1, "src/musubi_tuner/training/parser_common.py:352"),
    "lr_scheduler_timescale": Option(INT, None, "src/musubi_tuner/training/parser_common.py:358"),
    "lr_scheduler_min_lr_ratio": Option(FLOAT, None, "src/musubi_tuner/training/parser_common.py:365"),
    "lr_scheduler_type": Option(STR, '', "src/musubi_tuner/training/parser_common.py:372"),
    "lr_scheduler_args": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:373"),
    "fp8_base": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:383"),
    "blocks_to_swap": Option(INT, None, "src/musubi_tuner/training/parser_common.py:391"),
    "use_pinned_memory_for_block_swap": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:397"),
    "block_swap_h2d_only": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:403"),
    "block_swap_ring_size": Option(INT, 2, "src/musubi_tuner/training/parser_common.py:410"),
    "img_in_txt_in_offloading": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:418"),
    "disable_numpy_memmap": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:423"),
    "guidance_scale": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:433"),
    "timestep_sampling": Option(STR, 'sigma', "src/musubi_tuner/training/parser_common.py:436"),
    "discrete_flow_shift": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:456"),
    "sigmoid_scale": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:462"),
    "weighting_scheme": Option(STR, 'none', "src/musubi_tuner/training/parser_common.py:468"),
    "logit_mean": Option(FLOAT, 0.0, "src/musubi_tuner/training/parser_common.py:475"),
    "logit_std": Option(FLOAT, 1.0, "src/musubi_tuner/training/parser_common.py:481"),
    "mode_scale": Option(FLOAT, 1.29, "src/musubi_tuner/training/parser_common.py:487"),
    "min_timestep": Option(INT, None, "src/musubi_tuner/training/parser_common.py:493"),
    "max_timestep": Option(INT, None, "src/musubi_tuner/training/parser_common.py:499"),
    "preserve_distribution_shape": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:505"),
    "num_timestep_buckets": Option(INT, None, "src/musubi_tuner/training/parser_common.py:514"),
    "show_timesteps": Option(STR, None, "src/musubi_tuner/training/parser_common.py:528"),
    "no_metadata": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:538"),
    "network_weights": Option(STR, None, "src/musubi_tuner/training/parser_common.py:541"),
    "network_module": Option(STR, None, "src/musubi_tuner/training/parser_common.py:544"),
    "network_dim": Option(INT, None, "src/musubi_tuner/training/parser_common.py:547"),
    "network_alpha": Option(FLOAT, 1, "src/musubi_tuner/training/parser_common.py:553"),
    "network_dropout": Option(FLOAT, None, "src/musubi_tuner/training/parser_common.py:559"),
    "network_args": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:565"),
    "training_comment": Option(STR, None, "src/musubi_tuner/training/parser_common.py:572"),
    "dim_from_weights": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:578"),
    "scale_weight_norms": Option(FLOAT, None, "src/musubi_tuner/training/parser_common.py:583"),
    "base_weights": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:589"),
    "base_weights_multiplier": Option(LIST, None, "src/musubi_tuner/training/parser_common.py:596"),
    "output_dir": Option(STR, None, "src/musubi_tuner/training/parser_common.py:606"),
    "output_name": Option(STR, None, "src/musubi_tuner/training/parser_common.py:609"),
    "resume": Option(STR, None, "src/musubi_tuner/training/parser_common.py:615"),
    "save_every_n_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:617"),
    "save_every_n_steps": Option(INT, None, "src/musubi_tuner/training/parser_common.py:623"),
    "save_last_n_epochs": Option(INT, None, "src/musubi_tuner/training/parser_common.py:629"),
    "save_last_n_epochs_state": Option(INT, None, "src/musubi_tuner/training/parser_common.py:635"),
    "save_last_n_steps": Option(INT, None, "src/musubi_tuner/training/parser_common.py:641"),
    "save_last_n_steps_state": Option(INT, None, "src/musubi_tuner/training/parser_common.py:647"),
    "save_state": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:653"),
    "save_state_on_train_end": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:658"),
    "metadata_title": Option(STR, None, "src/musubi_tuner/training/parser_common.py:668"),
    "metadata_author": Option(STR, None, "src/musubi_tuner/training/parser_common.py:674"),
    "metadata_description": Option(STR, None, "src/musubi_tuner/training/parser_common.py:680"),
    "metadata_license": Option(STR, None, "src/musubi_tuner/training/parser_common.py:686"),
    "metadata_tags": Option(STR, None, "src/musubi_tuner/training/parser_common.py:692"),
    "metadata_reso": Option(STR, None, "src/musubi_tuner/training/parser_common.py:698"),
    "metadata_arch": Option(STR, None, "src/musubi_tuner/training/parser_common.py:704"),
    "huggingface_repo_id": Option(STR, None, "src/musubi_tuner/training/parser_common.py:713"),
    "huggingface_repo_type": Option(STR, None, "src/musubi_tuner/training/parser_common.py:719"),
    "huggingface_path_in_repo": Option(STR, None, "src/musubi_tuner/training/parser_common.py:725"),
    "huggingface_token": Option(STR, None, "src/musubi_tuner/training/parser_common.py:731"),
    "huggingface_repo_visibility": Option(STR, None, "src/musubi_tuner/training/parser_common.py:732"),
    "save_state_to_huggingface": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:738"),
    "resume_from_huggingface": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:741"),
    "async_upload": Option(BOOL, False, "src/musubi_tuner/training/parser_common.py:746"),
    "dit": Option(STR, None, "src/musubi_tuner/training/parser_common.py:754"),
    "vae": Option(STR, None, "src/musubi_tuner/training/parser_common.py:755"),
    "vae_dtype": Option(STR, None, "src/musubi_tuner/training/parser_common.py:756"),
}

# qwen_image_train_network.py qwen_image_setup_parser, qwen_image_utils.add_model_version_args
QWEN_IMAGE: dict[str, Option] = {
    "fp8_scaled": Option(BOOL, False, "src/musubi_tuner/qwen_image_train_network.py:592"),
    "text_encoder": Option(STR, None, "src/musubi_tuner/qwen_image_train_network.py:593"),
    "fp8_vl": Option(BOOL, False, "src/musubi_tuner/qwen_image_train_network.py:594"),
    "num_layers": Option(INT, None, "src/musubi_tuner/qwen_image_train_network.py:595"),
    "remove_first_image_from_target": Option(BOOL, False, "src/musubi_tuner/qwen_image_train_network.py:596"),
    "edit": Option(BOOL, False, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1551"),
    "edit_plus": Option(BOOL, False, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1554"),
    "model_version": Option(STR, None, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1557"),
}

# wan_train_network.py wan_setup_parser
WAN: dict[str, Option] = {
    "task": Option(STR, 't2v-14B', "src/musubi_tuner/wan_train_network.py:723"),
    "fp8_scaled": Option(BOOL, False, "src/musubi_tuner/wan_train_network.py:724"),
    "t5": Option(STR, None, "src/musubi_tuner/wan_train_network.py:725"),
    "fp8_t5": Option(BOOL, False, "src/musubi_tuner/wan_train_network.py:726"),
    "clip": Option(STR, None, "src/musubi_tuner/wan_train_network.py:727"),
    "vae_cache_cpu": Option(BOOL, False, "src/musubi_tuner/wan_train_network.py:733"),
    "one_frame": Option(BOOL, False, "src/musubi_tuner/wan_train_network.py:734"),
    "force_v2_1_time_embedding": Option(BOOL, False, "src/musubi_tuner/wan_train_network.py:737"),
    "dit_high_noise": Option(STR, None, "src/musubi_tuner/wan_train_network.py:740"),
    "timestep_boundary": Option(INT, None, "src/musubi_tuner/wan_train_network.py:741"),
    "offload_inactive_dit": Option(BOOL, False, "src/musubi_tuner/wan_train_network.py:747"),
}

# flux_kontext_train_network.py flux_kontext_setup_parser
FLUX_KONTEXT: dict[str, Option] = {
    "fp8_scaled": Option(BOOL, False, "src/musubi_tuner/flux_kontext_train_network.py:379"),
    "text_encoder1": Option(STR, None, "src/musubi_tuner/flux_kontext_train_network.py:380"),
    "fp8_t5": Option(BOOL, False, "src/musubi_tuner/flux_kontext_train_network.py:381"),
    "text_encoder2": Option(STR, None, "src/musubi_tuner/flux_kontext_train_network.py:382"),
}

# zimage_train_network.py zimage_setup_parser
ZIMAGE: dict[str, Option] = {
    "fp8_scaled": Option(BOOL, False, "src/musubi_tuner/zimage_train_network.py:339"),
    "text_encoder": Option(STR, None, "src/musubi_tuner/zimage_train_network.py:340"),
    "fp8_llm": Option(BOOL, False, "src/musubi_tuner/zimage_train_network.py:341"),
    "use_32bit_attention": Option(BOOL, False, "src/musubi_tuner/zimage_train_network.py:342"),
}

# flux_2_train_network.py flux2_setup_parser, flux2_utils.add_model_version_args
FLUX_2: dict[str, Option] = {
    "fp8_scaled": Option(BOOL, False, "src/musubi_tuner/flux_2_train_network.py:342"),
    "text_encoder": Option(STR, None, "src/musubi_tuner/flux_2_train_network.py:343"),
    "fp8_text_encoder": Option(BOOL, False, "src/musubi_tuner/flux_2_train_network.py:344"),
    "model_version": Option(STR, 'dev', "src/musubi_tuner/flux_2/flux2_utils.py:118"),
}

# cache_latents.py setup_parser_common: every *_cache_latents.py script's options
CACHE_LATENTS: dict[str, Option] = {
    "dataset_config": Option(STR, None, "src/musubi_tuner/cache_latents.py:381"),
    "vae": Option(STR, None, "src/musubi_tuner/cache_latents.py:382"),
    "vae_dtype": Option(STR, None, "src/musubi_tuner/cache_latents.py:383"),
    "device": Option(STR, None, "src/musubi_tuner/cache_latents.py:384"),
    "batch_size": Option(INT, None, "src/musubi_tuner/cache_latents.py:385"),
    "num_workers": Option(INT, None, "src/musubi_tuner/cache_latents.py:388"),
    "skip_existing": Option(BOOL, False, "src/musubi_tuner/cache_latents.py:389"),
    "keep_cache": Option(BOOL, False, "src/musubi_tuner/cache_latents.py:390"),
    "debug_mode": Option(STR, None, "src/musubi_tuner/cache_latents.py:391"),
    "console_width": Option(INT, 80, "src/musubi_tuner/cache_latents.py:392"),
    "console_back": Option(STR, None, "src/musubi_tuner/cache_latents.py:393"),
    "console_num_images": Option(INT, None, "src/musubi_tuner/cache_latents.py:396"),
    "disable_cudnn_backend": Option(BOOL, False, "src/musubi_tuner/cache_latents.py:402"),
}

# cache_text_encoder_outputs.py setup_parser_common: every *_cache_text_encoder_outputs.py script's
CACHE_TEXT: dict[str, Option] = {
    "dataset_config": Option(STR, None, "src/musubi_tuner/cache_text_encoder_outputs.py:214"),
    "device": Option(STR, None, "src/musubi_tuner/cache_text_encoder_outputs.py:215"),
    "batch_size": Option(INT, None, "src/musubi_tuner/cache_text_encoder_outputs.py:216"),
    "num_workers": Option(INT, None, "src/musubi_tuner/cache_text_encoder_outputs.py:219"),
    "skip_existing": Option(BOOL, False, "src/musubi_tuner/cache_text_encoder_outputs.py:220"),
    "keep_cache": Option(BOOL, False, "src/musubi_tuner/cache_text_encoder_outputs.py:221"),
}

# wan_cache_latents.py wan_setup_parser
WAN_CACHE_LATENTS: dict[str, Option] = {
    "vae_cache_cpu": Option(BOOL, False, "src/musubi_tuner/wan_cache_latents.py:274"),
    "i2v": Option(BOOL, False, "src/musubi_tuner/wan_cache_latents.py:275"),
    "clip": Option(STR, None, "src/musubi_tuner/wan_cache_latents.py:280"),
    "one_frame": Option(BOOL, False, "src/musubi_tuner/wan_cache_latents.py:286"),
}

# wan_cache_text_encoder_outputs.py wan_setup_parser
WAN_CACHE_TEXT: dict[str, Option] = {
    "t5": Option(STR, None, "src/musubi_tuner/wan_cache_text_encoder_outputs.py:101"),
    "fp8_t5": Option(BOOL, False, "src/musubi_tuner/wan_cache_text_encoder_outputs.py:102"),
}

# qwen_image_cache_text_encoder_outputs.py qwen_image_setup_parser
QWEN_IMAGE_CACHE_TEXT: dict[str, Option] = {
    "text_encoder": Option(STR, None, "src/musubi_tuner/qwen_image_cache_text_encoder_outputs.py:177"),
    "fp8_vl": Option(BOOL, False, "src/musubi_tuner/qwen_image_cache_text_encoder_outputs.py:178"),
}

# flux_kontext_cache_text_encoder_outputs.py flux_kontext_setup_parser
FLUX_KONTEXT_CACHE_TEXT: dict[str, Option] = {
    "text_encoder1": Option(STR, None, "src/musubi_tuner/flux_kontext_cache_text_encoder_outputs.py:116"),
    "text_encoder2": Option(STR, None, "src/musubi_tuner/flux_kontext_cache_text_encoder_outputs.py:117"),
    "fp8_t5": Option(BOOL, False, "src/musubi_tuner/flux_kontext_cache_text_encoder_outputs.py:118"),
}

# zimage_cache_text_encoder_outputs.py zimage_setup_parser
ZIMAGE_CACHE_TEXT: dict[str, Option] = {
    "text_encoder": Option(STR, None, "src/musubi_tuner/zimage_cache_text_encoder_outputs.py:119"),
    "fp8_llm": Option(BOOL, False, "src/musubi_tuner/zimage_cache_text_encoder_outputs.py:125"),
}

# flux_2_cache_text_encoder_outputs.py flux_2_setup_parser
FLUX_2_CACHE_TEXT: dict[str, Option] = {
    "text_encoder": Option(STR, None, "src/musubi_tuner/flux_2_cache_text_encoder_outputs.py:84"),
    "fp8_text_encoder": Option(BOOL, False, "src/musubi_tuner/flux_2_cache_text_encoder_outputs.py:85"),
}

# cache_latents.py hv_setup_parser: the VAE's chunking and tiling (Qwen-Image's and FLUX.1 Kontext's latents
# caching scripts add it)
HV_CACHE_LATENTS: dict[str, Option] = {
    "vae_tiling": Option(BOOL, False, "src/musubi_tuner/cache_latents.py:409"),
    "vae_chunk_size": Option(INT, None, "src/musubi_tuner/cache_latents.py:414"),
    "vae_spatial_tile_sample_min_size": Option(INT, None, "src/musubi_tuner/cache_latents.py:415"),
}

# qwen_image/qwen_image_utils.py add_model_version_args (both Qwen-Image caching scripts add it)
QWEN_IMAGE_VERSION: dict[str, Option] = {
    "edit": Option(BOOL, False, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1551"),
    "edit_plus": Option(BOOL, False, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1554"),
    "model_version": Option(STR, None, "src/musubi_tuner/qwen_image/qwen_image_utils.py:1557"),
}

# flux_2/flux2_utils.py add_model_version_args (both FLUX.2 caching scripts add it)
FLUX_2_VERSION: dict[str, Option] = {
    "model_version": Option(STR, 'dev', "src/musubi_tuner/flux_2/flux2_utils.py:118"),
}
