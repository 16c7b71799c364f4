"""The converter's CPU kernel: NVFP4 weight quantization (both rules, 1x16 blocks) fused into one
pass per block, in C, built once with the system compiler and called through ctypes.

The pure-torch twin is ``formats.nvfp4.quantize`` (scaling ``1d``), which also runs on CUDA. The C
code repeats the twin's fp32 operations one for one, so the codes and scales are bit-identical:

    s      = e4m3(clamp((amax / 6) / g, 2**-6, 448))            # block_scales
    recip  = (1 / g) / s_c                                       # per candidate scale s_c
    q      = rne(min(|x| * recip, 6) on the E2M1 grid)           # _e2m1_magnitude
    e      = ((q * s_c) * g - |x|)**2, summed in _sum16's order  # _block_sq_error
    s*     = the first candidate with the least e                # argmin
    code   = midpoints(|clamp(x * ((1 / g) / s*), -6, 6)|) | sign   # encode_with_scales

Built without contraction into FMAs (-ffp-contract=off) and without fast-math, each C operation
rounds as the torch op does. Why C and not torch: the eager search makes ~14 passes over memory per
candidate and block, ten candidates, two layouts; here a block stays in registers (~15x faster on 2
cores). The transposed layout W^T is read from W with strides, never copied.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from pact.formats import default_cache
from pact.formats import nvfp4 as F

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Sixteen blocks at once, one per SIMD lane: every loop below runs over the 16 lanes (L), so the
   compiler turns each line into one vector instruction and a block's 16 values never need a
   horizontal sum. x[i][l] is value i of block l. */
#define L 16

static inline float bits_f(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* _e2m1_magnitude: the nearest E2M1 magnitude of t >= 0 (beyond 6 saturates), ties to even. The grid
   step is 0.5 below 2, 1 below 4, 2 above: adding C = step * 2^23 rounds t to a multiple of the step
   (RNE, as round(t / step) * step does), subtracting it is exact. C = max(2^22, 2^22 * 2^exponent(t)). */
static inline float e2m1_mag(float t) {
    t = t > 6.0f ? 6.0f : t;
    float c = bits_f((f_bits(t) & 0x7F800000u) + (22u << 23));
    c = c > 4194304.0f ? c : 4194304.0f;
    return (t + c) - c;
}

/* x [16][L] -> packed bytes p[8][L] (byte j of block l), scale codes sc[L]; err2 / norm2 [L]
   (NULL: not wanted) accumulate sum (x - x_hat)^2 and sum x^2 in double. */
static void blocks(const float x[16][L], float g, float inv_g, int mse, int lo, int hi, int below, int above,
                   uint8_t p[8][L], uint8_t sc[L], double *err2, double *norm2) {
    float a[16][L], amax[L], best_err[L];
    int32_t best[L];
    for (int l = 0; l < L; l++) amax[l] = 0.0f;
    for (int i = 0; i < 16; i++)
        for (int l = 0; l < L; l++) { a[i][l] = fabsf(x[i][l]); amax[l] = a[i][l] > amax[l] ? a[i][l] : amax[l]; }
    for (int l = 0; l < L; l++) {  /* block_scales: e4m3(clamp((amax / 6) / g, 2^-6, 448)), RNE to 3 mantissa bits */
        float s0 = (amax[l] / 6.0f) / g;
        s0 = s0 < 0.015625f ? 0.015625f : (s0 > 448.0f ? 448.0f : s0);
        uint32_t b = f_bits(s0);
        b += 0x7FFFFu + ((b >> 20) & 1u);
        best[l] = (int32_t)((((b >> 23) - 120u) << 3) | ((b >> 20) & 7u));  /* exponent - 127 + 7 */
    }
    if (mse) {
        int32_t first[L];
        for (int l = 0; l < L; l++) first[l] = best[l];
        for (int k = -below; k <= above; k++) {
            float s[L], recip[L], e[16][L], h[8][L], err[L];
            int32_t c[L];
            for (int l = 0; l < L; l++) {
                int32_t v = first[l] + k;
                c[l] = v < lo ? lo : (v > hi ? hi : v);
                /* e4m3 code (a normal: lo >= 8) -> its fp32 value, exactly */
                s[l] = bits_f((uint32_t)(((c[l] >> 3) + 120) << 23) | (uint32_t)((c[l] & 7) << 20));
                recip[l] = inv_g / s[l];
            }
            for (int i = 0; i < 16; i++)
                for (int l = 0; l < L; l++) {
                    float q = e2m1_mag(a[i][l] * recip[l]);
                    float d = (q * s[l]) * g - a[i][l];
                    e[i][l] = d * d;
                }
            /* _sum16's order: pairs e[j] + e[j + 8], then left to right */
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < L; l++) h[j][l] = e[j][l] + e[j + 8][l];
            for (int l = 0; l < L; l++) err[l] = h[0][l];
            for (int j = 1; j < 8; j++)
                for (int l = 0; l < L; l++) err[l] += h[j][l];
            for (int l = 0; l < L; l++)  /* a tie keeps the earlier candidate (argmin's first minimum) */
                if (k == -below || err[l] < best_err[l]) { best_err[l] = err[l]; best[l] = c[l]; }
        }
    }
    float s[L], recip[L];
    for (int l = 0; l < L; l++) {
        s[l] = bits_f((uint32_t)(((best[l] >> 3) + 120) << 23) | (uint32_t)((best[l] & 7) << 20));
        recip[l] = inv_g / s[l];
        sc[l] = (uint8_t)best[l];
    }
    int32_t q[16][L];
    double se[L], sx[L];
    for (int l = 0; l < L; l++) se[l] = sx[l] = 0.0;
    for (int i = 0; i < 16; i++)
        for (int l = 0; l < L; l++) {
            /* encode_with_scales: |clamp(x * recip, -6, 6)| against the midpoints, x's sign bit (recip > 0, so
               x * recip keeps it, and the clamp moves nothing past the last midpoint: skipped) */
            float m = fabsf(x[i][l]) * recip[l];
            int32_t c = (int32_t)(m > 0.25f) + (int32_t)(m >= 0.75f) + (int32_t)(m > 1.25f) + (int32_t)(m >= 1.75f)
                        + (int32_t)(m > 2.5f) + (int32_t)(m >= 3.5f) + (int32_t)(m > 5.0f);
            q[i][l] = c | (int32_t)((f_bits(x[i][l]) >> 31) << 3);
            /* the error of what is stored, decoded as dequantize does ((q * s) * g); the midpoints and the
               step formula round alike, so q's magnitude is the step formula's, and x_hat has x's sign */
            float d = (e2m1_mag(m) * s[l]) * g - fabsf(x[i][l]);
            se[l] += (double)d * d;
            sx[l] += (double)x[i][l] * x[i][l];
        }
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < L; l++) p[j][l] = (uint8_t)(q[2 * j][l] | (q[2 * j + 1][l] << 4));
    if (err2)
        for (int l = 0; l < L; l++) { err2[l] += se[l]; norm2[l] += sx[l]; }
}

/* a 16x16 tile -> x[i][l] = w[(r0 + l * ls + i * is) ...] as fp32: the element at row offset
   (l * lstride + i * istride) from base; bf16 widens exactly by a shift */
static inline void tile(const void *w, int bf16, int64_t base, int64_t istride, int64_t lstride, float x[16][L]) {
    if (bf16) {
        const uint16_t *u = (const uint16_t *)w + base;
        for (int i = 0; i < 16; i++)
            for (int l = 0; l < L; l++) x[i][l] = bits_f((uint32_t)u[l * lstride + i * istride] << 16);
    } else {
        const float *f = (const float *)w + base;
        for (int i = 0; i < 16; i++)
            for (int l = 0; l < L; l++) x[i][l] = f[l * lstride + i * istride];
    }
}

/* W [rows, cols] (row-major, fp32 or bf16; rows and cols multiples of 16) -> forward layout (blocks
   along cols): packed [rows, cols/2], scales [rows, cols/16]; per-row err2 / norm2 (may be NULL).
   Lanes are 16 rows: a 16x16 tile is read transposed into x[i][l]. */
void pact_quantize_fwd(const void *w, int bf16, int64_t rows, int64_t cols, float g, float inv_g, int mse,
                       int lo, int hi, int below, int above,
                       uint8_t *packed, uint8_t *scales, double *err2, double *norm2, int threads) {
    int64_t nb = cols / 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        float x[16][L];
        uint8_t p[8][L], sc[L];
        double se[L], sx[L];
        for (int l = 0; l < L; l++) se[l] = sx[l] = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            tile(w, bf16, r0 * cols + b * 16, 1, cols, x);
            blocks(x, g, inv_g, mse, lo, hi, below, above, p, sc, err2 ? se : 0, sx);
            for (int l = 0; l < L; l++) {
                scales[(r0 + l) * nb + b] = sc[l];
                for (int j = 0; j < 8; j++) packed[(r0 + l) * (cols / 2) + b * 8 + j] = p[j][l];
            }
        }
        if (err2)
            for (int l = 0; l < L; l++) { err2[r0 + l] = se[l]; norm2[r0 + l] = sx[l]; }
    }
}

/* The same W -> backward layout W^T [cols, rows] (blocks along rows), read in place, never copied:
   lanes are 16 consecutive columns, a block's 16 values one 16-row stripe (contiguous loads). */
void pact_quantize_bwd(const void *w, int bf16, int64_t rows, int64_t cols, float g, float inv_g, int mse,
                       int lo, int hi, int below, int above, uint8_t *packed, uint8_t *scales, int threads) {
    int64_t nb = rows / 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < nb; b++) {
        float x[16][L];
        uint8_t p[8][L], sc[L];
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            tile(w, bf16, b * 16 * cols + c0, cols, 1, x);
            blocks(x, g, inv_g, mse, lo, hi, below, above, p, sc, 0, 0);
            for (int l = 0; l < L; l++) {
                scales[(c0 + l) * nb + b] = sc[l];
                for (int j = 0; j < 8; j++) packed[(c0 + l) * (rows / 2) + b * 8 + j] = p[j][l];
            }
        }
    }
}
"""

