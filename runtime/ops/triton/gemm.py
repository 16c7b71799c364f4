"""The `bf16-decode` GEMM: C = A @ W^T with W in NVFP4 (and A NVFP4 rows or bf16), decoded to bf16
in registers for `tl.dot` (the exact NVFP4 product up to summation order, on any GPU with bf16 MMA),
or for many rows decoded once into a bf16 scratch for cuBLAS. Twin: reference.nvfp4_gemm.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from pact.formats.nvfp4 import NVFP4Rows, NVFP4Tensor

from .codec import MMA_DTYPE, decode_qs, decode_tile, rne_bf16


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M row-tiles sharing B tiles while in L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m


@triton.jit
def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of an NVFP4 GEMM: row / column offsets, the byte and scale
    offsets within a BLOCK_K step, and the row / column masks."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 16), offs_m < M, offs_n < N


@triton.jit
def _nvfp4_gemm_kernel(a_ptr, a_scales_ptr, a_rs_ptr, stride_am, b_ptr, b_scales_ptr, b_gs_ptr, c_ptr, stride_cm,
                       M, N, K: tl.constexpr, A_NVFP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """C [M,N] = A [M,K] @ B [N,K]^T; B NVFP4 (blocked along K), A NVFP4 rows or bf16.

    K is a compile-time constant: a model has a handful of K values, the loop bound and
    the byte offsets fold, and (Triton 3.6) the interpreter cannot loop to a runtime scalar
    under NumPy >= 2.4.
    """
    offs_m, offs_n, offs_h, offs_s, mask_m, mask_n = gemm_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kh, ks = k0 // 2 + offs_h, k0 // 16 + offs_s
        bp = tl.load(b_ptr + offs_n[:, None] * (K // 2) + kh[None, :],
                     mask=mask_n[:, None] & (kh[None, :] < K // 2), other=0).to(tl.int32)
        bs = tl.load(b_scales_ptr + offs_n[:, None] * (K // 16) + ks[None, :],
                     mask=mask_n[:, None] & (ks[None, :] < K // 16), other=0).to(tl.int32)
        b = decode_tile(bp, bs, BLOCK_N, BLOCK_K).to(DOT_DTYPE)
        if A_NVFP4:
            ap = tl.load(a_ptr + offs_m[:, None] * (K // 2) + kh[None, :],
                         mask=mask_m[:, None] & (kh[None, :] < K // 2), other=0).to(tl.int32)
            as_ = tl.load(a_scales_ptr + offs_m[:, None] * (K // 16) + ks[None, :],
                          mask=mask_m[:, None] & (ks[None, :] < K // 16), other=0).to(tl.int32)
            a = decode_tile(ap, as_, BLOCK_M, BLOCK_K).to(DOT_DTYPE)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                        mask=mask_m[:, None] & (kk[None, :] < K), other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, tl.trans(b), acc)
    if A_NVFP4:
        acc = acc * tl.load(a_rs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    acc = rne_bf16(acc * tl.load(b_gs_ptr))
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(tl.bfloat16),
             mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------------------- launchers


# From this many rows on, decoding W once into a bf16 scratch and calling cuBLAS beats the
# register-decoding kernel on the H200 (measured: the fused kernel reaches ~80-120 TFLOP/s,
# cuBLAS bf16 ~700). The scratch lives for one call: a group's [N, K] bf16.
CUBLAS_MIN_ROWS = 256


def _mm_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a @ b_t.T with bf16 operands, fp32 accumulation and fp32 output (one rounding later)."""
    try:
        return torch.mm(a, b_t.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without out_dtype for this device (the CPU): an fp32 product
        return a.float() @ b_t.float().t()


def _gemm_blocks(M: int, N: int, K: int) -> dict:
    # Fixed tiles (the performance issue tunes these per GPU); BLOCK_K = 64 keeps 4 scale
    # bytes per row per step. Under the interpreter, bigger tiles mean fewer Python steps.
    return dict(BLOCK_M=64 if M <= 64 else 128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)


def nvfp4_gemm(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """C [M, N] = A [M, K] @ W [N, K]^T, W in NVFP4 blocked along K; A NVFP4 rows or bf16.

    ``a_hat``: A already dequantized to bf16 (the LoRA branch needs it anyway); the cuBLAS
    path then multiplies it instead of decoding A again. Large M on a GPU: W is decoded to
    q * s_b in bf16 (exact) and cuBLAS multiplies with the global scale as its alpha.
    Otherwise the register-decoding kernel.
    """
    if a.shape[0] >= CUBLAS_MIN_ROWS and w.packed.is_cuda:
        return nvfp4_gemm_cublas(a if a_hat is None else a_hat, w)
    return nvfp4_gemm_fused(a, w)


# id(global scale tensor) -> (weak reference, value). Not a WeakKeyDictionary: its lookups
# compare tensors with ==, and bool() of a CUDA comparison synchronizes the device per call.
_HOST_SCALES: dict[int, tuple[weakref.ref, float]] = {}


def _host_scale(t: torch.Tensor) -> float:
    """The global scale as a Python float, read from the device once per weight."""
    key = id(t)
    hit = _HOST_SCALES.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    v = float(t)
    _HOST_SCALES[key] = (weakref.ref(t, lambda _, key=key: _HOST_SCALES.pop(key, None)), v)
    return v


def nvfp4_gemm_cublas(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    check_k(a, w)
    wq = decode_qs(w.packed, w.scales)
    if isinstance(a, NVFP4Rows):  # exact: fp32 result, row and global scales, one rounding
        acc = _mm_fp32(decode_qs(a.packed, a.scales), wq) * a.row_scale[:, None]
        return (acc * w.global_scale).to(torch.bfloat16)
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty(a.shape[0], wq.shape[0], dtype=torch.bfloat16, device=a.device)
    # D = alpha * A @ Wq^T in cuBLAS's fp32 epilogue, then one rounding to bf16 (beta = 0: `out` unread)
    return torch.addmm(out, a, wq.t(), beta=0, alpha=_host_scale(w.global_scale), out=out)


def nvfp4_dgrad_fwd(dy: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """dX [M, K] = dY [M, N] @ W [N, K], W the forward layout: q * s_b decoded to bf16 (exact) and cuBLAS
    multiplies it untransposed, the global scale as its alpha (fp32 epilogue, one rounding). Any M: the
    register-decoding kernel wants W blocked along the contracted dimension, which this layout is not."""
    if dy.shape[1] != w.shape[0]:
        raise ValueError(f"nvfp4_dgrad_fwd: dY has {dy.shape[1]} columns, W has N={w.shape[0]}")
    wq = decode_qs(w.packed, w.scales)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    out = torch.empty(dy.shape[0], wq.shape[1], dtype=torch.bfloat16, device=dy.device)
    return torch.addmm(out, dy, wq, beta=0, alpha=_host_scale(w.global_scale), out=out)


def check_k(a, w: NVFP4Tensor) -> None:
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"nvfp4_gemm: A has K={a.shape[1]}, W has K={w.shape[1]}")


def nvfp4_gemm_fused(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """The register-decoding kernel: NVFP4 tiles decoded to bf16 in registers, tl.dot."""
    check_k(a, w)
    N, K = w.shape
    a_nvfp4 = isinstance(a, NVFP4Rows)
    if a_nvfp4:
        M = a.shape[0]
        a_args = (a.packed, a.scales.view(torch.uint8), a.row_scale, K // 2)
    else:
        a = a if a.stride(-1) == 1 else a.contiguous()
        M = a.shape[0]
        a_args = (a, a, a, a.stride(0))  # scale pointers unused when A is bf16
    c = torch.empty(M, N, dtype=torch.bfloat16, device=w.packed.device)
    if M == 0:
        return c
    cfg = _gemm_blocks(M, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    gs = w.global_scale.reshape(1)  # read in the kernel: no host sync per call
    _nvfp4_gemm_kernel[grid](*a_args, w.packed, w.scales.view(torch.uint8), gs, c, c.stride(0),
                             M, N, K, A_NVFP4=a_nvfp4, **cfg, DOT_DTYPE=MMA_DTYPE, num_warps=8, num_stages=3)
    return c
