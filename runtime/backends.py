"""Which implementation of the kernel launchers runs: the one place that knows about GPUs.

`torch`: the pure-PyTorch twins (runtime/reference.py) — the CPU path and the reference.
`triton`: the Triton kernels (runtime/kernels/), register-decoding NVFP4 into bf16 `tl.dot`
(the `bf16-decode` compute backend; exact NVFP4 products). On a CPU they run only under
TRITON_INTERPRET=1 (the tests do this).

Chosen once per model from `--kernels` or PACT_KERNELS (default: triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from pact.formats import PactError

KERNELS = ("torch", "triton")
_OPS = ("rmsnorm_quant", "silu_mul_quant", "quant_rows", "dequant_rows", "nvfp4_gemm", "rmsnorm_backward",
        "silu_mul_h", "silu_mul_backward")


def resolve_kernels(name: str | None, device: torch.device) -> str:
    name = name or os.environ.get("PACT_KERNELS") or ("triton" if device.type == "cuda" else "torch")
    if name not in KERNELS:
        raise PactError(f"--kernels / PACT_KERNELS must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PactError("--kernels triton on the CPU needs TRITON_INTERPRET=1 (slow; for tests): use --kernels torch")
    return name


def get_ops(name: str) -> SimpleNamespace:
    """A namespace with the launchers (same names and signatures in both implementations)."""
    if name == "torch":
        from . import reference as mod
    else:
        from . import kernels as mod
    return SimpleNamespace(name=name, **{op: getattr(mod, op) for op in _OPS})
