"""pact-calibrate: GPTQ beats round-to-nearest on every projection, stays bit-compatible, trains."""

import json
import logging
import os
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from conftest import TINY_TEXT, make_model, make_realistic, make_sentiment_jsonl
from pact.calibrate import GPTQ, NVFP4Quantizer, calibrate
from pact.convert import convert
from pact.formats import ArtifactError, PactError, open_artifact
from pact.formats import nvfp4 as F
from pact.pipelines.calibrate import main as calibrate_cli
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    make_model(d / "src", "llama", initializer_range=0.15)
    make_realistic(d / "src")
    convert(str(d / "src"), d / "art", progress=False, scaling="2d", block_scales="amax")  # the 2d claims below
    (d / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TINY_TEXT[:40]))
    return d


def _sweep_without_feedback(q, W):
    """The quantizer's sweep over W with Hinv = I (no error feedback): round-to-nearest."""
    q.begin(W, None)
    Wt, (n, k) = W.t().contiguous(), W.shape
    Qt, Errt = torch.empty(k, n), torch.empty(k, n)
    for c0 in range(0, k, 16):
        q.sweep(Wt, torch.eye(k), c0, Qt, Errt)
    return Qt.t()


@pytest.mark.parametrize("scaling", ["2d", "1d"])
def test_quantizer_is_bit_compatible_with_formats(scaling):
    torch.manual_seed(0)
    W = torch.randn(32, 64)
    g = F.global_scale_from_amax(W.abs().amax())
    q = NVFP4Quantizer(g, scaling=scaling, static=True)
    ref = F.quantize(W, global_scale=g, scaling=scaling)
    packed = q.pack(_sweep_without_feedback(q, W))
    assert torch.equal(packed.packed, ref.packed)
    assert torch.equal(packed.scales.view(torch.uint8), ref.scales.view(torch.uint8))


