"""Shared codec and tiling of the Triton kernels: E4M3 / E2M1 rounding and decoding on the bits,
NVFP4 block quantization and row decoding (``@triton.jit`` helpers the row, GEMM, fp8, rotary and
cross-entropy kernels call), the pair decoder (NVFP4 -> bf16 or E4M3, one output word per packed
byte) and the host-side launch helpers (buffers, block widths, warps, the E4M3 conversion mode).

Numerics (the torch twins in runtime/ops/reference.py do the same on purpose):
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
  multiply the fp32 accumulator.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pact.formats import nvfp4 as fmt
from pact.formats.nvfp4 import NVFP4Rows

from ..rows import FP8_ROW_AMAX

# Globals read inside @triton.jit must be tl.constexpr: the format's constants (formats/nvfp4.py).
E2M1_MAX = tl.constexpr(fmt.E2M1_MAX)
E4M3_MAX = tl.constexpr(fmt.E4M3_MAX)
E4M3_MIN_SCALE = tl.constexpr(fmt.E4M3_MIN_SCALE)  # 2^-6: smallest e4m3 normal (torchao's clamp)
GLOBAL_DIV = tl.constexpr(fmt.E2M1_MAX * fmt.E4M3_MAX)  # g = amax / (6 * 448)
FP8_FROM_NVFP4 = tl.constexpr(fmt.E4M3_MAX / FP8_ROW_AMAX)  # q * s_b -> E4M3 units (runtime/ops/rows.py)
NVFP4_ROW_AMAX = tl.constexpr(FP8_ROW_AMAX)  # amax of every NVFP4 activation row's E4M3 copy
# Triton 3.6's interpreter computes tl.dot wrongly on tiles cast to bf16 in the kernel, so
# under the interpreter the decoded tiles (exact in bf16, hence also in fp32) meet in fp32.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MMA_DTYPE = tl.float32 if INTERPRET else tl.bfloat16


# ---------------------------------------------------------------------------- helpers


@triton.jit
def e4m3_round(v):
    """fp32 v in [2^-6, 448] -> (v rounded to e4m3 as fp32, its e4m3 byte as int32)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # RNE to 3 mantissa bits (mask 0xFFF00000)
    byte = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)  # exponent bias 127 -> 7
    return bits.to(tl.float32, bitcast=True), byte


