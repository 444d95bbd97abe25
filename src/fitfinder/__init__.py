"""fitfinder: find the best LoRA-training configuration that fits a GPU, and prove it fits."""

__version__ = "0.1.0"
