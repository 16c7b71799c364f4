"""Generation with a key/value cache (runtime/generate.py), `pact generate` and `pact chat`."""

import types

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_converted_llama
from pact.convert.export import export
from pact.formats import PactError
from pact.pipelines.cli import main as pact_cli
from pact.runtime.generate import generate, next_logits, truncate
from pact.runtime.model import rmsnorm
from pact.runtime.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = make_converted_llama(tmp_path_factory.mktemp("gen"), 64)
    train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(d / "run"), max_len=64,
                      batch_size=16, steps=6, lr=5e-3, lora_r=4, lora_alpha=8, kernels="torch"), progress=False)
    return d


def _model(d, adapter=True):
    from pact.runtime.evaluate import load_adapted

    return load_adapted(str(d / "art"), str(d / "run") if adapter else None)


def _full_logits(model, ids):
    """The last position's logits with no cache: the whole prefix run again."""
    with torch.no_grad():
        h = rmsnorm(model.hidden_states(torch.tensor([ids]))[:, -1], model.final_norm, model.eps)
        return (h @ model.lm_head.t()).float()[0]


def test_scoring_models_leave_the_backward_layouts_on_disk(trained):
    """pact-eval, generate and chat build forward-only models: no backward layout loaded (half the frozen
    weights' memory), the same logits as a trainable model, and a backward through one is one clear error."""
    from pact.formats import open_artifact
    from pact.formats.peft import LoraConfig
    from pact.runtime.model import PactModel

    model, tok = _model(trained, adapter=False)
    groups = [g for L in model.layers for g in (L.qkv, L.o, L.gate_up, L.down)]
    assert all(g.weight is not None and g.weight_t is None for g in groups)
    art = open_artifact(str(trained / "art"))
    ids = torch.tensor([tok("review: fresh bright keep\nverdict:")["input_ids"]])
    assert torch.equal(model.logits(ids), PactModel(art, None, kernels="torch").logits(ids))
    forward_only = PactModel(art, LoraConfig(r=4, alpha=8), kernels="torch", backward=False)
    loss, _ = forward_only(ids, ids)
    with pytest.raises(RuntimeError, match="backward=False"):
        loss.backward()


def test_cached_logits_equal_a_full_rerun(trained):
    model, tok = _model(trained)
    prompt = tok("review: fresh bright keep\nverdict:")["input_ids"]
    out = generate(model, prompt, max_new_tokens=10, stop_ids=set())
    assert len(out) == 10
    cache, pos, seq = [None] * len(model.layers), 0, list(prompt)
    got = next_logits(model, prompt, cache, 0)
    pos = len(prompt)
    for t in out:
        ref = _full_logits(model, seq)
        assert torch.allclose(got, ref, atol=2e-2, rtol=2e-2), float((got - ref).abs().max())
        assert int(got.argmax()) == t  # greedy: the token the full rerun picks too
        seq.append(t)
        got = next_logits(model, [t], cache, pos)
        pos += 1
    # a cache cut back to the prompt continues as a fresh one does (a chat whose rendering changed)
    truncate(cache, len(prompt) - 2)
    again = next_logits(model, prompt[-2:], cache, len(prompt) - 2)
    assert torch.allclose(again, next_logits(model, prompt, [None] * len(model.layers), 0), atol=1e-3)


def test_generation_follows_transformers_on_the_bf16_export(trained, tmp_path):
    """Teacher-forced along transformers' greedy continuation of the bf16 export (base + adapter,
    merged in bf16): pact's cached logits stay close at every step and pick the same tokens."""
    export(str(trained / "art"), tmp_path / "bf16", fmt="bf16", adapter=str(trained / "run"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "bf16")
    prompt = tok("review: rotten low plot\nverdict:")["input_ids"]
    seq = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                      pad_token_id=tok.pad_token_id)[0].tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    model, _ = _model(trained)
    cache, agree = [None] * len(model.layers), 0
    got = next_logits(model, prompt, cache, 0)
    for k, t in enumerate(seq[len(prompt):]):
        r = ref[len(prompt) - 1 + k]
        assert (got - r).norm() / r.norm() < 0.05
        agree += int(got.argmax()) == t
        got = next_logits(model, [t], cache, len(prompt) + k)
    assert agree >= 7


