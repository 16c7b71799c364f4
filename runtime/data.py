"""Training data: JSONL / HF datasets folder -> token ids with completion-only targets.

Accepted records: ``{"prompt", "completion"}`` or ``{"messages": [...]}`` (the chat
template of the artifact's tokenizer; the last message must be the assistant's and is
the target). Loss is only on completion tokens (and the end-of-sequence token after them).
"""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pact.formats import PactError

log = logging.getLogger(__name__)
IGNORE = -100
TEMPLATE_SECONDS = 10  # one conversation's chat-template rendering; a template from an artifact may loop
TEMPLATE_CHARS = 1 << 20  # and the rendered text's bound
RECORD_BYTES = 4 << 20  # one JSONL line (a record of 40 MB took 75 s and 6 GB of memory to tokenize)


@dataclass
class Example:
    ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens
    completion: str  # the raw target text (labels for classification-style evaluation)
    prompt_ids: list[int]


def read_records(path: str | Path, flag: str = "--data") -> list[dict]:
    """Records from a .jsonl file or a `datasets.save_to_disk` folder; errors name the line
    (and ``flag``, the option the path came from). Each record gets "_where" (file:line)."""
    p = Path(path)
    if not p.exists():
        raise PactError(f"{flag} {p}: no such file or folder")
    if p.is_dir():
        import datasets  # a declared dependency: imported outside the try so a broken install is not "not a folder"

        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:
            raise PactError(f"{flag} {p}: not a datasets.save_to_disk folder ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise PactError(f"{flag} {p}: a DatasetDict without a 'train' split ({list(ds)})")
            ds = ds["train"]
        records = [dict(r) for r in ds]
        where = [f"{p} row {i}" for i in range(len(records))]
    else:
        records, where = [], []
        with open(p, "rb") as f:
            for n, raw in enumerate(iter(lambda: f.readline(RECORD_BYTES + 1), b""), 1):
                if len(raw) > RECORD_BYTES:
                    raise PactError(f"{p}:{n}: a record longer than {RECORD_BYTES >> 20} MiB: split it, or leave it "
                                    "out (training reads at most --max-len tokens of it)")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise PactError(f"{p}:{n}: not UTF-8 text (byte {e.start + 1} of the line): save the file as "
                                    "UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PactError(f"{p}:{n}: not valid JSON ({e.msg}): one JSON object per line") from None
                except (RecursionError, ValueError) as e:  # nesting too deep; an integer too long to convert
                    kind = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
                    raise PactError(f"{p}:{n}: unreadable JSON ({kind}): one flat JSON object per line") from None
                if not isinstance(rec, dict):
                    raise PactError(f"{p}:{n}: expected a JSON object, got {type(rec).__name__}")
                records.append(rec)
                where.append(f"{p}:{n}")
    if not records:
        raise PactError(f"{flag} {p}: no records (empty file)")
    for rec, w in zip(records, where):
        rec["_where"] = w
    return records


class _TemplateTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    """SIGALRM after ``seconds`` (main thread on POSIX; elsewhere no limit, the size bound still holds)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise _TemplateTimeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def render_chat(tokenizer, messages: list[dict], where: str, **kw) -> str:
    """The tokenizer's chat template applied to ``messages``, bounded in time and size: the
    template comes from the artifact (someone else's file), and a loop in it must not hang a run."""
    fix = "the artifact's chat template (hf/tokenizer_config.json or chat_template.jinja) is faulty or hostile; " \
          "use prompt/completion records or fix the template"
    try:
        with _time_limit(TEMPLATE_SECONDS):
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    except _TemplateTimeout:
        raise PactError(f"{where}: rendering the chat template took over {TEMPLATE_SECONDS} s: {fix}") from None
    except Exception as e:  # jinja errors: a template that cannot render this conversation
        raise PactError(f"{where}: the chat template failed to render ({type(e).__name__}: {e}): {fix}") from None
    if not isinstance(text, str) or len(text) > TEMPLATE_CHARS:
        raise PactError(f"{where}: the chat template rendered {len(text) if isinstance(text, str) else 'no'} "
                        f"characters (bound {TEMPLATE_CHARS}): {fix}")
    return text


def _text(value, where: str, what: str) -> str:
    """``value`` as training text: a string that encodes as UTF-8 (JSON may carry lone surrogates)."""
    if not isinstance(value, str):
        raise PactError(f"{where}: {what} must be a string, got {'null' if value is None else type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PactError(f"{where}: {what} holds a lone surrogate (\\u{ord(value[e.start]):04x} at character "
                        f"{e.start}): not text; fix the record") from None
    return value


def _split(tokenizer, rec: dict) -> tuple[str, str]:
    w = rec["_where"]
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise PactError(f"{w}: 'messages' must be a non-empty list of {{role, content}} objects")
        if msgs[-1]["role"] != "assistant":
            raise PactError(f"{w}: the last message must be the assistant's (it is the training target)")
        for i, m in enumerate(msgs):  # text, or a list of content parts (multimodal templates); never null
            if not isinstance(m["content"], list) or i == len(msgs) - 1:
                _text(m["content"], w, f"message {i + 1}'s content")
        if not msgs[-1]["content"]:
            raise PactError(f"{w}: the assistant's message is empty: nothing to train on")
        if tokenizer.chat_template is None:
            raise PactError(f"{w}: the artifact's tokenizer has no chat template: use prompt/completion records")
        full = render_chat(tokenizer, msgs, w)
        prompt = render_chat(tokenizer, msgs[:-1], w, add_generation_prompt=True)
        if not full.startswith(prompt):
            raise PactError(f"{w}: the chat template renders the conversation inconsistently; use prompt/completion")
        return prompt, full[len(prompt):]
    if "prompt" not in rec or "completion" not in rec:
        found = ", ".join(repr(k) for k in rec if k != "_where") or "none"
        raise PactError(f"{w}: expected 'prompt' and 'completion', or 'messages'; the record has {found}: "
                        "rename the fields (e.g. input/output -> prompt/completion)")
    prompt, completion = _text(rec["prompt"], w, "prompt"), _text(rec["completion"], w, "completion")
    if not completion:
        raise PactError(f"{w}: the completion is empty: nothing to train on")
    return prompt, completion


def tokenize(records: list[dict], tokenizer, *, max_len: int, overlong: str = "truncate",
             vocab_size: int | None = None) -> list[Example]:
    """Token ids with prompt tokens masked. ``overlong``: "truncate" (prompt from the left,
    then the completion's tail; one warning with the count) or "refuse" (error naming it)."""
    if overlong not in ("truncate", "refuse"):
        raise PactError(f"--overlong must be truncate or refuse, got {overlong!r}")
    eos = tokenizer.eos_token_id
    out, cut = [], 0
    for rec in records:
        prompt, completion = _split(tokenizer, rec)
        p = tokenizer(prompt, add_special_tokens="messages" not in rec)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if eos is not None and (not c or c[-1] != eos):
            c = c + [eos]
        if len(p) + len(c) > max_len:
            if overlong == "refuse":
                raise PactError(f"{rec['_where']}: {len(p) + len(c)} tokens > --max-len {max_len} "
                                "(raise --max-len or pass --overlong truncate)")
            cut += 1
            c = c[: max(1, max_len - 1)]
            p = p[len(p) - (max_len - len(c)):] if max_len - len(c) > 0 else []
        ids = p + c
        if vocab_size is not None and max(ids) >= vocab_size:
            raise PactError(f"{rec['_where']}: token id {max(ids)} >= the model's vocabulary {vocab_size}: "
                            "the artifact's tokenizer does not match its weights")
        out.append(Example(ids, [IGNORE] * len(p) + c, completion, p))
    if cut:
        log.warning("truncated %d of %d examples to --max-len %d", cut, len(out), max_len)
    return out


def batches(examples: list[Example], batch_size: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Length-bucketed batches of example indices, the same for the same (seed, epoch).

    Shuffle, sort by length inside windows of 50 batches (little padding), then shuffle
    the batches so lengths do not trend through the epoch.
    """
    idx = list(range(len(examples)))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(idx)
    window = batch_size * 50
    out = []
    for i in range(0, len(idx), window):
        chunk = sorted(idx[i : i + window], key=lambda j: len(examples[j].ids))
        out.extend(chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size))
    if shuffle:
        rng.shuffle(out)
    return out


def pad_id(tokenizer) -> int:
    """The padding id: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id or 0


def collate(examples: list[Example], index: list[int], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels (padding is never a target; causal attention ignores it)."""
    seqs = [examples[i] for i in index]
    width = max(len(e.ids) for e in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for r, e in enumerate(seqs):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
        labels[r, : len(e.labels)] = torch.tensor(e.labels)
    return ids.to(device), labels.to(device)
