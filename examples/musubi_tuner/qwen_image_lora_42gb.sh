#!/usr/bin/env bash
# musubi-tuner's Qwen-Image LoRA commands as docs/qwen_image.md writes them (pre-caching, then
# "Standard Qwen-Image Training"), at its VRAM table's row no memory option: 42GB ("For 1024x1024 training
# with the batch size of 1, `--mixed_precision bf16` and `--gradient_checkpointing` is enabled").
python src/musubi_tuner/qwen_image_cache_latents.py \
    --dataset_config dataset_1024.toml \
    --vae path/to/vae_model \
    --model_version original

python src/musubi_tuner/qwen_image_cache_text_encoder_outputs.py \
    --dataset_config dataset_1024.toml \
    --text_encoder path/to/text_encoder \
    --batch_size 1 \
    --model_version original

accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 src/musubi_tuner/qwen_image_train_network.py \
    --dit path/to/dit_model \
    --vae path/to/vae_model \
    --text_encoder path/to/text_encoder \
    --model_version original \
    --dataset_config dataset_1024.toml \
    --sdpa --mixed_precision bf16 \
    --timestep_sampling shift \
    --weighting_scheme none --discrete_flow_shift 2.2 \
    --optimizer_type adamw8bit --learning_rate 5e-5 --gradient_checkpointing \
    --max_data_loader_n_workers 2 --persistent_data_loader_workers \
    --network_module networks.lora_qwen_image \
    --network_dim 16 \
    --max_train_epochs 16 --save_every_n_epochs 1 --seed 42 \
    --output_dir path/to/output_dir --output_name name-of-lora