# -ffp-contract=off: a*b+c must stay two roundings, as in torch; -fno-math-errno lets rintf inline.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_LIB: ctypes.CDLL | None = None
_TRIED = False
_LOCK = threading.Lock()


def _cpu_id() -> str:
    try:  # -march=native: a library built on one CPU may not run on another
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, platform.machine(), _cpu_id()]).encode()).hexdigest()[:16]
    lib = default_cache() / "kernels" / f"nvfp4_cpu-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            src, so = Path(tmp) / "nvfp4_cpu.c", Path(tmp) / "nvfp4_cpu.so"
            src.write_text(_SOURCE)
            subprocess.run([cc, *_FLAGS, str(src), "-o", str(so), "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(so, lib)  # atomic: a concurrent build writes the same bytes
    dll = ctypes.CDLL(str(lib))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.pact_quantize_fwd.argtypes = [p, i32, i64, i64, f32, f32, i32, i32, i32, i32, i32, p, p, p, p, i32]
    dll.pact_quantize_bwd.argtypes = [p, i32, i64, i64, f32, f32, i32, i32, i32, i32, i32, p, p, i32]
    return dll


def library() -> ctypes.CDLL | None:
    """The built kernel, or None where no C compiler works (then the torch twin runs, same bits)."""
    global _LIB, _TRIED
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            if os.environ.get("PACT_CPU_KERNEL", "c") == "torch":
                return None
            try:
                _LIB = _build()
            except (OSError, subprocess.SubprocessError) as e:
                err = getattr(e, "stderr", b"") or b""
                if isinstance(e, (PermissionError, NotADirectoryError, FileExistsError)):  # the cache, not gcc
                    log.warning("could not build the converter's CPU kernel in the cache (%s): converting with the "
                                "torch path (same codes, ~15x slower); point PACT_CACHE at a writable folder", e)
                else:
                    log.warning("no C compiler for the converter's CPU kernel (%s%s): converting with the torch "
                                "path (same codes, ~15x slower); install gcc to speed it up", e,
                                f": {err.decode(errors='replace')[:200]}" if err else "")
    return _LIB


def quantize_weight_cpu(w: torch.Tensor, global_scale: torch.Tensor, scale_rule: str,
                        ) -> tuple[F.NVFP4Tensor, F.NVFP4Tensor, float] | None:
    """``formats.nvfp4.quantize_weight(w, scaling="1d")`` bit for bit, plus the forward layout's
    relative error ||W - W_hat|| / ||W||; None where the kernel is not built (the caller runs the twin)."""
    dll = library()
    if dll is None or w.device.type != "cpu":
        return None
    F._check_2d(w, "quantize_weight", need_rows16=True)
    x = w if w.dtype in (torch.float32, torch.bfloat16) else w.float()
    x = x.contiguous()
    dtype = 1 if x.dtype == torch.bfloat16 else 0
    rows, cols = x.shape
    g = torch.as_tensor(global_scale, dtype=torch.float32)
    inv_g = torch.tensor(1.0, dtype=torch.float32) / g  # as the twin computes it (_const(1) / g)
    lo, hi = F._SCALE_CODE_RANGE
    args = (float(g), float(inv_g), int(scale_rule == "mse"), lo, hi, F._SEARCH_BELOW, F._SEARCH_ABOVE)
    threads = torch.get_num_threads()
    fp, fs = torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(rows, cols // F.BLOCK, dtype=torch.uint8)
    bp, bs = torch.empty(cols, rows // 2, dtype=torch.uint8), torch.empty(cols, rows // F.BLOCK, dtype=torch.uint8)
    err2, norm2 = torch.empty(rows, dtype=torch.float64), torch.empty(rows, dtype=torch.float64)
    dll.pact_quantize_fwd(x.data_ptr(), dtype, rows, cols, *args, fp.data_ptr(), fs.data_ptr(),
                          err2.data_ptr(), norm2.data_ptr(), threads)
    dll.pact_quantize_bwd(x.data_ptr(), dtype, rows, cols, *args, bp.data_ptr(), bs.data_ptr(), threads)
    g = g.reshape(())
    den = float(norm2.sum())
    rel = (float(err2.sum()) / den) ** 0.5 if den > 0 else 0.0
    return (F.NVFP4Tensor(fp, fs.view(torch.float8_e4m3fn), g), F.NVFP4Tensor(bp, bs.view(torch.float8_e4m3fn), g), rel)
