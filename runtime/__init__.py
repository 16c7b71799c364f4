"""Online: memory-mapped NVFP4 artifact -> LoRA training (kernels, autograd, model, trainer)."""
