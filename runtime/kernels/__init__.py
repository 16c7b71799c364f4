"""Triton kernels and their launchers (twins in runtime/reference.py)."""

from .nvfp4 import (
    dequant_rows,
    nvfp4_gemm,
    quant_rows,
    rmsnorm_backward,
    rmsnorm_quant,
    rmsnorm_rows,
    silu_mul_backward,
    silu_mul_h,
    silu_mul_quant,
    silu_mul_rows,
)
from .rotary import rope
from .xent import ce_grad_

__all__ = ["dequant_rows", "nvfp4_gemm", "quant_rows", "rmsnorm_backward", "rmsnorm_quant", "rmsnorm_rows",
           "silu_mul_backward", "silu_mul_h", "silu_mul_quant", "silu_mul_rows", "rope", "ce_grad_"]
