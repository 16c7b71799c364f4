"""Each Triton kernel against its pure-torch twin (CPU: interpreter; GPU: @pytest.mark.gpu)."""

import os

import pytest
import torch
import torch.nn.functional as F

from pact.formats.nvfp4 import NVFP4Rows, quantize_weight
from pact.runtime.ops import E4M3Rows
from pact.runtime.ops import reference as R
from pact.runtime.ops import triton as K

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rows_equal(a: NVFP4Rows, b: NVFP4Rows):
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.row_scale, b.row_scale)


def _awkward(rows, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 1e3])  # zeros of both signs, tiny, outlier
    if rows > 2:
        x[2] = 0.0  # an all-zero row (global scale falls back to 1)
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("rows,k", [(1, 16), (6, 48), (42, 96), (123, 272)])
def test_quant_rows_exact(rows, k):
    x = _awkward(rows, k)
    _rows_equal(K.quant_rows(x), R.quant_rows(x))
    _rows_equal(K.quant_rows(x.float()), R.quant_rows(x.float()))  # fp32 input too


@pytest.mark.parametrize("rows,k", [(1, 16), (42, 96), (123, 272)])
def test_dequant_rows_exact(rows, k):
    q = R.quant_rows(_awkward(rows, k))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(K.dequant_rows(q, dtype), R.dequant_rows(q, dtype))


@pytest.mark.parametrize("rows,k", [(6, 48), (42, 96), (123, 272)])
def test_rmsnorm_quant(rows, k):
    x = _awkward(rows, k, seed=1)
    w = (torch.rand(k) + 0.5).to(torch.bfloat16)
    (qa, ra), (qb, rb) = K.rmsnorm_quant(x, w, 1e-5), R.rmsnorm_quant(x, w, 1e-5)
    # rstd comes from a sum whose order differs (kernel tree reduction vs torch): a few ulp
    torch.testing.assert_close(ra, rb, rtol=4e-7, atol=0)
    # so a code may flip where x * rstd * w sits on a rounding midpoint: allow 1 in 1000
    assert (qa.packed != qb.packed).float().mean() <= 1e-3
    assert (qa.scales.view(torch.uint8) != qb.scales.view(torch.uint8)).float().mean() <= 1e-3
    # and the same rows quantized from the same fp32 values are bit-exact (the quantizer itself)
    y = x.float() * rb[:, None] * w.float()
    _rows_equal(K.quant_rows(y), R.quant_rows(y))


@pytest.mark.parametrize("rows,k", [(1, 16), (42, 96), (123, 272)])
def test_e4m3_saved_rows_exact(rows, k):
    """Rows kept for backward as E4M3 (saved=fp8): bytes and scales == fp8_rows of the bf16 rows
    (the twin), their bf16 decode, and the RMSNorm backward reading them."""
    from pact.runtime.ops import E4M3Rows

    y = _awkward(rows, k, seed=5)
    a, b = K.e4m3_rows(y), R.e4m3_rows(y)
    assert isinstance(a, E4M3Rows) and a.shape == (rows, k)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert torch.equal(K.dequant_rows(a), R.dequant_rows(b))
    assert torch.equal(K.dequant_rows(a, torch.float32), R.dequant_rows(b, torch.float32))
    err = (R.dequant_rows(b, torch.float32) - y.float()).abs()
    assert (err <= y.float().abs() * 2.0**-4 + b.scale[:, None] * 2.0**-9).all()  # half an E4M3 step, or a subnormal's
    rstd, w, dy = torch.rand(rows) + 0.5, (torch.rand(k) + 0.5).to(torch.bfloat16), torch.randn(rows, k)
    _close_bf16(K.rmsnorm_backward(dy, a, rstd, w), R.rmsnorm_backward(dy, b, rstd, w))


