"""NVFP4, defined once: E2M1 elements, E4M3 block scales, one FP32 per-tensor scale.

Numerics match torchao 0.18 ``nvfp4_quantize`` bit for bit (and so NVIDIA's definition):

    g      = amax(W) / (6 * 448)                                  # fp32, decode direction
    s_b    = e4m3(clamp(block_amax / 6 / g, 2**-6, 448))          # one per 16 elements
    q      = rne_e2m1(clamp(x * ((1 / g) / s_b), -6, 6))           # reciprocal multiply
    x_hat  = q * s_b * g

An element code is 4 bits: bit 3 is the sign (taken from the float's sign bit, so -0.1 may
encode as "negative zero", 0b1000), bits 0-2 index the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
Two codes share a byte, the first element in the low nibble: ``byte = q[0::2] | q[1::2] << 4``.

Weights have two scaling modes:
- ``1d``: a scale per 1x16 block along K (the contraction dim). The backward layout is
  W^T quantized along N, so forward and backward see slightly different weights.
- ``2d``: a scale per 16x16 block. Every element of a block shares the scale, so W^T holds
  exactly the same codes: the backward layout is a lossless re-pack of the forward one.
Both store scales as [rows, cols/16] (2d repeats each block's scale over its 16 rows) so
kernels read one layout whatever the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16  # elements per scale along the contraction dim (NVFP4 fixes it at 16)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# torchao clamps block scales to e4m3's smallest *normal* (finfo.tiny), never a subnormal.
E4M3_MIN_SCALE = 2.0**-6
SCALINGS = ("1d", "2d")
# How a block's e4m3 scale is chosen: ``amax`` maps the block's largest magnitude to 6 (NVIDIA's
# and torchao's rule); ``mse`` tries the e4m3 scales from three codes below that one to six above
# it (about the one mapping the amax to 4) and keeps, per block, the one with the least squared
# error (a format-specific scale search, as in MR-GPTQ and Transformer Engine's "4 over 6").
SCALE_RULES = ("amax", "mse")
_SEARCH_BELOW, _SEARCH_ABOVE = 3, 6  # e4m3 codes tried around the amax rule's scale

# Code -> value, codes 0..15 (bit 3 = sign).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Round-to-nearest-even onto the magnitudes: the code is the number of midpoints passed.
# At a midpoint the even code wins, so the comparison is strict (>) where the code below
# the midpoint is even and inclusive (>=) where it is odd. Seven compare-and-adds run
# about 2x faster on the CPU than one torch.bucketize or an exponent/round formulation.
_MIDPOINTS = (  # (midpoint, inclusive)
    (0.25, False),  # 0 | 0.5   tie -> 0   (code 0)
    (0.75, True),  # 0.5 | 1   tie -> 1   (code 2)
    (1.25, False),  # 1 | 1.5   tie -> 1   (code 2)
    (1.75, True),  # 1.5 | 2   tie -> 2   (code 4)
    (2.5, False),  # 2 | 3     tie -> 2   (code 4)
    (3.5, True),  # 3 | 4     tie -> 4   (code 6)
    (5.0, False),  # 4 | 6     tie -> 4   (code 6)
)
# The same rounding as bucket edges for torch.bucketize (which counts the edges strictly below
# |x|): an inclusive midpoint m becomes the float just below it. round_e2m1 uses them.
_EDGES = torch.tensor([m if not inclusive else torch.nextafter(torch.tensor(m), torch.tensor(0.0)).item()
                       for m, inclusive in _MIDPOINTS], dtype=torch.float32)
# byte -> its two values (low nibble first): decoding reads bytes, never unpacked codes
_BYTE_VALUES = torch.stack((E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)), dim=-1)  # [256, 2]
# Rows quantized per step: keeps temporaries near 16 MB, which malloc reuses instead of
# mapping fresh pages for every call (page faults dominated the converter's time).
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class NVFP4Tensor:
    """A 2-D tensor [rows, cols] in NVFP4, blocked along cols.

    packed: uint8 [rows, cols/2]; scales: float8_e4m3fn [rows, cols/16];
    global_scale: float32 scalar tensor (decode direction, ``g`` above).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    # Divide by a *tensor*: on CUDA, torch turns division by a Python scalar into a multiply
    # by its reciprocal, which rounds differently and would make GPU and CPU codes disagree.
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """g = amax / (6 * 448) in fp32; an all-zero tensor gets g = 1 (any g decodes zeros)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    g = amax / _const(E4M3_MAX * E2M1_MAX, amax)
    return torch.where(g > 0, g, torch.ones_like(g))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already scaled into [-6, 6] -> uint8 codes (RNE, sign from the sign bit)."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for m, inclusive in _MIDPOINTS:
        code += (mag >= m) if inclusive else (mag > m)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def encode_e2m1_stochastic(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """fp32 values already scaled into [-6, 6] -> uint8 codes rounded stochastically: a magnitude
    between grid neighbours lo < hi becomes hi with probability (|x| - lo) / (hi - lo), so the
    expected value is x (unbiased). ``u``: uniform [0, 1) draws, one per element."""
    mag = x.abs()
    grid = E2M1_VALUES[:8].to(x.device)
    lo = (torch.bucketize(mag, grid, right=True) - 1).clamp_(0, 6)  # code below (6 rounds from 4 with p = 1)
    p = (mag - grid[lo]) / (grid[lo + 1] - grid[lo])
    code = (lo + (u < p)).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[codes.long()]


_ON_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket edges, the 8 magnitudes) on ``device``, copied there once (not per call: a GPU
    caller would wait on a host-to-device copy every time)."""
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = (_EDGES.to(device), E2M1_VALUES[:8].to(device))
    return _ON_DEVICE[device]


