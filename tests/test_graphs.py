"""--cuda-graphs: the decoder stack's forward and backward replayed as CUDA graphs (runtime/graphs.py)."""

import json
import types

import pytest
import torch

from conftest import make_model
from pact.convert import convert
from pact.formats import PactError, open_artifact
from pact.formats.peft import LoraConfig
from pact.runtime.data import Example, collate, collate_packed
from pact.runtime.graphs import bucket_length, graphable, layer_weights, use_graphs
from pact.runtime.model import PactModel
from pact.runtime.recipe import parse_recipe

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ex(ids, prompt=1):
    return Example(ids=list(ids), labels=[-100] * prompt + list(ids[prompt:]), completion="",
                   prompt_ids=list(ids[:prompt]))


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _artifact(tmp_path):
    make_model(tmp_path / "src", "llama")
    return open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False))


def test_bucket_lengths():
    assert [bucket_length(n, 1024) for n in (1, 63, 64, 65, 200, 513, 1024)] == [64, 64, 64, 128, 256, 1024, 1024]
    assert bucket_length(100, 96) == 100  # never below the batch's own length
    assert bucket_length(90, 96) == 96  # --max-len is the last bucket
    assert bucket_length(30, 48) == 48


def test_auto_graphs_where_launches_set_the_pace(tmp_path):
    one_b, three_b, eight_b = 61 * 2**20, 101 * 2**20, 218 * 2**20  # frozen weights a layer (Llama shapes)
    assert use_graphs("auto", 8 * 128, 3_540_000) == "auto" and use_graphs("auto", 16 * 2048, 3_540_000) == "auto"
    assert use_graphs("auto", 6 * 1024, one_b) == "auto" and use_graphs("auto", 8 * 1024, one_b) is False
    assert use_graphs("auto", 3 * 1024, three_b) == "auto" and use_graphs("auto", 8 * 1024, three_b) is False
    assert use_graphs("auto", 1024, eight_b) == "auto" and use_graphs("auto", 3 * 1024, eight_b) is False
    assert use_graphs("on", 16 * 1024, eight_b) is True and use_graphs("off", 16, 1) is False
    art = _artifact(tmp_path)
    model = PactModel(art, LoraConfig(r=4, alpha=8))
    h, i = model.hidden, model.layers[0].down.weight.shape[1]
    kv = model.n_kv * model.head_dim
    assert layer_weights(art) == h * (h + 2 * kv) + h * h + 2 * i * h + h * i


def test_collate_pads_to_the_bucket():
    ex = [_ex([5, 6, 7]), _ex([1, 2])]
    ids, labels = collate(ex, [0, 1], 0, "cpu", width=lambda n: 8)
    assert ids.shape == labels.shape == (2, 8)
    assert ids[0].tolist() == [5, 6, 7, 0, 0, 0, 0, 0] and labels[1].tolist() == [-100, 2] + [-100] * 6
    ids, labels, pos, mask = collate_packed(ex, [0, 1], 0, "cpu", width=lambda n: 8)
    assert ids.shape == pos.shape == (2, 8) and mask.shape == (2, 1, 8, 8)
    assert pos[0].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert bool(mask[0, 0].diagonal().all())  # padding attends to itself: no empty softmax row


def test_graphs_refused_where_they_cannot_run(tmp_path):
    art = _artifact(tmp_path)
    with pytest.raises(PactError, match="--cuda-graphs on: not on a CUDA device"):
        PactModel(art, LoraConfig(r=4, alpha=8), cuda_graphs=True)
    assert PactModel(art, LoraConfig(r=4, alpha=8), cuda_graphs="auto").cuda_graphs is False
    fake = types.SimpleNamespace(device=torch.device("cuda"), lora_params={"a": 1}, recipe=parse_recipe(None),
                                 adapters={"x": types.SimpleNamespace(dropout=0.1)}, kernels="triton")
    assert "dropout" in graphable(fake)
    fake.adapters = {"x": types.SimpleNamespace(dropout=0.0)}
    assert graphable(fake) is None
    fake.recipe = parse_recipe("mixed,gate_up.saved=nvfp4-sr")
    assert "stochastically" in graphable(fake)
    fake.recipe, fake.kernels = parse_recipe(None), "torch"
    assert "--kernels triton" in graphable(fake)


