"""Target-token cross-entropy: logits only at labelled positions, in chunks, never [T, V].

    loss = sum_i  logsumexp(h_i W^T) - (h_i W^T)[t_i]        h [n,H], W [V,H]
    dh_i = (softmax(h_i W^T) - onehot(t_i)) @ W               [c,V] @ [V,H] -> [c,H]

The gradient is computed in the forward pass chunk by chunk (as Liger's fused linear
cross-entropy does) and saved: [n, H] bf16 instead of [n, V] logits.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 25  # logits per chunk (fp32: 128 MiB)


class TargetCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n, vocab = h.shape[0], weight.shape[0]
        step = max(1, _CHUNK_ELEMENTS // vocab)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h)
        for i in range(0, n, step):
            logits = (h[i : i + step] @ weight.t()).float()
            t = targets[i : i + step]
            lse = torch.logsumexp(logits, dim=-1)
            rows = torch.arange(logits.shape[0], device=h.device)
            total += (lse - logits[rows, t]).sum()
            p = torch.exp(logits - lse[:, None])
            p[rows, t] -= 1.0
            dh[i : i + step] = (p.to(weight.dtype) @ weight).to(h.dtype)
        ctx.save_for_backward(dh)
        return total

    @staticmethod
    def backward(ctx, grad):
        (dh,) = ctx.saved_tensors
        return dh * grad.to(dh.dtype), None, None


def target_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``targets`` under logits ``h @ weight.T`` (divide by the count)."""
    return TargetCrossEntropyFn.apply(h, weight, targets)
