"""Triton kernels: NVFP4 row quantization (fused into RMSNorm and SiLU-mul), decode, GEMM.

Each launcher has a twin of the same name and signature in runtime/reference.py.

Numerics (the reference does the same on purpose):
- Scales use IEEE division (`div_rn`): Triton's plain `/` lowers to an approximate divide
  on NVIDIA GPUs, which would move codes across rounding midpoints.
- E4M3 block scales are rounded on the fp32 bits (RNE onto 3 mantissa bits); they are clamped
  to [2^-6, 448] first, so always e4m3 normals. E4M3 element bytes (the fp8 backend's copies;
  the quantizers' ``EMIT_FP8``, the pair decoder's and fp8.py's ``MODE``: 0 none, 1 emulated,
  2 hardware) are emulated exactly on the bits under the interpreter (whose
  `.to(tl.float8e4nv)` drops the mantissa carry and flushes subnormals) and on sm_89 (Triton
  converts there through fp16 rounded toward zero: a double rounding); on sm_90+ the GPU's own
  `cvt.rn.satfinite.e4m3x2.f32` does it, one instruction per pair. Both give torch's
  float8_e4m3fn bytes with every zero positive.
- Operands are decoded as q * s_b, exact in bf16; per-tensor and per-row fp32 scales
  multiply the fp32 accumulator. `tl.dot` on the decoded bf16 tiles is the `bf16-decode`
  backend: the exact NVFP4 product up to summation order, on any GPU with bf16 MMA.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import triton
import triton.language as tl

from pact.formats import nvfp4 as fmt
from pact.formats.nvfp4 import NVFP4Rows, NVFP4Tensor

from ..rows import FP8_ROW_AMAX, DenseRows, NVFP4RowsFP8

# Globals read inside @triton.jit must be tl.constexpr: the format's constants (formats/nvfp4.py).
E2M1_MAX = tl.constexpr(fmt.E2M1_MAX)
E4M3_MAX = tl.constexpr(fmt.E4M3_MAX)
E4M3_MIN_SCALE = tl.constexpr(fmt.E4M3_MIN_SCALE)  # 2^-6: smallest e4m3 normal (torchao's clamp)
GLOBAL_DIV = tl.constexpr(fmt.E2M1_MAX * fmt.E4M3_MAX)  # g = amax / (6 * 448)
FP8_FROM_NVFP4 = tl.constexpr(fmt.E4M3_MAX / FP8_ROW_AMAX)  # q * s_b -> E4M3 units (runtime/rows.py)
NVFP4_ROW_AMAX = tl.constexpr(FP8_ROW_AMAX)  # amax of every NVFP4 activation row's E4M3 copy
# Triton 3.6's interpreter computes tl.dot wrongly on tiles cast to bf16 in the kernel, so
# under the interpreter the decoded tiles (exact in bf16, hence also in fp32) meet in fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_DTYPE = tl.float32 if _INTERPRET else tl.bfloat16


# ---------------------------------------------------------------------------- helpers


@triton.jit
def _e4m3_round(v):
    """fp32 v in [2^-6, 448] -> (v rounded to e4m3 as fp32, its e4m3 byte as int32)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # RNE to 3 mantissa bits (mask 0xFFF00000)
    byte = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)  # exponent bias 127 -> 7
    return bits.to(tl.float32, bitcast=True), byte


