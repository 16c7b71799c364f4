"""Pure-PyTorch twins of every kernel launcher, same signatures, built from `formats` only.

They are the CPU path and the reference the Triton kernels are tested against. Numerics are
chosen to match the kernels on purpose:
- RMSNorm: fp32 statistics, y = x * rstd * w in fp32 (no bf16 rounding before quantizing).
- Quantization: per-row NVFP4 (`formats.nvfp4.quantize_rows`), bit-exact with the kernels
  given the same fp32 input.
- GEMMs: operands decoded as (q * s_b), which is exact in bf16; the per-tensor / per-row
  fp32 scales multiply the fp32 accumulator afterwards. The product is therefore exactly
  the NVFP4 product up to the order of summation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pact.formats.nvfp4 import BLOCK, NVFP4Rows, NVFP4Tensor, decode_packed, dequantize_rows, quantize_rows


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[NVFP4Rows, torch.Tensor]:
    """x [T, H] bf16 -> (NVFP4 rows of x * rstd * w, rstd fp32 [T])."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return quantize_rows(xf * rstd[:, None] * weight.float()), rstd


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[NVFP4Rows, NVFP4Rows, NVFP4Rows]:
    """gate_up [T, 2I] bf16 (gate | up) -> NVFP4 rows of (silu(gate) * up, gate, up)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_rows(F.silu(gate) * up), quantize_rows(gate), quantize_rows(up)


def quant_rows(x: torch.Tensor) -> NVFP4Rows:
    """x [T, K] -> NVFP4 rows (per-row fp32 scale)."""
    return quantize_rows(x.float())


def dequant_rows(q: NVFP4Rows, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize_rows(q, dtype)


def _decoded_qs(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q * s_b) as fp32 [rows, cols]: exact (and exact in bf16)."""
    rows = packed.shape[0]
    q = decode_packed(packed).reshape(rows, -1, BLOCK)
    return (q * scales.float().unsqueeze(-1)).reshape(rows, -1)


def nvfp4_gemm(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """C [M, N] = A [M, K] @ W [N, K]^T, W in NVFP4 blocked along K; A NVFP4 rows or bf16.

    ``a_hat`` (A dequantized to bf16) is accepted for the kernel's signature; the reference
    always multiplies the exact NVFP4 operands.

    Accumulates in fp32 and returns bf16. Used for the forward (W = fwd layout) and the
    input gradient (A = dy, W = bwd layout, i.e. W^T blocked along N).
    """
    wq = _decoded_qs(w.packed, w.scales)
    if isinstance(a, NVFP4Rows):
        aq = _decoded_qs(a.packed, a.scales)
        acc = aq @ wq.t()
        acc = acc * a.row_scale.float()[:, None]
    else:
        acc = a.float() @ wq.t()
    return (acc * w.global_scale.float()).to(torch.bfloat16)
