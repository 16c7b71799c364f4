"""pact-train --eval-every (OUT/best/, --early-stopping-patience) and extending a finished run
with --resume and more --steps."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from conftest import make_sentiment_task
from pact.formats import PactError
from pact.formats.peft import load_peft_adapter
from pact.pipelines.train import main as train_cli
from pact.runtime import trainer
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = make_sentiment_task(tmp_path_factory.mktemp("evaltask"), 128, 32)
    (d / "text.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}", "completion": f" word{i} and more"}) + "\n"
                                          for i in range(16)))
    return d


def _cfg(task, out, **kw):
    base = dict(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(out), max_len=64, batch_size=16,
                lr=5e-3, lora_r=4, lora_alpha=8, steps=8, seed=0, kernels="torch", eval_data=str(task / "test.jsonl"))
    return TrainConfig(**{**base, **kw})


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run):
    return load_peft_adapter(str(run))[1]


def test_eval_every_keeps_the_best_adapter(task, tmp_path):
    run = tmp_path / "run"
    result = train(_cfg(task, run, eval_every=2), progress=False)
    m = _metrics(run)
    assert [r["step"] for r in m if "eval_loss" in r] == [2, 4, 6]  # the last step's evaluation is eval.json's
    assert all("eval_accuracy" in r for r in m if "eval_loss" in r)
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["metric"] == "eval_accuracy"  # auto: label data
    evals = {r["step"]: r["eval_accuracy"] for r in m if "eval_loss" in r} | {8: result["eval_accuracy"]}
    assert best["value"] == max(evals.values()) and evals[best["step"]] == best["value"]
    assert best["step"] == min(s for s, v in evals.items() if v == best["value"])  # the first to reach it
    assert result["best_step"] == best["step"] == json.loads((run / "eval.json").read_text())["best_step"]
    assert set(_adapter(run / "best")) == set(_adapter(run))  # a whole PEFT adapter
    assert [p.name for p in run.iterdir() if p.name.startswith(".best")] == []  # no temp folder left


def test_early_stopping_after_patience(task, tmp_path, monkeypatch):
    """Scripted evaluations (loss 1.0, 0.9, then worse): with patience 2 the run stops at the 4th
    evaluation, its best/ is the adapter of the 2nd, the final adapter the stopping step's."""
    losses = iter([1.0, 0.9, 0.95, 0.97, 0.99, 1.0])
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: {"eval_loss": next(losses), "eval_tokens": 1})
    run = tmp_path / "run"
    result = train(_cfg(task, run, steps=20, eval_every=2, early_stopping_patience=2, metric_for_best="eval_loss"),
                   progress=False)
    m = _metrics(run)
    assert m[-1]["step"] == 8 and m[-1]["stopped_early"] and result["step"] == 8
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["step"] == 4 and best["value"] == 0.9 and result["best_step"] == 4
    best_a, final_a = _adapter(run / "best"), _adapter(run)
    assert any(not torch.equal(best_a[k][1], final_a[k][1]) for k in best_a)


def test_best_survives_a_resume(task, tmp_path, monkeypatch):
    losses = iter([0.5, 0.7, 0.8, 0.9])  # best at the first evaluation, then worse
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: {"eval_loss": next(losses), "eval_tokens": 1})
    cfg = _cfg(task, tmp_path / "run", steps=10, eval_every=2, save_every=2, early_stopping_patience=3,
               metric_for_best="eval_loss")
    train(cfg, progress=False, stop_after=4)  # killed after step 4: best = step 2, one bad evaluation
    result = train(cfg, resume=True, progress=False)
    assert result["step"] == 8 and result["best_step"] == 2  # 2 more bad evaluations (6, 8): stopped at patience 3


def test_eval_options_refuse_bad_combinations(task, tmp_path):
    with pytest.raises(PactError, match="--eval-every needs --eval-data"):
        _cfg(task, tmp_path / "r", eval_data=None, eval_every=2)
    with pytest.raises(PactError, match="--early-stopping-patience needs --eval-every"):
        _cfg(task, tmp_path / "r", early_stopping_patience=2)
    with pytest.raises(PactError, match="--eval-every must be >= 0"):
        _cfg(task, tmp_path / "r", eval_every=-1)
    for metric in ("eval_loss", "eval_accuracy"):  # (was ignored without a held-out file)
        with pytest.raises(PactError, match=f"--metric-for-best {metric} needs --eval-data"):
            _cfg(task, tmp_path / "r", eval_data=None, metric_for_best=metric)
    for bad in (float("nan"), float("inf"), 0.0):  # (nan and inf reached math.ceil)
        with pytest.raises(PactError, match="--epochs must be a finite number > 0"):
            _cfg(task, tmp_path / "r", steps=None, epochs=bad)
    with pytest.raises(PactError, match="eval_accuracy: .*text.jsonl is not label data"):
        train(_cfg(task, tmp_path / "r", eval_data=str(task / "text.jsonl"), eval_every=2,
                   metric_for_best="eval_accuracy"), progress=False)
    assert not (tmp_path / "r").exists()


