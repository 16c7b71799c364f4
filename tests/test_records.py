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


# ---- record forms: one parser for train, eval and calibrate


def test_alpaca_records_use_the_alpaca_prompt(tok, tmp_path):
    from pact.runtime.data import ALPACA, ALPACA_INPUT

    recs = _records(tmp_path, [{"instruction": "rate the movie", "input": "fresh and bright", "output": " fresh"},
                               {"instruction": "rate the movie", "input": "", "output": " fresh"},
                               {"instruction": "rate the movie", "output": " fresh"}])
    with_input, empty, absent = tokenize(recs, tok, max_len=512)
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    assert with_input.prompt_ids == enc(
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\nrate the movie\n\n### Input:\n"
        "fresh and bright\n\n### Response:\n")
    assert empty.prompt_ids == absent.prompt_ids == enc(ALPACA.format(instruction="rate the movie"))
    assert "{input}" in ALPACA_INPUT and "### Input" not in ALPACA
    assert with_input.completion == " fresh" and _targets(with_input) == [enc(" fresh") + [tok.eos_token_id]]


def test_sharegpt_is_the_same_as_messages(tok, tmp_path):
    role = {"system": "system", "user": "human", "assistant": "gpt"}
    share = {"conversations": [{"from": role[m["role"]], "value": m["content"]} for m in CHAT], "id": "x1"}
    a, b = tokenize(_records(tmp_path, [share, {"messages": CHAT}]), tok, max_len=256)
    assert a.ids == b.ids and a.labels == b.labels and a.prompt_ids == b.prompt_ids


@pytest.mark.parametrize("rec,match", [
    ({"question": "a", "answer": "b"}, r"data.jsonl:1: expected 'prompt' and 'completion', or 'messages'; the record "
                                       r"has 'question', 'answer': rename the fields .* or use Alpaca \{instruction, "
                                       r"input, output\} or ShareGPT \{conversations"),
    ({"instruction": "a"}, r"the record has 'instruction'"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, r"'conversations' \(ShareGPT\): its last turn must be "
                                                            r"from 'gpt'"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, r"'conversations' \(ShareGPT\) with 'from' 'bot': expected "
                                                          r"'human', 'user', 'gpt'"),
    ({"conversations": "hi"}, r"a non-empty list of \{from, value\} objects"),
    ({"instruction": 3, "output": "b"}, r"instruction must be a string, got int"),
])
def test_bad_records_name_the_fields_and_the_forms(tok, tmp_path, rec, match):
    with pytest.raises(PactError, match=match) as e:
        tokenize(_records(tmp_path, [rec]), tok, max_len=64)
    assert "\n" not in str(e.value)


def test_calibration_prompts_read_every_form(tok, tmp_path):
    """calibrate/prompts.py reads records through the same parser (plus {"text"})."""
    from pact.calibrate.prompts import _texts

    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": "plain"}, {"prompt": "a", "completion": "b"}, {"instruction": "rate", "output": " fresh"},
        {"conversations": [{"from": "human", "value": "hi"}]}, {"messages": CHAT[1:3]}]))
    texts = _texts(f, tok)
    assert texts[:2] == ["plain", "ab"] and texts[2].endswith("### Instruction:\nrate\n\n### Response:\n fresh")
    assert texts[3] == "<|im_start|>user\nhi<|im_end|>\n" and texts[4].endswith("fresh and bright<|im_end|>\n")
    f.write_text('{"nope": 1}\n')
    with pytest.raises(PactError, match=r"prompts.jsonl:1: expected an object with 'text', 'prompt' and "
                                        r"'completion', or 'messages'; the record has 'nope'"):
        _texts(f, tok)


def test_read_records_limit_stops_at_the_first_records(tmp_path):
    """limit: the first records only; a .jsonl file is read no further (a bad line after them is not
    reached), and without a limit that line is still refused, naming it."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c", "completion": "d"}\nnot json\n')
    got = read_records(f, limit=2)
    assert [r["prompt"] for r in got] == ["a", "c"] and got[1]["_where"] == f"{f}:3"
    assert len(read_records(f, limit=1)) == 1
    with pytest.raises(PactError, match=r"d.jsonl:4: not valid JSON"):
        read_records(f)
