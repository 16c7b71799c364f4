"""NVFP4 numerics: hand-written bits, an independent encoder, torchao, and error floors."""

import pytest
import torch

from pact.formats import nvfp4 as F


def test_value_table():
    # code = sign << 3 | magnitude index; E2M1: exponent bits 2..1, mantissa bit 0
    assert F.E2M1_VALUES[0b0000] == 0.0
    assert F.E2M1_VALUES[0b0001] == 0.5  # subnormal: 0.M * 2^0
    assert F.E2M1_VALUES[0b0010] == 1.0  # 1.0 * 2^0
    assert F.E2M1_VALUES[0b0011] == 1.5
    assert F.E2M1_VALUES[0b0100] == 2.0
    assert F.E2M1_VALUES[0b0101] == 3.0
    assert F.E2M1_VALUES[0b0110] == 4.0
    assert F.E2M1_VALUES[0b0111] == 6.0
    assert F.E2M1_VALUES[0b1111] == -6.0
    assert torch.signbit(F.E2M1_VALUES[0b1000])  # negative zero


# (input already scaled, expected value): every midpoint, plus neighbours
RNE_CASES = [
    (0.0, 0.0), (0.1, 0.0),
    (0.25, 0.0),  # tie -> 0 (code 0, even)
    (0.26, 0.5), (0.5, 0.5),
    (0.75, 1.0),  # tie 0.5|1 -> 1 (code 2, even)
    (0.74, 0.5),
    (1.25, 1.0),  # tie 1|1.5 -> 1 (code 2)
    (1.26, 1.5),
    (1.75, 2.0),  # tie 1.5|2 -> 2 (code 4)
    (1.74, 1.5),
    (2.5, 2.0),  # tie 2|3 -> 2 (code 4)
    (2.51, 3.0),
    (3.5, 4.0),  # tie 3|4 -> 4 (code 6)
    (3.49, 3.0),
    (5.0, 4.0),  # tie 4|6 -> 4 (code 6)
    (5.01, 6.0), (6.0, 6.0),
]