@pytest.mark.parametrize("scaling", ["2d", "1d"])
def test_quantizer_mse_rule_is_the_converters(scaling):
    """With the ``mse`` rule and no error feedback the quantizer picks exactly the scales and codes
    `formats.nvfp4.quantize(scale_rule="mse")` stores (heavy-tailed weights, so the search moves scales)."""
    torch.manual_seed(1)
    W = torch.randn(32, 64) * torch.rand(32, 1) ** 3
    g = F.global_scale_from_amax(W.abs().amax())
    q = NVFP4Quantizer(g, scaling=scaling, scale_rule="mse")
    ref = F.quantize(W, global_scale=g, scaling=scaling, scale_rule="mse")
    amax = F.quantize(W, global_scale=g, scaling=scaling)
    packed = q.pack(_sweep_without_feedback(q, W))
    assert torch.equal(packed.packed, ref.packed)
    assert torch.equal(packed.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    assert not torch.equal(ref.scales.view(torch.uint8), amax.scales.view(torch.uint8))
    with pytest.raises(ValueError, match="scale_rule"):
        NVFP4Quantizer(g, scale_rule="max")


def _layer(seed: int, rows: int, cols: int = 96, n: int = 1024):
    """Low-rank inputs X [n, cols] with their GPTQ Hessian, weights W [rows, cols] with a few heavy
    rows, and W's global scale."""
    torch.manual_seed(seed)
    X = torch.randn(n, 8) @ torch.randn(8, cols) + 0.2 * torch.randn(n, cols)
    W = torch.randn(rows, cols) * 0.05 * (1 + 3 * torch.rand(rows, 1) ** 4)
    gp = GPTQ(cols)
    gp.add_batch(X)
    return X, W, F.global_scale_from_amax(W.abs().amax()), gp


@pytest.mark.parametrize("scaling", ["2d", "1d"])
def test_gptq_with_searched_scales_beats_amax(scaling):
    """1x16 blocks: GPTQ choosing each block scale by the mse rule (from the weights as the sweep
    updated them) ends with lower layer-output error than with amax scales (measured 0.86-0.98x over
    8 seeds of this layer). 16x16 blocks: no consistent gain (0.92-1.07x: the block's later columns
    are updated after its scale is fixed, and the searched scale leaves them less headroom), so only
    "both beat round-to-nearest with the artifact's own searched scales" is claimed there."""
    X, W, g, gp = _layer(0, 48)

    def out_err(Q):
        return float((X @ (W - Q).t()).norm() / (X @ W.t()).norm())

    rtn = out_err(F.dequantize(F.quantize(W, global_scale=g, scaling=scaling, scale_rule="mse")))
    err = {rule: out_err(gp.quantize(W, NVFP4Quantizer(g, scaling=scaling, scale_rule=rule))[0])
           for rule in ("amax", "mse")}
    assert max(err.values()) < 0.5 * rtn, (err, rtn)
    if scaling == "1d":
        assert err["mse"] < err["amax"], err


def test_gptq_core_beats_rtn():
    torch.manual_seed(0)
    X = torch.randn(1024, 8) @ torch.randn(8, 96) + 0.2 * torch.randn(1024, 96)
    W = torch.randn(48, 96) * 0.05
    g = F.global_scale_from_amax(W.abs().amax())
    gp = GPTQ(96)
    for chunk in X.split(300):
        gp.add_batch(chunk)
    torch.testing.assert_close(gp.H, 2 * X.t() @ X / X.shape[0], rtol=1e-4, atol=1e-4)  # fp32 running mean

    def out_err(Q):
        return float((X @ (W - Q).t()).norm() / (X @ W.t()).norm())

    rtn = out_err(F.dequantize(F.quantize(W, global_scale=g, scaling="2d")))
    for static, act in ((False, False), (True, False), (True, True)):
        Q, _ = gp.quantize(W, NVFP4Quantizer(g, scaling="2d", static=static), actorder=act)
        assert out_err(Q) < 0.5 * rtn  # measured ~0.13x on these low-rank inputs


@pytest.mark.parametrize("scaling,rule", [("1d", "mse"), ("2d", "amax")])
def test_fused_sweep_matches_separate_sweeps(scaling, rule):
    """Members sharing one Hessian (q|k|v) swept as one stacked W give each member the codes and
    scales of its own sweep: GPTQ's rows are independent (awkward row counts, a dead column)."""
    torch.manual_seed(2)
    X = torch.randn(512, 8) @ torch.randn(8, 64) + 0.2 * torch.randn(512, 64)
    X[:, 7] = 0
    gp = GPTQ(64)
    gp.add_batch(X)
    Ws = [torch.randn(n, 64) * 0.05 * (1 + 3 * torch.rand(n, 1) ** 4) for n in (48, 16, 112)]
    g = F.global_scale_from_amax(torch.cat(Ws).abs().amax())
    q = NVFP4Quantizer(g, scaling=scaling, scale_rule=rule)
    fused = q.pack(gp.quantize(torch.cat(Ws), q, blocksize=32)[0])
    r0 = 0
    for W in Ws:
        qi = NVFP4Quantizer(g, scaling=scaling, scale_rule=rule)
        alone = qi.pack(gp.quantize(W, qi, blocksize=32)[0])
        r1 = r0 + W.shape[0]
        assert torch.equal(fused.packed[r0:r1], alone.packed)
        assert torch.equal(fused.scales[r0:r1].view(torch.uint8), alone.scales.view(torch.uint8))
        r0 = r1


def _textbook_gptq(W, H, q, percdamp=0.01):
    """GPTQ as the paper writes it, one column at a time with every later column updated at once
    (no lazy blocks), dynamic scales fixed from the updated weights at each group's first column."""
    W = W.double().clone()
    H = H.double().clone()
    H.diagonal().add_(percdamp * H.diagonal().mean())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    q.begin(W.float(), None)
    Q = torch.empty_like(W)
    for c in range(W.shape[1]):
        if c % 16 == 0:
            q._fix(c // 16, q._block_scales(W[:, c : c + 16].float())[:, 0])
        rs, sc = q._rs[c // 16].double(), q._s[c // 16].double()
        Q[:, c] = (F.round_e2m1((W[:, c] * rs).float()).double() * sc) * q.g.double()
        W[:, c + 1 :] -= torch.outer((W[:, c] - Q[:, c]) / Hinv[c, c], Hinv[c, c + 1 :])
    return Q.float()


def test_gptq_sweep_matches_the_textbook_loop():
    """The blocked sweep (the quantizer's 16-column groups, lazy group and block updates) ends where
    the textbook column-by-column loop ends: the same scales, the same codes for all but elements on
    a rounding midpoint (float summation order differs), blocks of 32 on 96 columns."""
    _, W, g, gp = _layer(7, 40, n=512)
    q = NVFP4Quantizer(g, scaling="1d", scale_rule="mse")
    Q, _ = gp.quantize(W, q, blocksize=32)
    ref_q = NVFP4Quantizer(g, scaling="1d", scale_rule="mse")
    ref = _textbook_gptq(W, gp.H, ref_q)
    assert (Q == ref).float().mean() > 0.99
    assert (q.scales.view(torch.uint8) == ref_q.scales.view(torch.uint8)).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gptq_on_the_gpu_matches_the_cpu():
    """The same sweep on a CUDA device: the same scales and codes as on the CPU but for elements
    on a rounding midpoint (fp32 sums in another order), the same loss; with each group's columns
    replayed as a CUDA graph, the same bits as without."""
    torch.manual_seed(5)
    X = torch.randn(2048, 16) @ torch.randn(16, 512) + 0.2 * torch.randn(2048, 512)
    W = torch.randn(384, 512) * 0.05 * (1 + 3 * torch.rand(384, 1) ** 4)
    g = F.global_scale_from_amax(W.abs().amax())
    out = []
    for dev in ("cpu", "cuda"):
        gp = GPTQ(512, dev)
        gp.add_batch(X.to(dev))
        q = NVFP4Quantizer(g, scaling="1d", scale_rule="mse")
        Q, losses = gp.quantize(W.to(dev), q)
        out.append((Q.cpu(), q.scales.view(torch.uint8).cpu(), losses.sum().cpu()))
    (qa, sa, la), (qb, sb, lb) = out
    assert (qa == qb).float().mean() > 0.99 and (sa == sb).float().mean() > 0.99
    torch.testing.assert_close(la, lb, rtol=1e-2, atol=0)
    # without the CUDA graph that replays each group's columns (PACT_GPTQ_CUDA_GRAPH=0): the same bits
    gp = GPTQ(512, "cuda")
    gp.add_batch(X.cuda())
    q = NVFP4Quantizer(g, scaling="1d", scale_rule="mse")
    os.environ["PACT_GPTQ_CUDA_GRAPH"] = "0"
    try:
        Q, losses = gp.quantize(W.cuda(), q)
    finally:
        del os.environ["PACT_GPTQ_CUDA_GRAPH"]
    assert torch.equal(Q.cpu(), qb) and torch.equal(q.scales.view(torch.uint8).cpu(), sb)
    assert torch.equal(losses.sum().cpu(), lb)
    # two tensors' rows in one sweep, one global scale per row (the merge's gains): each one's own codes
    # (cuBLAS may sum a wider GEMM in another order: a rare midpoint may round the other way)
    g2 = F.global_scale_from_amax(1.5 * W.abs().amax())
    q = NVFP4Quantizer(torch.cat([g.expand(384), g2.expand(384)]), scaling="1d", scale_rule="mse")
    Q2 = gp.quantize(torch.cat([W, 1.5 * W]).cuda(), q)[0].cpu()
    q1 = NVFP4Quantizer(g2, scaling="1d", scale_rule="mse")
    Q1 = gp.quantize((1.5 * W).cuda(), q1)[0].cpu()
    assert (Q2[:384] == qb).float().mean() > 0.999 and (Q2[384:] == Q1).float().mean() > 0.999


def test_gptq_refuses_columns_or_blocks_off_the_16_grid():
    q = NVFP4Quantizer(torch.tensor(0.01), scaling="1d")
    with pytest.raises(ValueError, match="groups of 16 columns: got 40 columns, blocksize 128"):
        GPTQ(40).quantize(torch.randn(8, 40), q)
    gp = GPTQ(64)
    gp.add_batch(torch.randn(32, 64))
    with pytest.raises(ValueError, match="got 64 columns, blocksize 24"):
        gp.quantize(torch.randn(8, 64), q, blocksize=24)


def test_round_e2m1_is_encode_then_decode():
    """The one-pass rounding GPTQ uses per column equals encode_e2m1 + decode_e2m1, bit for bit:
    every midpoint and its float neighbours (ties to even), both signs, zeros, beyond 6."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    near = [mids]
    for d in (torch.inf, -torch.inf):
        t = mids
        for _ in range(3):
            t = torch.nextafter(t, torch.full_like(t, d))
            near.append(t)
    x = torch.cat([*near, torch.tensor([0.0, 1e-40, 7.0, torch.inf]), torch.rand(4096) * 7])
    x = torch.cat([x, -x])
    x = torch.cat([x, x.repeat(8)])  # both ways: a small tensor (bucketize) and a large one (step formula)
    ref = F.decode_e2m1(F.encode_e2m1(x.clamp(-F.E2M1_MAX, F.E2M1_MAX)))
    assert x.numel() > 1 << 16 and x[: x.numel() // 9].numel() <= 1 << 16
    assert torch.equal(F.round_e2m1(x).view(torch.int32), ref.view(torch.int32))
    small = x[: x.numel() // 9]
    assert torch.equal(F.round_e2m1(small).view(torch.int32), ref[: small.numel()].view(torch.int32))
    assert F.round_e2m1(torch.tensor([-0.1])).signbit().item()  # negative zero, as code 0b1000 decodes


def test_calibrate_end_to_end(setup, tmp_path):
    out = calibrate(str(setup / "art"), setup / "prompts.jsonl", tmp_path / "cal", progress=False)
    art = open_artifact(out)
    assert art.verify() > 0
    cal = art.meta["provenance"]["calibration"]
    errs = cal["layer_output_error"]
    assert len(errs) == 14 and cal["samples"] == 40 and len(cal["prompts_sha256"]) == 64
    assert set(cal["seconds"]) == {"read", "activations", "solve", "write", "total"}
    for name, e in errs.items():
        assert e["gptq"] <= e["rtn"], name  # on every projection (measured ratios ~0.5-0.7)
        assert art.entry(name)["calibrated"] == "gptq"
        fwd = art.nvfp4(name)
        # bit-compatible: re-encoding the effective weights with the stored scales gives the stored codes
        assert torch.equal(F.encode_with_scales(F.dequantize(fwd), fwd.scales, fwd.global_scale), fwd.packed)
        assert torch.equal(art.dequantize(name, "bwd"), art.dequantize(name).t())  # 2d: exact re-pack
    # the fused group still shares one global scale, and the input artifact is untouched
    assert len({art.entry(f"model.layers.0.self_attn.{p}_proj.weight")["global_scale"] for p in "qkv"}) == 1
    assert "calibration" not in open_artifact(setup / "art").meta["provenance"]
    # and it trains
    make_sentiment_jsonl(tmp_path / "train.jsonl", 32)
    r = train(TrainConfig(artifact=str(out), data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"), steps=2,
                          batch_size=8, max_len=64), progress=False)
    assert r["step"] == 2


def test_too_few_calibration_tokens_are_said(setup, tmp_path, caplog):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "a short text"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="pact.calibrate.calibrate"):
        calibrate(str(setup / "art"), one, tmp_path / "cal", progress=False)
    said = [r.getMessage() for r in caplog.records if "rank-deficient" in r.getMessage()]
    assert len(said) == 1 and "--max-samples" in said[0]  # once per run, naming the fix
    assert open_artifact(tmp_path / "cal").verify() > 0  # a warning, not a refusal


def test_prompts_read_the_forms_pact_train_reads(setup, tmp_path):
    """--prompts takes what pact-train --data takes: a .csv / .parquet / .json table and a datasets.save_to_disk
    folder give the .jsonl's prompts; a folder without datasets' files stays a folder of images (refused for a
    text-only model), another suffix is one error naming the forms."""
    import datasets

    from pact.calibrate.prompts import load_prompts
    from pact.runtime.session import open_session

    tok = open_session(str(setup / "art"), tool="test").tokenizer
    recs = [json.loads(x) for x in (setup / "prompts.jsonl").read_text().splitlines()]
    want = load_prompts(setup / "prompts.jsonl", tok, vision=False, max_samples=8, seq_len=16)
    ds = datasets.Dataset.from_list(recs)
    ds.to_csv(tmp_path / "p.csv")
    ds.to_parquet(tmp_path / "p.parquet")
    ds.save_to_disk(str(tmp_path / "saved"))
    for src in (tmp_path / "p.csv", tmp_path / "p.parquet", tmp_path / "saved"):
        got = load_prompts(src, tok, vision=False, max_samples=8, seq_len=16)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), src
    # and the whole command on a datasets folder (its digest is of the token ids: no file to hash)
    out = calibrate(str(setup / "art"), tmp_path / "saved", tmp_path / "cal", max_samples=8, seq_len=16,
                    progress=False)
    assert open_artifact(out).meta["provenance"]["calibration"]["samples"] == 8
    (tmp_path / "imgs").mkdir()
    with pytest.raises(PactError, match="a folder of images, but this artifact is a text-only model"):
        load_prompts(tmp_path / "imgs", tok, vision=False, max_samples=8, seq_len=16)
    (tmp_path / "p.tsv").write_text("a\tb\n")
    with pytest.raises(PactError, match=r"expected a .jsonl, .txt, .parquet, .csv or .json file, a datasets"):
        load_prompts(tmp_path / "p.tsv", tok, vision=False, max_samples=8, seq_len=16)


def test_min_tokens_reads_past_max_samples(setup, tmp_path):
    """--min-tokens: the first --max-samples texts, then more until they hold that many tokens (or the
    file ends); recorded as the texts and tokens GPTQ saw. A bad value or --model-texts is one error."""
    from pact.calibrate.prompts import _texts, load_prompts, take_texts
    from pact.runtime.session import open_session

    tok = open_session(str(setup / "art"), tool="test").tokenizer
    path = setup / "prompts.jsonl"
    first = load_prompts(path, tok, vision=False, max_samples=4, seq_len=16)
    assert len(first) == 4
    lens = [t.numel() for t in load_prompts(path, tok, vision=False, max_samples=40, seq_len=16)]
    want = sum(lens[:4]) + 1  # one token more than the first four hold: a fifth text, and only until reached
    more = load_prompts(path, tok, vision=False, max_samples=4, seq_len=16, min_tokens=want)
    k = next(i for i in range(1, 41) if sum(lens[:i]) >= want)
    assert len(more) == max(k, 4) == 5 and all(torch.equal(a, b) for a, b in zip(first, more))
    texts = _texts(path, tok)
    assert take_texts(texts, tok, max_samples=4, seq_len=16, min_tokens=want)[1] == 5  # texts read: the next start here
    assert take_texts(texts, tok, max_samples=4, seq_len=16)[1] == 4
    every = load_prompts(path, tok, vision=False, max_samples=4, seq_len=16, min_tokens=10**6)
    assert len(every) == len(lens)  # the file ends first: all of them
    (tmp_path / "images").mkdir()
    with pytest.raises(PactError, match="--min-tokens reads text prompts only"):
        load_prompts(tmp_path / "images", tok, vision=True, max_samples=4, seq_len=16, min_tokens=8)
    r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--prompts", str(path), "--max-samples", "4",
                                           "--seq-len", "16", "--min-tokens", str(want), "--out", str(tmp_path / "c"),
                                           "--quiet"])
    assert r.exit_code == 0, r.output
    cal = open_artifact(tmp_path / "c").meta["provenance"]["calibration"]
    assert cal["samples"] == 5 and cal["tokens"] == sum(lens[:5])
    assert (cal["max_samples"], cal["seq_len"], cal["min_tokens"]) == (4, 16, want)  # enough to take them again
    for bad in (0, -3):
        with pytest.raises(PactError, match="--max-samples must be >= 1"):
            calibrate(str(setup / "art"), path, tmp_path / "c1", max_samples=bad)
    with pytest.raises(PactError, match="--min-tokens must be >= 0"):
        calibrate(str(setup / "art"), path, tmp_path / "c1", min_tokens=-1)
    with pytest.raises(PactError, match="--min-tokens reads more --prompts texts"):
        calibrate(str(setup / "art"), None, tmp_path / "c1", model_texts=True, min_tokens=8)
    assert not (tmp_path / "c1").exists()


def test_model_texts_calibrate_without_data(setup, tmp_path):
    """--model-texts: the artifact's model samples max-samples texts of seq-len tokens from its BOS
    token (seeded: the same texts twice), and GPTQ runs on them as on given prompts; the provenance
    says so. --prompts with it, or neither, is one error naming both flags."""
    from pact.runtime.generate import sample_texts
    from pact.runtime.session import open_session

    ses = open_session(str(setup / "art"), tool="test")
    model = ses.model(None)
    a = sample_texts(model, 1, 5, 12, seed=3, rows=2)  # three chunks of rows
    b = sample_texts(model, 1, 5, 12, seed=3, rows=2)
    assert len(a) == 5 and all(t.shape == (12,) and int(t[0]) == 1 for t in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a rerun gives the same tokens
    assert not all(torch.equal(a[0], t) for t in a[1:])  # sampled, not greedy: rows differ
    assert all(int(t.max()) < model.embed.shape[0] for t in a)
    allowed = torch.zeros(model.embed.shape[0], dtype=torch.bool)
    allowed[2:50] = True
    c = sample_texts(model, 1, 3, 30, seed=0, allowed=allowed)
    assert all(bool(allowed[t[1:]].all()) for t in c)  # only the ids it may write
    with pytest.raises(PactError, match="longer than the model's context"):
        sample_texts(model, 1, 1, model.cfg.max_position_embeddings + 1)
    r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--model-texts", "--max-samples", "8", "--seq-len",
                                           "24", "--out", str(tmp_path / "cal"), "--quiet"])
    assert r.exit_code == 0, r.output
    cal = open_artifact(tmp_path / "cal").meta["provenance"]["calibration"]
    assert cal["prompts"] == "model texts" and cal["samples"] == 8 and cal["tokens"] == 8 * 24
    assert cal["model_texts"] == {"seed": 0, "temperature": 1.0} and len(cal["prompts_sha256"]) == 64
    assert "model texts" in cal["seconds"]
    assert all(e["gptq"] <= e["rtn"] for e in cal["layer_output_error"].values())
    import importlib

    C = importlib.import_module("pact.calibrate.calibrate")
    tok = ses.tokenizer  # what --model-texts feeds GPTQ: the tokenizer's own ids (the embedding has more
    texts = C._model_texts(model, tok, 8, 24, 0)  # rows), no special token but end-of-text after the start
    assert len(tok) < model.embed.shape[0] and len(texts) == 8
    assert int(torch.cat(texts).max()) < len(tok)
    assert not set(torch.cat([t[1:] for t in texts]).tolist()) & (set(tok.all_special_ids) - {tok.eos_token_id})
    with pytest.raises(PactError, match="--prompts and --model-texts"):
        calibrate(str(setup / "art"), setup / "prompts.jsonl", tmp_path / "c1", model_texts=True)
    with pytest.raises(PactError, match="--seed seeds --model-texts"):
        calibrate(str(setup / "art"), setup / "prompts.jsonl", tmp_path / "c1", seed=3)
    for seed in (-1, 2**64):
        with pytest.raises(PactError, match=r"--seed must be in \[0, 2\*\*63\)"):
            calibrate(str(setup / "art"), None, tmp_path / "c1", model_texts=True, seed=seed)
    with pytest.raises(PactError, match="--seq-len 9999: longer than the model's context"):
        calibrate(str(setup / "art"), None, tmp_path / "c1", model_texts=True, seq_len=9999, max_samples=1)
    for where, how in (("art/cal", "is inside the artifact"), ("art", "is the artifact"), (".", "holds the artifact")):
        with pytest.raises(PactError, match=f"--out .* {how} .*choose an --out outside it"):
            calibrate(str(setup / "art"), None, setup / where, model_texts=True, overwrite=True)
    assert not (setup / "art" / "cal").exists()
    r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--out", str(tmp_path / "c2")])
    assert r.exit_code != 0 and "--prompts FILE|FOLDER, or --model-texts" in r.output
    assert not (tmp_path / "c1").exists() and not (tmp_path / "c2").exists()


def test_batched_prompts_match_one_at_a_time(setup, tmp_path, monkeypatch):
    """Prompts of different lengths run right-padded in batches give the Hessians (and so the
    calibrated weights) of running each prompt alone: padding rows are left out and causal
    attention keeps them from the real tokens."""
    import importlib

    C = importlib.import_module("pact.calibrate.calibrate")  # the module (the package exports the function)

    texts = [" ".join(TINY_TEXT[i : i + 1 + i % 4]) for i in range(24)]  # 1-4 sentences each
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPA's math kernel: the CPU flash kernel blocks keys by sequence length, so a padded batch
    # rounds its bf16 attention outputs differently from one prompt alone (on some CPUs by enough
    # to move GPTQ's o_proj error 1%); the math kernel gives every real row the same numbers.
    with sdpa_kernel(SDPBackend.MATH):
        batched = open_artifact(calibrate(str(setup / "art"), tmp_path / "p.jsonl", tmp_path / "b", progress=False))
        monkeypatch.setattr(C, "BATCH_TOKENS", 1)
        alone = open_artifact(calibrate(str(setup / "art"), tmp_path / "p.jsonl", tmp_path / "a", progress=False))
    eb = batched.meta["provenance"]["calibration"]["layer_output_error"]
    ea = alone.meta["provenance"]["calibration"]["layer_output_error"]
    for name in eb:
        assert eb[name]["rtn"] == pytest.approx(ea[name]["rtn"], rel=1e-3), name
        assert eb[name]["gptq"] == pytest.approx(ea[name]["gptq"], rel=1e-2), name
        same = (batched.nvfp4(name).packed == alone.nvfp4(name).packed).float().mean().item()
        assert same > 0.99, (name, same)


def test_calibration_follows_the_artifacts_block_scales(setup, tmp_path):
    """An artifact converted with searched block scales is calibrated with them (auto), recorded in
    the provenance; --block-scales overrides, a bad value is one error."""
    src = setup / "src"
    convert(str(src), tmp_path / "mse", progress=False, scaling="1d", block_scales="mse")
    out = calibrate(str(tmp_path / "mse"), setup / "prompts.jsonl", tmp_path / "cal", progress=False)
    cal = open_artifact(out)
    assert cal.meta["provenance"]["calibration"]["block_scales"] == "mse"
    errs = cal.meta["provenance"]["calibration"]["layer_output_error"]
    assert all(e["gptq"] <= e["rtn"] for e in errs.values())
    amax = open_artifact(calibrate(str(tmp_path / "mse"), setup / "prompts.jsonl", tmp_path / "cal-amax",
                                   block_scales="amax", progress=False))
    assert amax.meta["provenance"]["calibration"]["block_scales"] == "amax"
    e_amax = amax.meta["provenance"]["calibration"]["layer_output_error"]
    assert sum(e["gptq"] for e in errs.values()) < sum(e["gptq"] for e in e_amax.values())
    with pytest.raises(PactError, match="--block-scales must be"):
        calibrate(str(tmp_path / "mse"), setup / "prompts.jsonl", tmp_path / "c", block_scales="max")


def test_backward_layout_from_the_source(setup, tmp_path):
    """--backward-layout source: the calibrated forward codes, and the backward layout pact-convert made
    from the source (bit for bit), recorded in the provenance; the default rounds the calibrated weights
    again along the other dimension, which moves the backward GEMM off the source's W^T by more than
    round-to-nearest does. A bad value is one error naming the flag."""
    convert(str(setup / "src"), tmp_path / "mse", progress=False, scaling="1d", block_scales="mse")
    rtn = open_artifact(tmp_path / "mse")
    cal = {b: open_artifact(calibrate(str(tmp_path / "mse"), setup / "prompts.jsonl", tmp_path / b,
                                      backward_layout=b, progress=False)) for b in ("forward", "source")}
    assert [cal[b].meta["provenance"]["calibration"]["backward_layout"] for b in cal] == ["forward", "source"]
    assert cal["source"].meta["provenance"]["calibration"]["backward_block_scales"] == "mse"
    names = list(cal["source"].meta["provenance"]["calibration"]["layer_output_error"])
    assert len(names) == 14
    src = {n: t.float() for n, t in load_file(setup / "src" / "model.safetensors").items()}
    far = 0
    for n in names:
        f, s = cal["forward"].nvfp4(n, "bwd"), cal["source"].nvfp4(n, "bwd")
        assert torch.equal(cal["source"].nvfp4(n).packed, cal["forward"].nvfp4(n).packed)  # the forward: GPTQ's
        conv = rtn.nvfp4(n, "bwd")
        assert torch.equal(s.packed, conv.packed)
        assert torch.equal(s.scales.view(torch.uint8), conv.scales.view(torch.uint8))
        W = src[n].t()
        far += float((F.dequantize(f) - W).norm()) > float((F.dequantize(s) - W).norm())
    assert far >= 12, far  # the calibrated weights rounded again are farther from W^T (on all 14 here)
    r = CliRunner().invoke(calibrate_cli, [str(tmp_path / "mse"), "--prompts", str(setup / "prompts.jsonl"),
                                           "--out", str(tmp_path / "c"), "--backward-layout", "calibrated"])
    assert r.exit_code != 0 and "--backward-layout" in r.output, r.output
    with pytest.raises(PactError, match="--backward-layout must be forward or source"):
        calibrate(str(tmp_path / "mse"), setup / "prompts.jsonl", tmp_path / "c", backward_layout="bf16")


def test_cli_and_bad_input(setup, tmp_path):
    r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--prompts", str(setup / "prompts.jsonl"),
                                           "--out", str(tmp_path / "cal"), "--act-order", "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["output_error_ratio_gptq_over_rtn"]["max"] <= 1.0
    with pytest.raises(ArtifactError, match="already exists"):
        calibrate(str(setup / "art"), setup / "prompts.jsonl", tmp_path / "cal")
    with pytest.raises(PactError, match="no such file"):
        calibrate(str(setup / "art"), tmp_path / "nope.jsonl", tmp_path / "c2")
    (tmp_path / "images").mkdir()
    with pytest.raises(PactError, match="folder of images, but this artifact is a text-only model"):
        calibrate(str(setup / "art"), tmp_path / "images", tmp_path / "c3")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(PactError, match=r"bad.jsonl:2: expected an object with 'text'"):
        calibrate(str(setup / "art"), tmp_path / "bad.jsonl", tmp_path / "c4")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PactError, match="no usable prompts"):
        calibrate(str(setup / "art"), tmp_path / "empty.txt", tmp_path / "c5")
    with pytest.raises(PactError, match="not the model this artifact was converted from"):
        other = tmp_path / "other"
        make_model(other, "llama", seed=1, intermediate_size=256)
        art2 = tmp_path / "art2"
        import shutil

        shutil.copytree(setup / "art", art2)
        doc = json.loads((art2 / "zarr.json").read_text())
        doc["attributes"]["pact"]["provenance"]["source"] = str(other)
        (art2 / "zarr.json").write_text(json.dumps(doc))
        calibrate(str(art2), setup / "prompts.jsonl", tmp_path / "c6")


def test_source_with_other_weights_of_the_same_shapes_is_refused(setup, tmp_path):
    """Same config and safetensors headers, other values: the header fingerprint cannot tell them
    apart; the recorded sha256 of the weights can (with --source too)."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "src"
    shutil.copytree(setup / "src", other)
    f = next(other.glob("*.safetensors"))
    sd = load_file(f)
    k = next(k for k in sorted(sd) if "mlp" in k)
    sd[k] = torch.flip(sd[k], dims=[0]).contiguous()  # same dtype, shape and offsets; other bytes
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(PactError, match="not the weights this artifact was converted from"):
        calibrate(str(setup / "art"), setup / "prompts.jsonl", tmp_path / "c", source=str(other))
    assert not (tmp_path / "c").exists()


def test_calibrate_a_gemma3_artifact(tmp_path):
    """Gemma 3 through pact-calibrate: its layers (GeGLU, output norms, local/global attention) run as
    the runtime runs them, every projection's layer-output error at most round-to-nearest's, and it trains."""
    make_model(tmp_path / "src", "gemma3", initializer_range=0.15)
    convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TINY_TEXT[:24]))
    out = calibrate(str(tmp_path / "art"), prompts, tmp_path / "cal", progress=False)
    errs = open_artifact(out).meta["provenance"]["calibration"]["layer_output_error"]
    assert len(errs) == 14 and all(e["gptq"] <= e["rtn"] for e in errs.values()), errs
    make_sentiment_jsonl(tmp_path / "train.jsonl", 16)
    r = train(TrainConfig(artifact=str(out), data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"), steps=2,
                          batch_size=8, max_len=64), progress=False)
    assert r["step"] == 2


def test_train_calibrates_on_raw_text(tmp_path):
    """{text} records (continued pretraining: every token a target) train with pact-train's calibration, which
    calibrates on them as pact-calibrate --prompts does (the same codes); the error that refused them named
    {text} as the fix."""
    from pact.pipelines.train import main as train_cli

    make_model(tmp_path / "src", "llama", initializer_range=0.15)
    convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"the movie number {i} was {'fresh' if i % 2 else 'dull'} and long"})
                            + "\n" for i in range(40)))
    r = CliRunner().invoke(train_cli, [str(tmp_path / "art"), "--data", str(data), "--out", str(tmp_path / "run"),
                                       "--steps", "2", "--batch-size", "8", "--max-len", "64", "--quiet",
                                       "--calibrate", "--calibrate-samples", "16"])
    assert r.exit_code == 0, r.output
    (tmp_path / "first16.jsonl").write_text("".join(data.read_text().splitlines(keepends=True)[:16]))
    ref = open_artifact(calibrate(str(tmp_path / "art"), tmp_path / "first16.jsonl", tmp_path / "ref", max_samples=16,
                                  seq_len=64, progress=False))
    got = open_artifact(tmp_path / "run" / "calibrated")
    names = list(ref.names("nvfp4"))
    assert names and all(torch.equal(ref.nvfp4(n).packed, got.nvfp4(n).packed) for n in names)