def test_capture_reads_aliases_and_restores_the_parameters(tmp_path):
    from pact.runtime.graphs import _aliased

    model = PactModel(_artifact(tmp_path), LoraConfig(r=4, alpha=8))
    los, params = list(model.adapters.values()), list(model.lora_params.values())
    with pytest.raises(RuntimeError, match="boom"), _aliased(los, params) as leaves:
        assert len(leaves) == len(params) and all(a is not p for a, p in zip(leaves, params))
        assert all(a.data_ptr() == p.data_ptr() and a.requires_grad and a.is_leaf for a, p in zip(leaves, params))
        assert {id(t) for lo in los for t in (lo.A, lo.B)} == {id(a) for a in leaves}
        raise RuntimeError("boom")
    assert {id(t) for lo in los for t in (lo.A, lo.B)} == {id(p) for p in params}


@pytest.mark.parametrize("asked", [True, False])
def test_a_failed_capture(tmp_path, monkeypatch, caplog, asked):
    """auto: a capture that fails (out of memory, an op a graph cannot hold) leaves eager steps and a
    warning; on: an error naming the flag. (CPU: graphs switched on by hand, the capture made to fail.)"""
    import pact.runtime.model as model_mod

    def fail(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory while capturing")

    monkeypatch.setattr(model_mod, "LayerGraphs", fail)
    model = PactModel(_artifact(tmp_path), LoraConfig(r=4, alpha=8))
    model.cuda_graphs, model._graphs_asked = True, asked
    model._graph_pool = object()  # (no CUDA here: the pool handle is not the point)
    ids = torch.randint(0, 256, (2, 16))
    if asked:
        with pytest.raises(PactError, match="--cuda-graphs on: capturing a step of shape 2 x 16 failed"):
            model(ids, ids)
        return
    with caplog.at_level("WARNING"):
        loss, n = model(ids, ids)
    loss.backward()
    assert model.cuda_graphs is False and "every step runs eagerly" in caplog.text
    assert all(p.grad is not None for p in model.lora_params.values())


def test_config_reads_back_every_run_record(tmp_path):
    """pact-train --config RUN/train_config.json ignores what the run added to its options."""
    from pact.pipelines.common import RUN_RECORD_KEYS
    from pact.runtime.config import TrainConfig
    from pact.runtime.trainer import _write_run_config

    cfg = TrainConfig(artifact="art", data="d.jsonl", out=str(tmp_path))
    model = types.SimpleNamespace(recipe=parse_recipe(None), cuda_graphs=False,
                                  ops=types.SimpleNamespace(dgrad_reads="layout"))
    _write_run_config(tmp_path, cfg, model, types.SimpleNamespace(world=1),
                      {"inputs": {}, "recipe_auto": {"chosen": None}})
    added = set(json.loads((tmp_path / "train_config.json").read_text())) - set(cfg.as_json())
    assert added and added <= set(RUN_RECORD_KEYS), added - set(RUN_RECORD_KEYS)


def test_train_config_records_eager_steps_on_the_cpu(tmp_path):
    from pact.runtime.config import TrainConfig
    from pact.runtime.trainer import train

    art = _artifact(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": " yes"} for i in range(8)])
    train(TrainConfig(artifact=str(art.path), data=str(data), out=str(tmp_path / "run"), steps=1, batch_size=2,
                      lora_r=4, cuda_graphs="auto", device="cpu"), progress=False)
    cfg = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert cfg["cuda_graphs"] == "auto" and cfg["graphed"] is False


def _steps(model, batches, lr=1e-2):
    """Loss of each batch and the parameters after an AdamW step on each (the graphs must see the
    updated parameters: the optimizer writes them in place)."""
    opt = torch.optim.AdamW(list(model.lora_params.values()), lr=lr, foreach=True)
    losses = []
    for batch in batches:
        loss, n = model(*[t.cuda() for t in batch])
        (loss / n).backward()
        losses.append(loss.item() / n)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: p.detach().cpu().clone() for k, p in model.lora_params.items()}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("checkpoint", [False, True])
def test_gpu_graphed_steps_match_eager(tmp_path, checkpoint):
    """Three shapes (two plain, one packed with positions and a mask), one shape met twice: the
    replayed steps give the eager steps' losses and parameters."""
    art = _artifact(tmp_path)
    g = torch.Generator().manual_seed(0)
    ex = [_ex(torch.randint(0, 256, (n,), generator=g).tolist(), 3) for n in (20, 31, 9, 40, 17)]
    plain = [collate(ex, [0, 1], 0, "cpu", width=lambda n: 64), collate(ex, [2, 3, 4], 0, "cpu", width=lambda n: 64)]
    packed = collate_packed(ex, [0, 1], 0, "cpu", width=lambda n: 64)
    batches = [plain[0], plain[1], packed, plain[0]]
    out = []
    for graphs in (False, True):
        model = PactModel(art, LoraConfig(r=4, alpha=8), device="cuda", cuda_graphs=graphs, checkpoint=checkpoint)
        with torch.no_grad():
            for p in model.lora_params.values():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        out.append(_steps(model, batches))
        if graphs:
            assert len(model._graphs) == 3
    (l0, p0), (l1, p1) = out
    assert l1 == pytest.approx(l0, rel=1e-3), (l0, l1)
    for k in p0:
        assert torch.allclose(p0[k], p1[k], rtol=1e-3, atol=1e-5), k


def _with_correction(art, rank):
    """A copy of ``art`` where every other projection carries a rank-``rank`` correction U V (random values;
    members of a group with and without one): bench_train's."""
    from bench_train import with_random_correction

    return open_artifact(with_random_correction(art.path, rank, every=2, scale=0.3))


def test_with_correction_copy(tmp_path):
    """What the GPU test below reads: some projections corrected, the rest not."""
    art = _with_correction(_artifact(tmp_path), 4)
    assert art.corrected
    have = [art.correction(n) is not None for n in art.names("nvfp4")]
    assert any(have) and not all(have)


@pytest.mark.gpu
@cuda
def test_gpu_graphed_steps_match_eager_with_a_correction(tmp_path):
    """A corrected artifact (pact-calibrate --correct-rank: the fused U / V GEMMs, made when the artifact is
    bound, before any capture): the replayed steps give the eager steps' losses and parameters, and the
    correction is in them (the losses differ from the uncorrected artifact's)."""
    base = _artifact(tmp_path)
    art = _with_correction(base, 4)
    g = torch.Generator().manual_seed(0)
    ex = [_ex(torch.randint(0, 256, (n,), generator=g).tolist(), 3) for n in (20, 31, 9, 40, 17)]
    batches = [collate(ex, [0, 1], 0, "cpu", width=lambda n: 64), collate(ex, [2, 3, 4], 0, "cpu", width=lambda n: 64)]
    batches.append(batches[0])
    out = []
    for a, graphs in ((art, False), (art, True), (base, False)):
        model = PactModel(a, LoraConfig(r=4, alpha=8), device="cuda", cuda_graphs=graphs)
        with torch.no_grad():
            for p in model.lora_params.values():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        out.append(_steps(model, batches))
    (l0, p0), (l1, p1), (l2, _) = out
    assert l1 == pytest.approx(l0, rel=1e-3), (l0, l1)
    for k in p0:
        assert torch.allclose(p0[k], p1[k], rtol=1e-3, atol=1e-5), k
    assert abs(l0[0] - l2[0]) > 1e-3 * abs(l2[0]), (l0, l2)


@pytest.mark.gpu
@cuda
def test_gpu_new_shapes_hold_no_memory(tmp_path):
    """Every capture reads and writes the shared buffers and leaves nothing live in the pool: the
    memory allocated after a fourth shape's capture is what it was after the first's (buffers sized
    once from graph_tokens; the warm-ups share one stream, so cuBLAS keeps one workspace, not one
    per shape); a larger shape than the buffers hold re-sizes them and re-captures."""
    art = _artifact(tmp_path)
    model = PactModel(art, LoraConfig(r=64, alpha=64), device="cuda", cuda_graphs=True)
    model.graph_tokens = 4 * 128
    after = []
    for s in (128, 64, 96, 32):
        ids = torch.randint(0, 256, (4, s), device="cuda")
        loss, n = model(ids, ids)
        loss.backward()
        del loss
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert len(model._graphs) == 4 and model._graph_bufs.capacity == 4 * 128
    # what the three later captures would hold if each kept its own output and gradients
    own = sum(4 * s * model.hidden * 2 + sum(p.numel() * 4 for p in model.lora_params.values()) for s in (64, 96, 32))
    assert max(after) - after[0] < own / 4, (after, own)
    ids = torch.randint(0, 256, (8, 128), device="cuda")
    loss, n = model(ids, ids)
    loss.backward()
    assert len(model._graphs) == 1 and model._graph_bufs.capacity == 8 * 128


@pytest.mark.gpu
@cuda
def test_gpu_graphs_follow_a_new_recipe(tmp_path):
    """use_recipe drops the captures; recipe_as (the auto probe) runs eagerly and keeps them."""
    art = _artifact(tmp_path)
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    model = PactModel(art, LoraConfig(r=4, alpha=8), device="cuda", cuda_graphs=True)
    loss, n = model(ids, ids)
    loss.backward()
    assert len(model._graphs) == 1
    with model.recipe_as(parse_recipe("nvfp4-saved")):
        loss, n = model(ids, ids)
        loss.backward()
    assert len(model._graphs) == 1
    model.use_recipe(parse_recipe("bf16"))
    assert not model._graphs
    ref = PactModel(art, LoraConfig(r=4, alpha=8), device="cuda", activations="bf16")
    for m in (model, ref):
        for p in m.lora_params.values():
            p.grad = None
        with torch.no_grad():
            for p in m.lora_params.values():
                p.fill_(0.01)
    losses = []
    for m in (model, ref):
        loss, n = m(ids, ids)
        losses.append(loss.item() / n)
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)


