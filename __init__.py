"""pact: LoRA fine-tuning of LLMs whose frozen weights are stored in NVFP4."""

__version__ = "0.1.0"