@triton.jit
def _rne_bf16(v):
    """fp32 -> fp32 rounded to bf16 precision (RNE on the bits). Casting that to bf16 is then
    exact everywhere; the interpreter's own fp32 -> bf16 cast truncates instead of rounding."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # mask 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bytes(y, MODE: tl.constexpr):
    """fp32 y, |y| <= 448 -> e4m3fn bytes (int32), round to nearest even, subnormals kept, and
    every zero positive (a sign on zero carries nothing into a product; one rule both sides).
    MODE 2: the GPU's conversion (sm_90+), with -0 (also what tiny negatives round to) made +0.
    MODE 1: normals rounded on the fp32 bits, subnormals by an exact integer rounding."""
    if MODE == 2:
        b = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        out = tl.where(b == 128, 0, b)
    else:
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        mag_bits = bits & 0x7FFFFFFF
        rb = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -1048576  # RNE to 3 mantissa bits
        normal = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
        a = mag_bits.to(tl.float32, bitcast=True)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # multiples of 2^-9 (RNE); 8 = 2^-6
        mag = tl.where(a >= E4M3_MIN_SCALE, normal, sub)
        out = tl.where(mag == 0, 0, mag | (sign << 7))
    return out


@triton.jit
def _e4m3_value(b):
    """e4m3 byte (int32, sign bit clear) -> fp32."""
    e = (b >> 3) & 15
    m = b & 7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(max(e,1) - 10)
    return mant * pow2


@triton.jit
def _e2m1_codes(x):
    """fp32 in [-6, 6] -> E2M1 codes (int32): RNE with ties to the even code, sign bit 3."""
    m = tl.abs(x)
    c = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    c += (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return c | (sign << 3)


@triton.jit
def _e2m1_value(c):
    """E2M1 code (int32) -> fp32, built on the bits: the magnitude's 3 bits (e1 e0 m) placed at
    fp32 bits 24..22 over an exponent of 126 give 2^(e-1) * (1 + m/2) for e > 0; codes 0 and 1
    (0 and 0.5) are the exception. The sign is bit 3."""
    mag = c & 7
    v = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, v)
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _block_offsets(c0, CHUNK: tl.constexpr):
    """Offsets of elements c0 .. c0+CHUNK of a row as [CHUNK/16, 16]: one NVFP4 block per tile
    row, so block reductions and nibble packing stay inside the tile's layout (a 1-D row
    reshaped to blocks costs shuffles through shared memory)."""
    return c0 + tl.arange(0, CHUNK // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]


@triton.jit
def _row_scale(amax):
    """Per-row decode scale g = amax / (6 * 448); an all-zero row gets 1."""
    g = tl.math.div_rn(amax, GLOBAL_DIV)
    return tl.where(g > 0, g, 1.0)


@triton.jit
def _quantize_blocks(y, g):
    """Blocks y [n, 16] fp32 (zeros past K) with row scale g -> codes [n, 16] int32, scale values
    [n] fp32, scale bytes [n] u8."""
    bamax = tl.max(tl.abs(y), axis=1)
    s = tl.math.div_rn(tl.math.div_rn(bamax, E2M1_MAX), g)
    s = tl.minimum(tl.maximum(s, E4M3_MIN_SCALE), E4M3_MAX)
    s_val, s_byte = _e4m3_round(s)
    recip = tl.math.div_rn(tl.math.div_rn(1.0, g) + tl.zeros_like(s_val), s_val)
    scaled = y * recip[:, None]
    scaled = tl.minimum(tl.maximum(scaled, -E2M1_MAX), E2M1_MAX)
    return _e2m1_codes(scaled), s_val, s_byte.to(tl.uint8)


@triton.jit
def _store_blocks(row, c0, y, g, packed_ptr, scales_ptr, K, CHUNK: tl.constexpr, f8_ptr, EMIT_FP8: tl.constexpr):
    """Quantize elements c0 .. c0+CHUNK of a row (given as blocks [CHUNK/16, 16]) and store them;
    with EMIT_FP8 (1 emulated, 2 hardware conversion) also their E4M3 copy e4m3(q * s_b * 448 / 2688)
    (runtime/rows.py)."""
    codes, s_val, s_byte = _quantize_blocks(y, g)
    lo, hi = tl.split(tl.reshape(codes, (CHUNK // 16, 8, 2)))
    offs_b = c0 // 16 + tl.arange(0, CHUNK // 16)
    offs_h = offs_b[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(packed_ptr + row * (K // 2) + offs_h, (lo | (hi << 4)).to(tl.uint8), mask=offs_h < K // 2)
    tl.store(scales_ptr + row * (K // 16) + offs_b, s_byte, mask=offs_b < K // 16)
    if EMIT_FP8:
        v = _e2m1_value(codes) * s_val[:, None]  # q * s_b, exact
        f8 = _e4m3_bytes(tl.minimum(tl.maximum(v * FP8_FROM_NVFP4, -E4M3_MAX), E4M3_MAX), EMIT_FP8)
        offs = _block_offsets(c0, CHUNK)
        tl.store(f8_ptr + row * K + offs, f8.to(tl.uint8), mask=offs < K)


@triton.jit
def _store_row(row, y, packed_ptr, scales_ptr, rs_ptr, K, BLOCK_K: tl.constexpr, f8_ptr, EMIT_FP8: tl.constexpr):
    """Quantize a whole row held as blocks [BLOCK_K/16, 16] (its own amax sets g) and store it."""
    g = _row_scale(tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    _store_blocks(row, 0, y, g, packed_ptr, scales_ptr, K, BLOCK_K, f8_ptr, EMIT_FP8)
    tl.store(rs_ptr + row, g)


@triton.jit
def _decode_row(packed_ptr, scales_ptr, row, K, c0, CHUNK: tl.constexpr):
    """Elements c0 .. c0+CHUNK of an NVFP4 row -> q * s_b fp32 [CHUNK] (exact; zeros past K).
    Each element loads its own byte and scale (neighbours hit the same cache lines), so the
    values keep a plain 1-D layout instead of joining nibble pairs and reshaping."""
    offs = c0 + tl.arange(0, CHUNK)
    mask = offs < K
    byte = tl.load(packed_ptr + row * (K // 2) + offs // 2, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + row * (K // 16) + offs // 16, mask=mask, other=0).to(tl.int32)
    return _e2m1_value((byte >> ((offs & 1) * 4)) & 15) * _e4m3_value(s)


@triton.jit
def _decode_tile(p, s, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """packed [ROWS, BLOCK_K/2] and scale bytes [ROWS, BLOCK_K/16] (int32) -> q * s_b fp32 [ROWS, BLOCK_K]."""
    v = tl.join(_e2m1_value(p & 15), _e2m1_value(p >> 4))  # [ROWS, BLOCK_K/2, 2]: low nibble first
    v = tl.reshape(v, (ROWS, BLOCK_K // 16, 16))
    v = v * _e4m3_value(s)[:, :, None]
    return tl.reshape(v, (ROWS, BLOCK_K))


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
        offs = _block_offsets(c0, CHUNK)
        y = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    g = _row_scale(amax)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = _block_offsets(c0, CHUNK)
        y = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        _store_blocks(row, c0, y, g, packed_ptr, scales_ptr, K, CHUNK, f8_ptr, EMIT_FP8)
    tl.store(rs_ptr + row, g)


@triton.jit
def _rmsnorm_row(x_ptr, stride_x, w_ptr, eps, rstd_ptr, row, K, BLOCK_K: tl.constexpr):
    """A whole row's x * rstd * w in fp32 as blocks [BLOCK_K/16, 16] (zeros past K), and their
    offsets; stores rstd."""
    offs = _block_offsets(0, BLOCK_K)
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
    _store_row(row, y, packed_ptr, scales_ptr, rs_ptr, K, BLOCK_K, f8_ptr, EMIT_FP8)


@triton.jit
def _store_fp8_of(row, c0, y, amax, f8_ptr, f8s_ptr, K, CHUNK: tl.constexpr, MODE: tl.constexpr):
    """E4M3 bytes of elements c0 .. c0+CHUNK of a row (blocks [CHUNK/16, 16], fp32 holding bf16
    values) scaled by 448 / amax, as fp8.py's _fp8_rows_kernel writes a bf16 row; c0 == 0 also
    stores the row's decode scale amax / 448."""
    amax = tl.where(amax > 0, amax, E4M3_MAX)
    inv = tl.math.div_rn(E4M3_MAX + tl.zeros_like(amax), amax)
    f8 = _e4m3_bytes(tl.minimum(tl.maximum(y * inv, -E4M3_MAX), E4M3_MAX), MODE)
    offs = _block_offsets(c0, CHUNK)
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
    y = _rne_bf16(y)
    tl.store(y_ptr + row * K + offs, y.to(tl.bfloat16), mask=offs < K)
    if NVFP4:
        _store_row(row, y, packed_ptr, scales_ptr, rs_ptr, K, BLOCK_K, f8_ptr, 0)
    if FP8:
        _store_fp8_of(row, 0, y, tl.max(tl.max(tl.abs(y), axis=1), axis=0), f8_ptr, f8s_ptr, K, BLOCK_K, FP8)


