"""`fp8` compute backend (Ada sm_89 / Hopper sm_90): NVFP4 operands re-encoded as FP8 rows,
multiplied on FP8 tensor cores by cuBLAS (`torch._scaled_mm`, rowwise scales).

Per frozen GEMM C = A @ W^T:
- A (NVFP4 rows, or bf16 dY for the input gradient) -> E4M3 rows with one fp32 scale per row;
- W (the NVFP4 forward layout, or the backward layout for the input gradient) is decoded into
  E4M3 rows (one fp32 scale per output row, the tensor's global scale folded in) for this call
  only: the scratch is [N, K] bytes, and decoding costs a few % of the GEMM (BENCHMARKS.md).
- cuBLAS multiplies with fp32 accumulation and applies scale_a[m] * scale_b[n] in its epilogue.

Not exact, unlike `bf16-decode`: a product q * s_b has up to 5 mantissa bits and E4M3 keeps 3,
so each operand element moves by at most 2^-4 of its value (RNE; bound tested). The error is
well below NVFP4's own (~20 dB SQNR); the FP8 row conversion is what the twin
`reference.nvfp4_gemm_fp8` reproduces bit for bit.

E4M3 bytes: the GPU's own conversion on sm_90+, an exact emulation on the bits under the
interpreter and on sm_89 (triton/codec.py's docstring says why). The forward GEMMs' A
operand arrives with its E4M3 copy already written by the kernel that quantized it (RMSNorm,
SiLU-mul, o_proj input: runtime/ops/rows.py); only the input gradient's dY and the weights are
re-encoded here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pact.formats import nvfp4 as fmt
from pact.formats.nvfp4 import NVFP4Rows, NVFP4Tensor

from ..rows import E4M3Rows
from .codec import PAIRS_E4M3_ROWS, PAIRS_E4M3_W, block_width, decode_pairs, e4m3_bytes, e4m3_mode, row_config
from .gemm import check_k

FP8_MAX = tl.constexpr(fmt.E4M3_MAX)


@triton.jit
def _fp8_rows_kernel(src_ptr, stride_src, out_ptr, out_scale_ptr, K, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                     MODE: tl.constexpr):
    """One bf16 row -> E4M3 bytes [K] and its fp32 decode scale amax / 448 (a first pass takes
    the amax). NVFP4 sources take nvfp4.py's _decode_pairs_kernel."""
    row = tl.program_id(0)
    amax = 0.0
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        v = tl.load(src_ptr + row * stride_src + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
    amax = tl.where(amax > 0, amax, FP8_MAX)
    inv = tl.math.div_rn(FP8_MAX + tl.zeros_like(amax), amax)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        v = tl.load(src_ptr + row * stride_src + offs, mask=offs < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(v * inv, -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * K + offs, e4m3_bytes(y, MODE).to(tl.uint8), mask=offs < K)
    tl.store(out_scale_ptr + row, tl.math.div_rn(amax, FP8_MAX))


def fp8_rows(x: NVFP4Rows | NVFP4Tensor | torch.Tensor, pad_to: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x -> (E4M3 [R', K], fp32 scale [R']) with R' = R rounded up to ``pad_to``
    (cuBLAS wants every dimension a multiple of 16); padding rows are zeros with scale 1.
    amax per row: max |v| of bf16 rows; FP8_ROW_AMAX for NVFP4 activation rows (the bound
    every row meets: its per-row scale puts its largest block scale at 448); 6 * max(s_b) of
    the row for an NVFP4 weight (one scale per tensor), read from the row's scales alone."""
    rows, k = x.shape
    device = x.packed.device if isinstance(x, (NVFP4Rows, NVFP4Tensor)) else x.device
    padded = -(-rows // pad_to) * pad_to
    out = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(padded, dtype=torch.float32, device=device)
    if padded > rows:
        out[rows:].view(torch.uint8).zero_()
        scale[rows:] = 1.0
    if isinstance(x, NVFP4Rows):
        decode_pairs(x.packed, x.scales, x.row_scale, out[:rows], PAIRS_E4M3_ROWS, scale)
    elif isinstance(x, NVFP4Tensor):
        decode_pairs(x.packed, x.scales, x.global_scale.reshape(1), out[:rows], PAIRS_E4M3_W, scale)
    elif rows:
        x = x if x.stride(-1) == 1 else x.contiguous()
        _fp8_rows_kernel[(rows,)](x, x.stride(0), out.view(torch.uint8), scale, k, **row_config(block_width(k)),
                                  MODE=e4m3_mode(device))
    return out, scale


def e4m3_rows(y: torch.Tensor) -> E4M3Rows:
    """bf16 rows [T, K] -> E4M3 rows kept for backward (a recipe's saved=fp8): fp8_rows' bytes and
    scales, unpadded."""
    return E4M3Rows(*fp8_rows(y, pad_to=1))


def scaled_mm_rows(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """bf16 [Ma, Nb] = (sa[:, None] * A8) @ (sb[:, None] * B8)^T on FP8 tensor cores (cuBLAS)."""
    return torch._scaled_mm(a8, b8.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)


def nvfp4_gemm_fp8(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """C [M, N] = A [M, K] @ W [N, K]^T with both operands re-encoded as E4M3 rows.

    ``a_hat`` is accepted for the launcher signature and unused: the NVFP4 A is smaller to read.
    """
    check_k(a, w)
    m = a.shape[0]
    if getattr(a, "fp8", None) is not None:  # written by the kernel that quantized A
        a8, sa = a.fp8, a.fp8_scale
    else:
        a8, sa = fp8_rows(a)
    if getattr(w, "fp8", None) is not None:  # resident copy (--fp8-weights resident)
        w8, sw = w.fp8, w.fp8_scale
    else:
        w8, sw = fp8_rows(w)
    return scaled_mm_rows(a8, sa, w8, sw)[:m]
