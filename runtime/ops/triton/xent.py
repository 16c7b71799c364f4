"""Cross-entropy rows in place (twin: reference.ce_grad_): the loss's elementwise part.

One program per row of a bf16 logits chunk [c, V]: an online max / sum-of-exp pass (fp32,
per lane, combined at the end), then a pass writing softmax - onehot back as bf16. Two reads
and one write of the chunk, where the PyTorch version converts to fp32 and makes ~6 passes.
V is a compile-time constant (one per model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import rne_bf16

_FAR = tl.constexpr(-1.0e30)  # "minus infinity" that stays finite in max / exp arithmetic


@triton.jit
def _ce_grad_kernel(z_ptr, stride_z, t_ptr, loss_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), _FAR, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    mx = tl.max(m, axis=0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    t = tl.load(t_ptr + row)
    tl.store(loss_ptr + row, lse - tl.load(base + t).to(tl.float32))
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        x = tl.load(base + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(v0 + offs == t, p - 1.0, p)
        tl.store(base + v0 + offs, rne_bf16(p).to(tl.bfloat16), mask=mask)


def ce_grad_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """loss_i = logsumexp(z_i) - z_i[t_i] (fp32 [c]); logits (bf16 [c, V]) overwritten in place
    by softmax(z_i) - onehot(t_i)."""
    if logits.dtype != torch.bfloat16 or logits.stride(-1) != 1:
        raise ValueError(f"ce_grad_: needs bf16 logits with contiguous rows, "
                         f"got {logits.dtype} {tuple(logits.stride())}")
    c, vocab = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c:
        block = min(4096, triton.next_power_of_2(vocab))
        _ce_grad_kernel[(c,)](logits, logits.stride(0), targets.contiguous(), loss, V=vocab, BLOCK_V=block,
                              num_warps=8)
    return loss
