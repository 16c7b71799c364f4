"""Pure-PyTorch twins of every kernel launcher, same signatures, built from `formats` only.

They are the CPU path and the reference the Triton kernels are tested against. Numerics are
chosen to match the kernels on purpose:
- RMSNorm: fp32 statistics, y = x * rstd * w in fp32 (no bf16 rounding before quantizing).
- Quantization: per-row NVFP4 (`formats.nvfp4.quantize_rows`), bit-exact with the kernels
  given the same fp32 input.
- GEMMs: operands decoded as (q * s_b), which is exact in bf16; the per-tensor / per-row
  fp32 scales multiply the fp32 accumulator afterwards. The product is therefore exactly
  the NVFP4 product up to the order of summation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pact.formats.nvfp4 import BLOCK, E4M3_MAX, NVFP4Rows, NVFP4Tensor, decode_packed, dequantize_rows, quantize_rows

from .rows import FP8_ROW_AMAX, DenseRows, E4M3Rows, NVFP4RowsFP8

FP8_MAX = E4M3_MAX  # E4M3 rows use the format's whole range


def _attach_fp8(q: NVFP4Rows, fp8: bool) -> NVFP4Rows:
    """With ``fp8``: q plus its E4M3 copy (runtime/ops/rows.py), as the fused kernels write it."""
    return NVFP4RowsFP8(q.packed, q.scales, q.row_scale, *fp8_rows(q)) if fp8 else q


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  fp8: bool = False) -> tuple[NVFP4Rows, torch.Tensor]:
    """x [T, H] bf16 -> (NVFP4 rows of x * rstd * w, rstd fp32 [T]); ``fp8``: E4M3 copy attached."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return _attach_fp8(quantize_rows(xf * rstd[:, None] * weight.float()), fp8), rstd


GELU_2C = 1.5957691216057308  # 2 sqrt(2 / pi)


