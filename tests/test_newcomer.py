"""What a new user meets first: early data errors, no empty run folders, cached demo scores,
scoring options and the CPU notice for GPU backends."""

import json
import logging

import pytest

from conftest import make_converted_llama
from pact.formats import PactError
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("task"), 32)


def _cfg(task, out, **kw):
    return TrainConfig(**{**dict(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(out), max_len=32,
                                 batch_size=4, lora_r=4, lora_alpha=8, steps=1), **kw})


def test_data_errors_before_the_model_and_no_empty_run_folder(task, tmp_path, monkeypatch):
    from pact.runtime import trainer

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(trainer, "open_session", no_model)
    with pytest.raises(PactError, match=r"--data .*missing.jsonl: no such file"):
        train(_cfg(task, tmp_path / "run", data=str(tmp_path / "missing.jsonl")), progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(PactError, match=r"--eval-data .*nope.jsonl: no such file"):
        train(_cfg(task, tmp_path / "run", eval_data=str(tmp_path / "nope.jsonl")), progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_failing_before_its_first_step_leaves_no_folder(task, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": ""}\n')  # parses; fails once tokenized, after the model loads
    with pytest.raises(PactError, match="the completion is empty"):
        train(_cfg(task, tmp_path / "run", data=str(bad)), progress=False)
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made is never removed
    with pytest.raises(PactError):
        train(_cfg(task, tmp_path / "mine", data=str(bad)), progress=False)
    assert (tmp_path / "mine").is_dir()


def test_scores_cached_by_artifact_data_and_adapter(task, tmp_path):
    from pact.assets.sentiment import cached_score

    calls = []

    def compute():
        calls.append(1)
        return {"eval_accuracy": 0.5, "eval_loss": 1.0}

    data = task / "train.jsonl"
    a = cached_score(tmp_path / "scores", task / "art", data, None, compute, print)
    b = cached_score(tmp_path / "scores", task / "art", data, None, compute, print)
    assert a == b and len(calls) == 1
    run = tmp_path / "run"
    train(_cfg(task, run), progress=False)
    cached_score(tmp_path / "scores", task / "art", data, run, compute, print)
    assert len(calls) == 2  # another adapter: scored again
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text() + '{"prompt": "x", "completion": " fresh"}\n')
    cached_score(tmp_path / "scores", task / "art", other, None, compute, print)
    assert len(calls) == 3  # other data: scored again


def test_score_eos_option(task, tmp_path):
    from pact.runtime.evaluate import evaluate_artifact

    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": [" fresh", " rotten"][i % 2]}) + "\n"
                            for i in range(8)))
    with_eos = evaluate_artifact(str(task / "art"), str(test), max_len=32)
    without = evaluate_artifact(str(task / "art"), str(test), max_len=32, score_eos=False)
    assert with_eos["eval_tokens"] > without["eval_tokens"] and with_eos["eval_loss"] != without["eval_loss"]


def test_gpu_backend_on_the_cpu_says_so(caplog):
    import torch

    from pact.runtime.ops import resolve_compute

    with caplog.at_level(logging.WARNING):
        assert resolve_compute("fp8", torch.device("cpu")) == "fp8"
    assert "runs as its PyTorch twin" in caplog.text


def test_safetensors_files_get_the_ordinary_mode(tmp_path):
    import os

    import torch

    from pact.formats.artifact import save_safetensors

    old = os.umask(0o022)
    try:
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o644


def test_gguf_sourced_adapter_loads_with_autopeft(tmp_path):
    """An adapter trained on an artifact converted from a .gguf names the file's folder as its base;
    AutoPeftModelForCausalLM loads it given gguf_file (the README's line)."""
    from peft import AutoPeftModelForCausalLM

    from conftest import make_gguf, make_sentiment_jsonl
    from pact.convert import convert

    gguf = tmp_path / "src" / "tiny.gguf"
    gguf.parent.mkdir()
    make_gguf(gguf)
    convert(str(gguf), tmp_path / "art", progress=False)
    make_sentiment_jsonl(tmp_path / "train.jsonl", 8)
    train(TrainConfig(artifact=str(tmp_path / "art"), data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"),
                      steps=1, batch_size=4, max_len=32, lora_r=4, lora_alpha=8), progress=False)
    cfg = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(gguf.parent)
    model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "run"), gguf_file="tiny.gguf")
    assert type(model).__name__ == "PeftModelForCausalLM"


def test_a_failed_start_never_removes_a_folder_another_run_holds(task, tmp_path, monkeypatch):
    """Two pact-trains on one new --out: the one that loses the lock removes nothing, although the
    folder did not exist when it started."""
    from pact.runtime import trainer

    run = tmp_path / "run"

    def taken(folder):  # the other process made the folder, took the lock and wrote its config first
        (folder / "train_config.json").write_text("{}")
        raise PactError(f"--out {folder} is in use by another pact-train")

    monkeypatch.setattr(trainer, "run_lock", taken)
    with pytest.raises(PactError, match="is in use by another pact-train"):
        train(_cfg(task, run), progress=False)
    assert (run / "train_config.json").is_file()