def test_sampling_is_seeded_and_bounded(trained):
    model, tok = _model(trained)
    prompt = tok("review: the movie\nverdict:")["input_ids"]
    a = generate(model, prompt, max_new_tokens=6, stop_ids=set(), temperature=1.0, top_p=0.9, seed=3)
    b = generate(model, prompt, max_new_tokens=6, stop_ids=set(), temperature=1.0, top_p=0.9, seed=3)
    assert a == b and len(a) == 6
    with pytest.raises(PactError, match="--temperature must be >= 0"):
        generate(model, prompt, max_new_tokens=2, stop_ids=set(), temperature=-1)
    with pytest.raises(PactError, match="--max-new-tokens must be >= 1"):
        generate(model, prompt, max_new_tokens=0, stop_ids=set())
    for bad in (float("nan"), float("inf")):  # (nan reached torch.multinomial; inf sampled uniformly)
        with pytest.raises(PactError, match="--temperature must be >= 0 and finite"):
            generate(model, prompt, max_new_tokens=2, stop_ids=set(), temperature=bad)


def test_generate_and_chat_commands(trained):
    model, tok = _model(trained)
    prompt = "review: fresh bright keep\nverdict:"
    expect = tok.decode(generate(model, tok(prompt)["input_ids"], max_new_tokens=5,
                                 stop_ids={tok.eos_token_id, tok.pad_token_id}), skip_special_tokens=True)
    art, run = str(trained / "art"), str(trained / "run")
    r = CliRunner().invoke(pact_cli, ["generate", art, "--adapter", run, "--prompt", prompt, "--max-new-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert r.output.rstrip("\n").endswith(expect.rstrip("\n")) or expect.strip() in r.output
    r = CliRunner().invoke(pact_cli, ["chat", art, "--adapter", run, "--max-new-tokens", "4"],
                           input="hello there\nand again\n/reset\nonce more\n/exit\n")
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(pact_cli, ["generate", art, "--prompt", "x", "--temperature", "-1"])
    assert r.exit_code == 1 and "Error: --temperature must be >= 0" in r.output


def test_chat_needs_a_template(trained, tmp_path):
    import shutil

    from conftest import rehash_artifact

    art = tmp_path / "art"
    shutil.copytree(trained / "art", art)
    cfg = art / "hf" / "tokenizer_config.json"
    import json

    c = json.loads(cfg.read_text())
    c.pop("chat_template", None)
    cfg.write_text(json.dumps(c))
    for f in art.glob("hf/chat_template.*"):
        f.unlink()
    rehash_artifact(art)
    r = CliRunner().invoke(pact_cli, ["chat", str(art)], input="hi\n")
    assert r.exit_code == 1 and "pact chat needs a chat template, and the artifact's tokenizer has none" in r.output, \
        r.output


def test_chat_says_a_system_message_or_a_turn_too_long_by_name(trained):
    """A --system the context cannot hold is refused at the start, naming --system; a message too long
    alone is refused for its turn without first claiming that earlier turns were dropped to fit."""
    art = str(trained / "art")
    r = CliRunner().invoke(pact_cli, ["chat", art, "--system", "word " * 400], input="hi\n")
    assert r.exit_code == 1 and "Error: --system takes" in r.output and "shorten it" in r.output, r.output
    r = CliRunner().invoke(pact_cli, ["chat", art, "--max-new-tokens", "2"], input="hi\n" + "word " * 400 + "\n")
    assert r.exit_code == 0 and ("the conversation takes" in r.output or "the prompt takes" in r.output), r.output
    assert "earlier turns dropped" not in r.output


def test_cache_keeps_mistrals_sliding_window(tmp_path):
    """Past the window (8 tokens) the cached step attends to the last 8 only, as a full rerun does."""
    from conftest import make_model
    from pact.convert import convert
    from pact.formats import open_artifact
    from pact.runtime.model import PactModel

    make_model(tmp_path / "src", "mistral", sliding_window=8)
    model = PactModel(open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False)), None)
    prompt = list(range(10, 22))  # 12 tokens: already past the window
    out = generate(model, prompt, max_new_tokens=6, stop_ids=set())
    cache = [None] * len(model.layers)
    got, seq = next_logits(model, prompt, cache, 0), list(prompt)
    for t in out:
        assert torch.allclose(got, _full_logits(model, seq), atol=2e-2, rtol=2e-2)
        seq.append(t)
        got = next_logits(model, [t], cache, len(seq) - 1)
    for L in model.layers:
        L.window = None
    assert not torch.allclose(_full_logits(model, seq), got, atol=2e-2, rtol=2e-2)


