"""--activations auto[:F]: the probe's choice of saved precisions under a memory budget, recorded in
train_config.json and the checkpoint, kept on --resume."""

import json

import pytest
import torch

from conftest import make_sentiment_task
from pact.formats import PactError
from pact.formats.artifact import open_artifact
from pact.formats.peft import LoraConfig, load_peft_adapter
from pact.runtime.autorecipe import CANDIDATES, _bytes, choose, parse_auto, with_saved
from pact.runtime.data import batches, collate, pad_id, read_records, tokenize
from pact.runtime.evaluate import evaluate_artifact
from pact.runtime.model import PactModel
from pact.runtime.recipe import DEFAULT, SITES, parse_recipe
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_sentiment_task(tmp_path_factory.mktemp("autotask"), 128, 32)


def _cfg(task, out, **kw):
    base = dict(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(out), max_len=64, batch_size=8,
                lr=5e-3, lora_r=4, lora_alpha=8, steps=20, seed=0, kernels="torch")
    return TrainConfig(**{**base, **kw})


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("spec,want", [("auto", 1.0), ("auto:1.5", 1.5), ("auto:0.5", 0.5), ("mixed", None),
                                       ("nvfp4-saved,gate_up.saved=fp8", None), (None, None)])
def test_parse_auto(spec, want):
    assert parse_auto(spec) == want


@pytest.mark.parametrize("spec", ["auto:", "auto:x", "auto:0", "auto:-1", "auto:nan", "auto:inf"])
def test_bad_budget_one_error(spec, task, tmp_path):
    with pytest.raises(PactError, match=r"--activations .*auto:F with F > 0"):
        _cfg(task, tmp_path / "r", activations=spec)


def test_config_spells_it_canonically(task, tmp_path):
    assert _cfg(task, tmp_path / "r", activations="auto:1").activations == "auto"
    assert _cfg(task, tmp_path / "r", activations="auto:1.50").activations == "auto:1.5"


@pytest.fixture(scope="module")
def warmed(task):
    """A model whose adapter has trained a few steps (B no longer zero) and two probe batches."""
    art = open_artifact(str(task / "art"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art.hf_dir)
    ex = tokenize(read_records(str(task / "train.jsonl")), tok, max_len=64)
    order = batches(ex, 8, seed=0, epoch=0)
    torch.manual_seed(0)
    model = PactModel(art, LoraConfig(r=4, alpha=8), kernels="torch")
    opt = torch.optim.AdamW(list(model.lora_params.values()), lr=5e-3)
    for idx in order[:4]:
        loss, n = model(*collate(ex, idx, pad_id(tok), model.device))
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, [collate(ex, idx, pad_id(tok), model.device) for idx in order[4:6]]


def test_probe_measures_each_site_and_respects_the_budget(warmed):
    model, probe = warmed
    before = model.recipe
    chosen, rec = choose(model, probe, 1.0)
    assert model.recipe == before  # the probe leaves the model's recipe as it was
    err = rec["gradient_error"]
    for s in SITES:
        assert err[s]["bf16"] == 0.0
        assert err[s]["nvfp4"] > err[s]["fp8"] > 0.0  # E4M3 copies are 4x closer than NVFP4 ones
    default = parse_recipe(DEFAULT).on(before.compute)
    assert rec["budget_bytes_per_token"] == _bytes(model, default)
    assert rec["bytes_per_token"] == _bytes(model, chosen) <= rec["budget_bytes_per_token"]
    default_error = sum(err[s][default.site(s).saved] for s in SITES)
    assert rec["chosen_error"] <= default_error + 1e-12  # the default is one of the assignments it weighed
    assert rec["passes"] == len(probe) * (1 + len(SITES) * (len(CANDIDATES) - 1)) and rec["seconds"] > 0
    for s in SITES:  # only the saved copies move; GEMM and LoRA inputs stay the default's
        assert (chosen.site(s).gemm, chosen.site(s).lora) == (before.site(s).gemm, before.site(s).lora)


def test_budget_extremes(warmed):
    model, probe = warmed
    rich, rec = choose(model, probe, 100.0)
    assert all(rich.site(s).saved == "bf16" for s in SITES) and rec["chosen_error"] == 0.0
    poor, rec = choose(model, probe, 0.01)  # nothing fits: every copy NVFP4, the least memory
    assert all(poor.site(s).saved == "nvfp4" for s in SITES)
    assert rec["bytes_per_token"] == _bytes(model, with_saved(model.recipe, {s: "nvfp4" for s in SITES}))


def test_auto_run_records_its_choice_and_resumes_bitwise(task, tmp_path):
    full = tmp_path / "full"
    train(_cfg(task, full, activations="auto", save_every=3), progress=False)
    rec = json.loads((full / "train_config.json").read_text())
    auto = rec["recipe_auto"]
    assert rec["activations"] == "auto" and auto["step"] == 2  # min(20, 20 // 10)
    assert rec["recipe"] == {**parse_recipe(auto["chosen"]).as_json(), "compute": rec["recipe"]["compute"]}
    assert set(auto["gradient_error"]) == set(SITES) and auto["bytes_per_token"] <= auto["budget_bytes_per_token"]
    assert len(_metrics(full)) == 20 and all(torch.isfinite(torch.tensor(r["loss"])) for r in _metrics(full))
    for stop, every, name in ((7, 3, "after"), (1, 1, "before")):  # killed after the probe (checkpoint 6) or
        cut = tmp_path / name  # before it (checkpoint 1: the probe runs on resuming)
        train(_cfg(task, cut, activations="auto", save_every=every), progress=False, stop_after=stop)
        train(_cfg(task, cut, activations="auto", save_every=every), resume=True, progress=False)
        assert [r["loss"] for r in _metrics(cut)] == [r["loss"] for r in _metrics(full)]
        assert json.loads((cut / "train_config.json").read_text())["recipe_auto"]["chosen"] == auto["chosen"]
        a, b = load_peft_adapter(full)[1], load_peft_adapter(cut)[1]
        assert all(torch.equal(a[k][1], b[k][1]) for k in a)
    # pact-eval reads an auto run: forward passes read no saved copy, so the default's inputs
    out = evaluate_artifact(str(task / "art"), str(task / "test.jsonl"), adapter=str(full), max_len=64)
    assert 0.0 <= out["eval_accuracy"] <= 1.0


def test_damaged_choice_in_a_checkpoint_is_one_error(task, tmp_path):
    run = tmp_path / "run"
    train(_cfg(task, run, activations="auto", save_every=3, steps=8), progress=False, stop_after=4)
    state = run / "checkpoints" / "step-0000003" / "state.json"
    rec = json.loads(state.read_text())
    rec["recipe_auto"]["chosen"] = "import os"
    state.write_text(json.dumps(rec))
    with pytest.raises(PactError, match=r"state.json: its recipe_auto record 'import os' is not a recipe"):
        train(_cfg(task, run, activations="auto", save_every=3, steps=8), resume=True, progress=False)
