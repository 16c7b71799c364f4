"""Row kernels: NVFP4 row quantization fused into RMSNorm and SiLU-mul (with the bf16 rows and the
fp8 backend's E4M3 copy when a recipe asks for them), row decoding, and the backward kernels that
read saved NVFP4 rows (RMSNorm, SiLU-mul). Twins of the same names in runtime/ops/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pact.formats import nvfp4 as fmt
from pact.formats.nvfp4 import NVFP4Rows

from ..rows import FP8_ROW_AMAX, DenseRows, E4M3Rows, NVFP4RowsFP8
from .codec import (
    E4M3_MAX,
    PAIRS_ROWS,
    amax_scale,
    block_offsets,
    block_width,
    decode_pairs,
    decode_row,
    e4m3_bytes,
    e4m3_mode,
    e4m3_value,
    empty_rows,
    load_row_fp32,
    rne_bf16,
    row_args,
    row_config,
    store_blocks,
    store_row,
    warps_for,
)

# ---------------------------------------------------------------------------- kernels
# One program per row. Rows wider than CHUNK are walked in CHUNK-wide pieces (static loops):
# a first pass takes the row amax where a row scale is needed, a second quantizes / writes.
# Holding an 8192- or 16384-wide row in registers spilled and ran ~5x under bandwidth.


@triton.jit
def _quant_rows_kernel(x_ptr, stride_x, packed_ptr, scales_ptr, rs_ptr, f8_ptr, K, BLOCK_K: tl.constexpr,
                       CHUNK: tl.constexpr, EMIT_FP8: tl.constexpr):
    row = tl.program_id(0)
    amax = 0.0
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = block_offsets(c0, CHUNK)
        y = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    g = amax_scale(amax)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = block_offsets(c0, CHUNK)
        y = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        store_blocks(row, c0, y, g, packed_ptr, scales_ptr, K, CHUNK, f8_ptr, EMIT_FP8)
    tl.store(rs_ptr + row, g)


@triton.jit
def _rmsnorm_row(x_ptr, stride_x, w_ptr, eps, rstd_ptr, row, K, BLOCK_K: tl.constexpr):
    """A whole row's x * rstd * w in fp32 as blocks [BLOCK_K/16, 16] (zeros past K), and their
    offsets; stores rstd."""
    offs = block_offsets(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(x * x, axis=1), axis=0) / K + eps)
    tl.store(rstd_ptr + row, rstd)
    return x * rstd * w, offs


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, stride_x, w_ptr, eps, packed_ptr, scales_ptr, rs_ptr, rstd_ptr, f8_ptr, K,
                          BLOCK_K: tl.constexpr, EMIT_FP8: tl.constexpr):
    row = tl.program_id(0)
    y, _ = _rmsnorm_row(x_ptr, stride_x, w_ptr, eps, rstd_ptr, row, K, BLOCK_K)
    store_row(row, y, packed_ptr, scales_ptr, rs_ptr, K, BLOCK_K, f8_ptr, EMIT_FP8)


@triton.jit
def _store_fp8_of(row, c0, y, amax, f8_ptr, f8s_ptr, K, CHUNK: tl.constexpr, MODE: tl.constexpr):
    """E4M3 bytes of elements c0 .. c0+CHUNK of a row (blocks [CHUNK/16, 16], fp32 holding bf16
    values) scaled by 448 / amax, as fp8.py's _fp8_rows_kernel writes a bf16 row; c0 == 0 also
    stores the row's decode scale amax / 448."""
    amax = tl.where(amax > 0, amax, E4M3_MAX)
    inv = tl.math.div_rn(E4M3_MAX + tl.zeros_like(amax), amax)
    f8 = e4m3_bytes(tl.minimum(tl.maximum(y * inv, -E4M3_MAX), E4M3_MAX), MODE)
    offs = block_offsets(c0, CHUNK)
    tl.store(f8_ptr + row * K + offs, f8.to(tl.uint8), mask=offs < K)
    if c0 == 0:
        tl.store(f8s_ptr + row, tl.math.div_rn(amax, E4M3_MAX))