@pytest.mark.parametrize("x,expected", RNE_CASES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rne_ties(x, expected, sign):
    code = F.encode_e2m1(torch.tensor([sign * x]))
    assert F.decode_e2m1(code).item() == sign * expected
    assert bool(code[0] >> 3) == (sign < 0)  # sign bit kept, even for values rounding to 0


def test_pack_low_nibble_first():
    codes = torch.tensor([0b0001, 0b1111, 0b0111, 0b0000], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    # byte 0: first element (0.5 = 0b0001) low, second (-6 = 0b1111) high
    assert packed.tolist() == [0b1111_0001, 0b0000_0111]
    assert torch.equal(F.unpack_e2m1(packed), codes)


def test_hand_written_block():
    # g = 1 and block amax 6: block scale = e4m3(6/6/1) = 1.0, so x is encoded unscaled
    x = torch.tensor([[6.0, -3.0, 0.5, 0.25, 1.25, -0.75, 0.0, 2.5] + [0.0] * 8])
    t = F.quantize(x, global_scale=torch.tensor(1.0))
    assert t.scales.view(torch.uint8).tolist() == [[0x38]]  # 1.0 = 0 0111 000
    # codes: 6->0111, -3->1101, 0.5->0001, 0.25->0000 (tie to even), 1.25->0010 (tie),
    #        -0.75->1010 (tie to 1.0), 0->0000, 2.5->0100 (tie to 2)
    assert t.packed[0, :4].tolist() == [0b1101_0111, 0b0000_0001, 0b1010_0010, 0b0100_0000]


def test_default_global_scale():
    x = torch.tensor([[6.0] + [0.0] * 15])
    t = F.quantize(x)
    assert float(t.global_scale) == float(torch.tensor(6.0) / 2688)  # amax / (6 * 448) in fp32
    assert t.scales.view(torch.uint8).tolist() == [[0x7E]]  # 448 = 0 1111 110
    assert F.dequantize(t)[0, 0].item() == pytest.approx(6.0, rel=1e-6)


def _independent_quantize(x, g):
    """Straightforward reference: per element, nearest grid value by search, ties to the even code."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    rows, cols = x.shape
    out_codes = torch.zeros(rows, cols, dtype=torch.uint8)
    scales = torch.zeros(rows, cols // 16)
    inv_g = (torch.tensor(1.0) / g).item()
    for r in range(rows):
        for b in range(cols // 16):
            blk = x[r, b * 16:(b + 1) * 16]
            s = torch.tensor(float(blk.abs().max()) / 6.0, dtype=torch.float32) / g
            s = s.clamp(2**-6, 448).to(torch.float8_e4m3fn).float()
            scales[r, b] = s
            recip = torch.tensor(inv_g, dtype=torch.float32) / s
            for i in range(16):
                v = (blk[i] * recip).clamp(-6, 6).item()
                m = abs(v)
                best = min(range(8), key=lambda c: (abs(grid[c] - m), c % 2))  # tie: even code
                out_codes[r, b * 16 + i] = best | (8 if torch.signbit(torch.tensor(v)) else 0)
    return out_codes, scales


def test_encode_matches_independent_reference():
    torch.manual_seed(1)
    x = torch.randn(6, 64) * torch.logspace(-3, 1, 6).unsqueeze(1)
    x[2, 5] = 0.0
    g = F.global_scale_from_amax(x.abs().amax())
    t = F.quantize(x, global_scale=g)
    codes, scales = _independent_quantize(x, g)
    assert torch.equal(F.unpack_e2m1(t.packed), codes)
    assert torch.equal(t.scales.float(), scales)


def _independent_mse_scales(x, g):
    """Straightforward reference for ``scale_rule="mse"`` (1d): per block, each of the ten e4m3 codes
    from 3 below to 6 above the amax rule's, one fp32 scalar op at a time: q by nearest-grid search
    (ties to the even code), error ((q s) g - |x|)^2, the 16 errors summed as pairs e[j] + e[j+8] then
    left to right; the first least error wins."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    rows, cols = x.shape
    codes = torch.zeros(rows, cols // 16, dtype=torch.uint8)
    inv_g = f32(1.0) / g
    for r in range(rows):
        for b in range(cols // 16):
            blk = x[r, b * 16:(b + 1) * 16].float()
            base = int(((blk.abs().max() / f32(6.0)) / g).clamp(2**-6, 448).to(torch.float8_e4m3fn).view(torch.uint8))
            best = None
            for c in range(base - 3, base + 7):
                c = min(max(c, 0x08), 0x7E)  # 2**-6 .. 448
                s = torch.tensor(c, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
                recip = inv_g / s
                e = []
                for i in range(16):
                    a = blk[i].abs()
                    m = float((a * recip).clamp(max=6.0))
                    q = grid[min(range(8), key=lambda k: (abs(grid[k] - m), k % 2))]
                    e.append(((f32(q) * s) * g - a).square())
                h = [e[j] + e[j + 8] for j in range(8)]
                total = h[0]
                for j in range(1, 8):
                    total = total + h[j]
                if best is None or total < best[0]:
                    best = (total, c)
            codes[r, b] = best[1]
    return codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mse_matches_independent_reference(dtype):
    torch.manual_seed(2)
    x = (torch.distributions.StudentT(3.0).sample((4, 64)) * torch.logspace(-3, 1, 4).unsqueeze(1)).to(dtype)
    x[0, 0] = 80.0  # some blocks at the smallest scale: candidates clamped, duplicates tie
    g = F.global_scale_from_amax(x.float().abs().amax())
    t = F.quantize(x, global_scale=g, scale_rule="mse")
    scales = _independent_mse_scales(x, g)
    assert torch.equal(t.scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(t.packed, F.encode_with_scales(x, scales, g))


def test_sum16_order():
    """_sum16's order spelled out: pairs h[j] = e[j] + e[j+8], then h left to right. 1 + 2^-24 is a
    tie that rounds back to 1, so each case tells this order from another."""
    t = 2.0**-24
    e = torch.zeros(16)
    e[0], e[1], e[9] = 1.0, t, t  # pairs: h[1] = 2^-23 survives; left to right over e would give 1
    assert float(F._sum16(e)) == 1.0 + 2 * t
    e = torch.zeros(16)
    e[0], e[1], e[2] = 1.0, t, t  # h left to right: (1 + t) + t = 1; a tree adding h[1] + h[2] first would not
    assert float(F._sum16(e)) == 1.0


@pytest.mark.parametrize("rows,cols", [(6, 16), (42, 64), (123, 256), (431, 32)])
def test_matches_torchao(rows, cols):
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    torch.manual_seed(rows)
    x = torch.randn(rows, cols) * 2.0
    x[0, 0] = 40.0  # an outlier so some blocks hit the e4m3 clamp at the small end
    amax = x.abs().amax()
    scales, packed = nvfp4.nvfp4_quantize(x, 16, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(amax))
    t = F.quantize(x)
    assert torch.equal(t.packed, packed)
    assert torch.equal(t.scales.view(torch.uint8), scales.view(torch.uint8))


def test_2d_backward_is_exact_transpose():
    torch.manual_seed(0)
    w = torch.randn(48, 80)
    fwd, bwd = F.quantize_weight(w, scaling="2d")
    assert bwd.shape == (80, 48)
    assert torch.equal(F.dequantize(bwd), F.dequantize(fwd).t())
    # and the scales really are constant over each 16x16 block
    assert torch.equal(fwd.scales.view(torch.uint8)[::16].repeat_interleave(16, 0), fwd.scales.view(torch.uint8))


def test_1d_backward_error_bound():
    """1d quantizes W (blocks along K) and W^T (blocks along N) separately. Each is within
    half a grid step of W: |x - x_hat| <= 1 * s_b * g (the widest gap, 4..6, halved), so the
    two effective weights differ by at most the sum of their own block bounds."""
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    fwd, bwd = F.quantize_weight(w, scaling="1d")
    step_f = (fwd.scales.float() * fwd.global_scale).repeat_interleave(16, 1)  # [N, K]
    step_b = (bwd.scales.float() * bwd.global_scale).repeat_interleave(16, 1).t()  # [N, K]
    df, db = F.dequantize(fwd), F.dequantize(bwd).t()
    assert bool(((w - df).abs() <= step_f * (1 + 1e-6)).all())
    assert bool(((w - db).abs() <= step_b * (1 + 1e-6)).all())
    assert bool(((df - db).abs() <= (step_f + step_b) * (1 + 1e-6)).all())
    assert not torch.equal(df, db)  # really different weights: that is why 2d is the default


@pytest.mark.parametrize("scaling,floor_db", [("1d", 20.0), ("2d", 18.5)])
def test_sqnr_floor_gaussian(scaling, floor_db):
    # NVFP4 on N(0,1) weights measures ~20.5 dB (1d) and ~19.5 dB (2d: larger blocks, larger amax)
    torch.manual_seed(0)
    w = torch.randn(512, 512)
    fwd, _ = F.quantize_weight(w, scaling=scaling)
    assert F.sqnr_db(w, F.dequantize(fwd)) > floor_db


@pytest.mark.parametrize("scaling", F.SCALINGS)
def test_searched_block_scales(scaling):
    """``mse`` keeps the amax rule's scale among its candidates, so no block's error grows; the
    result is plain NVFP4 (2d still transposes exactly) and on heavy-tailed weights it helps."""
    torch.manual_seed(0)
    w = torch.distributions.StudentT(4.0).sample((64, 128))
    g = F.global_scale_from_amax(w.abs().amax())
    amax, mse = (F.quantize(w, global_scale=g, scaling=scaling, scale_rule=r) for r in F.SCALE_RULES)
    per_block = {}
    for name, t in (("amax", amax), ("mse", mse)):
        e = (F.dequantize(t) - w).square().reshape(64, 8, 16).sum(-1)  # [rows, K/16]
        per_block[name] = e if scaling == "1d" else e.reshape(4, 16, 8).sum(1)
    assert bool((per_block["mse"] <= per_block["amax"] * (1 + 1e-6)).all())
    assert float(per_block["mse"].sum()) < 0.97 * float(per_block["amax"].sum())
    assert not torch.equal(mse.scales.view(torch.uint8), amax.scales.view(torch.uint8))
    assert torch.equal(F.quantize(w, global_scale=g, scaling=scaling).packed, amax.packed)  # amax is the default
    if scaling == "2d":
        fwd, bwd = F.quantize_weight(w, global_scale=g, scale_rule="mse")
        assert torch.equal(fwd.packed, mse.packed) and torch.equal(F.dequantize(bwd), F.dequantize(fwd).t())
    with pytest.raises(ValueError, match="scale_rule"):
        F.quantize(w, scale_rule="max")


def test_zero_tensor_and_shared_global_scale():
    z = torch.zeros(16, 32)
    assert torch.equal(F.dequantize(F.quantize(z)), z)
    a, b = torch.randn(16, 32), torch.randn(16, 32) * 10
    g = F.global_scale_from_amax(torch.maximum(a.abs().amax(), b.abs().amax()))
    qa = F.quantize(a, global_scale=g)
    assert float(qa.global_scale) == float(g)
    assert F.sqnr_db(a, F.dequantize(qa)) > 15  # a small member of a fused group still fits the scale range


def test_bad_shapes():
    with pytest.raises(ValueError, match="divisible by 16"):
        F.quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match="both dimensions"):
        F.quantize_weight(torch.randn(20, 32))
    with pytest.raises(ValueError, match="scaling"):
        F.quantize(torch.randn(16, 16), scaling="3d")


def test_stochastic_rounding_is_unbiased_and_on_the_grid():
    """quantize_rows(stochastic=True): the same scales as round-to-nearest, every element one of
    its two grid neighbours, the mean over draws the input (RTN's error is a fixed bias per element)."""
    from pact.formats.nvfp4 import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g) * torch.logspace(-1, 1, 64)
    rtn = quantize_rows(x)
    torch.manual_seed(0)
    draws = torch.stack([dequantize_rows(quantize_rows(x, stochastic=True)) for _ in range(400)])
    one = quantize_rows(x, stochastic=True)
    assert torch.equal(one.scales.view(torch.uint8), rtn.scales.view(torch.uint8))
    assert torch.equal(one.row_scale, rtn.row_scale)
    step = (rtn.scales.float().repeat_interleave(16, -1) * rtn.row_scale[:, None]) * 2  # widest grid gap
    assert ((draws - x).abs() <= step).all()
    rtn_bias = (dequantize_rows(rtn) - x).abs().mean()
    assert (draws.mean(0) - x).abs().mean() < 0.25 * rtn_bias


def test_decode_packed_every_byte_any_shape():
    """decode_packed: each byte's two E2M1 values (low nibble first), for every byte value, on empty,
    1-D, 3-D and non-contiguous inputs."""
    from pact.formats.nvfp4 import E2M1_VALUES, decode_packed

    every = torch.arange(256, dtype=torch.uint8)
    want = torch.stack((E2M1_VALUES[(every & 15).long()], E2M1_VALUES[(every >> 4).long()]), -1).flatten()
    assert torch.equal(decode_packed(every), want.float())
    g = torch.Generator().manual_seed(0)
    for shape in ((0, 4), (2, 3, 5), (7, 0)):
        p = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        assert decode_packed(p).shape == (*shape[:-1], 2 * shape[-1])
    p = torch.randint(0, 256, (6, 8), dtype=torch.uint8, generator=g)[:, ::2]
    assert torch.equal(decode_packed(p), decode_packed(p.contiguous()))
