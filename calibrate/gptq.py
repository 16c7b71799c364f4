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
        self.H *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        x = x * (2.0 / self.nsamples) ** 0.5
        self.H += x.t() @ x

    def quantize(self, W: torch.Tensor, quantizer, *, blocksize: int = 128, percdamp: float = 0.01,
                 actorder: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (Q [N, K] fake-quantized weights in W's column order, per-column loss [K])."""
        W = W.float().clone()
        H = self.H.clone()
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0
        perm = None
        if actorder:
            perm = torch.argsort(torch.diag(H), descending=True)
            W, H = W[:, perm], H[perm][:, perm]
        quantizer.begin(W, perm)
        damp = percdamp * torch.mean(torch.diag(H))
        H[range(self.columns), range(self.columns)] += damp
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
        Q = torch.zeros_like(W)
        losses = torch.zeros(self.columns, device=W.device)
        for b0 in range(0, self.columns, blocksize):
            b1 = min(b0 + blocksize, self.columns)
            W1, Hinv1 = W[:, b0:b1].clone(), Hinv[b0:b1, b0:b1]
            Err1 = torch.zeros_like(W1)
            for i in range(b1 - b0):
                w, d = W1[:, i], Hinv1[i, i]
                q = quantizer.quantize(W1, i, b0 + i)
                Q[:, b0 + i] = q
                losses[b0 + i] = ((w - q) ** 2).sum() / d**2 / 2
                err = (w - q) / d
                W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
                Err1[:, i] = err
            W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]
        if perm is not None:
            inv = torch.argsort(perm)
            Q, losses = Q[:, inv], losses[inv]
        return Q, losses
