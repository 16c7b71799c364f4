"""Which implementation of the kernel launchers runs: the one place that knows about GPUs.

Compute backends (how the frozen NVFP4 GEMMs run), `--compute`:
- `bf16-decode` (any GPU; the default, `auto`): NVFP4 decoded to bf16 (in registers, or into a
  scratch for cuBLAS at >= 256 rows), fp32 accumulation: the exact NVFP4 product. The default
  because it learns what BF16 LoRA learns on the same weights (BENCHMARKS.md, learning
  fidelity: -0.8 points mean over 7 tasks x 2 learning rates, where `fp8` loses -2.0).
- `fp8` (sm_89 / sm_90, Ada and Hopper; opt-in speed): both operands re-encoded as E4M3 rows
  (W decoded per call from NVFP4), FP8 tensor cores via cuBLAS `_scaled_mm` with rowwise
  scales. Not exact: E4M3 keeps 3 of q * s_b's up to 5 mantissa bits (runtime/ops/triton/fp8.py);
  ~11% shorter steps on the H200 for a measured accuracy cost. `--activations ...,dgrad=fp8` runs
  this GEMM for the input gradients only (dX = dY W^T through the backward layout), the forward
  GEMMs staying the backend's.
- `nvfp4-native` (sm_100 / sm_120, Blackwell; opt-in): FP4 tensor cores via `tl.dot_scaled`,
  both operands NVFP4 (dY quantized for the input gradient). UNVERIFIED ON HARDWARE: compiled
  for sm_100 and sm_120 in the tests, never run (no Blackwell GPU here).

`torch`: the pure-PyTorch twins (runtime/ops/reference.py) — the CPU path and the reference.
`triton`: the Triton kernels (runtime/ops/triton/), register-decoding NVFP4 into bf16 `tl.dot`
(the `bf16-decode` compute backend; exact NVFP4 products). On a CPU they run only under
TRITON_INTERPRET=1 (the tests do this).

Chosen once per model from `--kernels` or PACT_KERNELS (default: triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from pact.formats import PactError, require
from pact.formats.nvfp4 import NVFP4Rows, NVFP4Tensor

from ..recipe import Recipe
from .rows import DenseRows, E4M3Rows, NVFP4TensorFP8

log = logging.getLogger(__name__)
KERNELS = ("torch", "triton")
COMPUTE = ("bf16-decode", "fp8", "nvfp4-native")
# fp8 backend: re-encode each frozen weight to E4M3 per GEMM call, or keep E4M3 copies on the GPU
# (1 byte per parameter per layout; no re-encode: cuBLAS FP8 speed).
FP8_WEIGHTS = ("per-call", "resident")
# what the input-gradient GEMMs (dX = dY W) multiply, `--backward-weights`: the artifact's backward layout (W^T
# blocked along N, rounded from the source or, calibrated, from the calibrated weights: a second rounding), or
# the forward layout itself (the exact transpose of the weights the forward multiplied; the backward layout is
# then never loaded). nvfp4-native needs the layout: FP4 tensor cores scale along the contracted dimension.
BACKWARD_WEIGHTS = ("auto", "layout", "forward")
_OPS = ("rmsnorm_quant", "silu_mul_quant", "rmsnorm_rows", "silu_mul_rows", "quant_rows", "dequant_rows",
        "nvfp4_gemm", "rmsnorm_backward", "silu_mul_h", "silu_mul_backward", "rope", "ce_grad_", "e4m3_rows")
Rows = NVFP4Rows | DenseRows | E4M3Rows
# Ops reading saved rows: unquantized rows (DenseRows, a recipe's "bf16" sites) go to the twins,
# elementwise torch in fp32 on either device; NVFP4 rows to the chosen implementation; E4M3 rows
# (saved=fp8) to it as well: every reader takes them.
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
                            "built "
                            f"{'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for the CPU only'}): "
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


def _no_fp8_cores(cap: tuple[int, int] | None) -> str | None:
    """A GPU's "sm_XY" where it has no FP8 tensor cores (below sm_89); None on the CPU (the twins run) and
    on GPUs that have them."""
    return f"sm_{cap[0]}{cap[1]}" if cap is not None and cap < (8, 9) else None


def resolve_compute(name: str | None, device: torch.device) -> str:
    """`auto`: bf16-decode on every device (the exact NVFP4 product: the backend whose training
    matches BF16 LoRA; the faster ones are opt-in). A backend the GPU cannot run is one error."""
    cap = _capability(device)
    if name in (None, "auto"):
        return "bf16-decode"
    if name not in COMPUTE:
        raise PactError(f"--compute must be one of auto, {', '.join(COMPUTE)}, got {name!r}")
    sm = None if cap is None else f"sm_{cap[0]}{cap[1]}"
    if cap is None and name != "bf16-decode":
        log.warning("--compute %s on the CPU runs as its PyTorch twin: the same numbers as on a GPU, "
                    "none of its speed", name)
    if name == "nvfp4-native" and cap is not None and cap[0] not in (10, 12):
        raise PactError(f"--compute nvfp4-native needs a Blackwell GPU (sm_100 / sm_120); this one is {sm}: "
                        "use --compute fp8 or bf16-decode")
    if name == "fp8" and _no_fp8_cores(cap):
        raise PactError(f"--compute fp8 needs FP8 tensor cores (sm_89 or newer); this GPU is {sm}: "
                        "use --compute bf16-decode")
    return name


def check_dgrad(dgrad: str, device: torch.device) -> None:
    """`--activations ...,dgrad=fp8` runs the input-gradient GEMMs on FP8 tensor cores: one error on a GPU
    without them (on the CPU it runs as the fp8 GEMM's PyTorch twin). Checked where a model trains: forward-only
    tools never run an input-gradient GEMM."""
    sm = _no_fp8_cores(_capability(device))
    if dgrad == "fp8" and sm:
        raise PactError(f"--activations ...,dgrad=fp8 needs FP8 tensor cores (sm_89 or newer); this GPU is {sm}: "
                        "drop dgrad=fp8")


def check_dgrad_flags(dgrad: str, compute: str, backward_weights: str | None) -> None:
    """`dgrad=fp8` beside the flags that leave it nothing to do: one error each (pact-train's settings check and
    get_ops both ask)."""
    if dgrad != "fp8":
        return
    if compute == "fp8":
        raise PactError("--activations ...,dgrad=fp8 with --compute fp8: that backend's input gradients are FP8 "
                        "already; drop dgrad=fp8")
    if backward_weights == "forward":
        raise PactError("--activations ...,dgrad=fp8 re-encodes the backward layout as E4M3, and --backward-weights "
                        "forward multiplies the forward layout in bf16 instead: use one of the two")


@dataclass(frozen=True)
class Ops:
    """The launchers a model runs (runtime/functions.py calls nothing else): one implementation's
    (`torch` twins or `triton` kernels: same names and signatures), with the recipe's compute
    backend and dgrad choice already applied. Built by `get_ops`; never edited in place."""

    name: str  # "<kernels>/<compute>"
    rmsnorm_quant: Callable[..., tuple[NVFP4Rows, torch.Tensor]]  # (x, w, eps) -> (NVFP4 rows, rstd)
    silu_mul_quant: Callable[[torch.Tensor], tuple[NVFP4Rows, NVFP4Rows, NVFP4Rows]]  # gate|up -> h, gate, up
    # (x, w, eps, nvfp4=, gemm_input=): gemm_input says a frozen GEMM reads the bf16 rows (the fp8
    # backend then writes their E4M3 copy in the same kernel)
    rmsnorm_rows: Callable[..., tuple[DenseRows, NVFP4Rows | None, torch.Tensor]]
    silu_mul_rows: Callable[..., tuple[DenseRows, Rows, Rows]]  # (gate_up, nvfp4=, gemm_input=, act=, e4m3=)
    quant_rows: Callable[[torch.Tensor], NVFP4Rows]  # a GEMM input (with its E4M3 copy on fp8)
    quant_saved: Callable[[torch.Tensor], NVFP4Rows]  # rows only kept for backward: never an E4M3 copy
    quant_saved_sr: Callable[[torch.Tensor], NVFP4Rows]  # the same, stochastically rounded (saved=nvfp4-sr)
    e4m3_rows: Callable[[torch.Tensor], E4M3Rows]  # bf16 rows -> E4M3 rows kept for backward (saved=fp8)
    dequant_rows: Callable[[Rows], torch.Tensor]
    nvfp4_gemm: Callable[..., torch.Tensor]  # (a, W [N, K], a_hat=None) -> a @ W^T bf16: forward GEMMs
    # (dY, W) -> dX: input gradients; W is the backward layout W^T [K, N] or, dgrad_reads "forward", the
    # forward layout [N, K] (`--backward-weights`)
    dgrad_gemm: Callable[[torch.Tensor, NVFP4Tensor], torch.Tensor]
    rmsnorm_backward: Callable[[torch.Tensor, Rows, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul_h: Callable[[Rows, Rows], torch.Tensor]
    silu_mul_backward: Callable[[torch.Tensor, Rows, Rows], torch.Tensor]
    rope: Callable[..., torch.Tensor]  # (x, cos, sin, inverse=False)
    ce_grad_: Callable[..., torch.Tensor]
    # what a frozen GEMM fed a site's unquantized rows y multiplies (q: the site's NVFP4 rows, if made):
    # y, or on nvfp4-native, whose GEMM quantizes its input anyway, q
    gemm_operand: Callable[[DenseRows, NVFP4Rows | None], DenseRows | NVFP4Rows]
    # a frozen weight as the backend keeps it: itself, or with --fp8-weights resident its E4M3 copy beside
    resident: Callable[[NVFP4Tensor], NVFP4Tensor]
    dgrad_reads: str = "layout"  # which stored weights dgrad_gemm reads: "layout" (backward) or "forward"

    def observed(self, observe: Callable[[NVFP4Tensor, torch.Tensor], None]) -> "Ops":
        """These ops with each forward GEMM first handing ``observe(weight, x)`` its input rows x in
        bf16 (dequantized NVFP4 rows, or the unquantized rows where the recipe keeps them): the
        public hook calibration collects its Hessians through. Input-gradient GEMMs are not observed."""
        gemm, dequant = self.nvfp4_gemm, self.dequant_rows

        def nvfp4_gemm(a, w, a_hat=None):
            x = a_hat if a_hat is not None else a if isinstance(a, torch.Tensor) else dequant(a)
            observe(w, x)
            return gemm(a, w, a_hat)

        return dataclasses.replace(self, nvfp4_gemm=nvfp4_gemm)


def resolve_fp8_weights(name: str, compute: str) -> str:
    """`--fp8-weights`, checked against the compute backend it serves."""
    if name not in FP8_WEIGHTS:
        raise PactError(f"--fp8-weights must be one of {', '.join(FP8_WEIGHTS)}, got {name!r}")
    if name == "resident" and compute != "fp8":
        raise PactError(f"--fp8-weights resident keeps E4M3 copies for the fp8 backend; this run computes with "
                        f"{compute}: add --compute fp8 or leave --fp8-weights at per-call")
    return name


def resolve_backward_weights(name: str | None, compute: str) -> str:
    """`--backward-weights`, checked against the compute backend: auto is the backward layout."""
    if name in (None, "auto"):
        return "layout"
    if name not in BACKWARD_WEIGHTS:
        raise PactError(f"--backward-weights must be one of {', '.join(BACKWARD_WEIGHTS)}, got {name!r}")
    if name == "forward" and compute == "nvfp4-native":
        raise PactError("--backward-weights forward needs --compute bf16-decode or fp8: nvfp4-native's FP4 "
                        "tensor cores read W^T blocked along N, the backward layout (use --backward-weights layout)")
    return name


def get_ops(recipe: Recipe, kernels: str, fp8_weights: str = "per-call", backward_weights: str | None = None) -> Ops:
    """The ops that run ``recipe`` (its compute backend and dgrad choice) with the ``kernels``
    implementation ("torch" twins or "triton" kernels); ``fp8_weights`` (`--fp8-weights`, checked
    against the backend): how the fp8 backend keeps the frozen weights' E4M3 copies; ``backward_weights``
    (`--backward-weights`): what the input-gradient GEMMs multiply (the forward layout: in bf16, exact
    q * s_b products, whatever the compute backend)."""
    fp8_weights = resolve_fp8_weights(fp8_weights, recipe.compute)
    dgrad_reads = resolve_backward_weights(backward_weights, recipe.compute)
    name, compute, dgrad = kernels, recipe.compute, recipe.dgrad
    check_dgrad_flags(dgrad, compute, dgrad_reads)
    if name == "torch":
        from . import reference as mod

        gemms = {"nvfp4-native": mod.nvfp4_gemm_native, "fp8": mod.nvfp4_gemm_fp8}
    else:
        require("triton", "kernels", "--kernels triton")
        from . import triton as mod

        gemms = {}
        if compute == "nvfp4-native":
            from .triton.native import nvfp4_gemm_native

            gemms["nvfp4-native"] = nvfp4_gemm_native
        if compute == "fp8" or dgrad == "fp8":
            from .triton.fp8 import nvfp4_gemm_fp8

            gemms["fp8"] = nvfp4_gemm_fp8
    from . import reference

    ops = {op: getattr(mod, op) for op in _OPS}
    if mod is not reference:
        ops.update({op: _dense_aware(ops[op], getattr(reference, op)) for op in _ROW_READERS})
    ops["quant_saved"] = ops["quant_rows"]  # NVFP4 rows only kept for backward: never an E4M3 copy
    ops["quant_saved_sr"] = reference.quant_saved_sr  # torch on every device (no fused kernel yet)
    if dgrad_reads == "forward":  # the forward layout, decoded to bf16: dY's format does not enter
        ops["dgrad_gemm"] = mod.nvfp4_dgrad_fwd
    else:
        ops["dgrad_gemm"] = (ops["nvfp4_gemm"] if dgrad == "bf16" else gemms["fp8"] if dgrad == "fp8"
                             else gemms.get(compute, ops["nvfp4_gemm"]))
    ops["nvfp4_gemm"] = gemms.get(compute, ops["nvfp4_gemm"])
    fp8 = compute == "fp8"
    if fp8:  # the quantizing kernels also write the E4M3 copy the next GEMM reads
        for op in ("rmsnorm_quant", "silu_mul_quant", "quant_rows"):
            ops[op] = functools.partial(ops[op], fp8=True)
    for op in ("rmsnorm_rows", "silu_mul_rows"):  # bf16 rows a GEMM reads: their E4M3 copy on fp8
        ops[op] = _gemm_input_rows(ops[op], fp8)
    # nvfp4-native quantizes a bf16 GEMM input to NVFP4 rows anyway: a site's NVFP4 copy serves as the operand
    ops["gemm_operand"] = _nvfp4_operand if compute == "nvfp4-native" else _bf16_operand
    ops["resident"] = _identity
    if fp8_weights == "resident":  # E4M3 copies of the frozen weights kept beside them
        if name == "torch":
            fp8_rows = mod.fp8_rows
        else:
            from .triton.fp8 import fp8_rows
        ops["resident"] = functools.partial(NVFP4TensorFP8.of, fp8_rows=fp8_rows)
    return Ops(name=f"{name}/{compute}" + ("/dgrad-fp8" if dgrad == "fp8" else ""), dgrad_reads=dgrad_reads, **ops)


def _gemm_input_rows(op, fp8: bool):
    def run(*args, gemm_input: bool = False, **kw):
        return op(*args, fp8=fp8 and gemm_input, **kw)

    run.__name__ = op.__name__
    return run


def _bf16_operand(y, q):
    return y


def _nvfp4_operand(y, q):
    return q if q is not None else y


def _identity(w):
    return w
