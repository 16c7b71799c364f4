"""Target-token cross-entropy: logits only at labelled positions, in chunks, never [T, V].

    loss = sum_i  logsumexp(h_i W^T) - (h_i W^T)[t_i]        h [n,H], W [V,H]
    dh_i = (softmax(h_i W^T) - onehot(t_i)) @ W               [c,V] @ [V,H] -> [c,H]

The gradient is computed in the forward pass chunk by chunk (as Liger's fused linear
cross-entropy does) and saved: [n, H] bf16 instead of [n, V] logits. Per chunk the bf16
logits from the GEMM are turned into (softmax - onehot) in place by ``ce_grad_`` (a Triton
kernel on the GPU: two reads and one write of the bf16 chunk; its twin in
runtime/ops/reference.py), which returns each row's loss in fp32.
"""

from __future__ import annotations

import torch

from .matmul import mm

_CHUNK_ELEMENTS = 1 << 25  # logits per chunk (bf16: 64 MiB)


class TargetCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ce_grad_) -> torch.Tensor:
        n, vocab = h.shape[0], weight.shape[0]
        step = max(1, _CHUNK_ELEMENTS // vocab)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h)
        for i in range(0, n, step):
            logits = mm(h[i : i + step], weight.t())
            total += ce_grad_(logits, targets[i : i + step]).sum()
            dh[i : i + step] = mm(logits.to(weight.dtype), weight).to(h.dtype)
        ctx.save_for_backward(dh)
        return total

    @staticmethod
    def backward(ctx, grad):
        (dh,) = ctx.saved_tensors
        return dh * grad.to(dh.dtype), None, None, None


def target_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ce_grad_) -> torch.Tensor:
    """Summed cross-entropy of ``targets`` under logits ``h @ weight.T`` (divide by the count).
    ``ce_grad_(logits, targets)``: per-row loss, logits overwritten by their gradient."""
    return TargetCrossEntropyFn.apply(h, weight, targets, ce_grad_)
