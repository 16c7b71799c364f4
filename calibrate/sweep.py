"""GPTQ's inner sweep over one 16-column NVFP4 group, fused: the torch twin here, the Triton
kernel in sweep_triton.py (the same signature and, under the interpreter, the same bits).

Per column c of the group, in order (Wt = W^T, so a column is a contiguous row of Wt):

    w   = Wt[c] as the group's earlier columns updated it
    q   = (round_e2m1(w * rs) * s) * g      rs = (1 / g) / s, s: the column's block scale per row
    err = (w - q) / Hinv[c, c]
    Wt[c'] -= Hinv[c, c'] * err             for the group's later columns c'

and Qt[c] = q, Errt[c] = err. The unfused sweep launches about ten small ops per column; for a
1B model's ~150K columns that launch overhead was most of a calibration or a merge on the GPU.
The kernel keeps the group's 16 columns of a slice of rows in registers and does all 16 steps in
one launch. Rows are independent, so programs split them.

Numerics: the twin multiplies then subtracts (no fused multiply-add) and divides in IEEE; the
kernel does the same under the interpreter (bit-identical, tests/test_calibrate.py) and divides
with ``div_rn`` on the GPU, where the compiler may fuse the update's multiply-add (rounding once
instead of twice: an error feedback differing in the last bit, as GPTQ's own summation order
does). Rows of Wt past a group are not written: the sweep reads only Qt and Errt afterwards.
"""

from __future__ import annotations

import torch

from pact.formats.nvfp4 import BLOCK, round_e2m1


def sweep_group_torch(Wt: torch.Tensor, Hinv: torch.Tensor, c0: int, rs: torch.Tensor, s: torch.Tensor,
                      grp: torch.Tensor, g: torch.Tensor, Qt: torch.Tensor, Errt: torch.Tensor) -> None:
    """Columns c0 .. c0+16 of Wt [K, N] (fp32): Qt and Errt [K, N] rows c0 .. c0+16 written.
    rs, s [K/16, N] fp32: per group and row, (1 / g) / scale and the scale; grp [16] (int, on
    Wt's device): the group of each of the 16 columns (c // 16 without act-order); g: the
    global scale (fp32, 0-d)."""
    T = Wt[c0 : c0 + BLOCK].clone()
    d = Hinv.diagonal()[c0 : c0 + BLOCK]
    rows_rs, rows_s = rs[grp], s[grp]  # [16, N]
    for i in range(BLOCK):
        w = T[i]
        q = (round_e2m1(w * rows_rs[i]) * rows_s[i]) * g
        Qt[c0 + i] = q
        err = torch.sub(w, q, out=Errt[c0 + i]).div_(d[i])
        if i + 1 < BLOCK:
            T[i + 1 :] -= Hinv[c0 + i, c0 + i + 1 : c0 + BLOCK, None] * err


def sweep_group(Wt, Hinv, c0, rs, s, grp, g, Qt, Errt) -> None:
    """The kernel on a GPU (calibrate/sweep_triton.py, imported there only), the twin on the CPU."""
    if Wt.is_cuda:
        from .sweep_triton import sweep_group_triton

        sweep_group_triton(Wt, Hinv, c0, rs, s, grp, g, Qt, Errt)
    else:
        sweep_group_torch(Wt, Hinv, c0, rs, s, grp, g, Qt, Errt)
