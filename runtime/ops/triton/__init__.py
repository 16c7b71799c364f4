"""Triton kernels and their launchers (twins of the same names in runtime/ops/reference.py), split by
job: codec.py (the shared rounding, decoding and tiling helpers), rows.py (quantizing row kernels
and the backward kernels reading saved rows), gemm.py (the `bf16-decode` GEMM), fp8.py (the `fp8`
backend), native.py (the `nvfp4-native` backend, Blackwell), rotary.py, xent.py."""

from .fp8 import e4m3_rows
from .gemm import nvfp4_dgrad_fwd, nvfp4_gemm
from .rotary import rope
from .rows import (
    dequant_rows,
    quant_rows,
    rmsnorm_backward,
    rmsnorm_quant,
    rmsnorm_rows,
    silu_mul_backward,
    silu_mul_h,
    silu_mul_quant,
    silu_mul_rows,
)
from .xent import ce_grad_

__all__ = ["dequant_rows", "e4m3_rows", "nvfp4_dgrad_fwd", "nvfp4_gemm", "quant_rows", "rmsnorm_backward",
           "rmsnorm_quant", "rmsnorm_rows", "silu_mul_backward", "silu_mul_h", "silu_mul_quant", "silu_mul_rows",
           "rope", "ce_grad_"]
