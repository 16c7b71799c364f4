"""Offline NVFP4-aware GPTQ: artifact + prompts -> calibrated artifact."""

from .calibrate import calibrate
from .gptq import GPTQ
from .quantizer import NVFP4Quantizer

__all__ = ["GPTQ", "NVFP4Quantizer", "calibrate"]
