"""--packing (several examples per row, each attending to itself only, positions from 0) and raw
{"text"} records (continued pretraining)."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from conftest import make_converted_llama
from pact.formats import PactError, open_artifact
from pact.formats.peft import LoraConfig
from pact.runtime.data import collate, collate_packed, pack, read_records, tokenize
from pact.runtime.model import PactModel
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("packing"), 48)


def _examples(task, max_len=64):
    tok = AutoTokenizer.from_pretrained(open_artifact(task / "art").hf_dir)
    return tokenize(read_records(task / "train.jsonl"), tok, max_len=max_len)


def test_pack_keeps_every_example_once(task):
    ex = _examples(task)
    rows = pack(ex, 128)
    assert len(rows) <= len(ex) / 2 and all(len(r.ids) <= 128 for r in rows)
    assert sum(len(r.ids) for r in rows) == sum(len(e.ids) for e in ex)
    pieces = [[t for t, s in zip(r.ids, r.segments) if s == k] for r in rows for k in sorted(set(r.segments))]
    assert sorted(pieces) == sorted(e.ids for e in ex)
    # targets: every example's own (its first token excepted, which is never a target unpacked either)
    assert sum(sum(t != -100 for t in r.labels) for r in rows) == sum(sum(t != -100 for t in e.labels[1:]) for e in ex)
    assert [r.ids for r in pack(ex, 128)] == [r.ids for r in rows]  # the same rows every time


def test_packed_loss_and_gradients_equal_unpacked(task):
    """The summed loss, target count and LoRA gradients of packed rows are those of each example
    run alone (no attention across examples, positions restart)."""
    ex = _examples(task)[:12]
    torch.manual_seed(0)
    model = PactModel(open_artifact(task / "art"), LoraConfig(r=4), activations="bf16", seed=1)
    with torch.no_grad():
        for lo in model.adapters.values():
            lo.B.normal_(0, 0.05)  # a nonzero adapter: B's gradient and A's both flow

    def run(batches):
        model.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for b in batches:
            loss, n = model(*b)
            loss.backward()
            total, count = total + float(loss), count + n
        return total, count, {k: p.grad.clone() for k, p in model.lora_params.items()}

    alone = run([collate(ex, [i], 0, "cpu") for i in range(len(ex))])
    rows = pack(ex, 128)
    packed = run([collate_packed(rows, list(range(len(rows))), 0, "cpu")])
    assert packed[1] == alone[1]
    assert packed[0] == pytest.approx(alone[0], rel=2e-3)
    for k, g in alone[2].items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), packed[2][k].flatten(), dim=0)
        assert cos > 0.995, (k, float(cos))
    # without the mask and positions the same rows give another loss: the test can see a leak
    leaky = run([collate(rows, list(range(len(rows))), 0, "cpu")])
    assert abs(leaky[0] - alone[0]) > 10 * abs(packed[0] - alone[0]), (leaky[0], packed[0], alone[0])


def test_raw_text_records_and_packed_training(task, tmp_path):
    text = tmp_path / "text.jsonl"
    words = "the movie with a bright cast and a rotten plot keeps low".split()
    text.write_text("".join(json.dumps({"text": " ".join(words[i % 5 :] + words[: i % 5]) * (1 + i % 3)}) + "\n"
                            for i in range(40)))
    tok = AutoTokenizer.from_pretrained(open_artifact(task / "art").hf_dir)
    ex = tokenize(read_records(text), tok, max_len=24)
    assert all(2 <= len(e.ids) <= 24 and e.labels == e.ids for e in ex)
    assert len(ex) > 40  # long texts are cut into --max-len pieces, not truncated
    run = tmp_path / "run"
    result = train(TrainConfig(artifact=str(task / "art"), data=str(text), out=str(run), max_len=96, batch_size=4,
                               steps=12, lr=5e-3, lora_r=4, lora_alpha=8, packing=True, kernels="torch"),
                   progress=False)
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 12 and m[-1]["loss"] < m[0]["loss"] and result["step"] == 12
    assert json.loads((run / "train_config.json").read_text())["packing"] is True
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with pytest.raises(PactError, match=r"empty.jsonl:1: the text is empty"):
        tokenize(read_records(empty), tok, max_len=24)
