"""Which implementation of the kernel launchers runs: the one place that knows about GPUs.

Compute backends (how the frozen NVFP4 GEMMs run), chosen by GPU capability or `--compute`:
- `nvfp4-native` (sm_100 / sm_120, Blackwell): FP4 tensor cores via `tl.dot_scaled`, both
  operands NVFP4 (dY quantized for the input gradient). UNVERIFIED ON HARDWARE: compiled for
  sm_100 and sm_120 in the tests, never run (no Blackwell GPU here).
- `bf16-decode` (any GPU; the default below sm_100): NVFP4 decoded to bf16 (in registers, or
  into a scratch for cuBLAS at >= 256 rows), fp32 accumulation: the exact NVFP4 product.

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
COMPUTE = ("bf16-decode", "nvfp4-native")
_OPS = ("rmsnorm_quant", "silu_mul_quant", "quant_rows", "dequant_rows", "nvfp4_gemm", "rmsnorm_backward",
        "silu_mul_h", "silu_mul_backward")


def resolve_kernels(name: str | None, device: torch.device) -> str:
    name = name or os.environ.get("PACT_KERNELS") or ("triton" if device.type == "cuda" else "torch")
    if name not in KERNELS:
        raise PactError(f"--kernels / PACT_KERNELS must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PactError("--kernels triton on the CPU needs TRITON_INTERPRET=1 (slow; for tests): use --kernels torch")
    return name


def resolve_compute(name: str | None, device: torch.device) -> str:
    if name in (None, "auto"):
        native = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (10, 12)
        return "nvfp4-native" if native else "bf16-decode"
    if name not in COMPUTE:
        raise PactError(f"--compute must be one of auto, {', '.join(COMPUTE)}, got {name!r}")
    if name == "nvfp4-native" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] not in (10, 12):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise PactError(f"--compute nvfp4-native needs a Blackwell GPU (sm_100 / sm_120); this one is sm_{cap}: "
                        "use --compute bf16-decode")
    return name


def get_ops(name: str, compute: str = "bf16-decode") -> SimpleNamespace:
    """A namespace with the launchers (same names and signatures in both implementations)."""
    if name == "torch":
        from . import reference as mod

        native = mod.nvfp4_gemm_native
    else:
        from . import kernels as mod

        native = None
        if compute == "nvfp4-native":
            from .kernels.native import nvfp4_gemm_native as native
    ops = {op: getattr(mod, op) for op in _OPS}
    if compute == "nvfp4-native":
        ops["nvfp4_gemm"] = native
    return SimpleNamespace(name=f"{name}/{compute}", **ops)
