"""--lora-layers: adapters on some decoder blocks only; backward stops below the lowest one; the
adapter says which blocks it adapts (PEFT's layers_to_transform) and PEFT loads it that way."""

import json

import pytest
import torch

from conftest import make_converted_llama
from pact.formats import PactError, open_artifact
from pact.formats.peft import LoraConfig, load_peft_adapter, parse_layers
from pact.runtime.data import collate, pad_id, read_records, tokenize
from pact.runtime.model import PactModel
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("layers"), 32)


def test_parse_layers():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("top:1", 4) == [3] and parse_layers("top:4", 4) == [0, 1, 2, 3]
    assert parse_layers("1-2", 4) == [1, 2] and parse_layers("3,1", 4) == [1, 3]
    for bad in ("top:0", "2-1", "x", "", "-1", "top:"):
        with pytest.raises(PactError, match="--lora-layers"):
            parse_layers(bad, None)
    with pytest.raises(PactError, match="the model has 4 decoder blocks"):
        parse_layers("top:5", 4)
    with pytest.raises(PactError, match="block 4 does not exist"):
        parse_layers("2-4", 4)
    with pytest.raises(PactError, match="--lora-layers"):
        TrainConfig(artifact="a", data="d", out="o", lora_layers="top:x")


def test_top_block_gradients_equal_all_blocks(task):
    """With adapters on the top block only, the lower block runs without autograd, and the loss and
    the top block's gradients are those of a model adapted everywhere whose lower adapter is still
    zero (B = 0 at init: it adds nothing)."""
    art = open_artifact(task / "art")
    full = PactModel(art, LoraConfig(r=4))
    top = PactModel(art, LoraConfig(r=4, layers="top:1"))
    assert full.first_adapted == 0 and top.first_adapted == 1
    assert set(top.adapters) == {n for n in full.adapters if ".layers.1." in n}
    top.load_adapter_state({n: ab for n, ab in full.adapter_state().items() if n in top.adapters})
    ex = tokenize(read_records(task / "train.jsonl"), _tok(art), max_len=32)
    ids, labels = collate(ex, list(range(4)), pad_id(_tok(art)), "cpu")
    losses = []
    for m in (full, top):
        loss, n = m(ids, labels)
        (loss / n).backward()
        losses.append(float(loss.detach()))
    assert losses[0] == losses[1]
    for name, p in top.lora_params.items():
        assert p.grad is not None and torch.equal(p.grad, full.lora_params[name].grad), name
    assert any(float(p.grad.abs().sum()) > 0 for p in top.lora_params.values())


def _tok(art):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(art.hf_dir)


def test_peft_loads_top_block_adapter(task, tmp_path):
    """The run's adapter names its blocks (layers_to_transform); PEFT loads it on the bf16 weights
    and gives pact's logits; pact-eval reads it back with the same blocks."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    train(TrainConfig(artifact=str(task / "art"), data=str(task / "train.jsonl"), out=str(run), steps=3, batch_size=4,
                      max_len=32, lr=5e-3, warmup_ratio=0.0, lora_layers="top:1"), progress=False)
    cfg = json.loads((run / "adapter_config.json").read_text())
    assert cfg["layers_to_transform"] == [1]
    lcfg, weights = load_peft_adapter(run)
    assert lcfg.layers == "1" and all(".layers.1." in n for n in weights)
    art = open_artifact(task / "art")
    model = PactModel(art, lcfg, activations="bf16")
    model.load_adapter_state(weights)
    ids = torch.randint(0, 200, (2, 16))
    ref = model.logits(ids)
    from safetensors.torch import load_file, save_file

    bf16 = tmp_path / "bf16"
    import shutil

    shutil.copytree(task / "src", bf16)
    sd = load_file(bf16 / "model.safetensors")
    sd.update({n: art.dequantize(n).to(torch.bfloat16) for n in art.names("nvfp4")})
    save_file(sd, bf16 / "model.safetensors", metadata={"format": "pt"})
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32), run)
    got = hf(input_ids=ids).logits.detach()
    assert float((got - ref).norm() / ref.norm()) < 0.02