def test_train_calibrate_flag(tmp_path, caplog):
    """pact-train --calibrate: GPTQ on the first N training records into OUT/calibrated/ (the same
    codes as pact-calibrate on those records), the run trains on it, records it, and eval warns when
    the adapter is given the uncalibrated artifact."""
    from pact.calibrate.forrun import calibrate_for_run
    from pact.pipelines.train import main as train_cli
    from pact.runtime.evaluate import evaluate_artifact

    make_model(tmp_path / "src", "llama", initializer_range=0.15)
    convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    data = make_sentiment_jsonl(tmp_path / "train.jsonl", 40)
    run = tmp_path / "run"
    args = [str(tmp_path / "art"), "--data", str(data), "--out", str(run), "--steps", "2", "--batch-size", "8",
            "--max-len", "64", "--quiet"]
    r = CliRunner().invoke(train_cli, [*args, "--calibrate", "--calibrate-samples", "0"])
    assert r.exit_code != 0 and "--calibrate-samples must be >= 1" in r.output and not run.exists()
    r = CliRunner().invoke(train_cli, [*args, "--calibrate", "--calibrate-samples", "16"])
    assert r.exit_code == 0, r.output
    cal_art = open_artifact(run / "calibrated")
    cal = cal_art.meta["provenance"]["calibration"]
    assert cal["samples"] == 16 and cal["from_artifact"] == str((tmp_path / "art").resolve())
    assert "the first 16 records of --data" in cal["prompts"] and "<= 64 tokens" in cal["prompts"]
    rec = json.loads((run / "train_config.json").read_text())
    assert rec["artifact"] == str((run / "calibrated").resolve()) and (run / "adapter_model.safetensors").is_file()
    # the same codes as pact-calibrate on those 16 records at the run's --max-len
    (tmp_path / "first16.jsonl").write_text("".join(data.read_text().splitlines(keepends=True)[:16]))
    ref = open_artifact(calibrate(str(tmp_path / "art"), tmp_path / "first16.jsonl", tmp_path / "ref", max_samples=16,
                                  seq_len=64, progress=False))
    names = list(ref.names("nvfp4"))
    assert names and all(torch.equal(ref.nvfp4(n).packed, cal_art.nvfp4(n).packed) for n in names)
    rtn = open_artifact(tmp_path / "art")
    assert any(not torch.equal(rtn.nvfp4(n).packed, cal_art.nvfp4(n).packed) for n in names)  # GPTQ moved codes
    # the default calibrates an uncalibrated artifact whose source is here (the same codes as --calibrate
    # with the default 128 records), says so, and trains on it; a calibrated artifact is trained as it is
    plain = [a for a in args if a != "--quiet"]
    r = CliRunner().invoke(train_cli, [*plain[:4], str(tmp_path / "auto"), *plain[5:]])
    assert r.exit_code == 0 and "before training (--no-calibrate skips it)" in r.output, r.output
    rec = json.loads((tmp_path / "auto" / "train_config.json").read_text())
    assert rec["artifact"] == str((tmp_path / "auto" / "calibrated").resolve())
    r = CliRunner().invoke(train_cli, [str(tmp_path / "auto" / "calibrated"), *plain[1:4], str(tmp_path / "plain2"),
                                       *plain[5:]])  # (its 40 records; run/calibrated's 16 would be calibrated again)
    assert r.exit_code == 0 and "calibrat" not in r.output.lower().replace("/calibrated", ""), r.output
    assert not (tmp_path / "plain2" / "calibrated").exists()
    # --no-calibrate: the artifact as it is, nothing said
    r = CliRunner().invoke(train_cli, [*plain[:4], str(tmp_path / "plain"), *plain[5:], "--no-calibrate"])
    assert r.exit_code == 0 and "calibrat" not in r.output and not (tmp_path / "plain" / "calibrated").exists()
    rec = json.loads((tmp_path / "plain" / "train_config.json").read_text())
    assert rec["artifact"] == str((tmp_path / "art").resolve())
    # a finished run is refused before any calibration; a rerun into a folder holding only calibrated/ reuses it
    r = CliRunner().invoke(train_cli, [*args, "--calibrate"])
    assert r.exit_code != 0 and "is not empty" in r.output
    run2 = tmp_path / "run2"
    first = calibrate_for_run(str(tmp_path / "art"), str(data), run2, samples=16, seq_len=64, progress=False)
    stamp = (first / "zarr.json").stat().st_mtime_ns
    again = calibrate_for_run(str(tmp_path / "art"), str(data), run2, samples=16, seq_len=64, progress=False)
    assert again == first and (again / "zarr.json").stat().st_mtime_ns == stamp
    other = calibrate_for_run(str(tmp_path / "art"), str(data), run2, samples=8, seq_len=64, progress=False)
    assert open_artifact(other).meta["provenance"]["calibration"]["samples"] == 8  # other texts: made anew
    with pytest.raises(PactError, match="own calibrated artifact"):
        calibrate_for_run(str(run2 / "calibrated"), str(data), run2, samples=8, progress=False)
    # given the artifact its run calibrated, the adapter is evaluated on its own calibrated/ (said; the
    # same scores); given another artifact's weights, a warning
    with caplog.at_level(logging.INFO):
        got = evaluate_artifact(str(tmp_path / "art"), str(data), adapter=str(run), max_len=64, generate=False)
    assert any("calibrated from" in m and "using it" in m for m in caplog.messages), caplog.messages
    assert not any("whose weights differ" in m for m in caplog.messages)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        own = evaluate_artifact(str(run / "calibrated"), str(data), adapter=str(run), max_len=64, generate=False)
    assert not any("whose weights differ" in m or "using it" in m for m in caplog.messages)
    assert got["eval_loss"] == own["eval_loss"]
    make_model(tmp_path / "src-b", "llama", seed=1, initializer_range=0.15)
    convert(str(tmp_path / "src-b"), tmp_path / "art-b", progress=False)
    with caplog.at_level(logging.WARNING):
        evaluate_artifact(str(tmp_path / "art-b"), str(data), adapter=str(run), max_len=64, generate=False)
    assert any("whose weights differ" in m for m in caplog.messages)
    from pact.runtime.evaluate import load_adapted, own_weights

    (run / "best").mkdir()  # RUN/best/ (as --eval-every keeps it) belongs to the same run
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (run / "best" / f).write_bytes((run / f).read_bytes())
    assert own_weights(str(tmp_path / "art"), str(run / "best")) == str(run / "calibrated")
    assert own_weights(str(tmp_path / "art-b"), str(run / "best")) == str(tmp_path / "art-b")
    from pact.pipelines.export import main as export_cli  # it reads calibrated/, and ART stays the user's:
    r = CliRunner().invoke(export_cli, [str(tmp_path / "art"), "--adapter", str(run), "--out",  # no export in it
                                        str(tmp_path / "art" / "exp"), "--quiet"])
    assert r.exit_code == 1 and "is inside the artifact" in r.output and not (tmp_path / "art" / "exp").exists()
    from pact.pipelines.export import _run_data

    assert Path(_run_data(str(run / "best"))).resolve() == data.resolve()  # --merge's texts: the run's --data

    for text in ('{"artifact": ', '{"activations": 5}'):  # a broken run record: the adapter still loads
        (run / "train_config.json").write_text(text)
        load_adapted(str(run / "calibrated"), str(run))