@pytest.mark.parametrize("rows,k", [(6, 16), (42, 96), (123, 176)])
def test_silu_mul_quant(rows, k):
    gu = _awkward(rows, 2 * k, seed=2)
    (ha, ga, ua), (hb, gb, ub) = K.silu_mul_quant(gu), R.silu_mul_quant(gu)
    _rows_equal(ga, gb)  # gate and up are quantized straight from the bf16 input: exact
    _rows_equal(ua, ub)
    # silu uses exp in both, with last-ulp differences (Triton exp vs torch sigmoid)
    assert (ha.packed != hb.packed).float().mean() <= 1e-3
    torch.testing.assert_close(ha.row_scale, hb.row_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows,k,chunk", [(6, 48, 4096), (42, 96, 4096), (21, 272, 32)])
def test_rows_kept_bf16_with_saved_and_fp8_copies(monkeypatch, rows, k, chunk):
    """RMSNorm / SiLU-mul rows kept unquantized (the default recipe's GEMM and LoRA inputs): the
    bf16 rows match the twin (rstd / exp differ in the last fp32 bits: a bf16 ulp, rarely); the
    NVFP4 rows saved for backward are exactly quantize_rows of the kernel's own bf16 rows, and
    the E4M3 copy exactly fp8_rows of them; gate and up exactly the twin's."""
    from pact.runtime.ops.triton import codec as KN

    monkeypatch.setattr(KN, "ROW_CHUNK", chunk)
    x = _awkward(rows, k, seed=6)
    w = (torch.rand(k) + 0.5).to(torch.bfloat16)
    for nvfp4 in (True, False):
        for fp8 in (False, True):
            (ya, qa, ra), (yb, qb, rb) = K.rmsnorm_rows(x, w, 1e-5, nvfp4, fp8), R.rmsnorm_rows(x, w, 1e-5, nvfp4, fp8)
            torch.testing.assert_close(ra, rb, rtol=4e-7, atol=0)
            assert (ya.data != yb.data).float().mean() <= 1e-3
            assert (qa is None) == (qb is None) == (not nvfp4)
            if nvfp4:
                _rows_equal(qa, R.quant_rows(ya.data))
            if fp8:
                r8, rs = R.fp8_rows(ya.data)
                assert torch.equal(ya.fp8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(ya.fp8_scale, rs)
            else:
                assert ya.fp8 is None
    gu = _awkward(rows, 2 * k, seed=7)
    for nvfp4 in (True, False):
        (ha, ga, ua), (hb, gb, ub) = K.silu_mul_rows(gu, nvfp4, True), R.silu_mul_rows(gu, nvfp4, True)
        assert (ha.data != hb.data).float().mean() <= 2e-3
        r8, rs = R.fp8_rows(ha.data)
        assert torch.equal(ha.fp8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(ha.fp8_scale, rs)
        if nvfp4:
            _rows_equal(ga, gb)
            _rows_equal(ua, ub)
        else:
            assert torch.equal(ga.data, gb.data) and torch.equal(ua.data, ub.data)
    # gate and up saved as E4M3 rows (down.saved=fp8): exactly e4m3_rows of each bf16 half, written in the same pass
    (ha, ga, ua), (hb, gb, ub) = (m.silu_mul_rows(gu, False, True, e4m3=True) for m in (K, R))
    assert (ha.data != hb.data).float().mean() <= 2e-3
    for a, b, half in ((ga, gb, gu[:, :k]), (ua, ub, gu[:, k:])):
        assert isinstance(a, E4M3Rows) and a.shape == (rows, k)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
        assert torch.equal(b.data.view(torch.uint8), R.e4m3_rows(half.contiguous()).data.view(torch.uint8))
    _close_bf16(K.silu_mul_h(ga, ua), R.silu_mul_h(gb, ub))
    dh = torch.randn(rows, k)
    _close_bf16(K.silu_mul_backward(dh, ga, ua), R.silu_mul_backward(dh, gb, ub))
    with pytest.raises(ValueError, match="not both"):
        K.silu_mul_rows(gu, True, False, e4m3=True)


def _close_bf16(a, b):
    # Same fp32 formula in both; Triton's exp and its reduction order differ from torch's in
    # the last fp32 bits, which moves a bf16 result by at most one ulp (2^-8 relative).
    torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-7, atol=b.float().abs().max().item() * 2.0**-16)


@pytest.mark.parametrize("rows,k", [(6, 48), (42, 96), (123, 272)])
def test_rmsnorm_backward(rows, k):
    yq = R.quant_rows(_awkward(rows, k, seed=4))
    rstd = torch.rand(rows) + 0.5
    w = (torch.rand(k) + 0.5).to(torch.bfloat16)
    w[3] = 0  # a zero weight: n is taken as 0 there
    dy = torch.randn(rows, k)
    _close_bf16(K.rmsnorm_backward(dy, yq, rstd, w), R.rmsnorm_backward(dy, yq, rstd, w))


@pytest.mark.parametrize("rows,k", [(6, 16), (42, 96), (123, 176)])
def test_silu_mul_h_and_backward(rows, k):
    gq, uq = R.quant_rows(_awkward(rows, k, seed=5)), R.quant_rows(_awkward(rows, k, seed=6))
    _close_bf16(K.silu_mul_h(gq, uq), R.silu_mul_h(gq, uq))
    dh = torch.randn(rows, k)
    _close_bf16(K.silu_mul_backward(dh, gq, uq), R.silu_mul_backward(dh, gq, uq))
    # E4M3 gate and up (down.saved=fp8) read by the same kernels, not the fp32 torch twins
    g8, u8 = R.e4m3_rows(_awkward(rows, k, seed=5)), R.e4m3_rows(_awkward(rows, k, seed=6))
    _close_bf16(K.silu_mul_h(g8, u8), R.silu_mul_h(g8, u8))
    _close_bf16(K.silu_mul_backward(dh, g8, u8), R.silu_mul_backward(dh, g8, u8))


def _gemm_ref64(a, w):
    """float64 product of the same decoded operands."""
    from pact.formats.nvfp4 import dequantize, dequantize_rows

    wd = dequantize(w).double()
    ad = dequantize_rows(a).double() if isinstance(a, NVFP4Rows) else a.double()
    return ad @ wd.t()


def _check_gemm(out, ref):
    # bf16 output: relative rounding 2^-9; fp32 accumulation order adds far less. The bound is
    # one bf16 ulp of each element plus a tiny absolute term for elements that cancel to ~0.
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0**-8 + ref.abs().max() * 2.0**-16
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (6, 48, 64), (42, 144, 96), (123, 32, 160)])
@pytest.mark.parametrize("scaling", ["2d", "1d"])
def test_nvfp4_gemm(m, n, k, scaling):
    torch.manual_seed(m + n + k)
    nn = n if scaling == "1d" or n % 16 == 0 else n
    w_src = torch.randn(nn, k) * 0.05
    fwd, bwd = quantize_weight(w_src, scaling=scaling)
    xq = R.quant_rows(_awkward(m, k, seed=3))
    for impl in (K, R):
        _check_gemm(impl.nvfp4_gemm(xq, fwd), _gemm_ref64(xq, fwd))
    dy = (torch.randn(m, nn) * 0.1).to(torch.bfloat16)
    for impl in (K, R):  # input gradient: bf16 dY against the backward layout W^T [K, N]
        _check_gemm(impl.nvfp4_gemm(dy, bwd), _gemm_ref64(dy, bwd))


