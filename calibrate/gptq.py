"""GPTQ, knowing nothing of the number format: it accumulates H and sweeps columns, calling a
quantizer object (IST-DASLab's structure).

    H = 2/n sum x x^T (fp32), dead columns zeroed, damp = percdamp * mean(diag H)
    Hinv = upper Cholesky factor of H^-1
    for each block of `blocksize` columns, for each group of GROUP columns, for each column i:
        q_i = quantize(w_i)                       (the quantizer fixes a group's scales first)
        err = (w_i - q_i) / Hinv[i, i]
        W[:, i+1:group_end] -= err * Hinv[i, i+1:group_end]
      W[:, group_end:block_end] -= Err_group @ Hinv[group, group_end:block_end]
    W[:, block_end:] -= Err_block @ Hinv[block, block_end:]

Quantizer protocol: ``begin(W, perm)`` once before the sweep (the whole weight, columns in
sweep order, and the permutation or None) and ``sweep(Wt, Hinv, c0, Qt, Errt)``: the innermost
loop over one group's columns c0 .. c0+GROUP of Wt = W^T (as the sweep has updated them),
writing the fake-quantized columns to Qt and (w - q) / Hinv[i, i] to Errt. The quantizer owns it
because it owns the rounding.
"""

from __future__ import annotations

import torch

GROUP = 16  # columns the quantizer sweeps one by one (NVFP4's block)


class GPTQ:
    def __init__(self, columns: int, device: torch.device | str = "cpu"):
        self.columns = columns
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x [n, K]: inputs of the layer (rows are tokens). Running mean of 2 x x^T."""
        x = x.reshape(-1, self.columns).float()
        n = x.shape[0]
        if n == 0:
            return
        # H <- H n0 / (n0 + n) + 2 / (n0 + n) x^T x, in one GEMM (no scaled copy of x)
        self.H.addmm_(x.t(), x, beta=self.nsamples / (self.nsamples + n), alpha=2.0 / (self.nsamples + n))
        self.nsamples += n

    def quantize(self, W: torch.Tensor, quantizer, *, blocksize: int = 128, percdamp: float = 0.01,
                 actorder: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (Q [N, K] fake-quantized weights in W's column order, per-column loss [K]).

        Rows are independent (one Hessian, one error feedback per row), so the members of a fused
        group that share H sweep as one W with their rows stacked. The sweep works on W^T: a
        column is a contiguous row of it. Updates are lazy at two levels: within a group of
        GROUP columns column by column (the quantizer's sweep), then the group's errors onto the rest
        of the block in one GEMM, then the block's onto the columns after it (each column sees every
        earlier column's update before it is quantized, as in the plain loop; only the float
        summation order differs). No host sync inside the sweep.
        """
        K = self.columns
        if K % GROUP or blocksize % GROUP:
            raise ValueError(f"GPTQ sweeps groups of {GROUP} columns: got {K} columns, blocksize {blocksize}")
        Wt = W.float().t().contiguous()  # [K, N]
        H = self.H.clone()
        dead = torch.diag(H) == 0
        H.diagonal().masked_fill_(dead, 1)
        Wt.masked_fill_(dead[:, None], 0)
        perm = None
        if actorder:
            perm = torch.argsort(torch.diag(H), descending=True)
            Wt, H = Wt[perm], H[perm][:, perm]
        quantizer.begin(Wt.t(), perm)
        H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
        Qt = torch.empty_like(Wt)
        Errt = torch.empty_like(Wt)  # (w - q) / Hinv[i, i] per column
        for b0 in range(0, K, blocksize):
            b1 = min(b0 + blocksize, K)
            for g0 in range(b0, b1, GROUP):
                g1 = g0 + GROUP
                quantizer.sweep(Wt, Hinv, g0, Qt, Errt)
                if g1 < b1:  # W[:, g1:b1] -= Err[:, g0:g1] Hinv[g0:g1, g1:b1]
                    Wt[g1:b1].addmm_(Hinv[g0:g1, g1:b1].t(), Errt[g0:g1], alpha=-1)
            if b1 < K:  # W[:, b1:] -= Err[:, b0:b1] Hinv[b0:b1, b1:]
                Wt[b1:].addmm_(Hinv[b0:b1, b1:].t(), Errt[b0:b1], alpha=-1)
        losses = Errt.square().sum(1) / 2  # ((w - q)^2).sum() / Hinv[i, i]^2 / 2
        if perm is not None:
            inv = torch.argsort(perm)
            Qt, losses = Qt[inv], losses[inv]
        return Qt.t().contiguous(), losses