def test_generation_stays_inside_the_context(trained):
    """A prompt that fills the model's context (256 tokens here) is refused; generation stops at its
    end; text that is not UTF-8 is one line; a chat turn past the context is refused and the chat goes on."""
    model, tok = _model(trained)
    window = model.cfg.max_position_embeddings
    with pytest.raises(PactError, match=rf"the prompt takes {window} tokens; the model's context is {window}"):
        generate(model, [5] * window, max_new_tokens=4, stop_ids=set())
    out = generate(model, [5] * (window - 3), max_new_tokens=50, stop_ids=set())
    assert len(out) == 3
    art = str(trained / "art")
    r = CliRunner().invoke(pact_cli, ["generate", art, "--prompt", "bad \udcff bytes"])
    assert r.exit_code == 1 and "Error: --prompt is not UTF-8 text (character 5)" in r.output, r.output
    long_turn = "movie " * 300
    r = CliRunner().invoke(pact_cli, ["chat", art, "--max-new-tokens", "2"], input=f"{long_turn}\nhello\n/exit\n")
    assert r.exit_code == 0 and "the model's context is 256" in r.output, r.output  # one turn alone too long
    turns = "".join(f"the movie with a bright cast number {i}\n" for i in range(40))  # together too long
    r = CliRunner().invoke(pact_cli, ["chat", art, "--max-new-tokens", "2"], input=turns + "/exit\n")
    assert r.exit_code == 0 and "earlier turns dropped" in r.output and "Error" not in r.output, r.output


