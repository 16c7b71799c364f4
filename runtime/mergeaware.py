"""`--merge-aware-steps N`: the run's last N optimizer steps see the weights a plain NVFP4 merge
(`pact-export --merge --merge-method rtn`) will write, so that the adapter learns around the
rounding that the merge would otherwise apply to it afterwards.

A merge writes, per fused group with an adapter (q|k|v, o, gate|up, down: the groups vLLM fuses),
Q(W + s B A): the group's members re-quantized together under one global scale with the
artifact's block-scale rule (convert/export.py). During these steps every such group's forward
GEMM adds x E^T, where E = Q(W + s B A) - (W + s B A) is computed again from the current adapter
before each step (no gradient): the forward is the merged model's, to bf16 rounding. The
gradients of A and B are the plain LoRA ones (straight-through: the rounding is treated as a
constant), and input gradients use W as in every other step. What a merge-aware run saves is
meant to be exported with the plain merge, which writes exactly the weights it trained through.

Cost: one bf16 copy of every adapted group's weight (E) while the phase runs, a quantization of
every adapted weight per step, and one more GEMM per adapted group in forward; CUDA graphs are
off for these steps.
"""

from __future__ import annotations

import torch

from pact.formats.nvfp4 import dequantize, global_scale_from_amax, quantize

from .functions import FrozenGroup


@torch.no_grad()
def merge_error(group: FrozenGroup, rule: str) -> torch.Tensor | None:
    """E = Q(W + s B A) - (W + s B A) over ``group``'s rows (bf16, [N, K]), Q as the plain merge
    quantizes (one global scale for the group, 1x16 blocks, ``rule``'s block scales); None for a
    group without an adapter or kept bf16 (a merge folds the adapter into those exactly)."""
    if group.weight is None or not any(lo is not None for lo in group.loras):
        return None
    w = dequantize(group.weight)
    merged, row = [], 0
    for n, lo in zip(group.sizes, group.loras):
        m = w[row:row + n]
        if lo is not None:
            m = m + lo.scale * (lo.B.float() @ lo.A.float())
        merged.append(m)
        row += n
    g = global_scale_from_amax(max(float(m.abs().amax()) for m in merged))
    return torch.cat([dequantize(quantize(m, global_scale=g.to(m.device), scaling="1d", scale_rule=rule)) - m
                      for m in merged]).to(torch.bfloat16)


def merge_errors(layers, rule: str) -> dict[int, torch.Tensor]:
    """Every adapted group's E (merge_error), keyed by id() of the forward weight its GEMM reads."""
    out = {}
    for L in layers:
        for g in (L.qkv, L.o, L.gate_up, L.down):
            e = merge_error(g, rule)
            if e is not None:
                out[id(g.weight)] = e
    return out