def test_cli_spellings(task, tmp_path):
    run = tmp_path / "run"
    r = CliRunner().invoke(train_cli, [str(task / "art"), "--data", str(task / "train.jsonl"), "--out", str(run),
                                       "--eval-data", str(task / "test.jsonl"), "--eval-steps", "3",
                                       "--metric-for-best-model", "eval_loss", "--early-stopping-patience", "5",
                                       "--max-steps", "6", "--batch-size", "16", "--max-len", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    saved = json.loads((run / "train_config.json").read_text())
    assert (saved["eval_every"], saved["metric_for_best"], saved["early_stopping_patience"]) == (3, "eval_loss", 5)
    assert json.loads((run / "best" / "best.json").read_text())["metric"] == "eval_loss"


def test_extend_a_finished_run(task, tmp_path):
    """A finished run that saved checkpoints trains further with --resume and more --steps (its
    metrics continue, the adapter moves on); fewer steps than its checkpoint, or other settings, are refused."""
    run = tmp_path / "run"
    train(_cfg(task, run, eval_data=None, steps=4, save_every=2), progress=False)
    first = _adapter(run)
    result = train(_cfg(task, run, eval_data=None, steps=6, save_every=2), resume=True, progress=False)
    assert result["step"] == 6 and [r["step"] for r in _metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert any(not torch.equal(first[k][1], _adapter(run)[k][1]) for k in first)
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(PactError, match=r"newest checkpoint of .*run is at step 6, beyond this run's 5 steps: pass "
                                        r"--max-steps \(--steps\) of at least 7 to train further; nothing was changed"):
        train(_cfg(task, run, eval_data=None, steps=5, save_every=2), resume=True, progress=False)
    assert (run / "metrics.jsonl").read_bytes() == metrics  # a refused resume cuts nothing
    with pytest.raises(PactError, match=r"(?s)other settings.*lr: checkpoint"):  # anything else still has to match
        train(_cfg(task, run, eval_data=None, steps=8, save_every=2, lr=1e-3), resume=True, progress=False)


def test_first_hour_commands(tmp_path):
    """README "Train"'s first hour, on a tiny model: chat data with --eval-every and --save-every,
    the best adapter in pact chat, pact-eval, then the run trained further through its own
    train_config.json with --resume and more --max-steps."""
    from conftest import make_converted_llama
    from pact.pipelines.cli import main as pact_cli

    d = make_converted_llama(tmp_path, 4)
    chat = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]}
    (d / "chats.jsonl").write_text(json.dumps(chat) + "\n")
    held = {"messages": [{"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Rome."}]}
    (d / "held.jsonl").write_text(json.dumps(held) + "\n")
    art, run = str(d / "art"), str(d / "run")
    r = CliRunner().invoke(train_cli, [art, "--data", str(d / "chats.jsonl"), "--eval-data", str(d / "held.jsonl"),
                                       "--out", run, "--max-steps", "6", "--learning-rate", "2e-4", "--eval-every",
                                       "2", "--save-every", "3", "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads((d / "run" / "best" / "best.json").read_text())["metric"] == "eval_loss"
    r = CliRunner().invoke(pact_cli, ["chat", art, "--adapter", str(d / "run" / "best"), "--max-new-tokens", "3"],
                           input="Capital of Spain?\n")
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(pact_cli, ["eval", art, "--adapter", run, "--data", str(d / "held.jsonl"), "--quiet"])
    assert r.exit_code == 0 and "eval_loss" in r.output, r.output
    r = CliRunner().invoke(train_cli, ["--config", str(d / "run" / "train_config.json"), "--max-steps", "9",
                                       "--resume", "--quiet"])
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["step"] for x in (d / "run" / "metrics.jsonl").read_text().splitlines()] == list(range(1, 10))


def test_best_put_back_after_a_kill_between_renames(task, tmp_path):
    """Killed between best/'s two renames: no best/, the earlier one aside under a dead process's name,
    the new one half made. The next run (here a resume that stops evaluating) puts the earlier one
    back and removes the leftovers."""
    import os

    run = tmp_path / "run"
    train(_cfg(task, run, steps=4, eval_every=2, save_every=2), progress=False, stop_after=2)
    best = (run / "best" / "adapter_model.safetensors").read_bytes()
    os.rename(run / "best", run / ".best.old-999999999-0badf00d")
    (run / ".best.tmp-999999999-deadbeef").mkdir()
    train(_cfg(task, run, steps=4, eval_every=0, save_every=2), resume=True, progress=False)
    assert (run / "best" / "adapter_model.safetensors").read_bytes() == best
    assert [p.name for p in run.iterdir() if p.name.startswith(".best")] == []


@pytest.mark.parametrize("backward", ["auto", "forward"])
def test_out_of_memory_names_the_ways_out(task, tmp_path, monkeypatch, backward):
    """Out of GPU memory mid-run: one error naming the flags that lower memory; --backward-weights forward
    among them only where the run still loads the backward layouts."""
    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(trainer, "_step", oom)
    with pytest.raises(PactError, match="out of GPU memory at --batch-size 16") as e:
        train(_cfg(task, tmp_path / "run", backward_weights=backward), progress=False)
    assert ("--backward-weights forward" in str(e.value)) == (backward == "auto")
    monkeypatch.setattr(trainer, "_setup", oom)  # while the weights load: the same way out
    with pytest.raises(PactError, match="out of GPU memory while loading the model") as e:
        train(_cfg(task, tmp_path / "run2", backward_weights=backward), progress=False)
    assert ("--backward-weights forward" in str(e.value)) == (backward == "auto")
    with pytest.raises(PactError, match="out of GPU memory while loading the model") as e:  # refused beside dgrad=fp8
        train(_cfg(task, tmp_path / "run3", activations="mixed,dgrad=fp8"), progress=False)
    assert "--backward-weights forward" not in str(e.value)


def test_flag_combinations_refused_before_anything_loads(tmp_path):
    """What the model would refuse once built, TrainConfig refuses first (an artifact that does not exist is
    never opened)."""
    base = dict(artifact=str(tmp_path / "none"), data=str(tmp_path / "none.jsonl"), out=str(tmp_path / "run"))
    with pytest.raises(PactError, match="nvfp4-native's FP4"):
        TrainConfig(**base, compute="nvfp4-native", backward_weights="forward")
    with pytest.raises(PactError, match="--backward-weights must be one of"):
        TrainConfig(**base, backward_weights="transposed")
    with pytest.raises(PactError, match="--fp8-weights resident"):
        TrainConfig(**base, fp8_weights="resident")
    assert TrainConfig(**base, compute="fp8", fp8_weights="resident", backward_weights="forward")
    with pytest.raises(PactError, match="dgrad=fp8 re-encodes the backward layout.*use one of the two"):
        TrainConfig(**base, activations="mixed,dgrad=fp8", backward_weights="forward")
    with pytest.raises(PactError, match="dgrad=fp8 with --compute fp8: .* drop dgrad=fp8"):
        TrainConfig(**base, activations="mixed,dgrad=fp8", compute="fp8")
    with pytest.raises(PactError, match="auto takes no overrides"):
        TrainConfig(**base, activations="auto:1.5,dgrad=fp8")
    assert TrainConfig(**base, activations="mixed,dgrad=fp8").activations == "mixed,dgrad=fp8"


def test_backward_weights_recorded(task, tmp_path, monkeypatch):
    """train_config.json records what the input gradients read, and stays a --config for another run."""
    import pact.pipelines.train as train_mod

    run = tmp_path / "run"
    cfg = _cfg(task, run, steps=2, eval_data=None, backward_weights="forward")
    train(cfg, progress=False)
    config = json.loads((run / "train_config.json").read_text())
    assert config["backward_weights"] == "forward" and config["backward_weights_read"] == "forward"
    seen = {}
    monkeypatch.setattr(train_mod, "train", lambda c, **kw: seen.setdefault("cfg", c) and {})
    r = CliRunner().invoke(train_cli, ["--config", str(run), "--out", str(tmp_path / "again"), "--no-calibrate",
                                       "--quiet"])
    assert r.exit_code == 0, r.output
    assert seen["cfg"] == dataclasses.replace(cfg, out=str(tmp_path / "again"))


def test_plain_text_eval_data_and_max_len_past_the_context(task, tmp_path, caplog):
    """pact-eval on {"text"} records measures the loss and generates only for records with a prompt (a plain
    text has none: it failed after scoring with "the prompt is empty"); asked to generate on such a file
    alone, it says so first. A --max-len past the model's context trains, with a warning naming both."""
    import logging

    from pact.runtime.evaluate import evaluate_artifact

    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": f"a plain text number {i} to score"}) + "\n" for i in range(4)))
    got = evaluate_artifact(str(task / "art"), str(plain), max_len=64)
    assert got["eval_loss"] > 0 and "eval_exact_match" not in got
    with pytest.raises(PactError, match=r"no record has a prompt to generate from .*drop --generate"):
        evaluate_artifact(str(task / "art"), str(plain), max_len=64, generate=True)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(plain.read_text() + json.dumps({"prompt": "say 1", "completion": " word1"}) + "\n")
    got = evaluate_artifact(str(task / "art"), str(mixed), max_len=64, generate=True)
    assert got["eval_generated"] == 1
    window = json.loads((task / "art" / "hf" / "config.json").read_text())["max_position_embeddings"]
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * (window + 20), "completion": " fresh"}) + "\n"
                    + (task / "train.jsonl").read_text())
    with caplog.at_level(logging.WARNING):  # short rows only: nothing to say, whatever --max-len allows
        train(_cfg(task, tmp_path / "short", max_len=window + 64, steps=1, eval_data=None), progress=False)
    assert not any("longer than the model's context" in m for m in caplog.messages), caplog.messages
    with caplog.at_level(logging.WARNING):
        train(_cfg(task, tmp_path / "long", data=str(long), max_len=window + 64, steps=1, eval_data=None),
              progress=False)
    assert any(f"1 of 129 examples are longer than the model's context ({window} positions" in m
               for m in caplog.messages), caplog.messages


