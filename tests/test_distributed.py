"""Data-parallel training on the CPU (gloo): torchrun with 2 processes against one process on the
same global batch; a 2-rank checkpoint resumed by one process; a failing rank ends the run."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_converted_llama
from pact.runtime.trainer import TrainConfig, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("ddp"), 40)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(d, out, batch, **kw):
    base = dict(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(out), steps=4, batch_size=batch,
                max_len=64, lr=2e-3, warmup_ratio=0.0, seed=3)
    return {**base, **kw}


def _losses(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run):
    return load_file(run / "adapter_model.safetensors")


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) < tol, k


def test_torchrun_two_ranks_match_one_process(setup, tmp_path):
    """`torchrun --nproc-per-node 2 -m pact.pipelines.train` with batch 2 per rank takes the batches
    one process takes with batch 4. Step 1 (same adapter): loss to 1e-6, gradient norm to 1e-4
    relative (rows padded to each rank's longest, sums in another order). Later steps drift as
    AdamW turns those last-bit differences into update differences (its first steps move each element
    by about +-lr by the sign of its gradient, so an element whose gradient is near zero can move
    the other way; measured by step 4: loss 2e-5, gradient norm 1e-3, lora_B 1.3e-2 relative): loss
    to 1e-4, gradient norm to 1e-2, adapter to 5e-2. One folder,
    written by rank 0 only, its targets and tokens the global counts."""
    d = setup
    one = train(TrainConfig(**_args(d, tmp_path / "one", 4)), progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "pact.pipelines.train", str(d / "art"), "--data", str(d / "train.jsonl"),
           "--out", str(tmp_path / "two"),
           "--steps", "4", "--batch-size", "2", "--max-len", "64", "--lr", "2e-3", "--warmup-ratio", "0", "--seed", "3",
           "--quiet"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count('"step": 4') == 1  # one result printed, by rank 0
    m1, m2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert [m["step"] for m in m2] == [1, 2, 3, 4]  # one writer
    assert m2[0]["loss"] == pytest.approx(m1[0]["loss"], rel=1e-6)
    assert m2[0]["grad_norm"] == pytest.approx(m1[0]["grad_norm"], rel=1e-4)
    for a, b in zip(m1, m2):
        assert a["targets"] == b["targets"] and a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)
    _close(_adapter(tmp_path / "two"), _adapter(tmp_path / "one"), 5e-2)
    cfg = json.loads((tmp_path / "two" / "train_config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["global_batch"] == 4
    assert one["step"] == 4


def _rank(rank: int, world: int, port: int, kwargs: dict, stop_after, fail_at, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if fail_at is not None and rank == 1:  # this rank breaks at step `fail_at`
        from pact.runtime.model import PactModel

        calls, forward = [0], PactModel.forward

        def broken(self, ids, labels):
            calls[0] += 1
            if calls[0] >= fail_at:
                raise RuntimeError("rank 1 broke on purpose")
            return forward(self, ids, labels)

        PactModel.forward = broken
    try:
        train(TrainConfig(**kwargs), progress=False, stop_after=stop_after)
        q.put((rank, "ok"))
    except Exception as e:
        q.put((rank, f"{type(e).__name__}: {e}"))


def _spawn(world: int, kwargs: dict, stop_after=None, fail_at=None, timeout=300) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, kwargs, stop_after, fail_at, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert not p.is_alive()
    return out


def test_two_rank_checkpoint_resumes_in_one_process(setup, tmp_path):
    """2 ranks x batch 2 stop after a checkpoint at step 2; one process with batch 4 resumes it and
    ends where an uninterrupted one-process run ends."""
    d = setup
    res = _spawn(2, _args(d, tmp_path / "run", 2, save_every=2), stop_after=2)
    assert res == {0: "ok", 1: "ok"}
    assert (tmp_path / "run" / "checkpoints" / "step-0000002").is_dir()
    train(TrainConfig(**_args(d, tmp_path / "run", 4, save_every=2)), resume=True, progress=False)
    train(TrainConfig(**_args(d, tmp_path / "ref", 4, save_every=2)), progress=False)
    losses = [m["loss"] for m in _losses(tmp_path / "run")]
    assert losses == pytest.approx([m["loss"] for m in _losses(tmp_path / "ref")], rel=1e-4)
    _close(_adapter(tmp_path / "run"), _adapter(tmp_path / "ref"), 5e-2)


def test_a_failing_rank_ends_the_run(setup, tmp_path):
    """Rank 1 raises at its second forward: both ranks stop (no hang), rank 0 naming rank 1, and no
    adapter is written."""
    d = setup
    res = _spawn(2, _args(d, tmp_path / "run", 2), fail_at=2, timeout=180)
    assert res[1] == "RuntimeError: rank 1 broke on purpose"
    assert res[0].startswith("PactError: rank 1 of 2 failed")
    assert not (tmp_path / "run" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "run" / ".lock").exists()


def test_single_process_tools_refuse_torchrun(setup, tmp_path, monkeypatch):
    """pact-eval and pact-calibrate under torchrun would run N copies into one output: one line instead."""
    from pact.calibrate import calibrate
    from pact.formats import PactError
    from pact.runtime.evaluate import evaluate_artifact

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PactError, match="pact-eval runs in one process .*without torchrun"):
        evaluate_artifact(str(setup / "art"), str(setup / "train.jsonl"))
    with pytest.raises(PactError, match="pact-calibrate runs in one process"):
        calibrate(str(setup / "art"), setup / "train.jsonl", tmp_path / "cal", progress=False)


def test_auto_recipe_under_two_ranks(setup, tmp_path):
    """--activations auto with 2 ranks: every rank probes, rank 0's choice is taken by both (one
    all-reduce), the run finishes and records the choice."""
    d = setup
    res = _spawn(2, _args(d, tmp_path / "run", 2, steps=10, activations="auto"))
    assert res == {0: "ok", 1: "ok"}
    cfg = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert cfg["activations"] == "auto" and cfg["recipe_auto"]["step"] == 1 and cfg["world_size"] == 2
    assert [m["step"] for m in _losses(tmp_path / "run")] == list(range(1, 11))
