"""The Triton kernel of calibrate/sweep.py's ``sweep_group_torch``: one launch sweeps a 16-column
group for every row, each program keeping the group's columns of BLOCK_N rows in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pact.runtime.ops.triton.codec import e2m1_codes, e2m1_value


@triton.jit
def _sweep_kernel(W, H, RS, S, GRP, G, Q, E, N, K, c0, BLOCK_N: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 16)
    m = (n < N)[None, :] & (j < 16)[:, None]
    T = tl.load(W + (c0 + j)[:, None] * N + n[None, :], mask=m, other=0.0)  # [16, BLOCK_N]
    gi = tl.load(GRP + j)
    RSt = tl.load(RS + gi[:, None] * N + n[None, :], mask=m, other=0.0)
    St = tl.load(S + gi[:, None] * N + n[None, :], mask=m, other=0.0)
    Hg = tl.load(H + (c0 + j)[:, None] * K + (c0 + j)[None, :])  # [16, 16]
    d = tl.load(H + (c0 + j) * (K + 1))
    g = tl.load(G)
    for i in tl.static_range(16):
        sel = (j == i)[:, None]
        # row i of a tile, bit for bit (signed zeros too): the max of it and -inf elsewhere
        w = tl.max(tl.where(sel, T, -float("inf")), axis=0)
        rs = tl.max(tl.where(sel, RSt, -float("inf")), axis=0)
        s = tl.max(tl.where(sel, St, -float("inf")), axis=0)
        di = tl.max(tl.where(j == i, d, -float("inf")), axis=0)
        q = (e2m1_value(e2m1_codes(w * rs)) * s) * g
        err = tl.math.div_rn(w - q, di + tl.zeros_like(w))
        tl.store(Q + (c0 + i) * N + n, q, mask=n < N)
        tl.store(E + (c0 + i) * N + n, err, mask=n < N)
        h = tl.max(tl.where(sel, Hg, -float("inf")), axis=0)  # Hinv[c0 + i, c0 + j]
        h = tl.where(j > i, h, 0.0)
        T = T - h[:, None] * err[None, :]


def sweep_group_triton(Wt: torch.Tensor, Hinv: torch.Tensor, c0: int, rs: torch.Tensor, s: torch.Tensor,
                       grp: torch.Tensor, g: torch.Tensor, Qt: torch.Tensor, Errt: torch.Tensor) -> None:
    """sweep_group_torch's arguments and effect, in one launch."""
    K, N = Wt.shape
    for t in (Wt, Hinv, rs, s, Qt, Errt):
        if not t.is_contiguous() or t.dtype != torch.float32:
            raise ValueError("sweep_group_triton: fp32 contiguous tensors expected")
    block_n = min(256, triton.next_power_of_2(N))
    _sweep_kernel[(triton.cdiv(N, block_n),)](Wt, Hinv, rs, s, grp.to(torch.int32), g.reshape(1), Qt, Errt,
                                              N, K, c0, BLOCK_N=block_n, num_warps=4)
