"""pact-train end to end on a tiny model: learning, run folder, PEFT interop, resume, bad input."""

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from conftest import make_sentiment_task, rehash_artifact
from pact.formats import PactError, open_artifact
from pact.formats.peft import load_peft_adapter
from pact.pipelines.train import main as train_cli
from pact.runtime.model import PactModel
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_sentiment_task(tmp_path_factory.mktemp("task"), 256, 64)


def _cfg(task, out, **kw):
    base = dict(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(out), max_len=64, batch_size=16,
                lr=5e-3, lora_r=8, lora_alpha=16, steps=60, seed=0)
    return TrainConfig(**{**base, **kw})


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_learns_and_writes_run_folder(task, tmp_path):
    run = tmp_path / "run"
    result = train(_cfg(task, run, eval_data=str(task / "test.jsonl")), progress=False)
    m = _metrics(run)
    assert [r["step"] for r in m] == list(range(1, 61))
    assert m[-1]["loss"] < 0.25 * m[0]["loss"]  # measured: 6.4 -> 0.1
    assert result["eval_accuracy"] >= 0.9
    assert sorted(result["eval_labels"]) == [" fresh", " rotten"]
    held = [json.loads(x)["completion"] for x in (task / "test.jsonl").read_text().splitlines()]
    assert sorted(result["eval_predicted"]) == sorted(result["eval_labels"])
    assert sum(result["eval_predicted"].values()) == len(held)  # a label per example, each once
    assert result["eval_answers"] == {n: held.count(n) for n in result["eval_labels"]}
    assert abs(result["eval_predicted"][" fresh"] - held.count(" fresh")) <= 0.1 * len(held)  # accuracy >= 0.9
    for f in ("adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", "train_config.json", "eval.json"):
        assert (run / f).is_file(), f
    cfg = json.loads((run / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and set(cfg["target_modules"]) >= {"q_proj", "down_proj"}
    # the same adapter scored by greedy generation: it writes the verdict and stops (EOS)
    from pact.runtime.evaluate import evaluate_artifact

    gen = evaluate_artifact(str(task / "art"), str(task / "test.jsonl"), adapter=str(run), max_len=64, generate=True)
    assert gen["eval_generated"] == 64
    assert gen["eval_exact_match"] >= 0.9 and gen["eval_f1"] >= gen["eval_exact_match"]


def test_generation_metrics_and_greedy_decoding(task):
    """EM / F1 as SQuAD defines them (hand-worked cases); greedy tokens == the argmax of the
    full-sequence logits at every generated position."""
    from pact.runtime.evaluate import exact_match, greedy_generate, token_f1

    assert exact_match("The  Fresh!", "fresh") == 1.0 and exact_match("fresh tomato", "fresh") == 0.0
    assert token_f1("fresh tomato", "fresh") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("a", "the") == 1.0 and token_f1("rotten", "fresh") == 0.0
    model = PactModel(open_artifact(task / "art"), None)
    prompt = [1, 17, 42, 9]
    out = greedy_generate(model, prompt, 5, stop_ids=set())
    assert len(out) == 5
    logits = model.logits(torch.tensor([prompt + out]))[0]
    for i, t in enumerate(out):
        assert int(logits[len(prompt) - 1 + i].argmax()) == t


def test_shared_prefix_scoring_equals_each_candidate_alone(task):
    """Label scoring runs each prompt once with every candidate after it (own positions, a mask
    that shows a candidate only the prompt and itself): each candidate's log-likelihood equals that
    of prompt + candidate run alone, for prompts of different lengths and candidates of 1-3 tokens."""
    from pact.runtime.data import Example
    from pact.runtime.evaluate import candidate_logprobs

    model = PactModel(open_artifact(task / "art"), None)
    cands = {"a": [5, 2], "b": [7], "c": [11, 3, 2]}
    g = torch.Generator().manual_seed(0)
    examples = [Example(list(p) + cands["a"], [], "a", list(p))
                for p in (torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 4, 13))]
    got = torch.cat([lp for _, lp in candidate_logprobs(model, examples, cands, 2, 0)])
    for i, e in enumerate(examples):
        for j, t in enumerate(cands.values()):
            logits = model.logits(torch.tensor([e.prompt_ids + t]))[0]
            logp = F.log_softmax(logits[len(e.prompt_ids) - 1 : -1], -1)
            alone = float(logp.gather(1, torch.tensor(t)[:, None]).sum())
            assert got[i, j].item() == pytest.approx(alone, abs=0.05), (i, j)


def test_peft_loads_adapter_and_reproduces_logits(task, tmp_path):
    import peft
    import transformers as tf

    run = tmp_path / "run"
    train(_cfg(task, run, steps=20), progress=False)
    art = open_artifact(task / "art")
    hf = tf.AutoModelForCausalLM.from_pretrained(task / "src", dtype=torch.float32)
    hf.load_state_dict({n: art.dequantize(n) for n in art.names()}, strict=False)
    pm = peft.PeftModel.from_pretrained(hf.to(torch.bfloat16), run)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = pm(input_ids=ids).logits.float()
    lcfg, adapters = load_peft_adapter(run)
    # bf16 activations: the same math rounded in other places (PEFT runs the adapter in the
    # base's bf16). nvfp4: pact's own forward, whose activation quantization (~20 dB per
    # tensor, two layers of it here) is the whole difference: measured 0.93 on random ids.
    for activations, floor in (("bf16", 0.999), ("nvfp4", 0.9)):
        model = PactModel(art, lcfg, activations=activations)
        model.load_adapter_state(adapters)
        ours = model.logits(ids)
        assert F.cosine_similarity(ours.flatten(), ref.flatten(), dim=0) >= floor, activations
    # on the task itself, PEFT with pact's adapter makes pact's predictions
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art.hf_dir)
    prompts = [json.loads(line)["prompt"] for line in (task / "test.jsonl").read_text().splitlines()[:16]]
    agree = 0
    for p in prompts:
        x = torch.tensor([tok(p)["input_ids"]])
        with torch.no_grad():
            agree += int(pm(input_ids=x).logits[0, -1].argmax() == model.logits(x)[0, -1].argmax())
    assert agree >= 15


