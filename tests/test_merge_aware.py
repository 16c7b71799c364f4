"""Merge-aware training (`pact-train --merge-aware-steps N`): the last N steps compute the adapted
projections with W + s B A re-quantized exactly as `pact-export --merge --merge-method rtn` writes
them (gradients straight through the rounding), so the merged export is the model those steps
trained; the export then rounds to nearest by default."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_converted_llama
from pact.formats import PactError, open_artifact

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def merge_aware(tmp_path_factory):
    """A tiny Llama, and a run whose last 2 of 4 steps trained the merged, re-quantized weights."""
    from pact.runtime.trainer import TrainConfig, train

    d = make_converted_llama(tmp_path_factory.mktemp("ma"), 16)
    train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(d / "run"), steps=4,
                      batch_size=4, max_len=64, lr=5e-3, warmup_ratio=0.0, merge_aware_steps=2), progress=False)
    return d


def _model(art, run, *, merged: bool):
    from pact.formats.peft import load_peft_adapter
    from pact.runtime.model import PactModel

    cfg, weights = load_peft_adapter(run)
    model = PactModel(open_artifact(art), cfg, activations="bf16")
    model.load_adapter_state(weights)
    if merged:
        model.merge_aware()
    return model


def test_the_merged_export_holds_what_the_run_trained(merge_aware, tmp_path):
    """`pact-export --merge` of a merge-aware run picks the plain merge (auto), and its weights,
    imported back as stored, are the ones the merge-aware forward computes with: the same values
    for every adapted projection, and the same logits."""
    from click.testing import CliRunner

    from pact.convert import convert
    from pact.pipelines.export import main as export_cli
    from pact.runtime.functions import requantized_merge

    d = merge_aware
    assert json.loads((d / "run" / "train_config.json").read_text())["merge_aware_steps"] == 2
    r = CliRunner().invoke(export_cli, [str(d / "art"), "--out", str(tmp_path / "m"), "--adapter", str(d / "run"),
                                        "--merge", "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["merge"] == {"method": "rtn"}
    back = open_artifact(convert(str(tmp_path / "m"), tmp_path / "back", progress=False))
    model = _model(d / "art", d / "run", merged=True)
    checked = 0
    for L in model.layers:
        for g in (L.qkv, L.o, L.gate_up, L.down):
            want, off = requantized_merge(g, g.merge_rule), 0
            for name, n in zip(g.names, g.sizes):
                # compressed-tensors stores 1 / g: g may come back one fp32 step away
                torch.testing.assert_close(back.dequantize(name), want[off : off + n], rtol=2**-20, atol=0)
                off += n
                checked += 1
    assert checked == 14
    ids = torch.randint(0, 200, (2, 24))
    from pact.runtime.model import PactModel

    served = PactModel(back, None, activations="bf16").logits(ids)
    torch.testing.assert_close(model.logits(ids), served, rtol=0.02, atol=0.02)
    # not the unmerged model's: the rounding the steps trained with is in these logits
    apart = _model(d / "art", d / "run", merged=False).logits(ids)
    assert not torch.allclose(apart, served, rtol=1e-3, atol=1e-3)


def test_merge_method_auto_and_explicit(merge_aware, tmp_path):
    """auto is GPTQ for an ordinary run (the merge-aware run's config edited back to 0), and an
    explicit --merge-method wins over auto."""
    import shutil

    from click.testing import CliRunner

    from pact.pipelines.export import main as export_cli

    d = merge_aware
    plain = tmp_path / "plain-run"
    shutil.copytree(d / "run", plain)
    cfg = json.loads((plain / "train_config.json").read_text())
    (plain / "train_config.json").write_text(json.dumps({**cfg, "merge_aware_steps": 0}))
    for run, extra, want in ((plain, [], "gptq"), (d / "run", ["--merge-method", "gptq"], "gptq")):
        r = CliRunner().invoke(export_cli, [str(d / "art"), "--out", str(tmp_path / want / run.name), "--adapter",
                                            str(run), "--merge", "--merge-samples", "4", "--quiet", *extra])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["merge"]["method"] == want


def test_the_merge_aware_steps_train_the_adapter(tmp_path):
    """With every step merge-aware, B (zero at the start) still moves: the straight-through gradients
    reach the adapter; the ordinary forward comes back with merge_aware(False)."""
    from pact.runtime.trainer import TrainConfig, train

    d = make_converted_llama(tmp_path, 8)
    train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(d / "run"), steps=2,
                      batch_size=4, max_len=64, lr=5e-3, warmup_ratio=0.0, merge_aware_steps=2), progress=False)
    model = _model(d / "art", d / "run", merged=True)
    assert all(float(lo.B.detach().abs().max()) > 0 for lo in model.adapters.values())
    ids = torch.randint(0, 200, (1, 16))
    merged = model.logits(ids)
    model.merge_aware(False)
    assert all(g.merge_rule is None for L in model.layers for g in (L.qkv, L.o, L.gate_up, L.down))
    torch.testing.assert_close(model.logits(ids), _model(d / "art", d / "run", merged=False).logits(ids))
    assert not torch.equal(model.logits(ids), merged)


def test_merge_aware_steps_refusals(tmp_path):
    from pact.runtime.trainer import TrainConfig, train

    with pytest.raises(PactError, match="--merge-aware-steps must be >= 0"):
        TrainConfig(artifact="a", data="d", out=str(tmp_path / "r"), merge_aware_steps=-1)
    d = make_converted_llama(tmp_path, 8)
    with pytest.raises(PactError, match="--merge-aware-steps 5 is more than the run's 2 steps"):
        train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(d / "run"), steps=2,
                          batch_size=4, max_len=64, merge_aware_steps=5), progress=False)