def glu_act(g: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The gate's activation (fp32 in, fp32 out): silu (SwiGLU) or the tanh-approximated GELU (GeGLU:
    Gemma's gelu_pytorch_tanh), as g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) = 0.5 g (1 + tanh(..)):
    the kernels' formula, which keeps the negative tail that 1 + tanh cancels away."""
    if act == "gelu_tanh":
        return g * torch.sigmoid(GELU_2C * (g + 0.044715 * g * g * g))
    return F.silu(g)


def glu_act_grad(g: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """d glu_act(g) / dg in fp32."""
    if act == "gelu_tanh":
        s = torch.sigmoid(GELU_2C * (g + 0.044715 * g * g * g))
        return s + g * s * (1 - s) * GELU_2C * (1 + 0.134145 * g * g)
    sig = torch.sigmoid(g)
    return sig * (1 + g * (1 - sig))


def silu_mul_quant(gate_up: torch.Tensor, fp8: bool = False, act: str = "silu"
                   ) -> tuple[NVFP4Rows, NVFP4Rows, NVFP4Rows]:
    """gate_up [T, 2I] bf16 (gate | up) -> NVFP4 rows of (act(gate) * up, gate, up); ``fp8``:
    the first with its E4M3 copy attached."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _attach_fp8(quantize_rows(glu_act(gate, act) * up), fp8), quantize_rows(gate), quantize_rows(up)


def _dense(y: torch.Tensor, fp8: bool) -> DenseRows:
    """bf16 rows y; ``fp8``: with their E4M3 copy (fp8_rows of bf16 rows), as the kernels write it."""
    return DenseRows(y, *fp8_rows(y)) if fp8 else DenseRows(y)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, nvfp4: bool = True, fp8: bool = False
                 ) -> tuple[DenseRows, NVFP4Rows | None, torch.Tensor]:
    """x [T, H] -> (bf16 rows of x * rstd * w computed in fp32, their NVFP4 rows when ``nvfp4``,
    rstd fp32 [T]); ``fp8``: the bf16 rows carry their E4M3 copy."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = (xf * rstd[:, None] * weight.float()).to(torch.bfloat16)
    return _dense(y, fp8), quantize_rows(y.float()) if nvfp4 else None, rstd


def silu_mul_rows(gate_up: torch.Tensor, nvfp4: bool = True, fp8: bool = False, act: str = "silu",
                  e4m3: bool = False) -> tuple[DenseRows, NVFP4Rows | E4M3Rows | DenseRows,
                                               NVFP4Rows | E4M3Rows | DenseRows]:
    """gate_up [T, 2I] -> (bf16 rows of silu(gate) * up, the product in fp32; gate; up), gate and up
    as NVFP4 rows (``nvfp4``), E4M3 rows (``e4m3``: e4m3_rows of each half) or the input's bf16
    halves; ``fp8``: h carries its E4M3 copy."""
    if nvfp4 and e4m3:
        raise ValueError("silu_mul_rows: gate and up are saved as NVFP4 or as E4M3 rows, not both")
    gate, up = gate_up.chunk(2, dim=-1)
    h = (glu_act(gate.float(), act) * up.float()).to(torch.bfloat16)
    if nvfp4:
        g, u = quantize_rows(gate.float()), quantize_rows(up.float())
    elif e4m3:
        g, u = e4m3_rows(gate), e4m3_rows(up)
    else:
        g, u = DenseRows(gate.contiguous()), DenseRows(up.contiguous())
    return _dense(h, fp8), g, u


def rows_value(q: NVFP4Rows | DenseRows | E4M3Rows) -> torch.Tensor:
    """fp32 values of saved rows: NVFP4, E4M3 or unquantized."""
    if isinstance(q, E4M3Rows):
        return q.value()
    return q.data.float() if isinstance(q, DenseRows) else dequantize_rows(q)


def rmsnorm_backward(dy: torch.Tensor, yq: NVFP4Rows | DenseRows, rstd: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """dx [T, H] bf16 from dY and the saved NVFP4 RMSNorm output Y_hat = x * rstd * w (fp32 math):
    n = Y_hat / w (0 where w = 0);  g = dY * w;  dx = rstd * (g - n * mean(g * n))."""
    return _rmsnorm_backward(dy, rows_value(yq), rstd, weight)


def _rmsnorm_backward(dy, y_hat, rstd, weight):
    wf = weight.float()
    n = torch.where(wf == 0, torch.zeros_like(y_hat), y_hat / torch.where(wf == 0, torch.ones_like(wf), wf))
    gw = dy.float() * wf
    return (rstd[:, None] * (gw - n * (gw * n).mean(-1, keepdim=True))).to(torch.bfloat16)


def silu_mul_h(gq: NVFP4Rows | DenseRows, uq: NVFP4Rows | DenseRows, act: str = "silu") -> torch.Tensor:
    """h = act(g) * u recomputed from the saved gate and up, bf16 [T, I]."""
    return _silu_h(rows_value(gq), rows_value(uq), act)


def _silu_h(g, u, act="silu"):
    return (glu_act(g, act) * u).to(torch.bfloat16)


def silu_mul_backward(dh: torch.Tensor, gq: NVFP4Rows | DenseRows, uq: NVFP4Rows | DenseRows,
                      act: str = "silu") -> torch.Tensor:
    """d(gate | up) [T, 2I] bf16 from dh: dg = dh * u * act'(g), du = dh * act(g)."""
    return _silu_backward(dh, rows_value(gq), rows_value(uq), act)


def _silu_backward(dh, g, u, act="silu"):
    dh = dh.float()
    return torch.cat((dh * u * glu_act_grad(g, act), dh * glu_act(g, act)), dim=-1).to(torch.bfloat16)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, heads * hd] bf16, token t at position t % S; cos/sin [S, hd/2]. Rotation in fp32,
    one rounding to bf16; ``inverse`` rotates back (the backward)."""
    T, width = x.shape
    S, half = cos.shape
    pos = torch.arange(T, device=x.device) % S
    c, s = cos.float()[pos][:, None, :], sin.float()[pos][:, None, :]
    s = -s if inverse else s
    xf = x.float().reshape(T, -1, 2 * half)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(T, width).to(torch.bfloat16)


def ce_grad_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy rows: returns loss_i = logsumexp(z_i) - z_i[t_i] (fp32 [c]) and overwrites
    the logits [c, V] with softmax(z_i) - onehot(t_i), the gradient, in their dtype."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    rows = torch.arange(z.shape[0], device=z.device)
    loss = lse - z[rows, targets]
    p = torch.exp(z - lse[:, None])
    p[rows, targets] -= 1.0
    logits.copy_(p)
    return loss


def quant_rows(x: torch.Tensor, fp8: bool = False) -> NVFP4Rows:
    """x [T, K] -> NVFP4 rows (per-row fp32 scale); ``fp8``: E4M3 copy attached."""
    return _attach_fp8(quantize_rows(x.float()), fp8)


def dequant_rows(q: NVFP4Rows | DenseRows | E4M3Rows, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if isinstance(q, E4M3Rows):
        return q.value(dtype)
    return q.data.to(dtype) if isinstance(q, DenseRows) else dequantize_rows(q, dtype)


def e4m3_rows(y: torch.Tensor) -> E4M3Rows:
    """bf16 rows [T, K] -> E4M3 rows kept for backward (a recipe's saved=fp8): ``fp8_rows`` of y, unpadded."""
    return E4M3Rows(*fp8_rows(y, pad_to=1))


def quant_saved_sr(x: torch.Tensor) -> NVFP4Rows:
    """x [T, K] -> NVFP4 rows with stochastically rounded elements (unbiased), for rows only kept
    for backward (a recipe site's ``saved=nvfp4-sr``); torch on every device."""
    return quantize_rows(x.float(), stochastic=True)


def _decoded_qs(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q * s_b) as fp32 [rows, cols]: exact (and exact in bf16)."""
    rows = packed.shape[0]
    q = decode_packed(packed).reshape(rows, -1, BLOCK)
    return (q * scales.float().unsqueeze(-1)).reshape(rows, -1)


def nvfp4_gemm(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """C [M, N] = A [M, K] @ W [N, K]^T, W in NVFP4 blocked along K; A NVFP4 rows or bf16.

    ``a_hat`` (A dequantized to bf16) is accepted for the kernel's signature; the reference
    always multiplies the exact NVFP4 operands.

    Accumulates in fp32 and returns bf16. Used for the forward (W = fwd layout) and the
    input gradient (A = dy, W = bwd layout, i.e. W^T blocked along N).
    """
    wq = _decoded_qs(w.packed, w.scales)
    if isinstance(a, NVFP4Rows):
        aq = _decoded_qs(a.packed, a.scales)
        acc = aq @ wq.t()
        acc = acc * a.row_scale.float()[:, None]
    else:
        acc = a.float() @ wq.t()
    return (acc * w.global_scale.float()).to(torch.bfloat16)


def nvfp4_dgrad_fwd(dy: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """dX [M, K] = dY [M, N] @ W [N, K] with W the forward layout (blocked along K): the input gradient
    through the very weights the forward multiplied (`--backward-weights forward`), where the backward
    layout holds W^T rounded a second time along N. fp32 accumulation, one rounding to bf16."""
    if dy.shape[1] != w.shape[0]:
        raise ValueError(f"nvfp4_dgrad_fwd: dY has {dy.shape[1]} columns, W has N={w.shape[0]}")
    wq = _decoded_qs(w.packed, w.scales)
    return ((dy.float() @ wq) * w.global_scale.float()).to(torch.bfloat16)


def nvfp4_gemm_native(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of the `nvfp4-native` GEMM: both operands NVFP4, so a bf16 A (dY) is quantized to
    NVFP4 rows first; then the same exact product as ``nvfp4_gemm``."""
    return nvfp4_gemm(a if isinstance(a, NVFP4Rows) else quant_rows(a), w)


def fp8_rows(x: NVFP4Rows | NVFP4Tensor | torch.Tensor, pad_to: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x -> (E4M3 [R', K], fp32 decode scale [R']), R' = R rounded up to ``pad_to``
    (cuBLAS's FP8 GEMM wants every dimension a multiple of 16).

    Per row: v = q * s_b (exact) or the bf16 value; y = e4m3(v * (448 / amax)); scale =
    (amax / 448) times the row's / tensor's NVFP4 scale, with amax = max |v| for bf16 rows,
    6 * 448 for NVFP4 activation rows and 6 * max(s_b) per row of an NVFP4 weight (the bounds
    the block scales set). Padding: zeros, scale 1."""
    rows = x.shape[0]
    if isinstance(x, (NVFP4Rows, NVFP4Tensor)):
        v = _decoded_qs(x.packed, x.scales)
        if isinstance(x, NVFP4Rows):  # every row's largest block scale is 448 (runtime/ops/rows.py)
            base, amax = x.row_scale.float(), torch.full((rows,), FP8_ROW_AMAX, device=v.device)
        else:
            base = x.global_scale.float().expand(rows)
            amax = 6.0 * x.scales.float().amax(-1) if x.shape[1] else torch.zeros(rows, device=v.device)
    else:
        v = x.float()
        base = torch.ones(rows, device=v.device)
        amax = v.abs().amax(-1) if v.shape[1] else torch.zeros(rows, device=v.device)
    fmax = torch.tensor(FP8_MAX, device=v.device)
    amax = torch.where(amax > 0, amax, fmax)
    y = (v * (fmax / amax)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    y = torch.where(y & 0x7F == 0, 0, y).view(torch.float8_e4m3fn)  # zeros positive, as the kernel writes them
    scale = (amax / fmax) * base
    pad = -(-rows // pad_to) * pad_to - rows
    if pad:
        y = torch.cat((y, torch.zeros(pad, v.shape[1], device=v.device).to(torch.float8_e4m3fn)))
        scale = torch.cat((scale, torch.ones(pad, device=v.device)))
    return y, scale


def nvfp4_gemm_fp8(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of the `fp8` GEMM: both operands re-encoded as E4M3 rows (``fp8_rows``), product in
    fp32, row scales applied to the accumulator, one rounding to bf16."""
    a8, sa = fp8_rows(a.data if isinstance(a, DenseRows) else a, pad_to=1)
    w8, sw = (w.fp8, w.fp8_scale) if getattr(w, "fp8", None) is not None else fp8_rows(w, pad_to=1)
    acc = a8.float() @ w8.float().t()
    return (acc * sa[:, None] * sw[None, :]).to(torch.bfloat16)
