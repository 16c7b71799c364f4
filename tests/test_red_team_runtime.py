"""Hostile or broken inputs to training, resume and evaluation: each is one clear error naming the
file or record (never a traceback or a silently wrong run), and nothing of the user's is lost."""

import errno
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_converted_llama
from pact.formats import PactError
from pact.formats.peft import load_peft_adapter
from pact.runtime import data as data_mod
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("task"), 32)


def _cfg(task, out, **kw):
    base = dict(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(out), max_len=32, batch_size=4,
                lr=1e-3, lora_r=4, lora_alpha=8, steps=2, seed=0)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("line,match", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}',
     r"message 2's content must be a string, got null"),
    ('{"prompt": "a", "completion": "b\\ud800"}', r"completion holds a lone surrogate"),
    ('{"input": "a", "output": "b"}', r"the record has 'input', 'output': rename the fields"),
    ('{"conversations": [{"from": "human", "value": "hi"}]}', r"the record has 'conversations'"),
    ("[" * 100000 + "]" * 100000, r"unreadable JSON \(nested too deeply\)"),
    ('{"prompt": "a", "completion": "b", "n": ' + "9" * 5000 + "}", r"unreadable JSON \(Exceeds the limit"),
])
def test_bad_records_one_line(task, tmp_path, line, match):
    f = tmp_path / "train.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(PactError, match=r"train.jsonl:1: .*" + match) as e:
        train(_cfg(task, tmp_path / "run", data=str(f)), progress=False)
    assert "\n" not in str(e.value)


def test_a_huge_record_is_refused_before_it_is_read_whole(task, tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "RECORD_BYTES", 1 << 16)
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "a", "completion": "b"}\n'
                 + json.dumps({"prompt": "x" * (1 << 17), "completion": "y"}) + "\n")
    with pytest.raises(PactError, match=r"train.jsonl:2: a record longer than"):
        data_mod.read_records(f)


def test_resume_compares_resolved_paths(task, tmp_path, monkeypatch):
    """--out ./run/ and --out run are the same run (the configs record absolute paths)."""
    monkeypatch.chdir(tmp_path)
    train(_cfg(task, "run", steps=4, save_every=2), progress=False, stop_after=2)
    cfg = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert cfg["out"] == str(tmp_path / "run") and cfg["data"] == str(task / "train.jsonl")
    r = train(_cfg(task, "./run/", steps=4, save_every=2), resume=True, progress=False)
    assert r["step"] == 4


def _cut_run(task, tmp_path):
    run = tmp_path / "run"
    train(_cfg(task, run, steps=4, save_every=2), progress=False, stop_after=3)
    return run, run / "checkpoints" / "step-0000002"


def test_resume_over_a_torn_metrics_line(task, tmp_path):
    run, _ = _cut_run(task, tmp_path)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "lo\xff')  # a kill mid-line
    r = train(_cfg(task, run, steps=4, save_every=2), resume=True, progress=False)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert r["step"] == 4 and steps == [1, 2, 3, 4]


def test_resume_with_a_garbage_rng_file(task, tmp_path):
    run, ck = _cut_run(task, tmp_path)
    save_file({"cpu": torch.zeros(7, dtype=torch.uint8)}, ck / "rng.safetensors")
    with pytest.raises(PactError, match=r"rng.safetensors: unreadable .*remove .*step-0000002"):
        train(_cfg(task, run, steps=4, save_every=2), resume=True, progress=False)


def test_resume_skips_a_checkpoint_with_an_absurd_step(task, tmp_path):
    run, ck = _cut_run(task, tmp_path)
    state = json.loads((ck / "state.json").read_text())
    (ck / "state.json").write_text(json.dumps({**state, "step": 10**30}))
    with pytest.raises(PactError, match=r"has no usable checkpoint"):
        train(_cfg(task, run, steps=4, save_every=2), resume=True, progress=False)


def test_a_full_disk_fails_before_training_not_at_the_final_adapter(task, tmp_path, monkeypatch):
    """The final adapter's space is claimed when the run starts (its last write overwrites that
    space in place): a disk too full for it fails the run at once, with no adapter half-written."""
    from pact.formats import peft

    real = peft.open_new  # (what the adapter's files are written anew through)

    def full(path, mode="w"):
        if path.name.startswith(".adapter_model"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode)

    monkeypatch.setattr(peft, "open_new", full)
    with pytest.raises(PactError, match=r"adapter_model.safetensors.*(space|full)"):
        train(_cfg(task, tmp_path / "a"), progress=False)
    assert not (tmp_path / "a" / "metrics.jsonl").exists() or not (tmp_path / "a" / "metrics.jsonl").read_text()


def test_final_adapter_written_in_the_reserved_space(task, tmp_path, monkeypatch):
    from pact.formats import peft

    run = tmp_path / "b"
    real = peft.open_new
    written = []

    def spy(path, mode="w"):
        written.append(path.name)
        return real(path, mode)

    monkeypatch.setattr(peft, "open_new", spy)
    train(_cfg(task, run), progress=False)
    # written anew once (the reservation at the start), overwritten in place at the end
    assert written.count(".adapter_model.safetensors.tmp") == 1
    assert (run / "adapter_model.safetensors").is_file() and not (run / ".adapter_model.safetensors.tmp").exists()
    load_peft_adapter(run)


def test_nan_adapter_refused_on_load(task, tmp_path):
    run = tmp_path / "c"
    train(_cfg(task, run), progress=False)
    from safetensors.torch import load_file

    t = load_file(run / "adapter_model.safetensors")
    k = sorted(t)[0]
    t[k][0, 0] = float("nan")
    save_file(t, run / "adapter_model.safetensors")
    with pytest.raises(PactError, match=r"holds NaN or Inf"):
        load_peft_adapter(run)


def test_a_checkpoint_save_that_fails_leaves_the_earlier_ones(task, tmp_path, monkeypatch):
    """A save that fails part-way (a full disk at step 4) leaves no half-written checkpoint and the one
    of step 2 as it was; a temp folder a killed save left is swept at the next save, never resumed from."""
    from pact.runtime import checkpoints

    run = tmp_path / "run"
    real = checkpoints._write_checkpoint

    def full_at_4(tmp, model, opt, state, cfg):
        if state["step"] == 4:
            (tmp / "partial").write_text("x")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, model, opt, state, cfg)

    monkeypatch.setattr(checkpoints, "_write_checkpoint", full_at_4)
    monkeypatch.setattr("pact.runtime.trainer._save_checkpoint", checkpoints._save_checkpoint)
    with pytest.raises(PactError, match=r"step-0000004.*(space|full)"):
        train(_cfg(task, run, steps=6, save_every=2), progress=False)
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-0000002"]
    killed = ck / ".step-0000004.tmp-999999-0123abcd"  # what a kill -9 during a save leaves
    killed.mkdir()
    monkeypatch.setattr(checkpoints, "_write_checkpoint", real)
    r = train(_cfg(task, run, steps=6, save_every=2), resume=True, progress=False)
    assert r["step"] == 6 and sorted(p.name for p in ck.iterdir()) == ["step-0000002", "step-0000004",
                                                                        "step-0000006"]