def test_cublas_route_exact_for_nvfp4_rows():
    """The route a GPU takes from 256 rows on, run on CPU tensors: NVFP4 rows meet the decoded weight in an fp32
    product scaled once and rounded once, also where torch has no mm(out_dtype=) for the device (the CPU): the
    fallback is an fp32 product, not a bf16 one scaled afterwards (which misses by up to a bf16 step)."""
    from pact.runtime.ops.triton.gemm import nvfp4_gemm_cublas

    torch.manual_seed(0)
    w, _ = quantize_weight(torch.randn(96, 32) * 0.05, scaling="1d")
    xq = R.quant_rows(_awkward(40, 32, seed=5))
    _check_gemm(nvfp4_gemm_cublas(xq, w), _gemm_ref64(xq, w))


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (42, 144, 96), (300, 32, 160)])
def test_dgrad_through_the_forward_layout(m, n, k):
    """`--backward-weights forward`: dX = dY @ W read from the forward layout W [N, K] (no W^T layout),
    the exact product of the decoded weights (300 rows: the cuBLAS route on a GPU, here the same
    decode + addmm), in the kernels and in the twin."""
    from pact.formats.nvfp4 import dequantize

    torch.manual_seed(m + n + k)
    fwd, _ = quantize_weight(torch.randn(n, k) * 0.05, scaling="1d")
    dy = (torch.randn(m, n) * 0.1).to(torch.bfloat16)
    ref = dy.double() @ dequantize(fwd).double()
    for impl in (K, R):
        out = impl.nvfp4_dgrad_fwd(dy, fwd)
        assert out.shape == (m, k) and out.dtype == torch.bfloat16
        _check_gemm(out, ref)
    for impl in (K, R):  # dY of another width than W's N: one clear error, not a wrong product
        with pytest.raises(ValueError, match=f"W has N={n}"):
            impl.nvfp4_dgrad_fwd(torch.zeros(m, n + 16, dtype=torch.bfloat16), fwd)


