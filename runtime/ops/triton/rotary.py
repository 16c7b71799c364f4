"""Rotary position embedding as one Triton kernel per direction (twin: reference.rope).

transformers computes ``x * cos + rotate_half(x) * sin`` with five bf16 kernels per tensor
(and as many in backward), on the transposed [B, heads, S, hd] view where they run strided.
Here one program rotates one token's heads in fp32 and rounds once to bf16; the backward is
the inverse rotation (rotate by -theta).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import rne_bf16


@triton.jit
def _rope_kernel(x_ptr, stride_x, cos_ptr, sin_ptr, out_ptr, S, HEADS, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, INVERSE: tl.constexpr):
    t = tl.program_id(0)
    pos = t % S
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * HALF + offs_j).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + offs_j).to(tl.float32)[None, :]
    if INVERSE:
        s = -s
    first = offs_h[:, None] * (2 * HALF) + offs_j[None, :]
    mask = offs_h[:, None] < HEADS
    x1 = tl.load(x_ptr + t * stride_x + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + t * stride_x + first + HALF, mask=mask, other=0.0).to(tl.float32)
    row = out_ptr + t * HEADS * 2 * HALF
    tl.store(row + first, rne_bf16(x1 * c - x2 * s).to(tl.bfloat16), mask=mask)
    tl.store(row + first + HALF, rne_bf16(x2 * c + x1 * s).to(tl.bfloat16), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, heads * hd] bf16 (rows may be strided), token t at position t % S; cos/sin [S, hd/2].
    Returns the rotated (``inverse``: rotated back) tensor, contiguous bf16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, width = x.shape
    S, half = cos.shape
    heads = width // (2 * half)
    out = torch.empty(T, width, dtype=torch.bfloat16, device=x.device)
    if T:
        _rope_kernel[(T,)](x, x.stride(0), cos, sin, out, S, heads, HALF=half,
                           BLOCK_H=triton.next_power_of_2(heads), INVERSE=inverse, num_warps=4)
    return out