def test_interrupt_says_how_to_continue(task, tmp_path, monkeypatch):
    """Ctrl-C in pact-train ends with one line: --resume when a checkpoint was saved, else that none was."""
    import pact.pipelines.train as train_module

    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train", interrupted)
    args = [str(task / "art"), "--data", str(task / "train.jsonl"), "--out", str(tmp_path / "run"), "--no-calibrate",
            "--quiet"]
    r = CliRunner().invoke(train_cli, args)
    assert r.exit_code == 1 and "interrupted: no checkpoint was saved: run the command again (--save-every N" \
        in r.output, r.output

    def interrupted_after_a_checkpoint(cfg, **kw):
        (tmp_path / "run" / "checkpoints" / "step-0000002").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train", interrupted_after_a_checkpoint)
    r = CliRunner().invoke(train_cli, args)
    assert "interrupted: the same command with --resume continues from the last checkpoint" in r.output, r.output


def test_bad_value_from_a_config_file_names_the_file(task, tmp_path):
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"lr": "nan", "max_len": 64}))
    r = CliRunner().invoke(train_cli, [str(task / "art"), "--data", str(task / "train.jsonl"), "--out",
                                       str(tmp_path / "run"), "--config", str(conf), "--no-calibrate"])
    assert r.exit_code == 1 and f"--lr must be a finite number > 0 (e.g. 2e-4), got nan (set in --config {conf})" \
        in r.output, r.output
    r = CliRunner().invoke(train_cli, [str(task / "art"), "--data", str(task / "train.jsonl"), "--out",
                                       str(tmp_path / "run"), "--config", str(conf), "--lr", "-1", "--no-calibrate"])
    assert r.exit_code == 1 and "got -1.0\n" in r.output and "--config" not in r.output  # the command line's own
    r = CliRunner().invoke(train_cli, [str(task / "art"), "--data", str(task / "train.jsonl"), "--out",
                                       str(tmp_path / "run"), "--config", str(conf), "--epochs", "nan",
                                       "--no-calibrate"])
    assert r.exit_code == 1 and "got nan\n" in r.output and "--config" not in r.output, r.output  # (nan != nan)


def test_out_inside_another_artifact_is_refused(task, tmp_path):
    """A run never writes into an artifact (not even one it does not read): it would hold files its manifest
    does not list, which --overwrite and pact-push then refuse."""
    import shutil

    shutil.copytree(task / "art", tmp_path / "other")
    with pytest.raises(PactError, match=f"--out {tmp_path / 'other' / 'run'} is inside the artifact"):
        train(_cfg(task, tmp_path / "other" / "run"), progress=False)
    assert not (tmp_path / "other" / "run").exists()
