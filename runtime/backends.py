"""Which implementation of the kernel launchers runs: the one place that knows about GPUs.

Compute backends (how the frozen NVFP4 GEMMs run), `--compute`:
- `bf16-decode` (any GPU; the default, `auto`): NVFP4 decoded to bf16 (in registers, or into a
  scratch for cuBLAS at >= 256 rows), fp32 accumulation: the exact NVFP4 product. The default
  because it learns what BF16 LoRA learns on the same weights (BENCHMARKS.md, learning
  fidelity: -0.8 points mean over 7 tasks x 2 learning rates, where `fp8` loses -2.0).
- `fp8` (sm_89 / sm_90, Ada and Hopper; opt-in speed): both operands re-encoded as E4M3 rows
  (W decoded per call from NVFP4), FP8 tensor cores via cuBLAS `_scaled_mm` with rowwise
  scales. Not exact: E4M3 keeps 3 of q * s_b's up to 5 mantissa bits (runtime/kernels/fp8.py);
  ~11% shorter steps on the H200 for a measured accuracy cost.
- `nvfp4-native` (sm_100 / sm_120, Blackwell; opt-in): FP4 tensor cores via `tl.dot_scaled`,
  both operands NVFP4 (dY quantized for the input gradient). UNVERIFIED ON HARDWARE: compiled
  for sm_100 and sm_120 in the tests, never run (no Blackwell GPU here).

`torch`: the pure-PyTorch twins (runtime/reference.py) — the CPU path and the reference.
`triton`: the Triton kernels (runtime/kernels/), register-decoding NVFP4 into bf16 `tl.dot`
(the `bf16-decode` compute backend; exact NVFP4 products). On a CPU they run only under
TRITON_INTERPRET=1 (the tests do this).

Chosen once per model from `--kernels` or PACT_KERNELS (default: triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from pact.formats import PactError, require

from .rows import DenseRows

KERNELS = ("torch", "triton")
COMPUTE = ("bf16-decode", "fp8", "nvfp4-native")
_OPS = ("rmsnorm_quant", "silu_mul_quant", "rmsnorm_rows", "silu_mul_rows", "quant_rows", "dequant_rows",
        "nvfp4_gemm", "rmsnorm_backward", "silu_mul_h", "silu_mul_backward", "rope", "ce_grad_")
# Ops reading saved rows: unquantized rows (DenseRows, a recipe's "bf16" sites) go to the twins,
# elementwise torch in fp32 on either device; NVFP4 rows to the chosen implementation.
_ROW_READERS = ("dequant_rows", "rmsnorm_backward", "silu_mul_h", "silu_mul_backward")


def _dense_aware(op, twin):
    def run(*args, **kw):
        return twin(*args, **kw) if any(isinstance(a, DenseRows) for a in args) else op(*args, **kw)

    run.__name__ = op.__name__
    return run


def resolve_device(name: str | None, flag: str = "--device") -> torch.device:
    """The torch device for ``--device`` (default: cuda when a GPU is visible, else cpu), checked
    here so that an unavailable one fails in one line rather than deep inside torch."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise PactError(f"{flag} {name!r}: not a device name ({e}); use cuda, cuda:N or cpu") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PactError(f"{flag} {name}: no CUDA device here (torch {torch.__version__}, "
                            f"built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for the CPU only'}): "
                            f"drop {flag} to run on the CPU, or install a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise PactError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s): "
                            f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type != "cpu":
        raise PactError(f"{flag} {name}: pact runs on cuda or cpu")
    return device


def resolve_kernels(name: str | None, device: torch.device) -> str:
    name = name or os.environ.get("PACT_KERNELS") or ("triton" if device.type == "cuda" else "torch")
    if name not in KERNELS:
        raise PactError(f"--kernels / PACT_KERNELS must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PactError("--kernels triton on the CPU needs TRITON_INTERPRET=1 (slow; for tests): use --kernels torch")
    return name


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def resolve_compute(name: str | None, device: torch.device) -> str:
    """`auto`: bf16-decode on every device (the exact NVFP4 product: the backend whose training
    matches BF16 LoRA; the faster ones are opt-in). A backend the GPU cannot run is one error."""
    cap = _capability(device)
    if name in (None, "auto"):
        return "bf16-decode"
    if name not in COMPUTE:
        raise PactError(f"--compute must be one of auto, {', '.join(COMPUTE)}, got {name!r}")
    sm = None if cap is None else f"sm_{cap[0]}{cap[1]}"
    if name == "nvfp4-native" and cap is not None and cap[0] not in (10, 12):
        raise PactError(f"--compute nvfp4-native needs a Blackwell GPU (sm_100 / sm_120); this one is {sm}: "
                        "use --compute fp8 or bf16-decode")
    if name == "fp8" and cap is not None and cap < (8, 9):
        raise PactError(f"--compute fp8 needs FP8 tensor cores (sm_89 or newer); this GPU is {sm}: "
                        "use --compute bf16-decode")
    return name


def get_ops(name: str, compute: str = "bf16-decode", dgrad: str = "auto") -> SimpleNamespace:
    """A namespace with the launchers (same names and signatures in both implementations).
    ``dgrad``: "auto", the input gradient on the compute backend's GEMM; "bf16", on the exact
    bf16 x NVFP4 GEMM whatever the backend (runtime/recipe.py)."""
    if name == "torch":
        from . import reference as mod

        gemms = {"nvfp4-native": mod.nvfp4_gemm_native, "fp8": mod.nvfp4_gemm_fp8}
    else:
        require("triton", "kernels", "--kernels triton")
        from . import kernels as mod

        gemms = {}
        if compute == "nvfp4-native":
            from .kernels.native import nvfp4_gemm_native

            gemms["nvfp4-native"] = nvfp4_gemm_native
        elif compute == "fp8":
            from .kernels.fp8 import nvfp4_gemm_fp8

            gemms["fp8"] = nvfp4_gemm_fp8
    from . import reference

    ops = {op: getattr(mod, op) for op in _OPS}
    if mod is not reference:
        ops.update({op: _dense_aware(ops[op], getattr(reference, op)) for op in _ROW_READERS})
    ops["quant_saved"] = ops["quant_rows"]  # NVFP4 rows only kept for backward: never an E4M3 copy
    ops["dgrad_gemm"] = ops["nvfp4_gemm"] if dgrad == "bf16" else gemms.get(compute, ops["nvfp4_gemm"])
    ops["nvfp4_gemm"] = gemms.get(compute, ops["nvfp4_gemm"])
    if compute == "fp8":  # the quantizing kernels also write the E4M3 copy the next GEMM reads
        for op in ("rmsnorm_quant", "silu_mul_quant", "quant_rows"):
            ops[op] = functools.partial(ops[op], fp8=True)
        if name == "torch":
            ops["fp8_rows"] = mod.fp8_rows
        else:
            from .kernels.fp8 import fp8_rows

            ops["fp8_rows"] = fp8_rows  # resident weight copies (--fp8-weights resident)
    # fp8: kernels making bf16 GEMM inputs also write their E4M3 copy; native: a bf16 GEMM input is
    # quantized to NVFP4 rows anyway, so a site's NVFP4 copy serves as the GEMM's operand
    return SimpleNamespace(name=f"{name}/{compute}", fp8=compute == "fp8", native=compute == "nvfp4-native", **ops)