@triton.jit
def _rmsnorm_rows_kernel(x_ptr, stride_x, w_ptr, eps, y_ptr, packed_ptr, scales_ptr, rs_ptr, rstd_ptr, f8_ptr, f8s_ptr,
                         K, BLOCK_K: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr):
    """RMSNorm rows kept unquantized: y = bf16(x * rstd * w) stored, plus (NVFP4) its NVFP4 rows
    for backward and (FP8 = E4M3 mode) its E4M3 copy for the fp8 backend's GEMM."""
    row = tl.program_id(0)
    y, offs = _rmsnorm_row(x_ptr, stride_x, w_ptr, eps, rstd_ptr, row, K, BLOCK_K)
    y = rne_bf16(y)
    tl.store(y_ptr + row * K + offs, y.to(tl.bfloat16), mask=offs < K)
    if NVFP4:
        store_row(row, y, packed_ptr, scales_ptr, rs_ptr, K, BLOCK_K, f8_ptr, 0)
    if FP8:
        _store_fp8_of(row, 0, y, tl.max(tl.max(tl.abs(y), axis=1), axis=0), f8_ptr, f8s_ptr, K, BLOCK_K, FP8)


@triton.jit
def _gelu_sigmoid(g):
    """sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)): tanh-approximated GELU(g) is g times it (the twin's
    GELU_2C form of 0.5 g (1 + tanh(...)))."""
    return 1.0 / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))


@triton.jit
def _glu(g, ACT: tl.constexpr):
    """The gate's activation in fp32: ACT 0 silu (SwiGLU), 1 tanh-approximated GELU (GeGLU)."""
    if ACT == 1:
        return g * _gelu_sigmoid(g)
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _glu_grad(g, ACT: tl.constexpr):
    """d act(g) / dg in fp32."""
    if ACT == 1:
        s = _gelu_sigmoid(g)
        return s + g * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    sig = 1.0 / (1.0 + tl.exp(-g))
    return sig * (1.0 + g * (1.0 - sig))


@triton.jit
def _gate_up_chunk(base, c0, K, CHUNK: tl.constexpr):
    """One chunk of a row of the fused [gate | up] output (gate at base, up at base + K), in fp32."""
    offs = block_offsets(c0, CHUNK)
    g = tl.load(base + offs, mask=offs < K, other=0.0).to(tl.float32)
    u = tl.load(base + K + offs, mask=offs < K, other=0.0).to(tl.float32)
    return offs, g, u


