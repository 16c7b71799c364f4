"""Training records -> ids and labels: every assistant turn of a conversation is a target (with and
without the template's {% generation %} tags), and the record forms the data readers accept."""

import json

import pytest

from conftest import make_tokenizer
from pact.formats import PactError
from pact.runtime.data import IGNORE, read_records, tokenize

PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # conftest's: no generation tags
# the newline is an expression: one right after a block tag is trimmed (transformers renders with trim_blocks)
TAGGED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}"
          "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "low rank adapters"},
        {"role": "user", "content": "the movie was"},
        {"role": "assistant", "content": "fresh and bright"},
        {"role": "user", "content": "and the plot"},
        {"role": "assistant", "content": "rotten"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _records(tmp_path, recs):
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return read_records(f)


def _targets(e):
    """The labelled runs of an example, as lists of token ids."""
    runs, run = [], []
    for lab in e.labels + [IGNORE]:
        if lab != IGNORE:
            run.append(lab)
        elif run:
            runs, run = runs + [run], []
    return runs


@pytest.mark.parametrize("template", [PLAIN, TAGGED], ids=["prefix-diff", "generation-tags"])
def test_every_assistant_turn_is_a_target(tok, tmp_path, monkeypatch, template):
    monkeypatch.setattr(tok, "chat_template", template)
    [e] = tokenize(_records(tmp_path, [{"messages": CHAT}]), tok, max_len=256)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # exactly the two replies, each with the end-of-turn token the template writes after it (not the "\n")
    assert _targets(e) == [enc("fresh and bright") + [end], enc("rotten") + [end]]
    assert [t for t, lab in zip(e.ids, e.labels) if lab == IGNORE] == enc(
        "<|im_start|>system\nlow rank adapters<|im_end|>\n<|im_start|>user\nthe movie was<|im_end|>\n"
        "<|im_start|>assistant\n") + enc("\n<|im_start|>user\nand the plot<|im_end|>\n<|im_start|>assistant\n")
    assert e.labels[: len(e.prompt_ids)].count(IGNORE) < len(e.prompt_ids)  # the first reply lies in the prompt
    assert e.ids[len(e.prompt_ids):] == enc("rotten") + [end] and e.completion == "rotten"


def test_both_methods_agree(tok, tmp_path, monkeypatch):
    recs = _records(tmp_path, [{"messages": CHAT}, {"messages": CHAT[1:3]}])
    monkeypatch.setattr(tok, "chat_template", PLAIN)
    plain = tokenize(recs, tok, max_len=256)
    monkeypatch.setattr(tok, "chat_template", TAGGED)
    assert tokenize(recs, tok, max_len=256) == plain


def test_single_turn_matches_prompt_completion_tokens(tok, tmp_path):
    """One user + one assistant message: the same targets as before multi-turn (the reply + end of turn)."""
    [e] = tokenize(_records(tmp_path, [{"messages": CHAT[1:3]}]), tok, max_len=256)
    prompt = tok.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert e.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
    assert _targets(e) == [tok("fresh and bright<|im_end|>", add_special_tokens=False)["input_ids"]]


def test_a_template_that_writes_no_end_of_turn_gets_eos(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                              "{% if add_generation_prompt %}assistant: {% endif %}")
    [e] = tokenize(_records(tmp_path, [{"messages": CHAT}]), tok, max_len=256)
    runs = _targets(e)
    assert len(runs) == 2 and runs[1][-1] == tok.eos_token_id and runs[0][-1] != tok.eos_token_id


def test_truncation_keeps_the_last_reply(tok, tmp_path):
    [e] = tokenize(_records(tmp_path, [{"messages": CHAT}]), tok, max_len=8)
    assert len(e.ids) == 8 and e.ids[len(e.prompt_ids):] == e.labels[len(e.prompt_ids):]
    assert len(e.prompt_ids) >= 1


def test_inconsistent_template_is_named(tok, tmp_path, monkeypatch):
    """A template that renders past assistant turns differently (as Qwen3's drops past reasoning)."""
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last "
                                              "%}[past]{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
    with pytest.raises(PactError, match=r"data.jsonl:1: the chat template renders earlier turns differently.*"
                                        r"message 3 \(the assistant's\)"):
        tokenize(_records(tmp_path, [{"messages": CHAT}]), tok, max_len=256)