def test_gemma3_trains_generates_and_exports(tmp_path):
    """Gemma 3 end to end on a tiny random model: pact-convert's defaults, a few training steps, cached
    generation past the local layer's window (16) equal to full reruns, and the bf16 export read by
    transformers giving pact's logits and greedy tokens."""
    import json

    from conftest import make_model
    from pact.convert import convert
    from pact.runtime.evaluate import load_adapted

    make_model(tmp_path / "src", "gemma3")
    art = convert(str(tmp_path / "src"), tmp_path / "art", progress=False)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"item {i} is", "completion": f" word{i % 5}"}) + "\n"
                            for i in range(32)))
    out = train(TrainConfig(artifact=str(art), data=str(data), out=str(tmp_path / "run"), max_len=32, batch_size=8,
                            steps=4, lr=5e-3, lora_r=4, lora_alpha=8, kernels="torch"), progress=False)
    assert out["step"] == 4 and out["loss"] == out["loss"]  # finite
    model, tok = load_adapted(str(art), str(tmp_path / "run"))
    prompt = list(range(10, 30))  # 20 tokens: past the local window
    gen = generate(model, prompt, max_new_tokens=6, stop_ids=set())
    cache, seq = [None] * len(model.layers), list(prompt)
    got = next_logits(model, prompt, cache, 0)
    for t in gen:
        assert torch.allclose(got, _full_logits(model, seq), atol=2e-2, rtol=2e-2)
        seq.append(t)
        got = next_logits(model, [t], cache, len(seq) - 1)
    export(str(art), tmp_path / "bf16", fmt="bf16", adapter=str(tmp_path / "run"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    ours = torch.stack([_full_logits(model, seq[: i + 1]) for i in range(len(prompt) - 1, len(seq))])
    ref = ref[len(prompt) - 1:]
    assert ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


class _ByteTokenizer:
    """A token is a byte: a character of two UTF-8 bytes takes two tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_printer_holds_half_a_character_and_prints_the_tail(capsys):
    """The printer waits for a character's last byte before showing it, and at the end prints what it still
    holds (a reply cut mid-character by --max-new-tokens printed nothing of its tail)."""
    from pact.pipelines.generate import _Printer

    p = _Printer(_ByteTokenizer())
    for t in b"a\xc2":
        p(t)
    assert capsys.readouterr().out == "a"
    p(0xB5)
    p.finish()
    assert capsys.readouterr().out == "\u00b5"
    p = _Printer(_ByteTokenizer())
    for t in b"b\xc2":
        p(t)
    p.finish()
    assert capsys.readouterr().out == "b\ufffd"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_non_finite_logits_are_one_error(monkeypatch, temperature):
    """Weights or an adapter that pass every check (finite values) can still compute NaN: greedy decoding printed
    nothing and exited 0, sampling died in torch.multinomial; both are one error naming the cause."""
    from pact.runtime import generate as G

    model = types.SimpleNamespace(cfg=types.SimpleNamespace(max_position_embeddings=64), layers=[None])
    monkeypatch.setattr(G, "next_logits", lambda m, ids, cache, pos: torch.full((10,), float("nan")))
    with pytest.raises(PactError, match=r"^the model computes non-finite values \(NaN or inf\) at token 3: its "
                                        r"weights or its adapter are not usable"):
        G.generate(model, [1, 2, 3], max_new_tokens=4, stop_ids=set(), temperature=temperature, seed=0)


def _metaspace_tokenizer(tmp_path):
    """A SentencePiece-like tokenizer (Metaspace: a word's leading space is a '▁' its decoder strips at the start
    of what it decodes), over PreTrainedTokenizerFast as an artifact's would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tk.train_from_iterator(["the movie was fresh and \u00e9t\u00e9 was fun \u4e2d\u6587"] * 20,
                           trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_the_printed_stream_is_the_decoded_reply(tmp_path, capsys, kind):
    """Printed token by token, a reply reads as its whole decode: byte-level tokens that split a character, and
    SentencePiece spaces a decoder strips at the start of what it decodes (the printer decodes a window of the
    last tokens, never the whole reply)."""
    from conftest import make_tokenizer
    from pact.pipelines.generate import _Printer

    tok = make_tokenizer(tmp_path) if kind == "byte-level" else _metaspace_tokenizer(tmp_path)
    for seed in range(5):
        ids = torch.randint(0, len(tok), (60,), generator=torch.Generator().manual_seed(seed)).tolist()
        p = _Printer(tok)
        for t in ids:
            p(t)
        p.finish()
        assert capsys.readouterr().out == tok.decode(ids, skip_special_tokens=True)


def test_the_printer_decodes_a_few_tokens_a_time():
    """A 4 MB token repeated made the printer (re-decoding the whole reply per token) quadratic: each decode
    now reads at most the last few tokens."""
    from pact.pipelines.generate import _Printer

    class Counting(_ByteTokenizer):
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids)

    p = _Printer(Counting())
    for t in b"abc" * 1000 + "\u00b5".encode() * 100:
        p(t)
    p.finish()
    assert Counting.longest <= 4  # the last printed step's tokens (a character's two) and the ones held