def test_resume_is_bitwise(task, tmp_path):
    kw = dict(steps=8, save_every=3, lora_dropout=0.1, batch_size=8, grad_accum=2)  # dropout: RNG must resume too
    full = tmp_path / "full"
    train(_cfg(task, full, **kw), progress=False)
    cut = tmp_path / "cut"
    train(_cfg(task, cut, **kw), progress=False, stop_after=5)  # "killed" after step 5; last checkpoint: 3
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-0000003"]
    train(_cfg(task, cut, **kw), resume=True, progress=False)
    assert [r["loss"] for r in _metrics(cut)] == [r["loss"] for r in _metrics(full)]
    _, a = load_peft_adapter(full)
    _, b = load_peft_adapter(cut)
    assert all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


def test_resume_names_the_recipe_the_run_trained_with(task, tmp_path, monkeypatch):
    """A run started under another default recipe (the default may change between versions) is not resumed
    with the new one: the refusal names the --activations that resumes it as it trained, and that resumes bitwise."""
    from pact.runtime import recipe as recipe_mod

    kw = dict(steps=6, save_every=3, batch_size=8)
    full, cut = tmp_path / "full", tmp_path / "cut"
    monkeypatch.setattr(recipe_mod, "DEFAULT", "nvfp4-saved")  # the default these runs started under
    train(_cfg(task, full, **kw), progress=False)
    train(_cfg(task, cut, **kw), progress=False, stop_after=4)
    monkeypatch.setattr(recipe_mod, "DEFAULT", "mixed,o.saved=fp8")  # a newer version's
    with pytest.raises(PactError, match=r"activations: checkpoint 'nvfp4-saved' -> now 'mixed,o.saved=fp8'\n  \(the "
                                        r"precision recipe it trained with: pass --activations nvfp4-saved"):
        train(_cfg(task, cut, **kw), resume=True, progress=False)
    train(_cfg(task, cut, activations="nvfp4-saved", **kw), resume=True, progress=False)
    assert [r["loss"] for r in _metrics(cut)] == [r["loss"] for r in _metrics(full)]


def test_resume_a_moved_run(task, tmp_path):
    """A run folder moved elsewhere (its inputs the same files, by fingerprint) resumes where it is and
    ends as it would have; a moved run with other settings is still refused for those."""
    import shutil

    kw = dict(steps=6, save_every=3)
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(_cfg(task, full, **kw), progress=False)
    train(_cfg(task, cut, **kw), progress=False, stop_after=4)
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(cut, moved)
    with pytest.raises(PactError, match=r"other settings(.|\n)*lr: checkpoint 0.005 -> now 0.001"):
        train(_cfg(task, moved, **kw, lr=1e-3), resume=True, progress=False)
    train(_cfg(task, moved, **kw), resume=True, progress=False)
    assert [r["loss"] for r in _metrics(moved)] == [r["loss"] for r in _metrics(full)]
    assert json.loads((moved / "train_config.json").read_text())["out"] == str(moved)