@triton.jit
def _gate_up_chunk(base, c0, K, CHUNK: tl.constexpr):
    """One chunk of a row of the fused [gate | up] output (gate at base, up at base + K), in fp32."""
    offs = _block_offsets(c0, CHUNK)
    g = tl.load(base + offs, mask=offs < K, other=0.0).to(tl.float32)
    u = tl.load(base + K + offs, mask=offs < K, other=0.0).to(tl.float32)
    return offs, g, u


@triton.jit
def _silu_mul_rows_kernel(gu_ptr, stride_gu, h_ptr, gp, gs, gr, up, us, ur, f8_ptr, f8s_ptr, K, BLOCK_K: tl.constexpr,
                          CHUNK: tl.constexpr, NVFP4: tl.constexpr, FP8: tl.constexpr):
    """h = bf16(silu(gate) * up) stored unquantized, plus (NVFP4) gate and up as NVFP4 rows for
    backward and (FP8) h's E4M3 copy for the fp8 backend's GEMM."""
    row = tl.program_id(0)
    base = gu_ptr + row * stride_gu
    am_h, am_g, am_u = 0.0, 0.0, 0.0
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
        h = _rne_bf16(g / (1.0 + tl.exp(-g)) * u)
        tl.store(h_ptr + row * K + offs, h.to(tl.bfloat16), mask=offs < K)
        am_h = tl.maximum(am_h, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
        am_g = tl.maximum(am_g, tl.max(tl.max(tl.abs(g), axis=1), axis=0))
        am_u = tl.maximum(am_u, tl.max(tl.max(tl.abs(u), axis=1), axis=0))
    if NVFP4 or FP8:
        sg, su = _row_scale(am_g), _row_scale(am_u)
        for c0 in tl.static_range(0, BLOCK_K, CHUNK):
            offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
            if NVFP4:
                _store_blocks(row, c0, g, sg, gp, gs, K, CHUNK, f8_ptr, 0)
                _store_blocks(row, c0, u, su, up, us, K, CHUNK, f8_ptr, 0)
            if FP8:  # h recomputed (the same bits) rather than read back from another thread's store
                _store_fp8_of(row, c0, _rne_bf16(g / (1.0 + tl.exp(-g)) * u), am_h, f8_ptr, f8s_ptr, K, CHUNK, FP8)
        if NVFP4:
            tl.store(gr + row, sg)
            tl.store(ur + row, su)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, stride_gu, hp, hs, hr, gp, gs, gr, up, us, ur, h8_ptr, K, BLOCK_K: tl.constexpr,
                           CHUNK: tl.constexpr, EMIT_FP8: tl.constexpr):
    row = tl.program_id(0)
    base = gu_ptr + row * stride_gu
    am_h, am_g, am_u = 0.0, 0.0, 0.0
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
        h = g / (1.0 + tl.exp(-g)) * u
        am_h = tl.maximum(am_h, tl.max(tl.max(tl.abs(h), axis=1), axis=0))
        am_g = tl.maximum(am_g, tl.max(tl.max(tl.abs(g), axis=1), axis=0))
        am_u = tl.maximum(am_u, tl.max(tl.max(tl.abs(u), axis=1), axis=0))
    sh, sg, su = _row_scale(am_h), _row_scale(am_g), _row_scale(am_u)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs, g, u = _gate_up_chunk(base, c0, K, CHUNK)
        h = g / (1.0 + tl.exp(-g)) * u
        _store_blocks(row, c0, h, sh, hp, hs, K, CHUNK, h8_ptr, EMIT_FP8)
        _store_blocks(row, c0, g, sg, gp, gs, K, CHUNK, h8_ptr, 0)
        _store_blocks(row, c0, u, su, up, us, K, CHUNK, h8_ptr, 0)
    tl.store(hr + row, sh)
    tl.store(gr + row, sg)
    tl.store(ur + row, su)