def test_train_calibrates_by_default_where_it_can(tmp_path, monkeypatch):
    """pact-train's default calibrates only where it can and should, and says why when it does not:
    the source model gone (trains on the artifact as it is, one note), under torchrun, a source that
    is a hub id, a calibrated or imported artifact (nothing said); resuming follows what the run
    trained on (an uncalibrated run is never calibrated under its checkpoints)."""
    import shutil

    from pact.calibrate.forrun import auto_calibrate
    from pact.pipelines.train import main as train_cli

    make_model(tmp_path / "src", "llama", initializer_range=0.15)
    art = convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    data = make_sentiment_jsonl(tmp_path / "train.jsonl", 40)
    assert auto_calibrate(str(art), str(data), tmp_path / "r0") == (True, None)
    few = make_sentiment_jsonl(tmp_path / "few.jsonl", 8)  # too few records for the default: a note
    do, why = auto_calibrate(str(art), str(few), tmp_path / "r0")
    assert not do and "has 8 records, fewer than the 32" in why
    r = CliRunner().invoke(train_cli, [str(art), "--data", str(few), "--out", str(tmp_path / "rq"), "--steps", "1",
                                       "--max-len", "64", "--batch-size", "4", "--quiet"])
    assert r.exit_code == 0 and "note: " in r.output and "fewer than the 32" in r.output, r.output  # (--quiet too)
    monkeypatch.setenv("WORLD_SIZE", "2")
    do, why = auto_calibrate(str(art), str(data), tmp_path / "r0")
    assert not do and "torchrun" in why and "pact-calibrate" in why
    monkeypatch.delenv("WORLD_SIZE")
    # an uncalibrated run resumed: not calibrated under its checkpoints, nothing to say
    args = [str(art), "--data", str(data), "--max-len", "64", "--batch-size", "8"]
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r1"), "--steps", "2", "--no-calibrate",
                                       "--save-every", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    assert auto_calibrate(str(art), str(data), tmp_path / "r1", resume=True) == (False, None)
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r1"), "--steps", "3", "--resume"])
    assert r.exit_code == 0 and "calibrat" not in r.output and not (tmp_path / "r1" / "calibrated").exists(), r.output
    # the source gone: one note naming it, and the run trains on the artifact as it is
    shutil.move(tmp_path / "src", tmp_path / "src-moved")
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r2"), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert f"uncalibrated: its source model {tmp_path / 'src'} is not on this machine" in r.output, r.output
    assert json.loads((tmp_path / "r2" / "train_config.json").read_text())["artifact"] == str(art.resolve())
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r3"), "--steps", "2", "--calibrate"])
    assert r.exit_code != 0 and "not there" in r.output  # --calibrate insists: refused, as before
    # an artifact calibrated on other texts: trained as it is, with a note; on --data itself: nothing said
    other = make_sentiment_jsonl(tmp_path / "other.jsonl", 12)
    shutil.move(tmp_path / "src-moved", tmp_path / "src")
    cal = calibrate(str(art), other, tmp_path / "cal-other", max_samples=8, seq_len=32, progress=False)
    assert auto_calibrate(str(cal), str(data), tmp_path / "r5") == (True, None)  # calibrated again, on --data
    own = calibrate(str(art), data, tmp_path / "cal-own", max_samples=40, seq_len=32, progress=False)
    assert auto_calibrate(str(own), str(data), tmp_path / "r5") == (False, None)
    few_cal = calibrate(str(art), data, tmp_path / "cal-few", max_samples=4, seq_len=32, progress=False)
    assert auto_calibrate(str(few_cal), str(data), tmp_path / "r5") == (True, None)  # 4 texts: calibrated again
    # another run's calibrated/: nothing said for the same --data, a note for other data
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r8"), "--steps", "2", "--save-every", "1",
                                       "--quiet"])
    assert r.exit_code == 0 and (tmp_path / "r8" / "calibrated").is_dir(), r.output
    assert auto_calibrate(str(tmp_path / "r8" / "calibrated"), str(data), tmp_path / "r9") == (False, None)
    do, note = auto_calibrate(str(tmp_path / "r8" / "calibrated"), str(other), tmp_path / "r9")
    assert not do and "not on --data" in note and "fewer than the 32" in note  # (other: 12 records)
    # an artifact calibrated on other texts, trained with its source here: calibrated again on --data (GPTQ
    # re-reads the source; each layer's own forward runs on that artifact's codes, so the codes are not those
    # of the converter's artifact calibrated on --data, except where the inputs are the embeddings')
    r = CliRunner().invoke(train_cli, [str(cal), *args[1:], "--out", str(tmp_path / "r10"), "--steps", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    again, first = open_artifact(tmp_path / "r10" / "calibrated"), open_artifact(tmp_path / "r8" / "calibrated")
    rec = again.meta["provenance"]["calibration"]
    assert "--data" in rec["prompts"] and rec["from_artifact"] == str(cal.resolve())
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again.nvfp4(q0).packed, first.nvfp4(q0).packed)
    assert not torch.equal(again.nvfp4(q0).packed, open_artifact(cal).nvfp4(q0).packed)
    # an adapter in a checkpoint belongs to its run: the run's calibrated/ is used
    from pact.runtime.evaluate import own_weights

    step = sorted((tmp_path / "r8" / "checkpoints").glob("step-*"))[-1]
    assert own_weights(str(art), str(step)) == str(tmp_path / "r8" / "calibrated")
    # what a killed recalibration left beside calibrated/ is removed when calibrated/ is reused
    from pact.calibrate.forrun import calibrate_for_run

    left = tmp_path / "r8" / ".calibrated.tmp-999999-deadbeef"
    left.mkdir()
    calibrate_for_run(str(art), str(data), tmp_path / "r8", seq_len=64, resume=True, progress=False)
    assert not left.exists()
    # the source path holds another model now: a note, and the run trains uncalibrated (never on a mix of
    # two models); --calibrate refuses, naming pact-calibrate --source and --no-calibrate
    shutil.move(tmp_path / "src", tmp_path / "src-orig")
    make_model(tmp_path / "src", "llama", seed=1, initializer_range=0.15)
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r6"), "--steps", "2"])
    assert r.exit_code == 0 and "could not calibrate: " in r.output and "converted from" in r.output, r.output
    assert not (tmp_path / "r6" / "calibrated").exists()
    assert json.loads((tmp_path / "r6" / "train_config.json").read_text())["artifact"] == str(art.resolve())
    r = CliRunner().invoke(train_cli, [*args, "--out", str(tmp_path / "r7"), "--steps", "2", "--calibrate"])
    assert r.exit_code != 0 and "--source ORIGINAL_MODEL" in r.output and "--no-calibrate" in r.output, r.output
    # a hub id as the source: said, not fetched
    import zarr

    g = zarr.open_group(str(art), mode="r+")
    meta = dict(g.attrs["pact"])
    meta["provenance"] = {**meta["provenance"], "source": "org/model"}
    g.attrs["pact"] = meta
    do, why = auto_calibrate(str(art), str(data), tmp_path / "r4")
    assert not do and "org/model, not a local path" in why


def test_train_calibrate_refusals_and_recovery(tmp_path, caplog):
    """--calibrate's reuse follows the artifact's weights (not its path) and refuses a damaged copy;
    --resume never recalibrates under checkpoints; a run that fails after calibrating leaves only
    calibrated/ (the rerun reuses it); bad records, a gone source and a broken run record are said."""
    from pact.calibrate.forrun import calibrate_for_run
    from pact.pipelines.train import main as train_cli
    from pact.runtime.evaluate import warn_other_weights

    for name, seed in (("a", 0), ("b", 1)):
        make_model(tmp_path / f"src-{name}", "llama", seed=seed, initializer_range=0.15)
        convert(str(tmp_path / f"src-{name}"), tmp_path / f"art-{name}", progress=False)
    data = make_sentiment_jsonl(tmp_path / "train.jsonl", 40)
    (tmp_path / "art").symlink_to(tmp_path / "art-a")
    run = tmp_path / "run"
    first = calibrate_for_run(str(tmp_path / "art"), str(data), run, samples=8, seq_len=64, progress=False)
    fp_a = open_artifact(first).meta["provenance"]["calibration"]["for_run"]["artifact_fingerprint"]
    (tmp_path / "art").unlink()
    (tmp_path / "art").symlink_to(tmp_path / "art-b")  # another model's artifact at the same path: calibrated anew
    again = open_artifact(calibrate_for_run(str(tmp_path / "art"), str(data), run, samples=8, seq_len=64,
                                            progress=False))
    assert again.meta["provenance"]["calibration"]["for_run"]["artifact_fingerprint"] == open_artifact(
        tmp_path / "art-b").fingerprint() != fp_a
    chunk = next(p for p in sorted((run / "calibrated" / "tensors").rglob("*"))
                 if p.is_file() and p.suffix != ".json" and p.stat().st_size > 4096)
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))  # damaged: made again, not reused
    with caplog.at_level(logging.WARNING):
        fixed = calibrate_for_run(str(tmp_path / "art"), str(data), run, samples=8, seq_len=64, progress=False)
    assert any("is damaged" in m for m in caplog.messages) and open_artifact(fixed).verify() > 0
    # killed between the two renames of a recalibration: calibrated/ aside, renamed back and reused
    stamp = (run / "calibrated" / "zarr.json").stat().st_mtime_ns
    (run / "calibrated").rename(run / ".calibrated.old-999999999-deadbeef")
    assert calibrate_for_run(str(tmp_path / "art"), str(data), run, samples=8, seq_len=64, progress=False) == fixed
    assert (run / "calibrated" / "zarr.json").stat().st_mtime_ns == stamp
    # a failure after calibration, before the first step: only calibrated/ stays; the fixed rerun reuses it
    args = [str(tmp_path / "art"), "--data", str(data), "--out", str(run), "--steps", "2", "--batch-size", "8",
            "--max-len", "64", "--quiet", "--calibrate", "--calibrate-samples", "8"]
    r = CliRunner().invoke(train_cli, [*args, "--lora-layers", "top:99"])
    assert r.exit_code != 0 and sorted(p.name for p in run.iterdir() if p.name != ".lock") == ["calibrated"]
    # settings the model refuses are refused before GPTQ: a new --out gets no calibrated/ for them
    for bad, said in (("--lora-layers=top:99", "the model has 2 decoder blocks"),
                      ("--kernels=triton", "TRITON_INTERPRET"), ("--targets=q_proj,bogus_proj", "--targets: unknown")):
        env = {"TRITON_INTERPRET": "0"} if "triton" in bad else {}
        r = CliRunner().invoke(train_cli, [*args[:4], str(tmp_path / "run2"), *args[5:], bad], env=env)
        assert r.exit_code != 0 and said in r.output, r.output
        assert not (tmp_path / "run2" / "calibrated").exists()
    stamp = (run / "calibrated" / "zarr.json").stat().st_mtime_ns
    r = CliRunner().invoke(train_cli, [*args, "--save-every", "1"])
    assert r.exit_code == 0, r.output
    assert (run / "calibrated" / "zarr.json").stat().st_mtime_ns == stamp
    # --resume with other calibration settings: refused before any GPTQ, the weights the checkpoints learned on kept
    (run / "adapter_model.safetensors").unlink()  # (as if killed after its checkpoints)
    r = CliRunner().invoke(train_cli, [*args[:-1], "4", "--save-every", "1", "--steps", "3", "--resume"])
    assert r.exit_code != 0 and "--resume: " in r.output and "learned on it" in r.output
    assert (run / "calibrated" / "zarr.json").stat().st_mtime_ns == stamp
    # no flag (the default): the run resumes on its own calibrated/ as it is, whatever --calibrate-samples says
    r = CliRunner().invoke(train_cli, [*args[:-4], "--save-every", "1", "--steps", "3", "--resume"])
    assert r.exit_code == 0, r.output
    assert json.loads((run / "train_config.json").read_text())["artifact"] == str(run / "calibrated")
    assert (run / "calibrated" / "zarr.json").stat().st_mtime_ns == stamp
    (run / "adapter_model.safetensors").unlink()
    # the run folder moved elsewhere: --resume --calibrate resumes it there, on its calibrated/ as it is
    moved = tmp_path / "moved" / "run"
    moved.parent.mkdir()
    run.rename(moved)
    r = CliRunner().invoke(train_cli, [*[str(moved) if a == str(run) else a for a in args], "--save-every", "1",
                                       "--steps", "4", "--resume"])
    assert r.exit_code == 0, r.output
    assert (moved / "calibrated" / "zarr.json").stat().st_mtime_ns == stamp
    assert json.loads((moved / "train_config.json").read_text())["artifact"] == str(moved / "calibrated")
    moved2 = tmp_path / "moved" / "run2"  # moved again, not resumed since: the warning names where its weights are
    moved.rename(moved2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_other_weights(str(moved2), open_artifact(tmp_path / "art"), "pact-eval")
    assert any(f"trained on {moved2 / 'calibrated'}," in m for m in caplog.messages), caplog.messages
    # resumed by its train_config.json, which names the old folder: it trains where it is, on its calibrated/
    (moved2 / "adapter_model.safetensors").unlink()
    r = CliRunner().invoke(train_cli, ["--config", str(moved2 / "train_config.json"), "--steps", "5", "--resume",
                                       "--quiet"])
    assert r.exit_code == 0 and "training there" in r.output, r.output
    assert json.loads((moved2 / "train_config.json").read_text())["artifact"] == str(moved2 / "calibrated")
    (moved2 / "calibrated").rename(tmp_path / "aside")  # its calibrated/ gone: said, nothing remade
    (moved2 / "adapter_model.safetensors").unlink()
    r = CliRunner().invoke(train_cli, [*[str(moved2) if a == str(run) else a for a in args], "--save-every", "1",
                                       "--steps", "3", "--resume"])
    assert r.exit_code != 0 and "weights) is gone" in r.output and not (moved2 / "calibrated").exists(), r.output
    r = CliRunner().invoke(train_cli, [*[str(moved2) if a == str(run) else a for a in args[:-3]], "--save-every", "1",
                                       "--steps", "3", "--resume"])  # the default: the same refusal, nothing remade
    assert r.exit_code != 0 and "weights) is gone" in r.output and not (moved2 / "calibrated").exists(), r.output
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # evaluated without its calibrated/: said as such
        warn_other_weights(str(moved2), open_artifact(tmp_path / "art"), "pact-eval")
    assert any("which are gone" in m for m in caplog.messages), caplog.messages
    # a record training would refuse names --data's own file, and no --out is left behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": "a"}\n')
    with pytest.raises(PactError, match="bad.jsonl:1"):
        calibrate_for_run(str(tmp_path / "art"), str(bad), tmp_path / "run-bad", progress=False)
    assert not (tmp_path / "run-bad").exists()
    # a record of the wrong type, or with an empty completion, anywhere in --data or --eval-data: refused
    # by training's own tokenization before any GPTQ, and no --out left
    lines = data.read_text().splitlines(keepends=True)
    for i, rec in ((4, '{"prompt": 5, "completion": " x"}\n'), (20, '{"prompt": "p", "completion": ""}\n')):
        (tmp_path / "typed.jsonl").write_text("".join(lines[:i] + [rec] + lines[i:]))
        for flags in (["--data", str(tmp_path / "typed.jsonl")], ["--data", str(data), "--eval-data",
                                                                   str(tmp_path / "typed.jsonl")]):
            r = CliRunner().invoke(train_cli, [str(tmp_path / "art"), *flags, "--out", str(tmp_path / "run-typed"),
                                               "--steps", "1", "--max-len", "64", "--quiet", "--calibrate"])
            assert r.exit_code != 0 and f"typed.jsonl:{i + 1}" in r.output and not (tmp_path / "run-typed").exists()
    # a calibrated/ that is not a readable artifact: said, with the fix (pact-train has no --overwrite)
    (tmp_path / "run-odd" / "calibrated").mkdir(parents=True)
    (tmp_path / "run-odd" / "calibrated" / "zarr.json").write_text("{")
    with pytest.raises(PactError, match="not a readable artifact .* remove it"):
        calibrate_for_run(str(tmp_path / "art"), str(data), tmp_path / "run-odd", samples=8, progress=False)
    # a calibrated/ pact-train did not make (pact-calibrate's output named so): never counted as the run's
    # own, never replaced
    user = tmp_path / "user"
    calibrate(str(tmp_path / "art-a"), data, user / "calibrated", max_samples=4, seq_len=32, progress=False)
    stamp = (user / "calibrated" / "zarr.json").stat().st_mtime_ns
    with pytest.raises(PactError, match="did not make .* never replaced"):
        calibrate_for_run(str(tmp_path / "art"), str(data), user, samples=8, progress=False)
    r = CliRunner().invoke(train_cli, [str(tmp_path / "art"), "--data", str(data), "--out", str(user), "--steps", "1",
                                       "--max-len", "64", "--quiet"])  # the default would calibrate there: refused
    assert r.exit_code != 0 and "never replaced; choose another --out" in r.output
    r = CliRunner().invoke(train_cli, [str(tmp_path / "art"), "--data", str(data), "--out", str(user), "--steps", "1",
                                       "--max-len", "64", "--quiet", "--no-calibrate"])
    assert r.exit_code != 0 and "is not empty" in r.output
    assert (user / "calibrated" / "zarr.json").stat().st_mtime_ns == stamp and len(list(user.iterdir())) == 1
    # the source model gone: said before anything, with the way around it
    import shutil

    shutil.copytree(tmp_path / "src-a", tmp_path / "src-gone")
    convert(str(tmp_path / "src-gone"), tmp_path / "art-gone", progress=False)
    shutil.rmtree(tmp_path / "src-gone")
    with pytest.raises(PactError, match="--calibrate needs the model .* pact-calibrate"):
        calibrate_for_run(str(tmp_path / "art-gone"), str(data), tmp_path / "run-gone", progress=False)
    assert not (tmp_path / "run-gone").exists()
    # an unreadable run record: no warning, no crash
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "train_config.json").write_text('{"artifact": ')
    warn_other_weights(str(tmp_path / "broken"), open_artifact(tmp_path / "art-a"), "pact-export")
    (tmp_path / "broken" / "train_config.json").write_text("[1, 2]")
    warn_other_weights(str(tmp_path / "broken"), open_artifact(tmp_path / "art-a"), "pact-export")
    from pact.runtime.evaluate import run_record

    assert run_record(str(tmp_path / "broken")) == {}