@triton.jit
def _silu_mul_rows_kernel(gu_ptr, stride_gu, h_ptr, gp, gs, gr, up, us, ur, f8_ptr, f8s_ptr, K, BLOCK_K: tl.constexpr,
                          CHUNK: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr, ACT: tl.constexpr,
                          E4M3: tl.constexpr):
    """h = bf16(silu(gate) * up) stored unquantized, plus (NVFP4) gate and up as NVFP4 rows for
    backward, or (E4M3 = E4M3 mode) as E4M3 rows (gp, up bytes; gr, ur row scales; gs, us unused),
    and (FP8) h's E4M3 copy for the fp8 backend's GEMM."""
    row = tl.program_id(0)
    base = gu_ptr + row * stride_gu
    am_h, am_g, am_u = 0.0, 0.0, 0.0
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
        h = rne_bf16(_glu(g, ACT) * u)
        tl.store(h_ptr + row * K + offs, h.to(tl.bfloat16), mask=offs < K)
        am_h = tl.maximum(am_h, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
        am_g = tl.maximum(am_g, tl.max(tl.max(tl.abs(g), axis=1), axis=0))
        am_u = tl.maximum(am_u, tl.max(tl.max(tl.abs(u), axis=1), axis=0))
    if NVFP4 or FP8 or E4M3:
        sg, su = amax_scale(am_g), amax_scale(am_u)
        for c0 in tl.static_range(0, BLOCK_K, CHUNK):
            offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
            if NVFP4:
                store_blocks(row, c0, g, sg, gp, gs, K, CHUNK, f8_ptr, 0)
                store_blocks(row, c0, u, su, up, us, K, CHUNK, f8_ptr, 0)
            if E4M3:  # as fp8.py's _fp8_rows_kernel writes each bf16 half (g and u hold bf16 values)
                _store_fp8_of(row, c0, g, am_g, gp, gr, K, CHUNK, E4M3)
                _store_fp8_of(row, c0, u, am_u, up, ur, K, CHUNK, E4M3)
            if FP8:  # h recomputed (the same bits) rather than read back from another thread's store
                _store_fp8_of(row, c0, rne_bf16(_glu(g, ACT) * u), am_h, f8_ptr, f8s_ptr, K, CHUNK, FP8)
        if NVFP4:
            tl.store(gr + row, sg)
            tl.store(ur + row, su)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, stride_gu, hp, hs, hr, gp, gs, gr, up, us, ur, h8_ptr, K, BLOCK_K: tl.constexpr,
                           CHUNK: tl.constexpr, EMIT_FP8: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0)
    base = gu_ptr + row * stride_gu
    am_h, am_g, am_u = 0.0, 0.0, 0.0
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
        h = _glu(g, ACT) * u
        am_h = tl.maximum(am_h, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
        am_g = tl.maximum(am_g, tl.max(tl.max(tl.abs(g), axis=1), axis=0))
        am_u = tl.maximum(am_u, tl.max(tl.max(tl.abs(u), axis=1), axis=0))
    sh, sg, su = amax_scale(am_h), amax_scale(am_g), amax_scale(am_u)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
        h = _glu(g, ACT) * u
        store_blocks(row, c0, h, sh, hp, hs, K, CHUNK, h8_ptr, EMIT_FP8)
        store_blocks(row, c0, g, sg, gp, gs, K, CHUNK, h8_ptr, 0)
        store_blocks(row, c0, u, su, up, us, K, CHUNK, h8_ptr, 0)
    tl.store(hr + row, sh)
    tl.store(gr + row, sg)
    tl.store(ur + row, su)


@triton.jit
def _dequant_rows_kernel(packed_ptr, scales_ptr, rs_ptr, out_ptr, K, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """NVFP4 rows -> fp32 (q * s_b) * g_r; bf16 outputs take _decode_pairs_kernel."""
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        v = decode_row(packed_ptr, scales_ptr, row, K, c0, CHUNK) * tl.load(rs_ptr + row)
        offs = c0 + tl.arange(0, CHUNK)
        tl.store(out_ptr + row * K + offs, v, mask=offs < K)


@triton.jit
def _e4m3_row(f8_ptr, sc_ptr, row, K, c0, CHUNK: tl.constexpr):
    """Elements c0 .. c0+CHUNK of an E4M3 row (saved=fp8) decoded to fp32 (zeros past K): byte value * row scale."""
    offs = c0 + tl.arange(0, CHUNK)
    b = tl.load(f8_ptr + row * K + offs, mask=offs < K, other=0).to(tl.int32)
    v = e4m3_value(b & 127)
    return tl.where((b & 128) != 0, -v, v) * tl.load(sc_ptr + row)


@triton.jit
def _dequant_e4m3_kernel(f8_ptr, sc_ptr, out_ptr, K, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """E4M3 rows -> bf16 (the fp32 product rounded to nearest even)."""
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        v = rne_bf16(_e4m3_row(f8_ptr, sc_ptr, row, K, c0, CHUNK))
        tl.store(out_ptr + row * K + offs, v.to(tl.bfloat16), mask=offs < K)


@triton.jit
def _saved_row(p, s, r, row, K, c0, CHUNK: tl.constexpr, E4M3: tl.constexpr):
    """Elements c0 .. c0+CHUNK of a saved row in fp32: E4M3 rows (p bytes, r row scales; s unused) or NVFP4 rows."""
    if E4M3:
        return _e4m3_row(p, r, row, K, c0, CHUNK)
    return load_row_fp32(p, s, r, row, K, c0, CHUNK)


@triton.jit
def _rmsnorm_backward_kernel(dy_ptr, stride_dy, yp, ys, yr, rstd_ptr, w_ptr, dx_ptr, K, BLOCK_K: tl.constexpr,
                             E4M3: tl.constexpr):
    """E4M3: the saved rows are E4M3 (yp bytes, yr row scales; ys unused), else NVFP4 rows."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    y = _saved_row(yp, ys, yr, row, K, 0, BLOCK_K, E4M3)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
    n = tl.where(w == 0, 0.0, y / tl.where(w == 0, 1.0, w))
    gw = dy * w
    dot = tl.sum(gw * n, axis=0) / K
    dx = tl.load(rstd_ptr + row) * (gw - n * dot)
    tl.store(dx_ptr + row * K + offs, rne_bf16(dx).to(tl.bfloat16), mask=mask)


@triton.jit
def _silu_mul_h_kernel(gp, gs, gr, up, us, ur, h_ptr, K, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                       ACT: tl.constexpr, E4M3: tl.constexpr):
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        g = _saved_row(gp, gs, gr, row, K, c0, CHUNK, E4M3)
        u = _saved_row(up, us, ur, row, K, c0, CHUNK, E4M3)
        h = _glu(g, ACT) * u
        tl.store(h_ptr + row * K + offs, rne_bf16(h).to(tl.bfloat16), mask=offs < K)


@triton.jit
def _silu_mul_backward_kernel(dh_ptr, stride_dh, gp, gs, gr, up, us, ur, dgu_ptr, K, BLOCK_K: tl.constexpr,
                              CHUNK: tl.constexpr, ACT: tl.constexpr, E4M3: tl.constexpr):
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = offs < K
        g = _saved_row(gp, gs, gr, row, K, c0, CHUNK, E4M3)
        u = _saved_row(up, us, ur, row, K, c0, CHUNK, E4M3)
        dh = tl.load(dh_ptr + row * stride_dh + offs, mask=mask, other=0.0).to(tl.float32)
        dg = dh * u * _glu_grad(g, ACT)
        du = dh * _glu(g, ACT)
        tl.store(dgu_ptr + row * 2 * K + offs, rne_bf16(dg).to(tl.bfloat16), mask=mask)
        tl.store(dgu_ptr + row * 2 * K + K + offs, rne_bf16(du).to(tl.bfloat16), mask=mask)


# ---------------------------------------------------------------------------- launchers

ACTS = {"silu": 0, "gelu_tanh": 1}  # the gate activation of the silu_mul_* ops (the kernels' ACT)


def _with_fp8(q: NVFP4Rows, fp8: bool) -> tuple[NVFP4Rows, torch.Tensor, int]:
    """(rows, E4M3 buffer, EMIT_FP8) for a quantizing kernel: with ``fp8``, ``q`` as NVFP4RowsFP8
    with a buffer for the kernel to fill (padding rows zeroed) and how to write it; else ``q``,
    a dummy pointer and 0."""
    if not fp8:
        return q, q.row_scale, 0
    rows, k = q.shape
    dev = q.packed.device
    padded = -(-rows // 16) * 16
    f8 = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=dev)
    f8[rows:].view(torch.uint8).zero_()
    scale = torch.ones(padded, dtype=torch.float32, device=dev)
    return NVFP4RowsFP8(q.packed, q.scales, q.row_scale, f8, scale), f8.view(torch.uint8), e4m3_mode(dev)


def _fp8_scale_from(q: NVFP4Rows) -> None:
    if isinstance(q, NVFP4RowsFP8):  # decode scale of the E4M3 copy: (FP8_ROW_AMAX / 448) * g
        q.fp8_scale[: q.shape[0]] = q.row_scale * (FP8_ROW_AMAX / fmt.E4M3_MAX)


def quant_rows(x: torch.Tensor, fp8: bool = False) -> NVFP4Rows:
    """x [T, K] -> NVFP4 rows (per-row fp32 scale); ``fp8``: with their E4M3 copy attached."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    out, f8, emit = _with_fp8(empty_rows(T, K, x.device), fp8)
    bk = block_width(K)
    if T:
        _quant_rows_kernel[(T,)](x, x.stride(0), *row_args(out), f8, K, **row_config(bk), EMIT_FP8=emit)
    _fp8_scale_from(out)
    return out


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  fp8: bool = False) -> tuple[NVFP4Rows, torch.Tensor]:
    """x [T, H] bf16 -> (NVFP4 rows of x * rstd * w, rstd fp32 [T]); ``fp8``: E4M3 copy attached."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    out, f8, emit = _with_fp8(empty_rows(T, K, x.device), fp8)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    bk = block_width(K)
    if T:
        _rmsnorm_quant_kernel[(T,)](x, x.stride(0), weight, eps, *row_args(out), rstd, f8, K, BLOCK_K=bk,
                                    EMIT_FP8=emit, num_warps=warps_for(bk))
    _fp8_scale_from(out)
    return out, rstd


def silu_mul_quant(gate_up: torch.Tensor, fp8: bool = False, act: str = "silu"
                   ) -> tuple[NVFP4Rows, NVFP4Rows, NVFP4Rows]:
    """gate_up [T, 2I] bf16 (gate | up) -> NVFP4 rows of (silu(gate) * up, gate, up); ``fp8``:
    the first (the down projection's input) with its E4M3 copy attached."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    T, K2 = gate_up.shape
    K = K2 // 2
    h, g, u = (empty_rows(T, K, gate_up.device) for _ in range(3))
    h, h8, emit = _with_fp8(h, fp8)
    bk = block_width(K)
    if T:
        _silu_mul_quant_kernel[(T,)](gate_up, gate_up.stride(0), *row_args(h), *row_args(g), *row_args(u), h8, K,
                                     **row_config(bk), EMIT_FP8=emit, ACT=ACTS[act])
    _fp8_scale_from(h)
    return h, g, u


def _dense_fp8(y: torch.Tensor, fp8: bool) -> tuple[DenseRows, torch.Tensor, torch.Tensor, int]:
    """(rows, E4M3 buffer, scale buffer, FP8 mode) for unquantized rows y: with ``fp8`` a DenseRows
    carrying the E4M3 copy (rows padded to 16 with zeros, scale 1) for the kernel to fill."""
    if not fp8:
        return DenseRows(y), y, y, 0
    rows, k = y.shape
    padded = -(-rows // 16) * 16
    f8 = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=y.device)
    f8[rows:].view(torch.uint8).zero_()
    scale = torch.ones(padded, dtype=torch.float32, device=y.device)
    return DenseRows(y, f8, scale), f8.view(torch.uint8), scale, e4m3_mode(y.device)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, nvfp4: bool = True, fp8: bool = False
                 ) -> tuple[DenseRows, NVFP4Rows | None, torch.Tensor]:
    """x [T, H] -> (bf16 rows of x * rstd * w, their NVFP4 rows or None, rstd fp32 [T]); ``fp8``:
    the bf16 rows carry their E4M3 copy (per-row amax / 448)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    y, f8, f8s, mode = _dense_fp8(torch.empty(T, K, dtype=torch.bfloat16, device=x.device), fp8)
    q = empty_rows(T, K, x.device) if nvfp4 else None
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    bk = block_width(K)
    if T:
        _rmsnorm_rows_kernel[(T,)](x, x.stride(0), weight, eps, y.data, *(row_args(q) if nvfp4 else (x, x, rstd)), rstd,
                                   f8, f8s, K, BLOCK_K=bk, NVFP4=nvfp4, FP8=mode, num_warps=warps_for(bk))
    return y, q, rstd


def silu_mul_rows(gate_up: torch.Tensor, nvfp4: bool = True, fp8: bool = False, act: str = "silu",
                  e4m3: bool = False) -> tuple[DenseRows, NVFP4Rows | E4M3Rows | DenseRows,
                                               NVFP4Rows | E4M3Rows | DenseRows]:
    """gate_up [T, 2I] -> (bf16 rows of silu(gate) * up, gate, up); gate and up as NVFP4 rows
    (``nvfp4``), E4M3 rows (``e4m3``: a recipe's down.saved=fp8, e4m3_rows' bytes of each half) or
    the bf16 input's halves; ``fp8``: h carries its E4M3 copy."""
    if nvfp4 and e4m3:
        raise ValueError("silu_mul_rows: gate and up are saved as NVFP4 or as E4M3 rows, not both")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    T, K2 = gate_up.shape
    K = K2 // 2
    dev = gate_up.device
    h, f8, f8s, mode = _dense_fp8(torch.empty(T, K, dtype=torch.bfloat16, device=dev), fp8)
    g, u = (empty_rows(T, K, dev) for _ in range(2)) if nvfp4 else (None, None)
    if e4m3:
        g, u = (E4M3Rows(torch.empty(T, K, dtype=torch.float8_e4m3fn, device=dev),
                         torch.empty(T, dtype=torch.float32, device=dev)) for _ in range(2))
    bk = block_width(K)
    if T:
        dummy = (gate_up, gate_up, f8s)
        saved = (*row_args(g), *row_args(u)) if nvfp4 else (*_e4m3_args(g), *_e4m3_args(u)) if e4m3 else dummy * 2
        _silu_mul_rows_kernel[(T,)](gate_up, gate_up.stride(0), h.data, *saved, f8, f8s, K, **row_config(bk),
                                    NVFP4=nvfp4, FP8=mode, ACT=ACTS[act], E4M3=e4m3_mode(dev) if e4m3 else 0)
    if not (nvfp4 or e4m3):
        g, u = DenseRows(gate_up[:, :K].contiguous()), DenseRows(gate_up[:, K:].contiguous())
    return h, g, u


def _e4m3_args(q: E4M3Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E4M3 rows as a row kernel's (values, scales, row scales) arguments: the middle one unused."""
    return q.data.view(torch.uint8), q.scale, q.scale


def dequant_rows(q: NVFP4Rows | E4M3Rows, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NVFP4 rows -> (q * s_b) * g_r in ``dtype`` (bf16: rounded to nearest even); E4M3 rows ->
    value * row scale, likewise."""
    T, K = q.shape
    if isinstance(q, E4M3Rows):
        if dtype != torch.bfloat16:
            return q.value(dtype)  # fp32 products: what the kernel computes before rounding
        out = torch.empty(T, K, dtype=dtype, device=q.data.device)
        if T:
            _dequant_e4m3_kernel[(T,)](q.data.view(torch.uint8), q.scale, out, K, **row_config(block_width(K)))
        return out
    if dtype == torch.bfloat16:
        out = torch.empty(T, K, dtype=dtype, device=q.packed.device)
        decode_pairs(q.packed, q.scales, q.row_scale, out, PAIRS_ROWS)
        return out
    out = torch.empty(T, K, dtype=torch.float32, device=q.packed.device)
    if T:
        _dequant_rows_kernel[(T,)](*row_args(q), out, K, **row_config(block_width(K)))
    return out.to(dtype)


def _saved_args(q: NVFP4Rows | E4M3Rows) -> tuple[tuple[torch.Tensor, ...], bool]:
    """Saved rows as a backward kernel's three row arguments, and whether they are E4M3."""
    return (_e4m3_args(q), True) if isinstance(q, E4M3Rows) else (row_args(q), False)


def rmsnorm_backward(dy: torch.Tensor, yq: NVFP4Rows | E4M3Rows, rstd: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """dx [T, H] bf16 from dY and the saved NVFP4 or E4M3 RMSNorm output (see the twin's formula)."""
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    T, K = yq.shape
    dx = torch.empty(T, K, dtype=torch.bfloat16, device=dy.device)
    bk = block_width(K)
    if T:
        args, e4m3 = _saved_args(yq)
        _rmsnorm_backward_kernel[(T,)](dy, dy.stride(0), *args, rstd, weight, dx, K, BLOCK_K=bk, E4M3=e4m3,
                                       num_warps=warps_for(bk))
    return dx


def silu_mul_h(gq: NVFP4Rows | E4M3Rows, uq: NVFP4Rows | E4M3Rows, act: str = "silu") -> torch.Tensor:
    """h = silu(g) * u from the saved gate and up (NVFP4 or E4M3 rows, both alike), bf16 [T, I]."""
    T, K = gq.shape
    (ga, e4m3), (ua, _) = _saved_args(gq), _saved_args(uq)
    h = torch.empty(T, K, dtype=torch.bfloat16, device=ga[0].device)
    bk = block_width(K)
    if T:
        _silu_mul_h_kernel[(T,)](*ga, *ua, h, K, **row_config(bk), ACT=ACTS[act], E4M3=e4m3)
    return h


def silu_mul_backward(dh: torch.Tensor, gq: NVFP4Rows | E4M3Rows, uq: NVFP4Rows | E4M3Rows,
                      act: str = "silu") -> torch.Tensor:
    """d(gate | up) [T, 2I] bf16 from dh and the saved gate and up (NVFP4 or E4M3 rows, both alike)."""
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    T, K = gq.shape
    (ga, e4m3), (ua, _) = _saved_args(gq), _saved_args(uq)
    dgu = torch.empty(T, 2 * K, dtype=torch.bfloat16, device=dh.device)
    bk = block_width(K)
    if T:
        _silu_mul_backward_kernel[(T,)](dh, dh.stride(0), *ga, *ua, dgu, K, **row_config(bk), ACT=ACTS[act],
                                        E4M3=e4m3)
    return dgu