@triton.jit
def _dequant_rows_kernel(packed_ptr, scales_ptr, rs_ptr, out_ptr, K, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """NVFP4 rows -> fp32 (q * s_b) * g_r; bf16 outputs take _decode_pairs_kernel."""
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        v = _decode_row(packed_ptr, scales_ptr, row, K, c0, CHUNK) * tl.load(rs_ptr + row)
        offs = c0 + tl.arange(0, CHUNK)
        tl.store(out_ptr + row * K + offs, v, mask=offs < K)


# What _decode_pairs_kernel writes per packed byte (its two elements, the low nibble first).
PAIRS_QS, PAIRS_ROWS, PAIRS_E4M3_W, PAIRS_E4M3_ROWS = 0, 1, 2, 3


@triton.jit
def _decode_pairs_kernel(packed_ptr, scales_ptr, sc_ptr, out_ptr, out_scale_ptr, ROWS, KB: tl.constexpr,
                         OUT: tl.constexpr, MODE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr,
                         SB: tl.constexpr):
    """NVFP4 [ROWS, 2*KB] (KB packed bytes per row) decoded in tiles of R rows x CB bytes: one
    output word per byte, so the nibble pair never has to be interleaved in registers (a
    join + reshape costs shuffles through shared memory) and loads and stores stay contiguous.
    OUT: PAIRS_QS   -> bf16 pair (as uint32) of q * s_b (exact: no rounding)
         PAIRS_ROWS -> bf16 pair of q * s_b * g_r rounded to nearest even (g_r = sc_ptr[row])
         PAIRS_E4M3_W / PAIRS_E4M3_ROWS -> E4M3 pair (as uint16) of q * s_b * 448 / amax, and the
         row's fp32 decode scale amax / 448 * (sc_ptr[0] | sc_ptr[row]) written by the first
         column of programs; amax = 6 * max(s_b) of the row (a weight: its scales, SB >= KB/8,
         are read whole) or FP8_ROW_AMAX (activation rows, runtime/rows.py): fp8.py's conventions."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    blk = tl.program_id(1) * (CB // 8) + tl.arange(0, CB // 8)  # NVFP4 blocks (8 bytes each) of this tile
    byte = blk[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    rmask = rows < ROWS
    bmask = rmask[:, None] & (blk[None, :] < KB // 8)
    p = tl.load(packed_ptr + rows[:, None, None] * KB + byte, mask=bmask[:, :, None], other=0).to(tl.int32)
    s = _e4m3_value(tl.load(scales_ptr + rows[:, None] * (KB // 8) + blk[None, :], mask=bmask, other=0).to(tl.int32))
    lo = _e2m1_value(p & 15) * s[:, :, None]
    hi = _e2m1_value(p >> 4) * s[:, :, None]
    if OUT < 2:  # bf16 pairs
        if OUT == 1:  # PAIRS_ROWS
            g = tl.load(sc_ptr + rows, mask=rmask, other=0.0)[:, None, None]
            lo, hi = _rne_bf16(lo * g), _rne_bf16(hi * g)
        lo_b, hi_b = lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)  # bf16 = the high halves
        word = ((lo_b >> 16) & 0xFFFF) | (hi_b & -65536)
        tl.store(out_ptr + rows[:, None, None] * KB + byte, word, mask=bmask[:, :, None])
    else:
        if OUT == 2:  # PAIRS_E4M3_W
            offs_s = tl.arange(0, SB)
            all_s = tl.load(scales_ptr + rows[:, None] * (KB // 8) + offs_s[None, :],
                            mask=rmask[:, None] & (offs_s[None, :] < KB // 8), other=0).to(tl.int32)
            amax = 6.0 * tl.max(_e4m3_value(all_s), axis=1)
            base = tl.load(sc_ptr) + tl.zeros_like(amax)
        else:
            amax = tl.zeros((R,), dtype=tl.float32) + NVFP4_ROW_AMAX
            base = tl.load(sc_ptr + rows, mask=rmask, other=1.0)
        amax = tl.where(amax > 0, amax, E4M3_MAX)
        inv = tl.math.div_rn(E4M3_MAX + tl.zeros_like(amax), amax)[:, None, None]
        lo8 = _e4m3_bytes(tl.minimum(tl.maximum(lo * inv, -E4M3_MAX), E4M3_MAX), MODE)
        hi8 = _e4m3_bytes(tl.minimum(tl.maximum(hi * inv, -E4M3_MAX), E4M3_MAX), MODE)
        tl.store(out_ptr + rows[:, None, None] * KB + byte, (lo8 | (hi8 << 8)).to(tl.int16), mask=bmask[:, :, None])
        if tl.program_id(1) == 0:
            tl.store(out_scale_ptr + rows, tl.math.div_rn(amax, E4M3_MAX) * base, mask=rmask)


@triton.jit
def _load_rows_fp32(packed_ptr, scales_ptr, rs_ptr, row, K, c0, CHUNK: tl.constexpr):
    """Elements c0 .. c0+CHUNK of an NVFP4 row decoded to fp32 (zeros past K): (q * s_b) * g_r."""
    return _decode_row(packed_ptr, scales_ptr, row, K, c0, CHUNK) * tl.load(rs_ptr + row)


@triton.jit
def _rmsnorm_backward_kernel(dy_ptr, stride_dy, yp, ys, yr, rstd_ptr, w_ptr, dx_ptr, K, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    y = _load_rows_fp32(yp, ys, yr, row, K, 0, BLOCK_K)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
    n = tl.where(w == 0, 0.0, y / tl.where(w == 0, 1.0, w))
    gw = dy * w
    dot = tl.sum(gw * n, axis=0) / K
    dx = tl.load(rstd_ptr + row) * (gw - n * dot)
    tl.store(dx_ptr + row * K + offs, _rne_bf16(dx).to(tl.bfloat16), mask=mask)


@triton.jit
def _silu_mul_h_kernel(gp, gs, gr, up, us, ur, h_ptr, K, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        g = _load_rows_fp32(gp, gs, gr, row, K, c0, CHUNK)
        u = _load_rows_fp32(up, us, ur, row, K, c0, CHUNK)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + row * K + offs, _rne_bf16(h).to(tl.bfloat16), mask=offs < K)


@triton.jit
def _silu_mul_backward_kernel(dh_ptr, stride_dh, gp, gs, gr, up, us, ur, dgu_ptr, K, BLOCK_K: tl.constexpr,
                              CHUNK: tl.constexpr):
    row = tl.program_id(0)
    for c0 in tl.static_range(0, BLOCK_K, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = offs < K
        g = _load_rows_fp32(gp, gs, gr, row, K, c0, CHUNK)
        u = _load_rows_fp32(up, us, ur, row, K, c0, CHUNK)
        dh = tl.load(dh_ptr + row * stride_dh + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        du = dh * g * sig
        tl.store(dgu_ptr + row * 2 * K + offs, _rne_bf16(dg).to(tl.bfloat16), mask=mask)
        tl.store(dgu_ptr + row * 2 * K + K + offs, _rne_bf16(du).to(tl.bfloat16), mask=mask)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M row-tiles sharing B tiles while in L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of an NVFP4 GEMM: row / column offsets, the byte and scale
    offsets within a BLOCK_K step, and the row / column masks."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 16), offs_m < M, offs_n < N


@triton.jit
def _nvfp4_gemm_kernel(a_ptr, a_scales_ptr, a_rs_ptr, stride_am, b_ptr, b_scales_ptr, b_gs_ptr, c_ptr, stride_cm,
                       M, N, K: tl.constexpr, A_NVFP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """C [M,N] = A [M,K] @ B [N,K]^T; B NVFP4 (blocked along K), A NVFP4 rows or bf16.

    K is a compile-time constant: a model has a handful of K values, the loop bound and
    the byte offsets fold, and (Triton 3.6) the interpreter cannot loop to a runtime scalar
    under NumPy >= 2.4.
    """
    offs_m, offs_n, offs_h, offs_s, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kh, ks = k0 // 2 + offs_h, k0 // 16 + offs_s
        bp = tl.load(b_ptr + offs_n[:, None] * (K // 2) + kh[None, :],
                     mask=mask_n[:, None] & (kh[None, :] < K // 2), other=0).to(tl.int32)
        bs = tl.load(b_scales_ptr + offs_n[:, None] * (K // 16) + ks[None, :],
                     mask=mask_n[:, None] & (ks[None, :] < K // 16), other=0).to(tl.int32)
        b = _decode_tile(bp, bs, BLOCK_N, BLOCK_K).to(DOT_DTYPE)
        if A_NVFP4:
            ap = tl.load(a_ptr + offs_m[:, None] * (K // 2) + kh[None, :],
                         mask=mask_m[:, None] & (kh[None, :] < K // 2), other=0).to(tl.int32)
            as_ = tl.load(a_scales_ptr + offs_m[:, None] * (K // 16) + ks[None, :],
                          mask=mask_m[:, None] & (ks[None, :] < K // 16), other=0).to(tl.int32)
            a = _decode_tile(ap, as_, BLOCK_M, BLOCK_K).to(DOT_DTYPE)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                        mask=mask_m[:, None] & (kk[None, :] < K), other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, tl.trans(b), acc)
    if A_NVFP4:
        acc = acc * tl.load(a_rs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    acc = _rne_bf16(acc * tl.load(b_gs_ptr))
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(tl.bfloat16),
             mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------------------- launchers


def _empty_rows(rows: int, k: int, device) -> NVFP4Rows:
    return NVFP4Rows(
        torch.empty(rows, k // 2, dtype=torch.uint8, device=device),
        torch.empty(rows, k // 16, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


def _row_args(q: NVFP4Rows):
    return q.packed, q.scales.view(torch.uint8), q.row_scale


def _block_k(k: int) -> int:
    if k % 16:
        raise ValueError(f"NVFP4 rows need a width divisible by 16, got {k}")
    return max(32, triton.next_power_of_2(k))


def _warps(block_k: int) -> int:
    return min(16, max(1, block_k // 256))


# Elements a row kernel holds at once (wider rows are walked in pieces) and warps per program
# (None: one warp per 256 elements, at most 8). Measured on the H200 (benchmarks/bench_rows.py,
# BENCHMARKS.md): 4096 x 8 warps beat 2048 x 8 by 12% over the row kernels, 21% on SiLU-mul.
ROW_CHUNK = int(os.environ.get("PACT_ROW_CHUNK", 4096))
ROW_WARPS = int(os.environ["PACT_ROW_WARPS"]) if os.environ.get("PACT_ROW_WARPS") else None


def _chunk(block_k: int) -> dict:
    c = min(block_k, ROW_CHUNK)
    return dict(BLOCK_K=block_k, CHUNK=c, num_warps=ROW_WARPS or min(8, _warps(c)))


@functools.lru_cache(maxsize=None)
def _e4m3_mode(device: torch.device) -> int:
    """How kernels on ``device`` write E4M3 element bytes: 2 = the GPU's own correctly rounded
    conversion (sm_90+), 1 = the exact emulation (the interpreter; sm_89, where Triton's
    conversion rounds twice). See the module docstring."""
    if _INTERPRET or device.type != "cuda":
        return 1
    return 2 if torch.cuda.get_device_capability(device) >= (9, 0) else 1


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
    return NVFP4RowsFP8(q.packed, q.scales, q.row_scale, f8, scale), f8.view(torch.uint8), _e4m3_mode(dev)


def _fp8_scale_from(q: NVFP4Rows) -> None:
    if isinstance(q, NVFP4RowsFP8):  # decode scale of the E4M3 copy: (FP8_ROW_AMAX / 448) * g
        q.fp8_scale[: q.shape[0]] = q.row_scale * (FP8_ROW_AMAX / fmt.E4M3_MAX)


def quant_rows(x: torch.Tensor, fp8: bool = False) -> NVFP4Rows:
    """x [T, K] -> NVFP4 rows (per-row fp32 scale); ``fp8``: with their E4M3 copy attached."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    out, f8, emit = _with_fp8(_empty_rows(T, K, x.device), fp8)
    bk = _block_k(K)
    if T:
        _quant_rows_kernel[(T,)](x, x.stride(0), *_row_args(out), f8, K, **_chunk(bk), EMIT_FP8=emit)
    _fp8_scale_from(out)
    return out


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8: bool = False) -> tuple[NVFP4Rows, torch.Tensor]:
    """x [T, H] bf16 -> (NVFP4 rows of x * rstd * w, rstd fp32 [T]); ``fp8``: E4M3 copy attached."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    out, f8, emit = _with_fp8(_empty_rows(T, K, x.device), fp8)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    bk = _block_k(K)
    if T:
        _rmsnorm_quant_kernel[(T,)](x, x.stride(0), weight, eps, *_row_args(out), rstd, f8, K, BLOCK_K=bk,
                                    EMIT_FP8=emit, num_warps=_warps(bk))
    _fp8_scale_from(out)
    return out, rstd


def silu_mul_quant(gate_up: torch.Tensor, fp8: bool = False) -> tuple[NVFP4Rows, NVFP4Rows, NVFP4Rows]:
    """gate_up [T, 2I] bf16 (gate | up) -> NVFP4 rows of (silu(gate) * up, gate, up); ``fp8``:
    the first (the down projection's input) with its E4M3 copy attached."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    T, K2 = gate_up.shape
    K = K2 // 2
    h, g, u = (_empty_rows(T, K, gate_up.device) for _ in range(3))
    h, h8, emit = _with_fp8(h, fp8)
    bk = _block_k(K)
    if T:
        _silu_mul_quant_kernel[(T,)](gate_up, gate_up.stride(0), *_row_args(h), *_row_args(g), *_row_args(u), h8, K,
                                     **_chunk(bk), EMIT_FP8=emit)
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
    return DenseRows(y, f8, scale), f8.view(torch.uint8), scale, _e4m3_mode(y.device)


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, nvfp4: bool = True, fp8: bool = False
                 ) -> tuple[DenseRows, NVFP4Rows | None, torch.Tensor]:
    """x [T, H] -> (bf16 rows of x * rstd * w, their NVFP4 rows or None, rstd fp32 [T]); ``fp8``:
    the bf16 rows carry their E4M3 copy (per-row amax / 448)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    y, f8, f8s, mode = _dense_fp8(torch.empty(T, K, dtype=torch.bfloat16, device=x.device), fp8)
    q = _empty_rows(T, K, x.device) if nvfp4 else None
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    bk = _block_k(K)
    if T:
        _rmsnorm_rows_kernel[(T,)](x, x.stride(0), weight, eps, y.data, *(_row_args(q) if nvfp4 else (x, x, rstd)), rstd,
                                   f8, f8s, K, BLOCK_K=bk, NVFP4=nvfp4, FP8=mode, num_warps=_warps(bk))
    return y, q, rstd


def silu_mul_rows(gate_up: torch.Tensor, nvfp4: bool = True, fp8: bool = False
                  ) -> tuple[DenseRows, NVFP4Rows | DenseRows, NVFP4Rows | DenseRows]:
    """gate_up [T, 2I] -> (bf16 rows of silu(gate) * up, gate, up); gate and up as NVFP4 rows
    (``nvfp4``) or the bf16 input's halves; ``fp8``: h carries its E4M3 copy."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    T, K2 = gate_up.shape
    K = K2 // 2
    h, f8, f8s, mode = _dense_fp8(torch.empty(T, K, dtype=torch.bfloat16, device=gate_up.device), fp8)
    g, u = (_empty_rows(T, K, gate_up.device) for _ in range(2)) if nvfp4 else (None, None)
    bk = _block_k(K)
    if T:
        dummy = (gate_up, gate_up, f8s)
        _silu_mul_rows_kernel[(T,)](gate_up, gate_up.stride(0), h.data, *(_row_args(g) if nvfp4 else dummy),
                                    *(_row_args(u) if nvfp4 else dummy), f8, f8s, K, **_chunk(bk), NVFP4=nvfp4,
                                    FP8=mode)
    if not nvfp4:
        g, u = DenseRows(gate_up[:, :K].contiguous()), DenseRows(gate_up[:, K:].contiguous())
    return h, g, u