def test_calibrate_refuses_bad_lengths_and_records_as_pact_train_does(setup, tmp_path):
    """--seq-len below 2 names the flag (not the prompts file, nor a traceback); a record whose fields are not
    text is refused as pact-train refuses it (never calibrated on str(5) or str(None)), a malformed
    conversation as a data error (not the chat template's; a null content, a turn that only calls tools, is
    the template's to render), and --source that is not a model as --source's."""
    ok = setup / "prompts.jsonl"
    for bad in ("-4", "0", "1"):
        r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--prompts", str(ok), "--seq-len", bad,
                                               "--out", str(tmp_path / "c"), "--quiet"])
        assert r.exit_code == 1 and f"--seq-len must be >= 2 (tokens a prompt), got {bad}" in r.output, r.output
        assert "Traceback" not in r.output
    cases = {'{"prompt": 5, "completion": ["x"]}': "prompt must be a string, got int",
             '{"prompt": null, "completion": "x"}': "prompt must be a string, got null",
             '{"prompt": "a", "completion": 7}': "completion must be a string, got int",
             '{"messages": "hi"}': "'messages' must be a non-empty list of {role, content} objects",
             '{"messages": [{"role": "user", "content": 5}]}': "message 1's content must be a string, got int",
             '{"text": 5}': "text must be a string, got int"}
    for i, (line, why) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text(json.dumps({"text": "a fine first record"}) + "\n" + line + "\n")
        r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--prompts", str(f), "--out",
                                               str(tmp_path / "c"), "--quiet"])
        assert r.exit_code == 1 and f"{f}:2: {why}" in r.output, (line, r.output)
        assert "chat template" not in r.output
    assert not (tmp_path / "c").exists()
    (tmp_path / "notmodel").mkdir()
    (tmp_path / "notmodel" / "notes.txt").write_text("not a model\n")
    r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--prompts", str(ok), "--source",
                                           str(tmp_path / "notmodel"), "--out", str(tmp_path / "c"), "--quiet"])
    assert r.exit_code == 1 and f"--source {tmp_path / 'notmodel'} has no config.json: not a model" in r.output
    assert "pact-convert" not in r.output and not (tmp_path / "c").exists()
    from pact.runtime.data import check_conversation

    calls = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": []}]
    check_conversation(calls, "f:1", null_content=True)  # calibration renders a turn that only calls tools
    with pytest.raises(PactError, match="f:1: message 2's content must be a string, got null"):
        check_conversation(calls, "f:1")  # training learns text