@pytest.mark.gpu
@cuda
def test_gpu_pact_train_with_graphs(tmp_path):
    """pact-train --cuda-graphs on: the loss curve of the eager run (padding to the bucket changes
    GEMM shapes only), train_config.json says the steps were graphed."""
    from pact.runtime.config import TrainConfig
    from pact.runtime.trainer import train

    art = _artifact(tmp_path)
    recs = [{"prompt": f"question {i} " + "word " * (i % 7), "completion": " yes" if i % 2 else " no"}
            for i in range(32)]
    data = _jsonl(tmp_path / "d.jsonl", recs)
    curves = {}
    for mode in ("off", "on"):
        run = tmp_path / f"run-{mode}"
        train(TrainConfig(artifact=str(art.path), data=str(data), out=str(run), steps=6, batch_size=4, lora_r=4,
                          lr=1e-3, cuda_graphs=mode), progress=False)
        curves[mode] = [json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"loss"' in line]
        assert json.loads((run / "train_config.json").read_text())["graphed"] is (mode == "on")
    assert curves["on"] == pytest.approx(curves["off"], rel=1e-2)


def test_graphs_on_refused_before_the_run_starts(tmp_path):
    """--cuda-graphs on where graphs cannot run: one line before any folder, model or GPTQ (pact-train
    --calibrate checks the inputs first)."""
    from conftest import make_converted_llama
    from pact.runtime.trainer import TrainConfig, check_inputs, train

    d = make_converted_llama(tmp_path, 8)
    cfg = TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(tmp_path / "run"), steps=1,
                      batch_size=2, max_len=32, cuda_graphs="on", device="cpu")
    for call in (lambda: check_inputs(cfg), lambda: train(cfg, progress=False)):
        with pytest.raises(PactError, match="--cuda-graphs on: not on a CUDA device"):
            call()
    assert not (tmp_path / "run").exists()
