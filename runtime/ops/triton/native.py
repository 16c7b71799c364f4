"""`nvfp4-native`: FP4 tensor cores through `tl.dot_scaled` (Blackwell: sm_100 tcgen05, sm_120).

UNVERIFIED ON HARDWARE: no sm_100/sm_120 GPU was available; the kernel is compiled for both
targets in the tests (Triton 3.6 ships ptxas), and its numerics are defined by the twin
`nvfp4_gemm_native` in runtime/ops/reference.py. Triton 3.6 cannot compile it for sm_90
(NVFP4 `dot_scaled` fails in TritonGPUAccelerateMatmul), nor run it under the interpreter.

Both operands must be NVFP4: a bf16 A (the input gradient dY) is first quantized to NVFP4
rows, so on this backend the input gradient is computed from a quantized dY, unlike the
`bf16-decode` backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pact.formats.nvfp4 import NVFP4Rows, NVFP4Tensor

from .gemm import gemm_tile
from .rows import quant_rows


@triton.jit
def _nvfp4_native_gemm_kernel(a_ptr, a_scales_ptr, a_rs_ptr, b_ptr, b_scales_ptr, b_gs_ptr, c_ptr, stride_cm, M, N,
                              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr):
    """C [M,N] = A [M,K] @ B [N,K]^T with A, B NVFP4 (packed along K, e4m3 scales per 16)."""
    offs_m, offs_n, offs_h, offs_s, mask_m, mask_n = gemm_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kh, ks = k0 // 2 + offs_h, k0 // 16 + offs_s
        a = tl.load(a_ptr + offs_m[:, None] * (K // 2) + kh[None, :], mask=mask_m[:, None], other=0)
        sa = tl.load(a_scales_ptr + offs_m[:, None] * (K // 16) + ks[None, :], mask=mask_m[:, None], other=0.0)
        # W [N, K/2] read as [K/2, N]: each byte still holds two consecutive K elements
        b = tl.load(b_ptr + offs_n[None, :] * (K // 2) + kh[:, None], mask=mask_n[None, :], other=0)
        sb = tl.load(b_scales_ptr + offs_n[:, None] * (K // 16) + ks[None, :], mask=mask_n[:, None], other=0.0)
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
    acc = acc * tl.load(a_rs_ptr + offs_m, mask=mask_m, other=0.0)[:, None] * tl.load(b_gs_ptr)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(tl.bfloat16),
             mask=mask_m[:, None] & mask_n[None, :])


NATIVE_BLOCKS = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)


def nvfp4_gemm_native(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """C [M, N] = A [M, K] @ W [N, K]^T on FP4 tensor cores; a bf16 A is quantized first."""
    if not isinstance(a, NVFP4Rows):
        a = quant_rows(a)
    N, K = w.shape
    if a.shape[1] != K or K % NATIVE_BLOCKS["BLOCK_K"]:
        raise ValueError(f"nvfp4_gemm_native: K={a.shape[1]} (A) / {K} (W) must match and be a multiple of "
                         f"{NATIVE_BLOCKS['BLOCK_K']}")
    M = a.shape[0]
    c = torch.empty(M, N, dtype=torch.bfloat16, device=w.packed.device)
    if M == 0:
        return c
    grid = (triton.cdiv(M, NATIVE_BLOCKS["BLOCK_M"]) * triton.cdiv(N, NATIVE_BLOCKS["BLOCK_N"]),)
    _nvfp4_native_gemm_kernel[grid](a.packed, a.scales, a.row_scale, w.packed, w.scales, w.global_scale.reshape(1), c,
                                    c.stride(0), M, N, K, **NATIVE_BLOCKS, num_warps=4)
    return c