# Tiles of the pair-decoding kernel: rows x packed bytes per program (8192 elements), and warps.
PAIR_ROWS, PAIR_BYTES, PAIR_WARPS = 16, 256, 4


def decode_pairs(packed: torch.Tensor, scales: torch.Tensor, sc: torch.Tensor, out: torch.Tensor, what: int,
                 out_scale: torch.Tensor | None = None) -> None:
    """Launch _decode_pairs_kernel: NVFP4 ``packed`` [rows, KB] / ``scales`` -> ``out`` [rows, 2*KB]
    (bf16, or E4M3 with ``out_scale`` [rows]); ``what`` is one of the PAIRS_* modes."""
    rows, kb = packed.shape
    if not rows or not kb:
        return
    words = out.view(torch.int32 if what < PAIRS_E4M3_W else torch.int16)
    cb = min(PAIR_BYTES, max(8, triton.next_power_of_2(kb)))
    grid = (triton.cdiv(rows, PAIR_ROWS), triton.cdiv(kb, cb))
    _decode_pairs_kernel[grid](packed, scales.view(torch.uint8), sc, words, sc if out_scale is None else out_scale,
                               rows, kb, OUT=what, MODE=_e4m3_mode(packed.device), R=PAIR_ROWS, CB=cb,
                               SB=max(2, triton.next_power_of_2(kb // 8)), num_warps=PAIR_WARPS)


def dequant_rows(q: NVFP4Rows, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NVFP4 rows -> (q * s_b) * g_r in ``dtype`` (bf16: rounded to nearest even)."""
    T, K = q.shape
    if dtype == torch.bfloat16:
        out = torch.empty(T, K, dtype=dtype, device=q.packed.device)
        decode_pairs(q.packed, q.scales, q.row_scale, out, PAIRS_ROWS)
        return out
    out = torch.empty(T, K, dtype=torch.float32, device=q.packed.device)
    if T:
        _dequant_rows_kernel[(T,)](*_row_args(q), out, K, **_chunk(_block_k(K)))
    return out.to(dtype)


def rmsnorm_backward(dy: torch.Tensor, yq: NVFP4Rows, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dx [T, H] bf16 from dY and the saved NVFP4 RMSNorm output (see the twin's formula)."""
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    T, K = yq.shape
    dx = torch.empty(T, K, dtype=torch.bfloat16, device=dy.device)
    bk = _block_k(K)
    if T:
        _rmsnorm_backward_kernel[(T,)](dy, dy.stride(0), *_row_args(yq), rstd, weight, dx, K, BLOCK_K=bk,
                                       num_warps=_warps(bk))
    return dx


def silu_mul_h(gq: NVFP4Rows, uq: NVFP4Rows) -> torch.Tensor:
    """h = silu(g) * u from the saved NVFP4 gate and up, bf16 [T, I]."""
    T, K = gq.shape
    h = torch.empty(T, K, dtype=torch.bfloat16, device=gq.packed.device)
    bk = _block_k(K)
    if T:
        _silu_mul_h_kernel[(T,)](*_row_args(gq), *_row_args(uq), h, K, **_chunk(bk))
    return h


def silu_mul_backward(dh: torch.Tensor, gq: NVFP4Rows, uq: NVFP4Rows) -> torch.Tensor:
    """d(gate | up) [T, 2I] bf16 from dh and the saved NVFP4 gate and up."""
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    T, K = gq.shape
    dgu = torch.empty(T, 2 * K, dtype=torch.bfloat16, device=dh.device)
    bk = _block_k(K)
    if T:
        _silu_mul_backward_kernel[(T,)](dh, dh.stride(0), *_row_args(gq), *_row_args(uq), dgu, K, **_chunk(bk))
    return dgu


def decode_qs(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * s_b as bf16 [rows, cols] (exact: at most 6 significant bits), no global/row scale."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.bfloat16, device=packed.device)
    decode_pairs(packed, scales, scales, out, PAIRS_QS)
    return out


# From this many rows on, decoding W once into a bf16 scratch and calling cuBLAS beats the
# register-decoding kernel on the H200 (measured: the fused kernel reaches ~80-120 TFLOP/s,
# cuBLAS bf16 ~700). The scratch lives for one call: a group's [N, K] bf16.
CUBLAS_MIN_ROWS = 256


def _mm_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a @ b_t.T with bf16 operands, fp32 accumulation and fp32 output (one rounding later)."""
    try:
        return torch.mm(a, b_t.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without out_dtype for this device
        return torch.mm(a, b_t.t()).float()


def _gemm_blocks(M: int, N: int, K: int) -> dict:
    # Fixed tiles (the performance issue tunes these per GPU); BLOCK_K = 64 keeps 4 scale
    # bytes per row per step. Under the interpreter, bigger tiles mean fewer Python steps.
    return dict(BLOCK_M=64 if M <= 64 else 128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)


def nvfp4_gemm(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor, a_hat: torch.Tensor | None = None) -> torch.Tensor:
    """C [M, N] = A [M, K] @ W [N, K]^T, W in NVFP4 blocked along K; A NVFP4 rows or bf16.

    ``a_hat``: A already dequantized to bf16 (the LoRA branch needs it anyway); the cuBLAS
    path then multiplies it instead of decoding A again. Large M on a GPU: W is decoded to
    q * s_b in bf16 (exact) and cuBLAS multiplies with the global scale as its alpha.
    Otherwise the register-decoding kernel.
    """
    if a.shape[0] >= CUBLAS_MIN_ROWS and w.packed.is_cuda:
        return nvfp4_gemm_cublas(a if a_hat is None else a_hat, w)
    return nvfp4_gemm_fused(a, w)


# id(global scale tensor) -> (weak reference, value). Not a WeakKeyDictionary: its lookups
# compare tensors with ==, and bool() of a CUDA comparison synchronizes the device per call.
_HOST_SCALES: dict[int, tuple[weakref.ref, float]] = {}


def _host_scale(t: torch.Tensor) -> float:
    """The global scale as a Python float, read from the device once per weight."""
    key = id(t)
    hit = _HOST_SCALES.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    v = float(t)
    _HOST_SCALES[key] = (weakref.ref(t, lambda _, key=key: _HOST_SCALES.pop(key, None)), v)
    return v


def nvfp4_gemm_cublas(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    _check_k(a, w)
    wq = decode_qs(w.packed, w.scales)
    if isinstance(a, NVFP4Rows):  # exact: fp32 result, row and global scales, one rounding
        acc = _mm_fp32(decode_qs(a.packed, a.scales), wq) * a.row_scale[:, None]
        return (acc * w.global_scale).to(torch.bfloat16)
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty(a.shape[0], wq.shape[0], dtype=torch.bfloat16, device=a.device)
    # D = alpha * A @ Wq^T in cuBLAS's fp32 epilogue, then one rounding to bf16 (beta = 0: `out` unread)
    return torch.addmm(out, a, wq.t(), beta=0, alpha=_host_scale(w.global_scale), out=out)


def _check_k(a, w: NVFP4Tensor) -> None:
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"nvfp4_gemm: A has K={a.shape[1]}, W has K={w.shape[1]}")


def nvfp4_gemm_fused(a: NVFP4Rows | torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """The register-decoding kernel: NVFP4 tiles decoded to bf16 in registers, tl.dot."""
    _check_k(a, w)
    N, K = w.shape
    a_nvfp4 = isinstance(a, NVFP4Rows)
    if a_nvfp4:
        M = a.shape[0]
        a_args = (a.packed, a.scales.view(torch.uint8), a.row_scale, K // 2)
    else:
        a = a if a.stride(-1) == 1 else a.contiguous()
        M = a.shape[0]
        a_args = (a, a, a, a.stride(0))  # scale pointers unused when A is bf16
    c = torch.empty(M, N, dtype=torch.bfloat16, device=w.packed.device)
    if M == 0:
        return c
    cfg = _gemm_blocks(M, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    gs = w.global_scale.reshape(1)  # read in the kernel: no host sync per call
    _nvfp4_gemm_kernel[grid](*a_args, w.packed, w.scales.view(torch.uint8), gs, c, c.stride(0),
                             M, N, K, A_NVFP4=a_nvfp4, **cfg, DOT_DTYPE=_DOT_DTYPE, num_warps=8, num_stages=3)
    return c