def test_resume_a_moved_run_by_its_config_and_eval_data(task, tmp_path, caplog):
    """--config RUN/train_config.json --resume of a run folder moved (or copied) since trains that
    folder, not the one the file names; --eval-data may move too (its fingerprint is recorded) but not
    change; --resume of a folder with no run yet says it starts one."""
    import logging
    import shutil

    from click.testing import CliRunner

    from pact.pipelines.train import main as train_cli

    held = tmp_path / "d1" / "test.jsonl"
    held.parent.mkdir()
    shutil.copy(task / "train.jsonl", held)
    first = tmp_path / "first"
    train(_cfg(task, first, steps=6, save_every=2, eval_data=str(held)), progress=False, stop_after=4)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    r = CliRunner().invoke(train_cli, ["--config", str(copy / "train_config.json"), "--resume", "--quiet"])
    assert r.exit_code == 0 and f"is now in {copy}: training there" in r.output, r.output
    assert (copy / "adapter_model.safetensors").is_file() and not (first / "adapter_model.safetensors").exists()
    held.parent.rename(tmp_path / "d2")  # the held-out file moved: resumes; another file there: refused
    moved = tmp_path / "d2" / "test.jsonl"
    train(_cfg(task, first, steps=6, save_every=2, eval_data=str(moved)), resume=True, progress=False)
    shutil.rmtree(first / "checkpoints" / "step-0000006")
    (first / "adapter_model.safetensors").unlink()
    moved.write_text(moved.read_text().splitlines(keepends=True)[0])
    with pytest.raises(PactError, match="the eval_data changed"):
        train(_cfg(task, first, steps=6, save_every=2, eval_data=str(moved)), resume=True, progress=False)
    with caplog.at_level(logging.WARNING):
        train(_cfg(task, tmp_path / "new", steps=1), resume=True, progress=False)
    assert any("holds no run yet: starting one from step 0" in m for m in caplog.messages)


def test_resume_refuses_other_hyperparameters(task, tmp_path):
    run = tmp_path / "run"
    train(_cfg(task, run, steps=3, save_every=3), progress=False, stop_after=3)
    with pytest.raises(PactError, match=r"other settings(.|\n)*lr: checkpoint 0.005 -> now 0.001"):
        train(_cfg(task, run, steps=3, save_every=3, lr=1e-3), resume=True, progress=False)
    with pytest.raises(PactError, match="not empty: pass --resume"):
        train(_cfg(task, run, steps=3), progress=False)


def test_chat_messages_and_datasets_folder(task, tmp_path):
    import datasets

    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()][:32]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                     {"role": "assistant", "content": r["completion"]}]}) + "\n"
                            for r in rows))
    r1 = train(_cfg(task, tmp_path / "r1", data=str(chat), steps=2), progress=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    r2 = train(_cfg(task, tmp_path / "r2", data=str(tmp_path / "ds"), steps=2), progress=False)
    assert r1["step"] == r2["step"] == 2 and r1["targets"] > 0 and r2["targets"] > 0


def test_cli(task, tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cli, [str(task / "art"), "--data", str(task / "train.jsonl"), "--out", str(out),
                                       "--steps", "2", "--batch-size", "4", "--max-len", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["step"] == 2
    r = CliRunner().invoke(train_cli, [str(task / "art"), "--data", str(tmp_path / "missing.jsonl"), "--out",
                                       str(tmp_path / "r2"), "--quiet"])
    assert r.exit_code == 1 and "missing.jsonl: no such file" in r.output


# ---- bad input


@pytest.mark.parametrize("content,match", [
    ("", "no records"),
    ('{"prompt": "a", "completion": "b"}\n{not json}\n', r"train.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}\n', r"train.jsonl:1: expected 'prompt' and 'completion', or 'messages'; the record has 'prompt'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"train.jsonl:1: the last message must be the assistant"),
    ('[1, 2]\n', r"train.jsonl:1: expected a JSON object"),
])
def test_bad_data(task, tmp_path, content, match):
    f = tmp_path / "train.jsonl"
    f.write_text(content)
    with pytest.raises(PactError, match=match):
        train(_cfg(task, tmp_path / "run", data=str(f)), progress=False)


def test_overlong(task, tmp_path, caplog):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"prompt": "fresh " * 200, "completion": " fresh"}) + "\n")
    with pytest.raises(PactError, match=r"train.jsonl:1: \d+ tokens > --max-len 64"):
        train(_cfg(task, tmp_path / "a", data=str(f), overlong="refuse"), progress=False)
    with caplog.at_level("WARNING"):
        r = train(_cfg(task, tmp_path / "b", data=str(f), steps=1), progress=False)
    assert "truncated 1 of 1 examples to --max-len 64" in caplog.text and r["targets"] > 0