def _fp8_sources(rows, k, seed=0):
    x = _awkward(rows, k, seed=seed)
    w = torch.randn(rows * 16, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :3] = torch.tensor([0.0, 1e-7, 3.0])  # a zero, an e4m3-subnormal-sized element, an outlier
    return {"bf16": x, "rows": R.quant_rows(x), "w1d": quantize_weight(w, scaling="1d")[0],
            "w2d": quantize_weight(w, scaling="2d")[1]}


@pytest.mark.parametrize("rows,k", [(1, 16), (6, 48), (42, 272)])
def test_fp8_rows_exact(rows, k):
    """E4M3 rows (manual bit rounding in the kernel) == the twin (torch's own float8 cast)."""
    from pact.runtime.ops.triton.fp8 import fp8_rows

    for name, src in _fp8_sources(rows, k).items():
        (a8, sa), (b8, sb) = fp8_rows(src), R.fp8_rows(src)
        assert a8.shape[0] % 16 == 0 and a8.shape == b8.shape, name
        assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)), name
        assert torch.equal(sa, sb), name


@pytest.mark.parametrize("chunk", [2048, 32])
def test_quantizers_write_the_fp8_copy(monkeypatch, chunk):
    """RMSNorm / SiLU-mul / row quantization with fp8=True also write the E4M3 copy of what they
    quantized: bytes and scales == fp8_rows of the NVFP4 rows (the twin), in one pass and
    walked in pieces; the GEMM reads the copy instead of re-encoding."""
    from pact.runtime.ops.triton import codec as KN
    from pact.runtime.ops.triton.fp8 import fp8_rows, nvfp4_gemm_fp8

    monkeypatch.setattr(KN, "ROW_CHUNK", chunk)
    x = _awkward(21, 272, seed=4)
    w = (torch.rand(272) + 0.5).to(torch.bfloat16)
    gu = _awkward(21, 544, seed=5)
    made = [K.quant_rows(x, fp8=True), K.rmsnorm_quant(x, w, 1e-5, fp8=True)[0], K.silu_mul_quant(gu, fp8=True)[0]]
    for q in made:
        b8, sb = fp8_rows(q)
        assert q.fp8.shape == b8.shape and torch.equal(q.fp8.view(torch.uint8), b8.view(torch.uint8))
        assert torch.equal(q.fp8_scale, sb)
        r8, rs = R.fp8_rows(q)
        assert torch.equal(b8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(sb, rs)
    fwd, _ = quantize_weight(torch.randn(48, 272) * 0.05)
    plain = R.quant_rows(x)
    assert torch.equal(nvfp4_gemm_fp8(made[0], fwd), nvfp4_gemm_fp8(plain, fwd))


def test_fp8_rows_error_bound():
    """Each element moves by at most half an E4M3 step: 2^-4 of its value for normals, 2^-10
    (half the subnormal step) of the row's scale below 2^-6; padding rows are zero."""
    from pact.formats.nvfp4 import dequantize, dequantize_rows

    for name, src in _fp8_sources(40, 96, seed=5).items():
        y8, scale = R.fp8_rows(src)
        n = src.shape[0]
        exact = {"bf16": lambda: src.float(), "rows": lambda: dequantize_rows(src)}.get(name, lambda: dequantize(src))()
        got = y8[:n].float() * scale[:n, None]
        unit = exact / scale[:n, None]  # the value in E4M3 units of its row
        bound = torch.where(unit.abs() >= 2.0**-6, unit.abs() * 2.0**-4, torch.full_like(unit, 2.0**-10))
        assert bool(((got - exact).abs() <= bound * scale[:n, None] * (1 + 1e-6)).all()), name
        assert not y8[n:].float().any() and bool((scale[n:] == 1).all()), name


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (42, 144, 96), (123, 32, 160)])
def test_fp8_gemm(m, n, k):
    """The fp8 GEMM (kernel rows + `torch._scaled_mm`) == its twin up to bf16 rounding, and
    within E4M3's error of the exact NVFP4 product."""
    from pact.runtime.ops.triton.fp8 import nvfp4_gemm_fp8

    torch.manual_seed(m + n + k)
    fwd, bwd = quantize_weight(torch.randn(n, k) * 0.05)
    xq = R.quant_rows(_awkward(m, k, seed=3))
    dy = (torch.randn(m, n) * 0.1).to(torch.bfloat16)
    for a, w in ((xq, fwd), (dy, bwd)):
        out, twin, exact = nvfp4_gemm_fp8(a, w), R.nvfp4_gemm_fp8(a, w), _gemm_ref64(a, w)
        assert out.shape == exact.shape
        torch.testing.assert_close(out.float(), twin.float(), rtol=2**-7, atol=exact.abs().max().item() * 2**-12)
        rel = ((twin.double() - exact).norm() / exact.norm()).item()
        assert rel <= 0.05, rel  # two operands each within 2^-4 per element (~2-3% measured)


