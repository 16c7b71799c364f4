"""The NVFP4 quantizer the GPTQ core calls: bit-compatible with pact.formats.nvfp4.

Scales: the global scale is fixed before the sweep (shared by a fused group, as at convert
time); block scales are fixed either all before the sweep from the original weights
(``static``, the only option with act-order) or when the sweep reaches each 16-column group,
from the columns as GPTQ has updated them so far (``dynamic``). 1d: one scale per row per
group; 2d: one per 16x16 block. ``scale_rule`` picks each block scale as the converter does
(formats.nvfp4.SCALE_RULES): ``amax`` maps the block's largest magnitude to 6; ``mse`` searches
the E4M3 codes around that one for the least squared error of the block's values (the weights
as the sweep has updated them, for dynamic scales) — the artifact's own rule, so calibration
never falls back to coarser scales than conversion chose.
"""

from __future__ import annotations

import os

import torch

from pact.formats.nvfp4 import (
    BLOCK,
    SCALE_RULES,
    NVFP4Tensor,
    block_scales,
    encode_with_scales,
    repeat_rows16,
    round_e2m1,
    search_block_scales,
)
from pact.runtime.graphs import side_stream


class NVFP4Quantizer:
    """``global_scale``: 0-dim, or one per row ([N], 1d only): rows that will be stored as different
    tensors, swept together (calibrate.merge solves several gains' rows in one sweep)."""

    def __init__(self, global_scale: torch.Tensor, *, scaling: str = "2d", static: bool = False,
                 scale_rule: str = "amax"):
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
        self.g = torch.as_tensor(global_scale, dtype=torch.float32)
        if self.g.dim() > 1 or (self.g.dim() == 1 and scaling != "1d"):
            raise ValueError(f"global_scale: 0-dim, or one per row with scaling='1d'; got shape {tuple(self.g.shape)}"
                             f" with scaling={scaling!r}")
        self.scaling, self.static, self.scale_rule = scaling, static, scale_rule
        self.scales: torch.Tensor | None = None  # e4m3 [N, K/16], groups in the original column order
        self.dynamic = not static  # scales fixed during the sweep (not with act-order: begin() says)
        self._grp: torch.Tensor | None = None  # [K/16, 16]: the group of each sweep column, per 16 of them
        self._rs: torch.Tensor | None = None  # fp32 [K/16, N]: (1 / g) / s, a group's row contiguous
        self._s: torch.Tensor | None = None  # fp32 [K/16, N]: s

    def _block_scales(self, W: torch.Tensor) -> torch.Tensor:
        """W [N, 16 m] -> e4m3 scales [N, m] (2d: each 16x16 block's, repeated over its rows)."""
        n, k = W.shape
        W = W.float().contiguous()  # a sweep's block is a transposed view
        if self.scaling == "1d":
            amax = W.reshape(n, k // BLOCK, BLOCK).abs().amax(-1)
        else:
            amax = W.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax(dim=(1, 3))
        g = self.g.reshape(n, 1) if self.g.dim() else self.g  # one per row: beside each row's blocks
        if self.scale_rule == "mse":
            sc = search_block_scales(W, amax, g, self.scaling)
        else:
            sc = block_scales(amax, g)
        return sc if self.scaling == "1d" else repeat_rows16(sc)

    def _fix(self, grp: slice | int, sc: torch.Tensor) -> None:
        """Store e4m3 scales [N, m] for group(s) ``grp`` and their fp32 factors (as formats.nvfp4 computes them)."""
        self.scales[:, grp] = sc
        s = sc.float().t()
        self._s[grp] = s
        self._rs[grp] = (1.0 / self.g) / s

    def begin(self, W: torch.Tensor, perm: torch.Tensor | None) -> None:
        n, k = W.shape
        self.dynamic = not (self.static or perm is not None)
        self.g = self.g.to(W.device)
        if self.g.dim() and self.g.numel() != n:
            raise ValueError(f"global_scale: {self.g.numel()} per-row scales for {n} rows")
        self.scales = torch.empty(n, k // BLOCK, dtype=torch.float8_e4m3fn, device=W.device)
        self._s = torch.empty(k // BLOCK, n, dtype=torch.float32, device=W.device)
        self._rs = torch.empty_like(self._s)
        cols = perm if perm is not None else torch.arange(k, device=W.device)
        self._grp = (cols // BLOCK).reshape(k // BLOCK, BLOCK)  # each sweep column's group
        if not self.dynamic:  # act-order sweeps out of order: groups fixed up front
            orig = W[:, torch.argsort(perm)] if perm is not None else W
            self._fix(slice(None), self._block_scales(orig))

    def sweep(self, Wt: torch.Tensor, Hinv: torch.Tensor, c0: int, Qt: torch.Tensor, Errt: torch.Tensor) -> None:
        """GPTQ's innermost loop, over the 16 columns c0 .. c0+16 (rows of Wt = W^T in sweep order, as
        the sweep has updated them). Dynamic scales are fixed first, from those columns; then each
        column c in order, its block's scale s and rs = (1 / g) / s (formats.nvfp4's numerics):

            w = Wt[c] as the group's earlier columns updated it (in a copy: afterwards the sweep
                reads only Qt and Errt)
            Qt[c] = q = (rne_e2m1(w * rs) * s) * g;  Errt[c] = err = (w - q) / Hinv[c, c]
            Wt[c'] -= Hinv[c, c'] * err for the group's later columns c'
        """
        if self.dynamic:
            self._fix(c0 // BLOCK, self._block_scales(Wt[c0 : c0 + BLOCK].t())[:, 0])
        grp = self._grp[c0 // BLOCK]  # each column's group (act-order mixes them)
        cols = slice(c0, c0 + BLOCK)
        args = (self._rs[grp], self._s[grp], self.g, Hinv[cols, cols], Qt[cols], Errt[cols])  # rows [16, N]
        if Wt.is_cuda and os.environ.get("PACT_GPTQ_CUDA_GRAPH", "1") != "0":
            _graph(Wt.device, Wt.shape[1])(Wt[cols], *args)
        else:
            _columns(Wt[cols].clone(), *args)

    def pack(self, Q: torch.Tensor) -> NVFP4Tensor:
        """The fake-quantized sweep result as stored NVFP4 (codes re-derived exactly; one global scale)."""
        if self.g.dim():
            raise ValueError("pack: one global scale per row is not one tensor; encode each one's rows")
        return NVFP4Tensor(encode_with_scales(Q, self.scales, self.g), self.scales, self.g)


def _columns(T: torch.Tensor, rs: torch.Tensor, s: torch.Tensor, g: torch.Tensor, Hb: torch.Tensor,
             Q: torch.Tensor, E: torch.Tensor) -> None:
    """``sweep``'s 16 columns in order: T [16, N] the group's columns (updated in place), rs and s
    [16, N] their factors, g the global scale (0-dim), Hb [16, 16] Hinv's block; writes Q and E."""
    d = Hb.diagonal()
    for i in range(BLOCK):
        w = T[i]
        q = (round_e2m1(w * rs[i]) * s[i]) * g
        Q[i] = q
        err = torch.sub(w, q, out=E[i]).div_(d[i])
        if i + 1 < BLOCK:
            T[i + 1 :].addr_(Hb[i, i + 1 :], err, alpha=-1)


class _ColumnsGraph:
    """``_columns`` on static [16, N] buffers, captured once as a CUDA graph: the ~180 kernel
    launches of a group replayed as one, behind 7 copies. The sweep's way on CUDA (PACT_GPTQ_CUDA_GRAPH=0:
    the eager ops): the same bits (tests/test_calibrate.py's GPU test), half the solve's time on the
    H200 (Llama-3.2-1B shapes: 54.5 -> 27.3 s; BENCHMARKS.md)."""

    def __init__(self, device: torch.device, n: int):
        with torch.cuda.device(device):  # capture on this device's stream (not the current device's)
            self._capture(device, n)

    def _capture(self, device: torch.device, n: int) -> None:
        f32 = {"dtype": torch.float32, "device": device}
        self.ins = [torch.zeros(BLOCK, n, **f32), torch.ones(BLOCK, n, **f32), torch.ones(BLOCK, n, **f32),
                    torch.ones(n, **f32), torch.eye(BLOCK, **f32)]  # T, rs, s, g (per row; a 0-dim g broadcasts), Hb
        self.outs = [torch.empty(BLOCK, n, **f32), torch.empty(BLOCK, n, **f32)]  # Q, E
        side = side_stream(device)  # one per device: cuBLAS keeps a workspace per stream it ran on
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: lookup tables on the device, kernels loaded
            for _ in range(2):
                _columns(*self.ins, *self.outs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            _columns(*self.ins, *self.outs)

    def __call__(self, T, rs, s, g, Hb, Q, E) -> None:
        with torch.cuda.device(T.device):
            for buf, src in zip(self.ins, (T, rs, s, g, Hb)):
                buf.copy_(src)
            self.graph.replay()
            Q.copy_(self.outs[0])
            E.copy_(self.outs[1])


_GRAPHS: dict[tuple[torch.device, int], _ColumnsGraph] = {}



def _graph(device: torch.device, n: int) -> _ColumnsGraph:
    if (device, n) not in _GRAPHS:
        _GRAPHS[device, n] = _ColumnsGraph(device, n)
    return _GRAPHS[device, n]