def test_tokenizer_artifact_mismatch(task, tmp_path):
    import shutil

    from conftest import make_tokenizer

    art = tmp_path / "art"
    shutil.copytree(task / "art", art)
    make_tokenizer(art / "hf", vocab_size=400)  # more tokens than the 320-row embedding
    rehash_artifact(art)  # a consistent artifact (its checksums pass) whose tokenizer does not fit its weights
    with pytest.raises(PactError, match=r"tokenizer has \d+ tokens but the embedding has 320 rows"):
        train(_cfg(task, tmp_path / "run", artifact=str(art)), progress=False)


def test_corrupt_artifact(task, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(task / "art", art)
    chunk = art / "tensors" / "model.layers.1.mlp.up_proj.weight" / "fwd_packed" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(PactError, match="truncated or damaged"):
        train(_cfg(task, tmp_path / "run", artifact=str(art)), progress=False)


def test_bad_flags(task, tmp_path):
    with pytest.raises(PactError, match="--batch-size must be >= 1"):
        _cfg(task, tmp_path / "r", batch_size=0)
    with pytest.raises(PactError, match="--targets: unknown"):
        train(_cfg(task, tmp_path / "r", targets=("qq_proj",)), progress=False)


def _steps_to_learn(task, tmp_path, activations, steps=80, threshold=0.2):
    """First step whose 10-step mean training loss is under ``threshold`` (the label prior of this
    task is ~0.35 per target token: under 0.2 the verdict is being read from the words)."""
    run = tmp_path / f"run-{activations}"
    train(_cfg(task, run, lr=3e-3, steps=steps, activations=activations, kernels="torch"), progress=False)
    loss = [r["loss"] for r in _metrics(run)]
    return next((i + 1 for i in range(9, len(loss)) if sum(loss[i - 9 : i + 1]) / 10 < threshold), None)


def test_default_flow_learns_as_fast_as_bf16(task, tmp_path):
    """Learning fidelity in steps: bf16 activations (same NVFP4 weights, same lr) learn the task
    within N steps; the default flow must learn it within 1.1 N. Measured (CPU twins): N = 52,
    default 52, the all-NVFP4 flow that stayed on the plateau of real tasks 70 (1.35 N) — a tiny
    random model shows that failure only as a delay, so the bound is tighter than 1.5 N, and the
    test checks that it still tells the old flow apart."""
    n_ref = _steps_to_learn(task, tmp_path, "bf16")
    assert n_ref is not None and n_ref < 70, n_ref  # the reference learns with room to spare
    n_default = _steps_to_learn(task, tmp_path, None)
    assert n_default is not None and n_default <= 1.1 * n_ref, (n_default, n_ref)
    n_old = _steps_to_learn(task, tmp_path, "nvfp4")  # the test's power: the old default misses the bound
    assert n_old is None or n_old > 1.1 * n_ref, (n_old, n_ref)


def test_collapse_note():
    from pact.runtime.evaluate import collapse_note

    labels = [" fresh", " rotten"]
    res = {"eval_labels": labels, "eval_predicted": {" fresh": 97, " rotten": 3},
           "eval_answers": {" fresh": 54, " rotten": 46}}
    assert "' fresh' was the likeliest label for 97% of the 100 examples and is the answer of 54%" in collapse_note(res)
    assert collapse_note({**res, "eval_predicted": {" fresh": 60, " rotten": 40}}) is None  # both labels given
    assert collapse_note({**res, "eval_answers": {" fresh": 96, " rotten": 4}}) is None  # the data itself is one label
    assert collapse_note({**res, "eval_predicted": {" fresh": 10, " rotten": 0}}) is None  # too few to say
    assert collapse_note({"eval_loss": 1.0, "exact_match": 0.2}) is None  # generations: no label counts


def test_eval_cli_says_collapse(task, monkeypatch):
    import pact.pipelines.eval as ev

    collapsed = {"eval_loss": 0.7, "eval_accuracy": 0.54, "eval_labels": [" fresh", " rotten"],
                 "eval_predicted": {" fresh": 0, " rotten": 64}, "eval_answers": {" fresh": 30, " rotten": 34}}
    monkeypatch.setattr(ev, "evaluate_artifact", lambda *a, **k: collapsed)
    r = CliRunner().invoke(ev.main, [str(task / "art"), "--data", str(task / "test.jsonl"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "collapsed onto one label" in r.stderr and json.loads(r.stdout)["eval_predicted"][" rotten"] == 64