@pytest.mark.parametrize("T,S,heads,hd", [(6, 3, 1, 16), (40, 20, 5, 32), (24, 24, 2, 128)])
def test_rope(T, S, heads, hd):
    """Rotary kernel == twin (fp32 rotation, one bf16 rounding) on strided rows; == transformers'
    formula within a bf16 ulp; the inverse undoes it (to bf16 rounding)."""
    g = torch.Generator().manual_seed(T)
    wide = torch.randn(T, heads * hd + 48, generator=g).to(torch.bfloat16)
    x = wide[:, 8 : 8 + heads * hd]  # rows strided as q/k inside the fused qkv output
    theta = torch.arange(S)[:, None] * (10000.0 ** (-torch.arange(hd // 2) / (hd // 2)))[None, :]
    cos, sin = theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)
    out = K.rope(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out, R.rope(x, cos, sin))
    pos = torch.arange(T) % S
    xf = x.float().reshape(T, heads, hd)
    c, s = torch.cat((cos, cos), -1).float()[pos][:, None], torch.cat((sin, sin), -1).float()[pos][:, None]
    hf = xf * c + torch.cat((-xf[..., hd // 2 :], xf[..., : hd // 2]), -1) * s
    torch.testing.assert_close(out.float().reshape(T, heads, hd), hf, rtol=2**-8, atol=1e-6)
    back = K.rope(out, cos, sin, inverse=True)
    assert torch.equal(back, R.rope(out, cos, sin, inverse=True))
    torch.testing.assert_close(back.float(), x.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("c,V", [(1, 7), (5, 1000), (9, 5000)])
def test_ce_grad(c, V):
    """Cross-entropy rows in place: kernel == twin (fp32 loss to a few ulp, bf16 gradient to one
    ulp) and the twin == torch's cross-entropy and its autograd gradient."""
    g = torch.Generator().manual_seed(V)
    z = (torch.randn(c, V, generator=g) * 3).to(torch.bfloat16)
    t = torch.randint(0, V, (c,), generator=g)
    zk, zr = z.clone(), z.clone()
    lk, lr = K.ce_grad_(zk, t), R.ce_grad_(zr, t)
    torch.testing.assert_close(lk, lr, rtol=1e-5, atol=1e-5)
    _close_bf16(zk, zr)
    zf = z.float().requires_grad_()
    ref = F.cross_entropy(zf, t, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(lr, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(zr.float(), zf.grad, rtol=2**-8, atol=1e-6)
    with pytest.raises(ValueError, match="needs bf16 logits"):
        K.ce_grad_(z.float(), t)


def test_rows_walked_in_chunks(monkeypatch):
    """Rows wider than ROW_CHUNK are walked in pieces (two passes where a row scale is needed):
    with a 32-element chunk, a 272-wide row takes 16 pieces, results unchanged."""
    from pact.runtime.ops.triton import codec as KN
    from pact.runtime.ops.triton.fp8 import fp8_rows

    monkeypatch.setattr(KN, "ROW_CHUNK", 32)
    x = _awkward(5, 272, seed=7)
    _rows_equal(K.quant_rows(x), R.quant_rows(x))
    q = R.quant_rows(x)
    assert torch.equal(K.dequant_rows(q), R.dequant_rows(q))
    gu = _awkward(5, 544, seed=8)
    (ha, ga, ua), (hb, gb, ub) = K.silu_mul_quant(gu), R.silu_mul_quant(gu)
    _rows_equal(ga, gb)
    _rows_equal(ua, ub)
    assert (ha.packed != hb.packed).float().mean() <= 1e-2  # exp's last bits may move a code
    _close_bf16(K.silu_mul_h(gb, ub), R.silu_mul_h(gb, ub))
    dh = (torch.randn(5, 272) * 0.1).to(torch.bfloat16)
    _close_bf16(K.silu_mul_backward(dh, gb, ub), R.silu_mul_backward(dh, gb, ub))
    for src in (x, q, quantize_weight(torch.randn(16, 272))[0]):
        (a8, sa), (b8, sb) = fp8_rows(src), R.fp8_rows(src)
        assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(sa, sb)


def test_pair_decoder_tiles(monkeypatch):
    """The pair-decoding kernel (bf16 decode, E4M3 re-encode) walks rows and bytes in tiles:
    with 4 rows x 16 bytes, a 37 x 272 operand takes 10 x 9 programs (partial tiles on both
    edges; the row scale written by the first column, a weight's amax read from whole rows)."""
    from pact.runtime.ops.triton import codec as KN
    from pact.runtime.ops.triton.fp8 import fp8_rows

    monkeypatch.setattr(KN, "PAIR_ROWS", 4)
    monkeypatch.setattr(KN, "PAIR_BYTES", 16)
    q = R.quant_rows(_awkward(37, 272, seed=9))
    w = quantize_weight(torch.randn(48, 272) * 0.05)[0]  # 12 x 9 programs
    assert torch.equal(K.dequant_rows(q), R.dequant_rows(q))
    assert torch.equal(KN.decode_qs(w.packed, w.scales), R._decoded_qs(w.packed, w.scales).to(torch.bfloat16))
    for src in (q, w):
        (a8, sa), (b8, sb) = fp8_rows(src), R.fp8_rows(src)
        assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(sa, sb)


def test_host_scale_cached_without_tensor_ops():
    """The cuBLAS path's alpha (a weight's global scale as a float) is read once per tensor; a
    hit runs no tensor op (a WeakKeyDictionary compares keys with ==, whose bool() synchronizes
    a CUDA device on every GEMM), and the entry goes with its tensor."""
    import gc

    from torch.overrides import TorchFunctionMode

    from pact.runtime.ops.triton import gemm as KN

    calls = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    g = torch.tensor(0.375)
    assert KN._host_scale(g) == 0.375
    with Count():
        assert KN._host_scale(g) == 0.375
    assert calls == []
    key = id(g)
    del g
    gc.collect()
    assert key not in KN._HOST_SCALES


def test_gemm_rejects_mismatched_k():
    fwd, _ = quantize_weight(torch.randn(16, 32))
    with pytest.raises(ValueError, match="K=48"):
        K.nvfp4_gemm(torch.zeros(2, 48, dtype=torch.bfloat16), fwd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(8192, 2048, 2048), (4096, 8192, 2048), (100, 3072, 576)])
def test_dgrad_through_the_forward_layout_gpu(m, n, k):
    from pact.formats.nvfp4 import dequantize

    torch.manual_seed(0)
    fwd, _ = quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    _check_gemm(K.nvfp4_dgrad_fwd(dy, fwd), dy.double() @ dequantize(fwd).double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(8192, 2048, 2048), (4096, 8192, 2048), (4096, 2048, 8192), (1000, 3072, 576)])
def test_kernels_native_gpu(m, n, k):
    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda")).to(torch.bfloat16)
    _rows_equal(K.quant_rows(x), R.quant_rows(x))
    w = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    (qa, _), (qb, rb) = K.rmsnorm_quant(x, w, 1e-5), R.rmsnorm_quant(x, w, 1e-5)
    assert (qa.packed != qb.packed).float().mean() <= 1e-3
    gu = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
    (_, ga, ua), (_, gb, ub) = K.silu_mul_quant(gu), R.silu_mul_quant(gu)
    _rows_equal(ga, gb)
    _rows_equal(ua, ub)
    assert torch.equal(K.dequant_rows(qb), R.dequant_rows(qb))
    dy = torch.randn(m, k, device="cuda")
    _close_bf16(K.rmsnorm_backward(dy, qb, rb, w), R.rmsnorm_backward(dy, qb, rb, w))
    _close_bf16(K.silu_mul_h(gb, ub), R.silu_mul_h(gb, ub))
    _close_bf16(K.silu_mul_backward(dy, gb, ub), R.silu_mul_backward(dy, gb, ub))
    fwd, bwd = quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    from pact.runtime.ops.triton.gemm import nvfp4_gemm_cublas, nvfp4_gemm_fused

    for gemm in (nvfp4_gemm_fused, nvfp4_gemm_cublas):
        _check_gemm(gemm(qb, fwd), _gemm_ref64(qb, fwd))
        _check_gemm(gemm(dy, bwd), _gemm_ref64(dy, bwd))
    from pact.runtime.ops.triton.fp8 import fp8_rows, nvfp4_gemm_fp8

    for src in (x, qb, fwd, bwd):
        (a8, sa), (b8, sb) = fp8_rows(src), R.fp8_rows(src)
        assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(sa, sb)
    # the quantizers' own E4M3 copies (the GPU's conversion on sm_90+) == the twin's bytes
    for made in (K.quant_rows(x, fp8=True), K.rmsnorm_quant(x, w, 1e-5, fp8=True)[0],
                 K.silu_mul_quant(gu, fp8=True)[0]):
        r8, rs = R.fp8_rows(made)  # the twin's E4M3 encoding of the kernel's own NVFP4 rows
        assert torch.equal(made.fp8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(made.fp8_scale, rs)
    # the default recipe's rows kept bf16: saved NVFP4 and E4M3 copies exactly the twin's encodings of them
    y, q, _ = K.rmsnorm_rows(x, w, 1e-5, True, True)
    _rows_equal(q, R.quant_rows(y.data))
    r8, rs = R.fp8_rows(y.data)
    assert torch.equal(y.fp8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(y.fp8_scale, rs)
    h, g2, u2 = K.silu_mul_rows(gu, True, True)
    _rows_equal(g2, gb)
    _rows_equal(u2, ub)
    r8, rs = R.fp8_rows(h.data)
    assert torch.equal(h.fp8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(h.fp8_scale, rs)
    assert (h.data != R.silu_mul_rows(gu)[0].data).float().mean() <= 2e-3
    _, g8, u8 = K.silu_mul_rows(gu, False, False, e4m3=True)  # E4M3 gate and up (down.saved=fp8)
    for a, half in ((g8, gu[:, : gu.shape[1] // 2]), (u8, gu[:, gu.shape[1] // 2 :])):
        r8, rs = R.fp8_rows(half.contiguous(), pad_to=1)
        assert torch.equal(a.data.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(a.scale, rs)
    z = torch.randn(64, 128256, device="cuda").to(torch.bfloat16)
    t = torch.randint(0, 128256, (64,), device="cuda")
    zk, zr = z.clone(), z.clone()
    torch.testing.assert_close(K.ce_grad_(zk, t), R.ce_grad_(zr, t), rtol=1e-5, atol=1e-5)
    _close_bf16(zk, zr)
    cos, sin = torch.rand(m, 32, device="cuda").to(torch.bfloat16), torch.rand(m, 32, device="cuda").to(torch.bfloat16)
    for inverse in (False, True):
        _close_bf16(K.rope(x[:, :1024], cos, sin, inverse), R.rope(x[:, :1024], cos, sin, inverse))
    for a, w in ((qb, fwd), (dy, bwd)):
        out, twin = nvfp4_gemm_fp8(a, w).float(), R.nvfp4_gemm_fp8(a, w).float()
        assert ((out - twin).norm() / twin.norm()).item() <= 2**-8  # bf16 rounding + summation order


@pytest.mark.parametrize("capability", [100, 120])
def test_native_gemm_compiles_for_blackwell(capability):
    """The nvfp4-native GEMM compiles for sm_100 and sm_120 (never run: no Blackwell here)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_kernels.py")
    r = subprocess.run([sys.executable, str(script), str(capability), "native"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "ok _nvfp4_native_gemm_kernel" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_compute_choice_by_capability(monkeypatch):
    """auto is the exact bf16-decode on every GPU (the faster backends cost accuracy: opt-in); a
    backend the GPU cannot run is one clear error naming the flag and the alternative
    (capabilities faked: no GPU here)."""
    from pact.formats import PactError
    from pact.runtime.ops import build as backends

    gpu = torch.device("cuda")
    for cap in ((12, 0), (10, 0), (9, 0), (8, 9), (8, 0)):
        monkeypatch.setattr(backends, "_capability", lambda device, cap=cap: cap)
        assert backends.resolve_compute("auto", gpu) == "bf16-decode"
    monkeypatch.setattr(backends, "_capability", lambda device: (9, 0))
    assert backends.resolve_compute("fp8", gpu) == "fp8"
    monkeypatch.setattr(backends, "_capability", lambda device: (12, 0))
    assert backends.resolve_compute("nvfp4-native", gpu) == "nvfp4-native"
    monkeypatch.setattr(backends, "_capability", lambda device: (9, 0))
    with pytest.raises(PactError, match="--compute nvfp4-native needs a Blackwell GPU.*sm_90.*--compute fp8"):
        backends.resolve_compute("nvfp4-native", gpu)
    monkeypatch.setattr(backends, "_capability", lambda device: (8, 0))
    with pytest.raises(PactError, match="--compute fp8 needs FP8 tensor cores.*sm_80.*bf16-decode"):
        backends.resolve_compute("fp8", gpu)
    with pytest.raises(PactError, match="--compute must be one of auto, bf16-decode, fp8, nvfp4-native"):
        backends.resolve_compute("fp4", gpu)
    assert backends.resolve_compute(None, torch.device("cpu")) == "bf16-decode"


def test_native_twin_quantizes_the_gradient():
    fwd, bwd = quantize_weight(torch.randn(32, 64) * 0.05)
    dy = (torch.randn(6, 32)).to(torch.bfloat16)
    assert torch.equal(R.nvfp4_gemm_native(dy, bwd), R.nvfp4_gemm(R.quant_rows(dy), bwd))
    xq = R.quant_rows(torch.randn(6, 64))
    assert torch.equal(R.nvfp4_gemm_native(xq, fwd), R.nvfp4_gemm(xq, fwd))


def test_kernels_compile_for_gpus():
    """Compile every kernel for sm_90 (Hopper) with Triton's own ptxas, no GPU needed: catches
    what the interpreter lets through (non-constexpr globals, layout errors). Runs in a child
    process because TRITON_INTERPRET=1 is set for this one."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_kernels.py")
    r = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # 17, the 6 variants of the bf16-rows kernels, the 2 E4M3 readers; GeGLU's 6 gate kernels (ACT=1) and
    # 2 norm kernels with Gemma's fp32 weights; E4M3 gate and up: 2 writers, 2 readers
    assert r.stdout.count("ok") == 37, r.stdout


@pytest.mark.parametrize("rows,k", [(6, 16), (42, 96)])
def test_geglu_rows_kernels_match_twin(rows, k):
    """Gemma's GeGLU (act="gelu_tanh") through the same four row kernels as SwiGLU: forward rows,
    the fused NVFP4 path, h recomputed and the backward, against the twins (the same sigmoid form;
    Triton's exp differs from torch's in the last fp32 bits)."""
    gu = _awkward(rows, 2 * k, seed=8)
    (ha, ga, ua), (hb, gb, ub) = K.silu_mul_rows(gu, True, False, act="gelu_tanh"), R.silu_mul_rows(
        gu, True, False, act="gelu_tanh")
    assert (ha.data != hb.data).float().mean() <= 2e-3
    _rows_equal(ga, gb)
    _rows_equal(ua, ub)
    assert (hb.data != R.silu_mul_rows(gu, True, False)[0].data).float().mean() > 0.5  # not SwiGLU's h
    (qa, _, _), (qb, _, _) = K.silu_mul_quant(gu, act="gelu_tanh"), R.silu_mul_quant(gu, act="gelu_tanh")
    assert (qa.packed != qb.packed).float().mean() <= 1e-3
    _close_bf16(K.silu_mul_h(gb, ub, act="gelu_tanh"), R.silu_mul_h(gb, ub, act="gelu_tanh"))
    dh = torch.randn(rows, k)
    _close_bf16(K.silu_mul_backward(dh, gb, ub, act="gelu_tanh"), R.silu_mul_backward(dh, gb, ub, act="gelu_tanh"))


def test_geglu_twin_is_torchs_tanh_gelu():
    """The twin's GeGLU and its derivative are torch's tanh GELU and autograd's gradient of it (in
    float64, where 1 + tanh loses nothing)."""
    g = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    u = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    dh = torch.randn(8, 32, dtype=torch.float64)
    (torch.nn.functional.gelu(g, approximate="tanh") * u).backward(dh)
    from pact.runtime.ops.reference import glu_act, glu_act_grad

    ref = torch.nn.functional.gelu(g.detach(), approximate="tanh")
    torch.testing.assert_close(glu_act(g.detach(), "gelu_tanh"), ref)
    torch.testing.assert_close(dh * u.detach() * glu_act_grad(g.detach(), "gelu_tanh"), g.grad)
