"""bf16 matrix products outside the frozen GEMMs (the LoRA branches, bf16-kept projections, the loss head).

On a GPU they are plain ``@`` / ``addmm_``: cuBLAS multiplies bf16 with fp32 accumulation and rounds the
product once. On the CPU the same numbers come from an fp32 product rounded once to bf16: CPUs without
bf16 instructions (AVX2 machines, most laptops and CI runners) run bf16 GEMMs one to two orders of magnitude
slower per FLOP than fp32 ones, which made the LoRA products and the loss head most of a CPU step.
"""

from __future__ import annotations

import torch


def _upcast(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (bf16 on the CPU: an fp32 product, one rounding)."""
    if _upcast(a):
        return (a.float() @ b.float()).to(torch.bfloat16)
    return a @ b


def addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """out += alpha * a @ b in place (bf16 on the CPU: out + alpha * a @ b in fp32, one rounding, as addmm)."""
    if _upcast(out):
        return out.copy_(torch.addmm(out.float(), a.float(), b.float(), alpha=alpha))
    return out.addmm_(a, b, alpha=alpha)