# ---- --correct-rank: a frozen low-rank correction of what the NVFP4 weights miss


@pytest.fixture(scope="module")
def corrected(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("corr") / "c"
    return open_artifact(calibrate(str(setup / "art"), setup / "prompts.jsonl", out, correct_rank=4, seq_len=64,
                                   progress=False))


def test_correction_is_stored_and_lowers_the_output_error(corrected):
    """Each projection stores U [N, 4], V [4, K] in bf16; the model's weight is dequantize + U V; on the
    calibration inputs the layer outputs come nearer the source's than GPTQ's alone."""
    corrected.verify()
    cal = corrected.meta["provenance"]["calibration"]
    assert cal["correct_rank"] == 4 and corrected.corrected
    ratios = []
    for name in corrected.names("nvfp4"):
        n, k = corrected.entry(name)["shape"]
        u, v = corrected.correction(name)
        assert (u.dtype, tuple(u.shape), v.dtype, tuple(v.shape)) == (torch.bfloat16, (n, 4), torch.bfloat16, (4, k))
        torch.testing.assert_close(corrected.dequantize(name),
                                   F.dequantize(corrected.nvfp4(name)) + u.float() @ v.float())
        torch.testing.assert_close(corrected.dequantize(name, "bwd"), corrected.dequantize(name).t())
        e = cal["layer_output_error"][name]
        ratios.append(e["corrected"] / e["gptq"])
    ratios.sort()
    assert ratios[len(ratios) // 2] < 0.9 and ratios[-1] < 1.05, ratios


def test_correction_in_forward_and_backward(corrected, setup):
    """The model computes with the corrected weights both ways: transformers + PEFT on dequantize + U V
    (the reference) give the same loss and LoRA gradients."""
    import test_model as tm
    from pact.formats.peft import LoraConfig
    from pact.runtime.model import PactModel

    model = PactModel(corrected, LoraConfig(r=tm.R, alpha=tm.ALPHA), activations="bf16")
    assert any(c is not None for L in model.layers for c in L.gate_up.corr)
    ours, ref, cos = tm._against_hf(corrected, setup / "src", model)
    assert ours == pytest.approx(ref, rel=2e-3)
    assert min(cos.values()) >= 0.999, min(cos.items(), key=lambda kv: kv[1])


def test_group_correction_with_some_members_and_mixed_ranks():
    """A group whose members carry corrections of different ranks, or none: each member's slice of the output gets
    x V_i^T U_i^T and the input gradient sum_i (dY_i U_i) V_i, and a member without one is left as it was; a new
    list of corrections (a recalibration) is used at once, not the fused copy of the old one."""
    from pact.runtime import functions as fn

    gen = torch.Generator().manual_seed(0)
    sizes, k, t = [8, 4, 4], 16, 5
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    corr = [(r(8, 3), r(3, k)), None, (r(4, 2), r(2, k))]
    g = fn.FrozenGroup(names=["q", "k", "v"], sizes=sizes, corr=corr)
    x, y0, dy, dx0 = r(t, k), r(t, 16), r(t, 16), r(t, k)
    for _ in range(2):  # made once, then read from the cache
        y, dx = y0.clone(), dx0.clone()
        fn._correct(g, y, x)
        fn._correct_backward(g, dy, dx)
        want_y, want_dx, off = y0.float().clone(), dx0.float().clone(), 0
        for c, n in zip(corr, sizes):
            if c is not None:
                want_y[:, off : off + n] += x.float() @ (c[0].float() @ c[1].float()).t()
                want_dx += dy[:, off : off + n].float() @ c[0].float() @ c[1].float()
            off += n
        assert torch.equal(y[:, 8:12], y0[:, 8:12])  # the member without a correction
        torch.testing.assert_close(y.float(), want_y, rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(dx.float(), want_dx, rtol=2e-2, atol=5e-2)
    g.corr = [None, None, (r(4, 2), r(2, k))]
    y = y0.clone()
    fn._correct(g, y, x)
    assert torch.equal(y[:, :12], y0[:, :12]) and not torch.equal(y[:, 12:], y0[:, 12:])


def test_correction_rides_on_the_lora_gemms(monkeypatch):
    """With adapters (no dropout) a corrected group adds its correction through the LoRA GEMMs ([A; V] in, [s B;
    U] out, one pass over y and dX): the same output, input gradient and LoRA gradients as the correction made
    apart, for members with and without an adapter or a correction, ranks mixed; the xa's kept for backward are
    the LoRA columns only."""
    from pact.runtime import functions as fn
    from pact.runtime.ops.rows import DenseRows

    gen = torch.Generator().manual_seed(1)
    sizes, k, t = [8, 4, 4], 16, 6
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    corr = [(r(8, 3).bfloat16(), r(3, k).bfloat16()), None, (r(4, 2).bfloat16(), r(2, k).bfloat16())]
    loras = [fn.Lora(torch.nn.Parameter(r(4, k)), torch.nn.Parameter(r(8, 4)), 1.5, 0.0), None,
             fn.Lora(torch.nn.Parameter(r(2, k)), torch.nn.Parameter(r(4, 2)), 0.5, 0.0)]
    g = fn.FrozenGroup(names=["q", "k", "v"], sizes=sizes, dense=r(16, k).bfloat16(), loras=loras, corr=corr)
    x, dy = r(t, k).bfloat16(), r(t, 16).bfloat16()
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(fn, "_fused_corr", lambda g, f=fused: f and any(c is not None for c in g.corr))
        y, xas, seeds = fn.project(None, g, DenseRows(x), x)
        dx, grads = fn.project_backward(None, g, dy, x, xas, seeds)
        out[fused] = y, dx, grads, xas
    (y1, dx1, g1, xa1), (y0, dx0, g0, _) = out[True], out[False]
    torch.testing.assert_close(y1.float(), y0.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(dx1.float(), dx0.float(), rtol=2e-2, atol=5e-2)
    assert g1[1] is None and g0[1] is None and xa1[1] is None
    for a, b in ((g1[0], g0[0]), (g1[2], g0[2])):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(ga, gb, rtol=2e-2, atol=5e-2)
    assert [tuple(t.shape) for t in xa1 if t is not None] == [(t, 4), (t, 2)]
    assert xa1[0].untyped_storage().nbytes() == t * 6 * 2  # the LoRA columns alone, not V's
    want = x.float() @ g.dense.float().t()  # the reference in fp32: frozen + correction + LoRA
    off = 0
    for c, lo, n in zip(corr, loras, sizes):
        if c is not None:
            want[:, off : off + n] += x.float() @ (c[0].float() @ c[1].float()).t()
        if lo is not None:
            want[:, off : off + n] += lo.scale * (x.float() @ lo.A.t()) @ lo.B.t()
        off += n
    torch.testing.assert_close(y1.float(), want, rtol=2e-2, atol=1e-1)


def test_correction_exports_to_bf16_only(corrected, tmp_path):
    """An NVFP4 checkpoint cannot hold the correction: that export is refused, in one line naming the fix;
    the bf16 export holds the weights the model computes with."""
    from pact.convert.export import export

    with pytest.raises(PactError, match=r"low-rank corrections .* export --format bf16"):
        export(str(corrected.path), tmp_path / "ct")
    export(str(corrected.path), tmp_path / "bf16", fmt="bf16")
    sd = load_file(tmp_path / "bf16" / "model.safetensors")
    name = corrected.names("nvfp4")[0]
    torch.testing.assert_close(sd[name].float(), corrected.dequantize(name).to(torch.bfloat16).float())


@pytest.mark.parametrize("edit,match", [
    (lambda e: e["arrays"].pop("corr_v"), "has arrays"),
    (lambda e: e["arrays"]["corr_u"].update(shape=[e["shape"][0], 5]), "is bfloat16"),
    (lambda e: e["arrays"]["corr_u"].update(shape=[e["shape"][0], 10**6]), "a correction of rank 1000000"),
])
def test_a_malformed_correction_is_refused(corrected, tmp_path, edit, match):
    import shutil

    from conftest import edit_manifest

    art = tmp_path / "a"
    shutil.copytree(corrected.path, art)
    edit_manifest(art, lambda m: edit(m["tensors"][corrected.names("nvfp4")[0]]))
    with pytest.raises(ArtifactError, match=match):
        open_artifact(art)


def test_correct_rank_is_checked(setup, tmp_path):
    r = CliRunner().invoke(calibrate_cli, [str(setup / "art"), "--prompts", str(setup / "prompts.jsonl"), "--out",
                                           str(tmp_path / "c"), "--correct-rank", "-1"])
    assert r.exit_code != 0 and "--correct-rank must be in [0, 1024]" in r.output and not (tmp_path / "c").exists()


def test_a_run_recalibrates_a_corrected_artifact_with_its_rank(corrected, setup, tmp_path):
    """pact-train's calibration of a corrected artifact on the run's texts keeps a correction of the same
    rank (it would otherwise drop what the user chose)."""
    from pact.calibrate.forrun import calibrate_for_run

    data = make_sentiment_jsonl(tmp_path / "train.jsonl", 32)
    out = calibrate_for_run(str(corrected.path), str(data), tmp_path / "run", samples=16, seq_len=64, progress=False)
    art = open_artifact(out)
    assert art.meta["provenance"]["calibration"]["correct_rank"] == 4
    assert all(art.correction(n)[1].shape[0] == 4 for n in art.names("nvfp4"))


def test_train_calibrate_correct_rank(setup, tmp_path):
    """pact-train --calibrate-correct-rank R: the run's calibration fits a rank-R correction (it implies
    --calibrate), the same command reuses it, and another rank calibrates again; with --no-calibrate or out of
    range it is one error before anything is made."""
    import shutil

    from pact.pipelines.train import main as train_cli

    data = make_sentiment_jsonl(tmp_path / "train.jsonl", 32)
    run = tmp_path / "run"
    args = [str(setup / "art"), "--data", str(data), "--out", str(run), "--steps", "1", "--batch-size", "4",
            "--max-len", "64", "--calibrate-samples", "16", "--quiet"]
    for bad, said in ((["--calibrate-correct-rank", "2", "--no-calibrate"], "drop one of them"),
                      (["--calibrate-correct-rank", "2000"], "must be in [0, 1024]")):
        r = CliRunner().invoke(train_cli, [*args, *bad])
        assert r.exit_code != 0 and said in r.output and not run.exists(), r.output
    r = CliRunner().invoke(train_cli, [*args, "--calibrate-correct-rank", "2"])
    assert r.exit_code == 0, r.output
    art = open_artifact(run / "calibrated")
    assert art.meta["provenance"]["calibration"]["correct_rank"] == 2
    assert all(art.correction(n)[1].shape[0] == 2 for n in art.names("nvfp4"))
    run2 = tmp_path / "run2"
    shutil.copytree(run / "calibrated", run2 / "calibrated")  # the same run's calibration, in a new --out
    made = (run2 / "calibrated" / "zarr.json").stat().st_mtime_ns
    r = CliRunner().invoke(train_cli, [*args[:4], str(run2), *args[5:], "--calibrate-correct-rank", "2"])
    assert r.exit_code == 0, r.output
    assert (run2 / "calibrated" / "zarr.json").stat().st_mtime_ns == made  # reused, not made again
    run3 = tmp_path / "run3"
    shutil.copytree(run / "calibrated", run3 / "calibrated")
    r = CliRunner().invoke(train_cli, [*args[:4], str(run3), *args[5:], "--calibrate-correct-rank", "3"])
    assert r.exit_code == 0, r.output
    assert open_artifact(run3 / "calibrated").meta["provenance"]["calibration"]["correct_rank"] == 3
    # a resumed run keeps the weights it learned on: another rank is refused, and the message says which
    run4, steps = tmp_path / "run4", args.index("--steps") + 1
    more = [*args[:4], str(run4), *args[5:steps], "2", *args[steps + 1:], "--save-every", "1"]
    assert CliRunner().invoke(train_cli, [*more, "--calibrate-correct-rank", "2"]).exit_code == 0
    more[steps] = "3"
    r = CliRunner().invoke(train_cli, [*more, "--resume", "--calibrate-correct-rank", "3"])
    assert r.exit_code != 0 and "holds a rank-2 correction where these settings ask for rank 3" in r.output, r.output


def test_train_calibrate_correct_rank_under_torchrun(setup, tmp_path, monkeypatch):
    """Several processes cannot calibrate: the refusal names the flag given and the pact-calibrate line that
    keeps the correction."""
    from pact.pipelines.train import main as train_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    data = make_sentiment_jsonl(tmp_path / "train.jsonl", 32)
    r = CliRunner().invoke(train_cli, [str(setup / "art"), "--data", str(data), "--out", str(tmp_path / "run"),
                                       "--steps", "1", "--quiet", "--calibrate-correct-rank", "2"])
    assert r.exit_code != 0 and "--calibrate-correct-rank under torchrun" in r.output, r.output
    assert "--correct-rank 2 --out CALIBRATED/" in r.output


def test_recalibrating_without_a_correction_drops_the_old_one(corrected, setup, tmp_path, monkeypatch):
    """Calibrated again without --correct-rank, a corrected artifact keeps no correction, and once a group is
    solved the layers after it see its new weights alone: a correction fitted to older codes is dropped."""
    from pact.runtime import functions

    seen = []
    real = functions._correct

    def spy(g, y, x):
        seen.append(bool(g.corr))
        return real(g, y, x)

    monkeypatch.setattr(functions, "_correct", spy)
    again = open_artifact(calibrate(str(corrected.path), setup / "prompts.jsonl", tmp_path / "a", seq_len=64,
                                    progress=False))
    assert not again.corrected
    groups = 4 * corrected.meta["hf_config"]["num_hidden_layers"]  # q|k|v, o, gate|up, down in every layer
    # each layer runs twice a unit (the Hessians' pass on the artifact's weights, then the pass on the solved
    # ones that feeds the next layer): the second holds no correction
    per_layer = len(seen) // corrected.meta["hf_config"]["num_hidden_layers"]
    for i in range(0, len(seen), per_layer):
        first, second = seen[i:i + per_layer // 2], seen[i + per_layer // 2:i + per_layer]
        assert all(first) and not any(second), (i, first, second)
    assert len(seen) % groups == 0


def test_a_hub_source_the_artifact_names_is_bounded_before_download(tmp_path, monkeypatch):
    """An artifact (maybe a stranger's) naming a hub repo as its source: pact-calibrate without --source asks the
    hub for the repo's file sizes first and downloads nothing past what the artifact's weights can need
    (source_bound: 4 bytes a weight); within the bound it downloads that very commit."""
    import huggingface_hub

    from pact.calibrate.calibrate import source_bound

    make_model(tmp_path / "src", "llama")
    art = convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    root = json.loads((art / "zarr.json").read_text())
    root["attributes"]["pact"]["provenance"]["source"] = "attacker-org/one-terabyte"
    (art / "zarr.json").write_text(json.dumps(root))
    prompts = make_sentiment_jsonl(tmp_path / "p.jsonl", 8)
    bound = source_bound(open_artifact(art))
    n = sum(p.numel() for p in load_file(next((tmp_path / "src").glob("*.safetensors"))).values())
    assert 4 * n <= bound <= 4 * n + (256 << 20)
    downloads = []

    class Info:
        sha = "0123abcd" * 5

        def __init__(self, size):
            self.siblings = [types.SimpleNamespace(rfilename="model.safetensors", size=size),
                             types.SimpleNamespace(rfilename="config.json", size=1000),
                             types.SimpleNamespace(rfilename="weights.bin", size=10**12)]  # (not a source file)

    size = {"v": 10**12}
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **kw: Info(size["v"]))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: downloads.append((repo, kw)) or str(tmp_path / "src"))
    with pytest.raises(PactError, match=r"'attacker-org/one-terabyte': its model files come to 1000.00 GB, more than "
                                        r"the [0-9.]+ GB the artifact's weights need as a source .*not downloaded"):
        calibrate(str(art), prompts, tmp_path / "out", max_samples=4, seq_len=16, progress=False)
    assert downloads == [] and not (tmp_path / "out").exists()
    size["v"] = 2 * n  # a bf16 checkpoint of these weights: fetched, at the commit the sizes came from
    assert open_artifact(calibrate(str(art), prompts, tmp_path / "out", max_samples=4, seq_len=16, progress=False))
    assert [(r, kw["revision"], kw["local_files_only"]) for r, kw in downloads] == [
        ("attacker-org/one-terabyte", Info.sha, False)]

    def offline(self, repo, **kw):
        raise huggingface_hub.errors.OfflineModeIsEnabled("offline")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", offline)  # offline: the hub cache only, as before
    assert open_artifact(calibrate(str(art), prompts, tmp_path / "out2", max_samples=4, seq_len=16, progress=False))
    assert downloads[-1][1]["local_files_only"] is True
