"""Autograd Functions of the PACT data flow: what each saves for backward is decided here.

Notation per decoder layer: T tokens, H hidden, A = heads * head_dim, I intermediate,
N = output width of a fused group (q|k|v: A + 2 * kv_heads * head_dim; gate|up: 2I).
NVFP4 rows of width K cost K/2 + K/16 + 4 bytes per token (codes, e4m3 scales, fp32 row scale).

    attention input  x [T,H] -> RMSNorm -> quantize (one NVFP4 copy: GEMM input and saved)
                     qkv [T,N] = Xq [T,H] @ Wqkv[N,H]^T  (+ bias)  + LoRA per member
    attention output o [T,A] -> quantize -> o_proj [T,H] = Oq @ Wo[H,A]^T + LoRA
    MLP              x -> RMSNorm -> quantize -> gate|up [T,2I] = Xq @ Wgu[2I,H]^T + LoRA
                     h = silu(gate) * up -> quantize -> down [T,H] = Hq @ Wd[H,I]^T + LoRA
                     saved: Xq, rstd, NVFP4 copies of gate and up (h is recomputed from them)

Backward, per frozen group (W in NVFP4; dgrad through the backward layout W^T blocked
along N):  dX [T,K] = dY [T,N] @ W [N,K]   (computed as dY @ (W^T)^T with W^T [K,N])
LoRA member i (A_i [r,K], B_i [N_i,r], scale s, input X_hat = dequant(Xq) in bf16):
    xa = drop(X_hat) @ A_i^T          [T,K] @ [K,r] -> [T,r]    (saved, bf16)
    y_i += s * xa @ B_i^T             [T,r] @ [r,N_i] -> [T,N_i]
    dB_i = s * dY_i^T @ xa            [N_i,T] @ [T,r] -> [N_i,r]
    dxa  = s * dY_i @ B_i             [T,N_i] @ [N_i,r] -> [T,r]
    dA_i = dxa^T @ drop(X_hat)        [r,T] @ [T,K] -> [r,K]
    dX  += drop'(dxa @ A_i)           [T,r] @ [r,K] -> [T,K]
RMSNorm backward from the saved NVFP4 output Y_hat (= x * rstd * w, quantized), in fp32:
    n = Y_hat / w;  g = dY * w;  dx = rstd * (g - n * mean(g * n))
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from pact.formats.nvfp4 import NVFP4Tensor

from .matmul import addmm_, mm
from .ops.rows import DenseRows, E4M3Rows
from .recipe import Site, parse_recipe


@dataclass
class Lora:
    """One adapter on one member of a frozen group (parameters live in the model)."""

    A: torch.nn.Parameter  # [r, K] fp32 master weights
    B: torch.nn.Parameter  # [N_i, r] fp32, starts at zero
    scale: float  # alpha / r
    dropout: float


@dataclass
class FrozenGroup:
    """Frozen projections sharing one input: q|k|v, o, gate|up, down.

    ``weight`` is the fused forward layout [N, K] and ``weight_t`` the fused backward layout
    [K, N] (None where the input gradients read ``weight``: `--backward-weights forward`); a group
    with a member kept in bf16 holds ``dense`` [N, K] bf16 instead.
    """

    names: list[str]
    sizes: list[int]
    weight: NVFP4Tensor | None = None
    weight_t: NVFP4Tensor | None = None
    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    loras: list[Lora | None] = field(default_factory=list)
    # per member: its frozen low-rank correction (U [N_i, R], V [R, K] bf16; pact-calibrate --correct-rank), the
    # weight it computes with being the NVFP4 one + U V; empty: none (a dense group holds it in ``dense``)
    corr: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    # corr_fused's matrices and the ``corr`` list they were made from
    corr_cache: tuple[list, tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    def lora_params(self) -> list[torch.nn.Parameter]:
        return [p for lo in self.loras if lo is not None for p in (lo.A, lo.B)]


# LoRA dropout applies while training only: PactModel.layer sets this from torch's grad mode (scoring, generation and
# calibration run under torch.no_grad and must not draw masks), and a Function's backward reads the default (True)
TRAINING = ContextVar("pact_lora_training", default=True)


def _p(lo: Lora | None) -> float:
    """The dropout an adapter applies now: its own while training, none otherwise."""
    return lo.dropout if lo is not None and TRAINING.get() else 0.0


def _dropout_mask(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    # Regenerated from the seed in backward instead of saving a [T,K] mask.
    gen = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.rand(x.shape, generator=gen, device=x.device) >= p
    return keep.to(x.dtype) / (1.0 - p)


def _new_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def _batched(g: FrozenGroup) -> bool:
    """Members' LoRA branches can run as one GEMM over concatenated A's (no dropout: one
    shared input, so xa for every member is X_hat @ [A_1; A_2; ...]^T)."""
    return all(_p(lo) == 0 for lo in g.loras)


def _a_cat(g: FrozenGroup, dtype) -> torch.Tensor:
    return torch.cat([lo.A for lo in g.loras if lo is not None]).to(dtype)


def _rank_sum(g: FrozenGroup) -> int:
    """sum r: the rows of _a_cat (the LoRA block of the fused correction's [A; V] comes first)."""
    return sum(lo.A.shape[0] for lo in g.loras if lo is not None)


def _by_member(g: FrozenGroup, t: torch.Tensor, dim: int) -> list:
    """Each member's rank block of ``t`` along ``dim`` (its r columns of xa_all, rows of dA_all: _a_cat's order),
    None for a member without an adapter."""
    out, at = [], 0
    for lo in g.loras:
        r = 0 if lo is None else lo.A.shape[0]
        out.append(None if lo is None else t.narrow(dim, at, r))
        at += r
    return out


def project(ops, g: FrozenGroup, a, x_hat: torch.Tensor, a_hat: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, list, list]:
    """Frozen GEMM (+bias) + LoRA per member. Returns y [T,N] bf16, saved xa's, dropout seeds.

    ``a`` is the GEMM's operand (NVFP4 rows, or DenseRows), ``a_hat`` its bf16 value when already
    decoded, ``x_hat`` the LoRA branch's bf16 input (runtime/recipe.py: the same, or unquantized).
    Without dropout, one GEMM computes every member's xa and each member's update is added
    into its slice of y by cuBLAS (addmm, alpha = scale): no [T, N_i] temporaries."""
    a_val = a.data if isinstance(a, DenseRows) and a.fp8 is None else a  # with an E4M3 copy: the fp8 GEMM reads it
    if g.weight is not None:
        y = ops.nvfp4_gemm(a_val, g.weight, a_hat)
    else:
        dense_a = a.data if isinstance(a, DenseRows) else a_hat if a_hat is not None else ops.dequant_rows(a)
        y = mm(dense_a, g.dense.t())
    if g.bias is not None:
        y = y + g.bias
    if _fused_corr(g):  # the correction rides on the LoRA GEMMs: one pass over y for both
        a_ext = _a_ext(g, x_hat.dtype)
        xe = mm(x_hat, a_ext.t())  # [T, sum r + sum R]: every member's xa, then x V_cat^T
        addmm_(y, xe, _w_ext(g, x_hat.dtype))
        # (contiguous: what backward keeps is the LoRA columns, not the correction's)
        return y, _by_member(g, xe[:, : _rank_sum(g)].contiguous(), 1), [None] * len(g.loras)
    _correct(g, y, x_hat)
    if not any(lo is not None for lo in g.loras):
        return y, [None] * len(g.loras), [None] * len(g.loras)
    seeds = [_new_seed() if _p(lo) > 0 else None for lo in g.loras]
    xas = []
    if _batched(g):  # every member's xa from one GEMM; each member's is a column slice of it
        xas = _by_member(g, mm(x_hat, _a_cat(g, x_hat.dtype).t()), 1)  # of [T, sum r]
    else:
        for lo, seed in zip(g.loras, seeds):
            xd = x_hat * _dropout_mask(x_hat, lo.dropout, seed) if seed is not None else x_hat
            xas.append(None if lo is None else mm(xd, lo.A.to(x_hat.dtype).t()))
    off = 0
    for lora, n, xa in zip(g.loras, g.sizes, xas):
        if lora is not None:
            addmm_(y[:, off : off + n], xa, lora.B.to(x_hat.dtype).t(), alpha=lora.scale)
        off += n
    return y, xas, seeds


def corr_fused(g: FrozenGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The members' corrections as two matrices, made once per ``g.corr`` list: U_bd [sum R, N] (member i's U_i^T
    in its rows and its own columns, zeros elsewhere) and V_cat [sum R, K], so that the group's correction is
    x V_cat^T U_bd and its input gradient (dY U_bd^T) V_cat: two GEMMs a call, no per-call concatenation (and
    nothing allocated that a CUDA graph's replay would miss). The cache is keyed on the list itself: ``g.corr`` is
    replaced by a new list (bind, a recalibration), never edited in place."""
    if g.corr_cache is not None and g.corr_cache[0] is g.corr:
        return g.corr_cache[1]
    parts = [c for c in g.corr if c is not None]
    ref = parts[0][1]
    u = torch.zeros(sum(c[1].shape[0] for c in parts), sum(g.sizes), dtype=ref.dtype, device=ref.device)
    row, off = 0, 0
    for c, n in zip(g.corr, g.sizes):
        if c is not None:
            r = c[1].shape[0]
            u[row : row + r, off : off + n] = c[0].t()
            row += r
        off += n
    fused = (u, torch.cat([c[1] for c in parts]))
    g.corr_cache = (g.corr, fused)
    return fused


def _fused_corr(g: FrozenGroup) -> bool:
    """A corrected group whose LoRA branches batch (no dropout) adds its correction through the LoRA GEMMs:
    y += [x A_cat^T | x V_cat^T] @ [s B_bd ; U_bd] and dX += [dxa | dY U_bd^T] @ [A_cat ; V_cat], where the
    separate correction made a second pass over y and dX (10% of a 1B step)."""
    return any(c is not None for c in g.corr) and any(lo is not None for lo in g.loras) and _batched(g)


def _a_ext(g: FrozenGroup, dtype) -> torch.Tensor:
    """[A_cat ; V_cat] [sum r + sum R, K]: the members' LoRA A's, then their corrections' V's."""
    return torch.cat([_a_cat(g, dtype), corr_fused(g)[1].to(dtype)])


def _w_ext(g: FrozenGroup, dtype) -> torch.Tensor:
    """[s B_bd ; U_bd] [sum r + sum R, N]: member i's s * B_i^T in its rows of the first block and its own columns
    (zeros elsewhere), then the correction's U_bd (corr_fused). Made per call: B moves every step."""
    u, rs = corr_fused(g)[0], _rank_sum(g)
    w = torch.zeros(rs + u.shape[0], u.shape[1], dtype=dtype, device=u.device)
    row, off = 0, 0
    for lo, n in zip(g.loras, g.sizes):
        if lo is not None:
            r = lo.A.shape[0]
            w[row : row + r, off : off + n] = (lo.B * lo.scale).t()
            row += r
        off += n
    w[rs:] = u
    return w


def _correct(g: FrozenGroup, y: torch.Tensor, x: torch.Tensor) -> None:
    """y += x V_i^T U_i^T in each corrected member's slice of y (two GEMMs for the group: corr_fused)."""
    if not any(c is not None for c in g.corr):
        return
    u, v = corr_fused(g)
    addmm_(y, mm(x, v.to(x.dtype).t()), u.to(x.dtype))


def _correct_backward(g: FrozenGroup, dy: torch.Tensor, dx: torch.Tensor) -> None:
    """dx += (dy_i U_i) V_i summed over the corrected members (the correction is frozen: no gradient of its own)."""
    if not any(c is not None for c in g.corr):
        return
    u, v = corr_fused(g)
    addmm_(dx, mm(dy, u.to(dy.dtype).t()), v.to(dx.dtype))


def project_backward(ops, g: FrozenGroup, dy: torch.Tensor, x_hat: torch.Tensor, xas: list, seeds: list):
    """dX (bf16 [T,K]) and the LoRA grads [(dA, dB) or None per member].

    Without dropout the members' dxa's are concatenated: dA for all members is one GEMM and
    their input gradient is added onto the frozen one by one addmm (fp32 in cuBLAS's epilogue)."""
    dy = dy.to(torch.bfloat16).contiguous()
    if g.weight is None:
        dx = mm(dy, g.dense)
    else:
        w = g.weight if ops.dgrad_reads == "forward" else g.weight_t
        if w is None:
            raise RuntimeError("a backward through a model built with backward=False (no backward layouts loaded): "
                               "build it with backward=True to train")
        dx = ops.dgrad_gemm(dy, w)
    if _fused_corr(g):
        a_ext = _a_ext(g, dy.dtype)
        dxe = mm(dy, _w_ext(g, dy.dtype).t())  # [T, sum r + sum R]: every member's dxa, then dY U_bd^T
        dA_all = mm(dxe[:, : _rank_sum(g)].t(), x_hat).float()  # [sum r, K]
        addmm_(dx, dxe, a_ext)
        grads, off = [], 0
        for lora, n, xa, dA in zip(g.loras, g.sizes, xas, _by_member(g, dA_all, 0)):
            grads.append(None if lora is None else (dA, mm(dy[:, off : off + n].t(), xa).float() * lora.scale))
            off += n
        return dx, grads
    _correct_backward(g, dy, dx)
    if not any(lo is not None for lo in g.loras):
        return dx, [None] * len(g.loras)
    batched = _batched(g)
    grads, dxas, off = [], [], 0
    dx32 = None if batched else dx.float()
    for lora, n, xa, seed in zip(g.loras, g.sizes, xas, seeds):
        if lora is None:
            grads.append(None)
            off += n
            continue
        dyi = dy[:, off : off + n]
        off += n
        dB = mm(dyi.t(), xa).float() * lora.scale
        dxa = mm(dyi, (lora.B * lora.scale).to(dy.dtype))
        if batched:
            dxas.append(dxa)
            grads.append(dB)  # (its dA: one GEMM for every member, below)
            continue
        mask = _dropout_mask(x_hat, lora.dropout, seed) if seed is not None else None
        xd = x_hat * mask if mask is not None else x_hat
        dA = mm(dxa.t(), xd).float()
        dxl = mm(dxa, lora.A.to(dy.dtype)).float()
        dx32 += dxl * mask if mask is not None else dxl
        grads.append((dA, dB))
    if not batched:
        return dx32.to(torch.bfloat16), grads
    dxa_all = torch.cat(dxas, dim=1) if len(dxas) > 1 else dxas[0]  # [T, sum r]
    dA_all = mm(dxa_all.t(), x_hat).float()  # [sum r, K]
    addmm_(dx, dxa_all, _a_cat(g, dy.dtype))
    return dx, [None if dB is None else (dA, dB) for dB, dA in zip(grads, _by_member(g, dA_all, 0))]


def _per_member(loras: list, kept) -> list:
    """The saved xa's (only members with an adapter) back in member order, None elsewhere."""
    it = iter(kept)
    return [next(it) if lo is not None else None for lo in loras]


def _flat_grads(groups: list[FrozenGroup], grads: list[list]) -> list:
    out = []
    for g, gg in zip(groups, grads):
        for lora, pair in zip(g.loras, gg):
            if lora is not None:
                out.extend(pair)
    return out


def _rows_tensors(q) -> tuple[torch.Tensor, ...]:
    if isinstance(q, DenseRows):
        return (q.data,)
    return (q.data, q.scale) if isinstance(q, E4M3Rows) else (q.packed, q.scales, q.row_scale)


def _rows_from(kind: type, tensors: list[torch.Tensor]):
    """Rebuild a rows object of ``kind`` from the front of ``tensors``; returns (rows, rest)."""
    n = 1 if kind is DenseRows else 2 if kind is E4M3Rows else 3
    return kind(*tensors[:n]), tensors[n:]


def _saved_copy(ops, saved: str, y: DenseRows, q=None):
    """The rows a site keeps for backward, of its unquantized rows y: the NVFP4 copy q ("nvfp4"), y
    itself ("bf16"), E4M3 rows ("fp8": the fp8 backend's E4M3 copy of y when y carries one, the same
    bytes) or stochastically rounded NVFP4 ("nvfp4-sr")."""
    if saved == "nvfp4":
        return q if q is not None else ops.quant_saved(y.data)
    if saved == "fp8":
        rows = y.data.shape[0]
        return E4M3Rows(y.fp8[:rows], y.fp8_scale[:rows]) if y.fp8 is not None else ops.e4m3_rows(y.data)
    return ops.quant_saved_sr(y.data) if saved == "nvfp4-sr" else DenseRows(y.data)


def _operands(ops, site: Site, y: DenseRows, q=None):
    """A site's uses of its rows: y unquantized (bf16, possibly carrying the fp8 backend's E4M3
    copy) and q their NVFP4 rows (made here if the site needs them and q is None). Returns (GEMM
    operand, its bf16 value when already decoded, LoRA input, rows saved for backward)."""
    if q is None and site.needs_nvfp4:
        q = (ops.quant_rows if site.gemm == "nvfp4" else ops.quant_saved)(y.data)
    q_hat = ops.dequant_rows(q) if site.lora == "nvfp4" else None  # the LoRA input, and A for cuBLAS
    gemm = q if site.gemm == "nvfp4" else ops.gemm_operand(y, q)
    return gemm, q_hat if gemm is q else None, y.data if q_hat is None else q_hat, _saved_copy(ops, site.saved, y, q)


# the down site's ``saved`` is about gate and up; h itself is never saved (recomputed from them)
_H_USES = {(g, lo): Site(g, lo, "bf16") for g in ("nvfp4", "bf16") for lo in ("nvfp4", "bf16")}


def _norm_operands(ops, site: Site, x, norm_w, eps):
    """RMSNorm of x as the site asks: (GEMM operand, a_hat, LoRA input, saved rows, rstd)."""
    if site.quantized:  # one fused kernel: NVFP4 rows (and the fp8 backend's E4M3 copy)
        xq, rstd = ops.rmsnorm_quant(x, norm_w, eps)
        x_hat = ops.dequant_rows(xq)
        return xq, x_hat, x_hat, xq, rstd
    # one fused kernel: bf16 rows, their NVFP4 copy when the site uses one, the E4M3 copy for the GEMM
    y, q, rstd = ops.rmsnorm_rows(x, norm_w, eps, nvfp4=site.needs_nvfp4, gemm_input=site.gemm == "bf16")
    return (*_operands(ops, site, y, q), rstd)


class RopeFn(torch.autograd.Function):
    """Rotary embedding of x [T, heads * hd] (one kernel each way; saves nothing but cos/sin)."""

    @staticmethod
    def forward(ctx, x, cos, sin, ops):
        ctx.ops, ctx.cos, ctx.sin = ops, cos, sin
        return ops.rope(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        return ctx.ops.rope(dy.contiguous(), ctx.cos, ctx.sin, inverse=True), None, None, None


class NormProjectionFn(torch.autograd.Function):
    """y = RMSNorm(x) quantized -> frozen group + LoRA. Saves Xq and rstd (and LoRA xa's)."""

    @staticmethod
    def forward(ctx, x, norm_w, eps, group, ops, site, *params):
        a, a_hat, x_lora, saved, rstd = _norm_operands(ops, site, x, norm_w, eps)
        y, xas, seeds = project(ops, group, a, x_lora, a_hat)
        ctx.ops, ctx.group, ctx.norm_w, ctx.seeds, ctx.kind = ops, group, norm_w, seeds, type(saved)
        ctx.save_for_backward(*_rows_tensors(saved), rstd, *[xa for xa in xas if xa is not None])
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, (rstd, *xas_kept) = _rows_from(ctx.kind, list(ctx.saved_tensors))
        xas = _per_member(ctx.group.loras, xas_kept)
        dxn, grads = project_backward(ctx.ops, ctx.group, dy, ctx.ops.dequant_rows(xq), xas, ctx.seeds)
        dx = ctx.ops.rmsnorm_backward(dxn, xq, rstd, ctx.norm_w) if ctx.needs_input_grad[0] else None
        return (dx, None, None, None, None, None, *_flat_grads([ctx.group], [grads]))


class ProjectionFn(torch.autograd.Function):
    """y = quantize(x) -> frozen group + LoRA (o_proj). Saves Xq (and LoRA xa's)."""

    @staticmethod
    def forward(ctx, x, group, ops, site, *params):
        a, a_hat, x_lora, saved = _operands(ops, site, DenseRows(x))
        y, xas, seeds = project(ops, group, a, x_lora, a_hat)
        ctx.ops, ctx.group, ctx.seeds, ctx.kind = ops, group, seeds, type(saved)
        ctx.save_for_backward(*_rows_tensors(saved), *[xa for xa in xas if xa is not None])
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, xas_kept = _rows_from(ctx.kind, list(ctx.saved_tensors))
        xas = _per_member(ctx.group.loras, xas_kept)
        dx, grads = project_backward(ctx.ops, ctx.group, dy, ctx.ops.dequant_rows(xq), xas, ctx.seeds)
        dx = dx.to(dy.dtype) if ctx.needs_input_grad[0] else None
        return (dx, None, None, None, *_flat_grads([ctx.group], [grads]))


class MlpFn(torch.autograd.Function):
    """out = down(act(gate) * up) on RMSNorm(x), all frozen GEMMs NVFP4, LoRA on each; ``act`` the
    family's gate activation (silu: SwiGLU, gelu_tanh: GeGLU).

    Saves the RMSNorm rows, rstd, gate and up (h for down's LoRA is recomputed from them), each
    as its recipe site says (the gate_up site for the first, the down site's ``saved`` for gate and up).
    """

    @staticmethod
    def forward(ctx, x, norm_w, eps, gate_up, down, ops, sites, act, *params):
        site1, site2 = sites
        a, a_hat, x_lora, saved, rstd = _norm_operands(ops, site1, x, norm_w, eps)
        gu, xas1, seeds1 = project(ops, gate_up, a, x_lora, a_hat)
        if site2.quantized:  # one fused kernel: NVFP4 h (+ E4M3 copy), gate and up
            hq, gq, uq = ops.silu_mul_quant(gu, act=act)
            h_hat = ops.dequant_rows(hq)
            h_op, h_lora = hq, h_hat
        else:  # one fused kernel: bf16 h (+ its E4M3 copy for the GEMM), gate and up as the site saves them
            h, gq, uq = ops.silu_mul_rows(gu, nvfp4=site2.saved == "nvfp4", gemm_input=site2.gemm == "bf16",
                                          act=act, e4m3=site2.saved == "fp8")
            if site2.saved == "nvfp4-sr":  # gate and up as stochastically rounded rows
                gq, uq = (_saved_copy(ops, site2.saved, t) for t in (gq, uq))
            h_op, h_hat, h_lora, _ = _operands(ops, _H_USES[site2.gemm, site2.lora], h)
        out, xas2, seeds2 = project(ops, down, h_op, h_lora, h_hat)
        ctx.ops, ctx.groups, ctx.norm_w, ctx.seeds, ctx.act = ops, (gate_up, down), norm_w, (seeds1, seeds2), act
        ctx.n_xa1 = sum(xa is not None for xa in xas1)
        ctx.kinds = (type(saved), type(gq), type(uq))
        kept = [xa for xa in xas1 + xas2 if xa is not None]
        ctx.save_for_backward(*_rows_tensors(saved), rstd, *_rows_tensors(gq), *_rows_tensors(uq), *kept)
        return out

    @staticmethod
    def backward(ctx, dout):
        ops, (gate_up, down) = ctx.ops, ctx.groups
        xq, (rstd, *rest) = _rows_from(ctx.kinds[0], list(ctx.saved_tensors))
        gq, rest = _rows_from(ctx.kinds[1], rest)
        uq, kept = _rows_from(ctx.kinds[2], rest)
        xas1 = _per_member(gate_up.loras, kept[: ctx.n_xa1])
        xas2 = _per_member(down.loras, kept[ctx.n_xa1 :])
        dh, grads2 = project_backward(ops, down, dout, ops.silu_mul_h(gq, uq, act=ctx.act), xas2, ctx.seeds[1])
        dgu = ops.silu_mul_backward(dh, gq, uq, act=ctx.act)
        dxn, grads1 = project_backward(ops, gate_up, dgu, ops.dequant_rows(xq), xas1, ctx.seeds[0])
        dx = ops.rmsnorm_backward(dxn, xq, rstd, ctx.norm_w) if ctx.needs_input_grad[0] else None
        return (dx, None, None, None, None, None, None, None, *_flat_grads([gate_up, down], [grads1, grads2]))


def saved_bytes_per_token(hidden: int, attn: int, inter: int, rank_members: dict[str, int], recipe=None) -> int:
    """What the three Functions of one layer save per token under ``recipe`` (default: the default
    recipe; the attention core not included). A site's saved rows of width K cost K/2 + K/16 + 4
    bytes as NVFP4 (nvfp4, nvfp4-sr), K + 4 as E4M3 (fp8), 2K as bf16; the norms add rstd (4 bytes).

    ``rank_members``: LoRA rank per target (q_proj..down_proj), 0 for none; xa is bf16 [T, r].
    """
    recipe = parse_recipe(recipe)

    def rows(k: int, saved: str) -> int:
        return {"fp8": k + 4, "bf16": 2 * k}.get(saved, k // 2 + k // 16 + 4)

    lora = sum(2 * r for r in rank_members.values())
    return ((rows(hidden, recipe.qkv.saved) + 4) + rows(attn, recipe.o.saved) + (rows(hidden, recipe.gate_up.saved) + 4)
            + 2 * rows(inter, recipe.down.saved) + lora)