def _e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """fp32 magnitudes (>= 0; beyond 6 saturates) -> the nearest E2M1 magnitude, RNE: the grid step
    is 0.5 below 2, 1 below 4, 2 above, a power of two, so a / step is exact and torch.round's
    ties-to-even are the format's (e.g. 5 / 2 = 2.5 -> 2 -> 4; 1.75 / 0.5 = 3.5 -> 4 -> 2)."""
    a = a.clamp(max=E2M1_MAX)
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5))
    return a.div_(step).round_().mul_(step)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already scaled (beyond +-6 saturates) -> the nearest E2M1 value, sign kept
    (-0.0 where a negative value rounds to zero): exactly ``decode_e2m1(encode_e2m1(x.clamp(-6, 6)))``
    in a few ops instead of about twenty. Small tensors (GPTQ's one column) by bucketize + take: four
    kernel launches; large ones by the step formula, which runs 2.5x faster than bucketize on the CPU."""
    if x.numel() <= 1 << 16:
        edges, mags = _tables(x.device)
        return torch.copysign(mags.take(torch.bucketize(x.abs(), edges)), x)
    return torch.copysign(_e2m1_magnitude(x.abs()), x)


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] fp32 values (a 256-row table's index_select with int32 indices: several
    times faster on the CPU than indexing it with int64 ones)."""
    pairs = _BYTE_VALUES.to(packed.device).index_select(0, packed.reshape(-1).int())
    return pairs.view(*packed.shape, 2).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 codes -> [..., n] bytes, first element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] uint8 codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 block amax -> e4m3 block scales relative to the global scale (torchao's order). The
    global scale is 0-dim, or one per row ([rows, 1], 1d blocks: rows solved together that will be
    stored as different tensors, as calibrate.merge's gains)."""
    s = (block_amax.float() / _const(E2M1_MAX, block_amax)) / global_scale
    return s.clamp(E4M3_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn)


def encode_with_scales(x: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                       u: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, cols] with e4m3 scales [rows, cols/16] -> packed [rows, cols/2]; with ``u``
    (uniform draws [rows, cols]) rounded stochastically (``encode_e2m1_stochastic``)."""
    rows, cols = x.shape
    recip = (_const(1.0, global_scale) / global_scale) / scales.float()  # [rows, cols/16]
    scaled = x.float().reshape(rows, cols // BLOCK, BLOCK) * recip.unsqueeze(-1)
    scaled = scaled.clamp_(-E2M1_MAX, E2M1_MAX).reshape(rows, cols)
    codes = encode_e2m1(scaled) if u is None else encode_e2m1_stochastic(scaled, u)
    return pack_e2m1(codes)


def _block_sq_error(x: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """Squared error of x [rows, cols] quantized with e4m3 ``scales`` (one per block: [..., rows, cols/16]
    for 1d, [..., rows/16, cols/16] for 2d; leading dims are candidates), summed per block."""
    rows, cols = x.shape
    nb = cols // BLOCK
    if scaling == "1d":
        xb, s = x.reshape(rows, nb, BLOCK), scales.float().unsqueeze(-1)  # s [..., rows, nb, 1]
        if global_scale.dim():  # one per row: [rows, 1] -> [rows, 1, 1], beside s's blocks
            global_scale = global_scale.reshape(rows, 1, 1)
    else:  # a 16x16 block's scale broadcast over its rows (no repeated copy)
        xb, s = x.reshape(rows // BLOCK, BLOCK, nb, BLOCK), scales.float()[..., :, None, :, None]
    # on magnitudes: |q s g - x| = |q| s g - |x| exactly, as q takes x's sign (and s, g > 0)
    ab = xb.abs()
    q = _e2m1_magnitude(ab * ((_const(1.0, global_scale) / global_scale) / s))
    err = _sum16(((q * s) * global_scale - ab).square_())  # summed along the row first, then (2d) over rows
    return err if scaling == "1d" else _sum_rows16(err)


def _sum16(e: torch.Tensor) -> torch.Tensor:
    """e [..., 16] summed in a fixed order, so that CPU, CUDA and the converter's C kernel agree bit for bit
    (torch's own sum order differs by device and vector width; argmin over near-equal errors would not):
    eight pairs (e[j] + e[j + 8]), then those left to right. It is the order torch's AVX512 CPU sum takes,
    so the codes match what earlier versions wrote there."""
    h = e[..., :8] + e[..., 8:]
    s = h[..., 0].clone()
    for j in range(1, 8):
        s += h[..., j]
    return s


def _sum_rows16(e: torch.Tensor) -> torch.Tensor:
    """e [..., 16, n] summed over its 16 rows left to right (torch's CPU order when n is a multiple of 16)."""
    s = e[..., 0, :].clone()
    for j in range(1, 16):
        s += e[..., j, :]
    return s


_SCALE_CODE_RANGE = (int(torch.tensor(E4M3_MIN_SCALE).to(torch.float8_e4m3fn).view(torch.uint8)),
                     int(torch.tensor(E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)))


def search_block_scales(x: torch.Tensor, block_amax: torch.Tensor, global_scale: torch.Tensor,
                        scaling: str) -> torch.Tensor:
    """Per block, the e4m3 scale near the amax rule's with the least squared error (``mse``).
    ``global_scale``: 0-dim, or [rows, 1] for 1d (one per row, as ``block_scales``).
    The candidates are scored together, as many at a time as keep temporaries near _CHUNK_ELEMENTS."""
    base = block_scales(block_amax, global_scale).view(torch.uint8).to(torch.int16)
    steps = torch.arange(-_SEARCH_BELOW, _SEARCH_ABOVE + 1, dtype=torch.int16, device=base.device)
    # positive e4m3 codes are ordered as their values
    codes = (base.unsqueeze(0) + steps.view(-1, *[1] * base.dim())).clamp_(*_SCALE_CODE_RANGE).to(torch.uint8)
    per = max(1, _CHUNK_ELEMENTS // max(1, x.numel()))
    err = torch.cat([_block_sq_error(x, codes[c : c + per].view(torch.float8_e4m3fn), global_scale, scaling)
                     for c in range(0, codes.shape[0], per)])
    best = err.argmin(0, keepdim=True)  # the first minimum: a tie keeps the earlier candidate
    return codes.gather(0, best).squeeze(0).view(torch.float8_e4m3fn)


def _check_2d(x: torch.Tensor, what: str, need_rows16: bool) -> None:
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if cols % BLOCK or (need_rows16 and rows % BLOCK):
        dims = "both dimensions" if need_rows16 else "the last dimension"
        raise ValueError(f"{what}: shape {tuple(x.shape)}: NVFP4 needs {dims} divisible by {BLOCK}")


def _row_step(rows: int, cols: int) -> int:
    return max(BLOCK, min(rows, _CHUNK_ELEMENTS // cols) // BLOCK * BLOCK)


def quantize(
    x: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    scaling: str = "1d",
    scale_rule: str = "amax",
) -> NVFP4Tensor:
    """Quantize a 2-D tensor along its last dim (1x16 blocks, or 16x16 with ``scaling="2d"``).

    ``global_scale`` defaults to this tensor's own amax; pass a shared one for fused groups.
    ``scale_rule`` picks the block scales (``SCALE_RULES``).
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    _check_2d(x, "quantize", need_rows16=scaling == "2d")
    if global_scale is None:
        global_scale = global_scale_from_amax(x.abs().amax())
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    rows, cols = x.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, cols // BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    step = _row_step(rows, cols)
    for r in range(0, rows, step):
        xc = x[r : r + step].float()
        n = xc.shape[0]
        if scaling == "1d":
            amax = xc.reshape(n, cols // BLOCK, BLOCK).abs().amax(-1)
        else:
            amax = xc.reshape(n // BLOCK, BLOCK, cols // BLOCK, BLOCK).abs().amax(dim=(1, 3))
        if scale_rule == "mse":
            sc = search_block_scales(xc, amax, global_scale, scaling)
        else:
            sc = block_scales(amax, global_scale)
        if scaling == "2d":
            sc = repeat_rows16(sc)
        scales[r : r + n] = sc
        packed[r : r + n] = encode_with_scales(xc, sc, global_scale)
    return NVFP4Tensor(packed, scales, global_scale)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = (q * s_b) * g in fp32; q * s_b is exact (at most 6 significant bits), so the
    only rounding is the multiply by g. Kernels decode in this order to match bit for bit."""
    rows, cols = t.shape
    out = torch.empty(rows, cols, dtype=dtype, device=t.packed.device)
    g = t.global_scale.float()
    for r in range(0, rows, _row_step(rows, cols)):
        p = t.packed[r : r + _row_step(rows, cols)]
        n = p.shape[0]
        q = decode_packed(p).reshape(n, cols // BLOCK, BLOCK)
        out[r : r + n] = ((q * t.scales[r : r + n].float().unsqueeze(-1)) * g).reshape(n, cols).to(dtype)
    return out


@dataclass(frozen=True)
class NVFP4Rows:
    """Activations [rows, cols] in NVFP4 with one fp32 scale per row instead of per tensor.

    A per-row (per-token) scale needs no reduction across the tensor, so a kernel that
    holds a row in registers (RMSNorm, SiLU-mul) quantizes it in the same pass.
    packed: uint8 [rows, cols/2]; scales: float8_e4m3fn [rows, cols/16]; row_scale: fp32 [rows].
    """

    packed: torch.Tensor
    scales: torch.Tensor
    row_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.row_scale))


def quantize_rows(x: torch.Tensor, stochastic: bool = False) -> NVFP4Rows:
    """Per row: g_r = amax(row) / (6 * 448), then 1x16 blocks exactly as ``quantize``.
    ``stochastic``: elements rounded stochastically (unbiased; draws from torch's generator of
    x's device), scales as usual."""
    _check_2d(x, "quantize_rows", need_rows16=False)
    rows, cols = x.shape
    xf = x.float()
    g = global_scale_from_amax(xf.abs().amax(-1, keepdim=True))  # [rows, 1]
    scales = block_scales(xf.reshape(rows, cols // BLOCK, BLOCK).abs().amax(-1), g)
    u = torch.rand(xf.shape, device=xf.device) if stochastic else None
    return NVFP4Rows(encode_with_scales(xf, scales, g, u), scales, g.squeeze(-1))


def dequantize_rows(t: NVFP4Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q * s_b) * g_r in fp32, then cast."""
    rows, cols = t.shape
    q = decode_packed(t.packed).reshape(rows, cols // BLOCK, BLOCK)
    x = (q * t.scales.float().unsqueeze(-1)) * t.row_scale.float().reshape(rows, 1, 1)
    return x.reshape(rows, cols).to(dtype)


def repeat_rows16(scales: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales [n, m] -> [16 n, m], each row repeated 16 times (a 2d block's scale over its
    rows). Through uint8: float8 index kernels are not built on every device."""
    return scales.view(torch.uint8).repeat_interleave(BLOCK, dim=0).view(scales.dtype)


def transpose_2d(t: NVFP4Tensor) -> NVFP4Tensor:
    """The exact re-pack of a 2d-scaled [N, K] tensor as [K, N] (the backward layout)."""
    n, k = t.shape
    if n % BLOCK:
        raise ValueError(f"transpose_2d: {n} rows is not a multiple of {BLOCK}")
    block = t.scales[::BLOCK]  # [N/16, K/16]: one scale per 16x16 block
    if not torch.equal(block.repeat_interleave(BLOCK, 0).view(torch.uint8), t.scales.view(torch.uint8)):
        raise ValueError("transpose_2d: scales are not constant over 16-row blocks (not 2d-scaled)")
    codes_t = unpack_e2m1(t.packed).t().contiguous()
    scales_t = repeat_rows16(block.t().contiguous())
    return NVFP4Tensor(pack_e2m1(codes_t), scales_t, t.global_scale)


def quantize_weight(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    scaling: str = "2d",
    scale_rule: str = "amax",
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """A frozen weight W [N, K] -> (forward [N, K] blocked along K, backward [K, N] along N)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    _check_2d(w, "quantize_weight", need_rows16=True)
    if global_scale is None:
        global_scale = global_scale_from_amax(w.float().abs().amax())
    fwd = quantize(w, global_scale=global_scale, scaling=scaling, scale_rule=scale_rule)
    if scaling == "2d":
        return fwd, transpose_2d(fwd)
    return fwd, quantize(w.t().contiguous(), global_scale=global_scale, scaling="1d", scale_rule=scale_rule)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 20*log10(|x| / |x - y|) in dB."""
    x, y = x.double(), y.double()
    return float(20 * torch.log10(x.norm() / (x - y).norm()))
