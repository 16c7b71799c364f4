"""GPTQ, knowing nothing of the number format: it accumulates H and sweeps columns, calling a
quantizer object (IST-DASLab's structure).

    H = 2/n sum x x^T (fp32), dead columns zeroed, damp = percdamp * mean(diag H)
    Hinv = upper Cholesky factor of H^-1
    for each block of `blocksize` columns, for each column i:
        q_i = quantizer.quantize(w_i, i)          (the quantizer may fix a group's scales here)
        err = (w_i - q_i) / Hinv[i, i]
        W[:, i+1:block_end] -= err * Hinv[i, i+1:block_end]
    W[:, block_end:] -= Err_block @ Hinv[block, block_end:]

Quantizer protocol: ``begin(W, perm)`` once before the sweep (the whole weight, columns in
sweep order, and the permutation or None) and ``quantize(block, i, col) -> q_col [N]``: the
current (error-updated) block of columns, the column's index in it and in the sweep, returning
fake-quantized values. A quantizer with group scales can fix a group's scales from the block
when the sweep reaches the group's first column (blocks are multiples of the group size).
"""

from __future__ import annotations

import torch

GROUP = 16  # columns updated eagerly one by one; a multiple of the quantizer's group (NVFP4: 16)


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
        GROUP columns column by column, then the group's errors onto the rest of the block in one
        GEMM, then the block's onto the columns after it (each column sees every earlier column's
        update before it is quantized, as in the plain loop; only the float summation order differs).
        No host sync inside the sweep.
        """
        K = self.columns
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
        dinv = Hinv.diagonal()
        Qt = torch.empty_like(Wt)
        Errt = torch.empty_like(Wt)  # (w - q) / Hinv[i, i] per column
        for b0 in range(0, K, blocksize):
            b1 = min(b0 + blocksize, K)
            block = Wt[b0:b1].t()  # [N, b], a view of the columns being updated, as the protocol reads them
            for g0 in range(b0, b1, GROUP):
                g1 = min(g0 + GROUP, b1)
                for c in range(g0, g1):
                    q = quantizer.quantize(block, c - b0, c)
                    Qt[c] = q
                    err = torch.sub(Wt[c], q, out=Errt[c]).div_(dinv[c])
                    if c + 1 < g1:  # W[:, c+1:g1] -= err Hinv[c, c+1:g1]
                        Wt[c + 1 : g1].addr_(Hinv[c, c + 1 : g1], err, alpha=-1)
                if g1 < b1:  # W[:, g1:b1] -= Err[:, g0:g1] Hinv[g0:g1, g1:b1]
                    Wt[g1:b1].addmm_(Hinv[g0:g1, g1:b1].t(), Errt[g0:g1], alpha=-1)
            if b1 < K:  # W[:, b1:] -= Err[:, b0:b1] Hinv[b0:b1, b1:]
                Wt[b1:].addmm_(Hinv[b0:b1, b1:].t(), Errt[b0:b1], alpha=-1)
        losses = Errt.square().sum(1) / 2  # ((w - q)^2).sum() / Hinv[i, i]^2 / 2
        if perm is not None:
            inv = torch.argsort(perm)
            Qt, losses = Qt[inv], losses[inv]
        return Qt.t().contiguous(), losses
