"""pact-train --report-to tensorboard / wandb (offline): the step metrics and the evaluation."""

import json

import pytest

from conftest import make_converted_llama, make_sentiment_jsonl
from pact.formats import PactError
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = make_converted_llama(tmp_path_factory.mktemp("report"), 48)
    make_sentiment_jsonl(d / "test.jsonl", 16, seed=1)
    return d


def _cfg(task, out, **kw):
    return TrainConfig(**{**dict(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(out), max_len=64,
                                 batch_size=16, steps=4, lr=5e-3, lora_r=4, lora_alpha=8, kernels="torch",
                                 eval_data=str(task / "test.jsonl")), **kw})


def test_tensorboard_gets_every_step(task, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(_cfg(task, run, report_to="tensorboard", eval_every=2), progress=False)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in steps], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [2, 4]  # --eval-every 2, then the final evaluation


def test_wandb_offline(task, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(_cfg(task, run, report_to="wandb"), progress=False)
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    run_id = (run / "wandb_id.txt").read_text().strip()
    assert offline[0].name.endswith(run_id)


def test_bad_report_to(task, tmp_path):
    with pytest.raises(PactError, match=r"--report-to 'mlflow': use none, tensorboard, wandb"):
        _cfg(task, tmp_path / "r", report_to="mlflow")
    with pytest.raises(PactError, match=r"--report-to 'none,wandb'"):
        _cfg(task, tmp_path / "r", report_to="none,wandb")


def test_wandb_without_a_login_is_one_line(task, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def no_key(**kw):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(PactError, match=r"--report-to wandb: could not start a W&B run \(No API key configured.*"
                                        r"wandb login.*WANDB_MODE=offline"):
        train(_cfg(task, tmp_path / "run", report_to="wandb"), progress=False)