@triton.jit
def rne_bf16(v):
    """fp32 -> fp32 rounded to bf16 precision (RNE on the bits). Casting that to bf16 is then
    exact everywhere; the interpreter's own fp32 -> bf16 cast truncates instead of rounding."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # mask 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bytes(y, MODE: tl.constexpr):
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
def e4m3_value(b):
    """e4m3 byte (int32, sign bit clear) -> fp32."""
    e = (b >> 3) & 15
    m = b & 7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(max(e,1) - 10)
    return mant * pow2


@triton.jit
def e2m1_codes(x):
    """fp32 in [-6, 6] -> E2M1 codes (int32): RNE with ties to the even code, sign bit 3."""
    m = tl.abs(x)
    c = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    c += (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return c | (sign << 3)


@triton.jit
def e2m1_value(c):
    """E2M1 code (int32) -> fp32, built on the bits: the magnitude's 3 bits (e1 e0 m) placed at
    fp32 bits 24..22 over an exponent of 126 give 2^(e-1) * (1 + m/2) for e > 0; codes 0 and 1
    (0 and 0.5) are the exception. The sign is bit 3."""
    mag = c & 7
    v = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, v)
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def block_offsets(c0, CHUNK: tl.constexpr):
    """Offsets of elements c0 .. c0+CHUNK of a row as [CHUNK/16, 16]: one NVFP4 block per tile
    row, so block reductions and nibble packing stay inside the tile's layout (a 1-D row
    reshaped to blocks costs shuffles through shared memory)."""
    return c0 + tl.arange(0, CHUNK // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]


@triton.jit
def amax_scale(amax):
    """Per-row decode scale g = amax / (6 * 448); an all-zero row gets 1."""
    g = tl.math.div_rn(amax, GLOBAL_DIV)
    return tl.where(g > 0, g, 1.0)


@triton.jit
def quantize_blocks(y, g):
    """Blocks y [n, 16] fp32 (zeros past K) with row scale g -> codes [n, 16] int32, scale values
    [n] fp32, scale bytes [n] u8."""
    bamax = tl.max(tl.abs(y), axis=1)
    s = tl.math.div_rn(tl.math.div_rn(bamax, E2M1_MAX), g)
    s = tl.minimum(tl.maximum(s, E4M3_MIN_SCALE), E4M3_MAX)
    s_val, s_byte = e4m3_round(s)
    recip = tl.math.div_rn(tl.math.div_rn(1.0, g) + tl.zeros_like(s_val), s_val)
    scaled = y * recip[:, None]
    scaled = tl.minimum(tl.maximum(scaled, -E2M1_MAX), E2M1_MAX)
    return e2m1_codes(scaled), s_val, s_byte.to(tl.uint8)


@triton.jit
def store_blocks(row, c0, y, g, packed_ptr, scales_ptr, K, CHUNK: tl.constexpr, f8_ptr, EMIT_FP8: tl.constexpr):
    """Quantize elements c0 .. c0+CHUNK of a row (given as blocks [CHUNK/16, 16]) and store them;
    with EMIT_FP8 (1 emulated, 2 hardware conversion) also their E4M3 copy e4m3(q * s_b * 448 / 2688)
    (runtime/ops/rows.py)."""
    codes, s_val, s_byte = quantize_blocks(y, g)
    lo, hi = tl.split(tl.reshape(codes, (CHUNK // 16, 8, 2)))
    offs_b = c0 // 16 + tl.arange(0, CHUNK // 16)
    offs_h = offs_b[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(packed_ptr + row * (K // 2) + offs_h, (lo | (hi << 4)).to(tl.uint8), mask=offs_h < K // 2)
    tl.store(scales_ptr + row * (K // 16) + offs_b, s_byte, mask=offs_b < K // 16)
    if EMIT_FP8:
        v = e2m1_value(codes) * s_val[:, None]  # q * s_b, exact
        f8 = e4m3_bytes(tl.minimum(tl.maximum(v * FP8_FROM_NVFP4, -E4M3_MAX), E4M3_MAX), EMIT_FP8)
        offs = block_offsets(c0, CHUNK)
        tl.store(f8_ptr + row * K + offs, f8.to(tl.uint8), mask=offs < K)


@triton.jit
def store_row(row, y, packed_ptr, scales_ptr, rs_ptr, K, BLOCK_K: tl.constexpr, f8_ptr, EMIT_FP8: tl.constexpr):
    """Quantize a whole row held as blocks [BLOCK_K/16, 16] (its own amax sets g) and store it."""
    g = amax_scale(tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    store_blocks(row, 0, y, g, packed_ptr, scales_ptr, K, BLOCK_K, f8_ptr, EMIT_FP8)
    tl.store(rs_ptr + row, g)


@triton.jit
def decode_row(packed_ptr, scales_ptr, row, K, c0, CHUNK: tl.constexpr):
    """Elements c0 .. c0+CHUNK of an NVFP4 row -> q * s_b fp32 [CHUNK] (exact; zeros past K).
    Each element loads its own byte and scale (neighbours hit the same cache lines), so the
    values keep a plain 1-D layout instead of joining nibble pairs and reshaping."""
    offs = c0 + tl.arange(0, CHUNK)
    mask = offs < K
    byte = tl.load(packed_ptr + row * (K // 2) + offs // 2, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + row * (K // 16) + offs // 16, mask=mask, other=0).to(tl.int32)
    return e2m1_value((byte >> ((offs & 1) * 4)) & 15) * e4m3_value(s)


@triton.jit
def decode_tile(p, s, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """packed [ROWS, BLOCK_K/2] and scale bytes [ROWS, BLOCK_K/16] (int32) -> q * s_b fp32 [ROWS, BLOCK_K]."""
    v = tl.join(e2m1_value(p & 15), e2m1_value(p >> 4))  # [ROWS, BLOCK_K/2, 2]: low nibble first
    v = tl.reshape(v, (ROWS, BLOCK_K // 16, 16))
    v = v * e4m3_value(s)[:, :, None]
    return tl.reshape(v, (ROWS, BLOCK_K))


@triton.jit
def load_row_fp32(packed_ptr, scales_ptr, rs_ptr, row, K, c0, CHUNK: tl.constexpr):
    """Elements c0 .. c0+CHUNK of an NVFP4 row decoded to fp32 (zeros past K): (q * s_b) * g_r."""
    return decode_row(packed_ptr, scales_ptr, row, K, c0, CHUNK) * tl.load(rs_ptr + row)


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
         are read whole) or FP8_ROW_AMAX (activation rows, runtime/ops/rows.py): fp8.py's conventions."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    blk = tl.program_id(1) * (CB // 8) + tl.arange(0, CB // 8)  # NVFP4 blocks (8 bytes each) of this tile
    byte = blk[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    rmask = rows < ROWS
    bmask = rmask[:, None] & (blk[None, :] < KB // 8)
    p = tl.load(packed_ptr + rows[:, None, None] * KB + byte, mask=bmask[:, :, None], other=0).to(tl.int32)
    s = e4m3_value(tl.load(scales_ptr + rows[:, None] * (KB // 8) + blk[None, :], mask=bmask, other=0).to(tl.int32))
    lo = e2m1_value(p & 15) * s[:, :, None]
    hi = e2m1_value(p >> 4) * s[:, :, None]
    if OUT < 2:  # bf16 pairs
        if OUT == 1:  # PAIRS_ROWS
            g = tl.load(sc_ptr + rows, mask=rmask, other=0.0)[:, None, None]
            lo, hi = rne_bf16(lo * g), rne_bf16(hi * g)
        lo_b, hi_b = lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)  # bf16 = the high halves
        word = ((lo_b >> 16) & 0xFFFF) | (hi_b & -65536)
        tl.store(out_ptr + rows[:, None, None] * KB + byte, word, mask=bmask[:, :, None])
    else:
        if OUT == 2:  # PAIRS_E4M3_W
            offs_s = tl.arange(0, SB)
            all_s = tl.load(scales_ptr + rows[:, None] * (KB // 8) + offs_s[None, :],
                            mask=rmask[:, None] & (offs_s[None, :] < KB // 8), other=0).to(tl.int32)
            amax = 6.0 * tl.max(e4m3_value(all_s), axis=1)
            base = tl.load(sc_ptr) + tl.zeros_like(amax)
        else:
            amax = tl.zeros((R,), dtype=tl.float32) + NVFP4_ROW_AMAX
            base = tl.load(sc_ptr + rows, mask=rmask, other=1.0)
        amax = tl.where(amax > 0, amax, E4M3_MAX)
        inv = tl.math.div_rn(E4M3_MAX + tl.zeros_like(amax), amax)[:, None, None]
        lo8 = e4m3_bytes(tl.minimum(tl.maximum(lo * inv, -E4M3_MAX), E4M3_MAX), MODE)
        hi8 = e4m3_bytes(tl.minimum(tl.maximum(hi * inv, -E4M3_MAX), E4M3_MAX), MODE)
        tl.store(out_ptr + rows[:, None, None] * KB + byte, (lo8 | (hi8 << 8)).to(tl.int16), mask=bmask[:, :, None])
        if tl.program_id(1) == 0:
            tl.store(out_scale_ptr + rows, tl.math.div_rn(amax, E4M3_MAX) * base, mask=rmask)


# ---------------------------------------------------------------------------- launchers


def empty_rows(rows: int, k: int, device) -> NVFP4Rows:
    return NVFP4Rows(
        torch.empty(rows, k // 2, dtype=torch.uint8, device=device),
        torch.empty(rows, k // 16, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


def row_args(q: NVFP4Rows):
    return q.packed, q.scales.view(torch.uint8), q.row_scale


def block_width(k: int) -> int:
    if k % 16:
        raise ValueError(f"NVFP4 rows need a width divisible by 16, got {k}")
    return max(32, triton.next_power_of_2(k))


def warps_for(block_k: int) -> int:
    return min(16, max(1, block_k // 256))


# Elements a row kernel holds at once (wider rows are walked in pieces) and warps per program
# (None: one warp per 256 elements, at most 8). Measured on the H200 (benchmarks/bench_rows.py,
# BENCHMARKS.md): 4096 x 8 warps beat 2048 x 8 by 12% over the row kernels, 21% on SiLU-mul.
ROW_CHUNK = int(os.environ.get("PACT_ROW_CHUNK", 4096))
ROW_WARPS = int(os.environ["PACT_ROW_WARPS"]) if os.environ.get("PACT_ROW_WARPS") else None


def row_config(block_k: int) -> dict:
    c = min(block_k, ROW_CHUNK)
    return dict(BLOCK_K=block_k, CHUNK=c, num_warps=ROW_WARPS or min(8, warps_for(c)))


@functools.lru_cache(maxsize=None)
def e4m3_mode(device: torch.device) -> int:
    """How kernels on ``device`` write E4M3 element bytes: 2 = the GPU's own correctly rounded
    conversion (sm_90+), 1 = the exact emulation (the interpreter; sm_89, where Triton's
    conversion rounds twice). See the module docstring."""
    if INTERPRET or device.type != "cuda":
        return 1
    return 2 if torch.cuda.get_device_capability(device) >= (9, 0) else 1


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
                               rows, kb, OUT=what, MODE=e4m3_mode(packed.device), R=PAIR_ROWS, CB=cb,
                               SB=max(2, triton.next_power_of_2(kb // 8)), num_warps=PAIR_WARPS)


def decode_qs(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * s_b as bf16 [rows, cols] (exact: at most 6 significant bits), no global/row scale."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.bfloat16, device=packed.device)
    decode_pairs(packed, scales, scales, out, PAIRS_QS)
    return out
