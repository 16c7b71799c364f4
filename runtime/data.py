"""Training data: JSONL / HF datasets folder -> token ids with completion-only targets.

Accepted records (parse_record): ``{"prompt", "completion"}``, ``{"messages": [...]}`` (the chat
template of the artifact's tokenizer; the last message must be the assistant's), Alpaca
``{"instruction", "input", "output"}`` (the Alpaca prompt) and ShareGPT ``{"conversations":
[{"from", "value"}]}`` (as messages). Loss is only
on completion tokens (and the end-of-sequence token after them); in a conversation on every
assistant turn (and the end-of-turn token the template writes after it).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import re
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
TEMPLATE_CHARS = 1 << 20  # and the rendered text's bound (and the template's)
TEMPLATE_BYTES = 256 << 20  # the address space one rendering may add (a real one: kilobytes): _memory_limit
MUL_MAX = 1024  # the largest repeat count a chat template may write (`'-' * 80`): see template_hazard
TEMPLATE_FIX = ("the artifact's chat template (hf/tokenizer_config.json or chat_template.jinja) is faulty or hostile; "
                "use prompt/completion records or fix the template")
RECORD_BYTES = 4 << 20  # one JSONL line (a record of 40 MB took 75 s and 6 GB of memory to tokenize)


@dataclass
class Example:
    ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens
    completion: str  # the raw target text (labels for classification-style evaluation)
    prompt_ids: list[int]
    segments: list[int] | None = None  # a packed row (--packing): each token's sequence number in the row


TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json"}  # read through datasets.load_dataset
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # "org/name": what a missing --data that looks like a hub dataset id is


DEFAULT_SPLITS = {"--data": ("train",), "--eval-data": ("test", "validation")}  # a DatasetDict's split, first found


def _split_flag(flag: str) -> str:
    """The option naming the split of what ``flag`` gives (--data: --data-split, --eval-data: --eval-split)."""
    return "--eval-split" if flag == "--eval-data" else "--data-split"


def read_records(path: str | Path, flag: str = "--data", split: str | None = None,
                 default_splits: tuple[str, ...] | None = None, limit: int | None = None) -> list[dict]:
    """Records from a .jsonl file, a .parquet / .csv / .json table (datasets' loaders; .json: an
    array of objects or JSON lines) or a `datasets.save_to_disk` folder (of a DatasetDict: ``split``,
    else the first of DEFAULT_SPLITS[flag] it has); errors name the line (and ``flag``, the option
    the path came from). Each record gets "_where" (file:line or row). ``limit``: the first records
    only (a .jsonl file is read no further; the lines after them are not checked)."""
    p = Path(path)
    split_flag = _split_flag(flag)
    if split is not None and p.exists() and not p.is_dir():
        raise PactError(f"{split_flag} {split}: {p} is a file; a split names a part of a datasets.save_to_disk "
                        f"folder (DatasetDict) or a hub dataset: drop {split_flag}")
    if not p.exists():
        if not looks_like_hub_id(str(path)):
            raise PactError(f"{flag} {p}: no such file or folder")
        records = _hub_records(str(path), flag, split, default_splits or DEFAULT_SPLITS.get(flag, ("train",)),
                               limit)
        where = [f"{path} row {i}" for i in range(len(records))]
    elif p.is_file() and p.suffix.lower() in TABLE_FORMATS:
        records = _table_records(p, flag, limit)
        where = [f"{p} row {i}" for i in range(len(records))]
    elif p.is_dir():
        import datasets  # a declared dependency: imported outside the try so a broken install is not "not a folder"

        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:
            raise PactError(f"{flag} {p}: not a datasets.save_to_disk folder ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            wanted = (split,) if split is not None else default_splits or DEFAULT_SPLITS.get(flag, ("train",))
            found = next((w for w in wanted if w in ds), None)
            if found is None:
                raise PactError(f"{flag} {p}: a DatasetDict without a {' or '.join(map(repr, wanted))} split (it has "
                                f"{', '.join(map(repr, ds))}): pass {split_flag} NAME")
            ds = ds[found]
        elif split is not None:
            raise PactError(f"{split_flag} {split}: {p} holds one dataset, not a DatasetDict with splits: "
                            f"drop {split_flag}")
        records = _rows(ds, limit)
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
                if len(records) == limit:
                    break
    records, where = records[:limit], where[:limit]
    if not records:
        raise PactError(f"{flag} {p}: no records (empty file)")
    for rec, w in zip(records, where):
        rec["_where"] = w
    return records


DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".arrow", ".tsv")


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is no local path: not a data file's name (``data/train.jsonl``), and its first
    part not a folder here (a mistyped local path stays a missing file, never a download)."""
    return (HUB_ID.fullmatch(path) is not None and not path.lower().endswith(DATA_SUFFIXES)
            and not Path(path.split("/")[0]).is_dir())


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (offline mode, or its host does not resolve), else None: checked
    first, so an offline machine gets its one-line answer at once, not after the library's retries."""
    import os
    import socket
    from urllib.parse import urlsplit

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on") or \
            os.environ.get("HF_DATASETS_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return "offline mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    host = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} does not resolve: {e.strerror or e}"
    return None


def _hub_records(repo: str, flag: str, split: str | None, defaults: tuple[str, ...],
                 limit: int | None = None) -> list[dict]:
    """A hub dataset id through datasets.load_dataset (``split``, else the first of ``defaults`` it has);
    without a network, or for an id the hub does not have, one line saying how to use it locally."""
    import datasets

    local = (f"pact reads it through datasets.load_dataset, which could not get it ({{why}}); offline, save it "
             f"once where there is a network with datasets.load_dataset('{repo}', split=...).save_to_disk(DIR) "
             "and pass DIR")
    why = _hub_unreachable()
    if why is None:
        try:
            ds = datasets.load_dataset(repo, split=split) if split else datasets.load_dataset(repo)
        except Exception as e:  # ConnectionError, DatasetNotFoundError, ... : the library's own types
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    if why is not None:
        raise PactError(f"{flag} {repo}: no such file or folder, and as a hub dataset id: "
                        + local.format(why=why)) from None
    if isinstance(ds, datasets.DatasetDict):
        found = next((w for w in defaults if w in ds), None)
        if found is None:
            raise PactError(f"{flag} {repo}: the hub dataset has splits {', '.join(map(repr, ds))}, none of "
                            f"{', '.join(map(repr, defaults))}: pass {_split_flag(flag)} NAME")
        ds = ds[found]
    return _rows(ds, limit)


def _rows(ds, limit: int | None) -> list[dict]:
    """A datasets table's rows as dicts, the first ``limit`` only when given (the rest never converted:
    pact-train's calibration decision reads the head of --data, not the whole table)."""
    return [dict(r) for r in (ds if limit is None else ds.select(range(min(limit, len(ds)))))]


def _table_records(p: Path, flag: str, limit: int | None = None) -> list[dict]:
    """The rows of a .parquet / .csv / .json file as dicts, through datasets' loaders (their Arrow
    cache in a temporary folder, removed after: nothing is left in the user's datasets cache)."""
    import shutil
    import tempfile

    import datasets

    cache = tempfile.mkdtemp(prefix="pact-data-")
    try:
        ds = datasets.load_dataset(TABLE_FORMATS[p.suffix.lower()], data_files=str(p), split="train",
                                   cache_dir=cache)
        return _rows(ds, limit)
    except Exception as e:  # the loaders raise their own (pyarrow, pandas) error types
        kind = p.suffix.lower()[1:]
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise PactError(f"{flag} {p}: not a readable {kind} table ({why}): fix the file, or give JSONL "
                        "(one JSON object per line)") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)


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


def _address_space() -> int:
    """This process's virtual size in bytes (Linux: /proc/self/statm); OSError elsewhere."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def _memory_limit(nbytes: int):
    """RLIMIT_AS lowered to this process's present size + ``nbytes`` while a chat template renders (Linux), then
    restored (a process may raise its soft limit back up to the hard one). jinja runs a filter in C, where no time
    bound reaches it (``'x'|center(3000000000)``: 6 GB at once), and a loop of doublings outgrows the host before
    SIGALRM: past the bound, an allocation fails with MemoryError instead. The bound is the whole process's for
    those milliseconds (the main thread renders; nothing else allocates meanwhile). Elsewhere: no bound (the time
    bound and template_hazard still hold)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = _address_space() + nbytes
    except (ImportError, OSError, ValueError):
        yield
        return
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft <= want:  # the process is bounded more tightly already
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@functools.cache
def _template_parser():
    """A parser of chat templates with transformers' extensions: its {% generation %} block and loop controls."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=[Generation, jinja2.ext.loopcontrols])


def _number(node, bound: float) -> bool:
    """``node`` is a number written in the template, at most ``bound`` in size."""
    from jinja2 import nodes

    v = node.value if isinstance(node, nodes.Const) else None
    return isinstance(v, (int, float)) and abs(v) <= bound


def _short_text(node) -> bool:
    """A written string of at most 16 characters: its repeat by a computed count (tool templates indent
    by depth) costs what the count costs, a number the template can make large only by multiplying
    computed values, which is refused."""
    from jinja2 import nodes

    return isinstance(node, nodes.Const) and isinstance(node.value, str) and len(node.value) <= 16


@functools.lru_cache(maxsize=16)
def template_hazard(src: str) -> str | None:
    """What in the chat template ``src`` could outrun TEMPLATE_SECONDS, or None. SIGALRM only stops
    Python between operations, and jinja runs these in C for as long as a number in them says
    (``7 ** 777777777``: minutes): a power, a product of two computed values (``n * n``: a written
    count stays, ``'-' * 80``, ``x * 2``, and so does a short written string's repeat, ``'  ' * depth``),
    ``round`` to a computed precision (a power of ten), ``sum`` from a computed start (adding up lists:
    quadratic). Real chat templates use none of them. A template that does not parse raises jinja2's
    TemplateSyntaxError."""
    from jinja2 import nodes

    if len(src) > TEMPLATE_CHARS:
        return f"is {len(src)} characters (bound {TEMPLATE_CHARS})"
    for node in _template_parser().parse(src).find_all((nodes.Pow, nodes.Mul, nodes.Filter)):
        if isinstance(node, nodes.Pow):
            what = "raises to a power (**)"
        elif isinstance(node, nodes.Mul):
            ok = (_number(node.left, MUL_MAX) or _number(node.right, MUL_MAX)
                  or (_short_text(node.left) and not _number(node.right, math.inf))  # an indent: '  ' * depth
                  or (_short_text(node.right) and not _number(node.left, math.inf)))  # (a written count: bound)
            what = None if ok else f"multiplies by a computed count or one over {MUL_MAX} (*)"
        else:
            what = _filter_hazard(node)
        if what:
            return f"{what} on line {node.lineno}: jinja computes it in C, where no time bound can stop it"
    return None


def _filter_hazard(node) -> str | None:
    from jinja2 import nodes

    name, args, kw = node.name, list(node.args), {k.key: k.value for k in node.kwargs}
    if node.dyn_args or node.dyn_kwargs:
        return f"calls {name} with unpacked arguments"
    while name == "map" and args:  # map('sum', ...): that filter on each item (map(attribute=...) maps no filter)
        if not (isinstance(args[0], nodes.Const) and isinstance(args[0].value, str)):
            return "maps a computed filter"
        name = args.pop(0).value
    for filt, i, key, bound in (("round", 0, "precision", MUL_MAX), ("sum", 1, "start", math.inf)):
        arg = args[i] if len(args) > i else kw.get(key)
        if name == filt and arg is not None and not _number(arg, bound):
            return f"calls {filt} with a computed {key}"
    return None


TEMPLATES_MAX = 8  # named chat templates a tokenizer may carry (real ones: 1-3)
TEMPLATE_CHARS = 256 << 10  # their characters together (real ones: a few thousand; 1 MiB took ~3.5 s to check)


def check_templates(tokenizer, where: str) -> None:
    """Each of the tokenizer's chat templates free of template_hazard's operations (one error naming it), once a
    tokenizer (a record renders three times; 17 templates of 1 MiB each, parsed each time, took 128 s a record)."""
    t = getattr(tokenizer, "chat_template", None)
    key = tuple(t.items()) if isinstance(t, dict) else t
    if getattr(tokenizer, "_pact_templates_checked", None) == key:
        return
    if isinstance(t, dict) and len(t) > TEMPLATES_MAX:
        raise PactError(f"{where}: the tokenizer carries {len(t)} chat templates, more than {TEMPLATES_MAX}: "
                        f"{TEMPLATE_FIX}")
    chars = sum(len(v) for v in (t.values() if isinstance(t, dict) else [t]) if isinstance(v, str))
    if chars > TEMPLATE_CHARS:
        raise PactError(f"{where}: the tokenizer's chat templates hold {chars} characters, more than {TEMPLATE_CHARS} "
                        f"(each is parsed before it renders): {TEMPLATE_FIX}")
    for name, src in (t.items() if isinstance(t, dict) else [(None, t)]):
        if isinstance(src, str) and (why := template_hazard(src)):
            raise PactError(f"{where}: the chat template{f' {name!r}' if name else ''} {why}: {TEMPLATE_FIX}")
    tokenizer._pact_templates_checked = key


def _bounded_render(tokenizer, where: str, render):
    """``render()`` of the tokenizer's chat template, its templates checked first (template_hazard), under the
    rendering's bounds: time (SIGALRM), address space (_memory_limit); each failure one error naming ``where``."""
    try:
        check_templates(tokenizer, where)  # (one that does not parse fails here, never reaching jinja's compiler)
        with _time_limit(TEMPLATE_SECONDS), _memory_limit(TEMPLATE_BYTES):
            return render()
    except PactError:
        raise
    except _TemplateTimeout:
        raise PactError(f"{where}: rendering the chat template took over {TEMPLATE_SECONDS} s: "
                        f"{TEMPLATE_FIX}") from None
    except MemoryError:
        raise PactError(f"{where}: rendering the chat template needed over {TEMPLATE_BYTES >> 20} MiB of memory: "
                        f"{TEMPLATE_FIX}") from None
    except Exception as e:  # jinja errors: a template that cannot render this conversation
        raise PactError(f"{where}: the chat template failed to render ({type(e).__name__}: {e}): "
                        f"{TEMPLATE_FIX}") from None


def _sized(text, where: str) -> str:
    """A rendered text within TEMPLATE_CHARS, or one error."""
    if not isinstance(text, str) or len(text) > TEMPLATE_CHARS:
        raise PactError(f"{where}: the chat template rendered {len(text) if isinstance(text, str) else 'no'} "
                        f"characters (bound {TEMPLATE_CHARS}): {TEMPLATE_FIX}")
    return text


def render_chat(tokenizer, messages: list[dict], where: str, **kw) -> str:
    """The tokenizer's chat template applied to ``messages``, bounded in time, memory and size: the
    template comes from the artifact (someone else's file), and a loop in it must not hang a run."""
    return _sized(_bounded_render(tokenizer, where,
                                  lambda: tokenizer.apply_chat_template(messages, tokenize=False, **kw)), where)


def check_text(value, where: str, what: str) -> str:
    """``value`` as training text: a string that encodes as UTF-8 (JSON may carry lone surrogates)."""
    if not isinstance(value, str):
        raise PactError(f"{where}: {what} must be a string, got {'null' if value is None else type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PactError(f"{where}: {what} holds a lone surrogate (\\u{ord(value[e.start]):04x} at character "
                        f"{e.start}): not text; fix the record") from None
    return value


OTHER_FORMS = ("Alpaca {instruction, input, output} or ShareGPT {conversations: [{from, value}]} records, or "
               "{text} for raw text")
# the Stanford Alpaca prompt (tatsu-lab/stanford_alpaca, train.py), with and without an input
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
          "\n\n### Instruction:\n{instruction}\n\n### Response:\n")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def parse_record(rec: dict, *, text: bool = False) -> dict:
    """A record in any accepted form as ``{"prompt", "completion"}`` or ``{"messages"}`` (with
    ``text``, calibration's plain ``{"text"}`` too), "_where" kept: the one parser of train, eval
    and calibrate. Other fields are ignored; a record in none of the forms is an error naming its
    fields and the forms."""
    w = rec["_where"]
    if text and isinstance(rec.get("text"), str):
        return {"text": rec["text"], "_where": w}
    if "messages" in rec:
        return {"messages": rec["messages"], "_where": w}
    if "conversations" in rec:  # ShareGPT
        turns = rec["conversations"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "from" in t and "value" in t
                                                               for t in turns):
            raise PactError(f"{w}: the record has 'conversations' (ShareGPT): it must be a non-empty list of "
                            "{from, value} objects")
        unknown = sorted({str(t["from"]) for t in turns if t["from"] not in SHAREGPT_ROLES})
        if unknown:
            raise PactError(f"{w}: the record has 'conversations' (ShareGPT) with 'from' "
                            f"{', '.join(map(repr, unknown))}: "
                            f"expected {', '.join(map(repr, SHAREGPT_ROLES))}")
        msgs = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
        if msgs[-1]["role"] != "assistant" and not text:
            raise PactError(f"{w}: the record has 'conversations' (ShareGPT): its last turn must be from 'gpt' "
                            "(the training target)")
        return {"messages": msgs, "_where": w}
    if "prompt" in rec and "completion" in rec:
        return {"prompt": rec["prompt"], "completion": rec["completion"], "_where": w}
    if "instruction" in rec and "output" in rec:  # Alpaca
        instruction = check_text(rec["instruction"], w, "instruction")
        extra = check_text(rec.get("input") or "", w, "input")  # absent, null or "": no input section
        prompt = (ALPACA_INPUT if extra else ALPACA).format(instruction=instruction, input=extra)
        return {"prompt": prompt, "completion": rec["output"], "_where": w}
    if text and "text" in rec:  # the plain-text form, its value not a string
        check_text(rec["text"], w, "text")
    found = ", ".join(repr(k) for k in rec if k != "_where") or "none"
    raise PactError(f"{w}: expected {'an object with ' + repr('text') + ', ' if text else ''}"
                    "'prompt' and 'completion', "
                    f"or 'messages'; the record has {found}: rename the fields (e.g. question/answer -> "
                    f"prompt/completion), or use {OTHER_FORMS}")


def check_conversation(msgs, w: str, *, null_content: bool = False) -> None:
    """``msgs`` is a conversation a chat template can render: a non-empty list of {role, content} objects,
    each content text or a list of content parts (multimodal templates); null only with ``null_content``
    (calibration, which renders and never learns: an assistant turn that only calls tools)."""
    if (not isinstance(msgs, list) or not msgs
            or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs)):
        raise PactError(f"{w}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m["content"], list) and not (null_content and m["content"] is None):
            check_text(m["content"], w, f"message {i + 1}'s content")


def _check_messages(msgs, w: str) -> None:
    check_conversation(msgs, w)
    if msgs[-1]["role"] != "assistant":
        raise PactError(f"{w}: the last message must be the assistant's (it is the training target)")
    for i, m in enumerate(msgs):  # what is learned is text
        if m["role"] == "assistant" and isinstance(m["content"], list):
            check_text(m["content"], w, f"message {i + 1}'s content")
    if not msgs[-1]["content"]:
        raise PactError(f"{w}: the assistant's message is empty: nothing to train on")


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _tagged_mask(tokenizer, msgs: list[dict], w: str) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and transformers' assistant mask: 1 on the tokens the
    template's ``{% generation %}`` blocks wrote. The template renders once, under render_chat's bounds
    (time, address space, size), returning the blocks' character spans as transformers finds them
    (render_jinja_template); the text is tokenized after, outside the address-space bound (the tokenizers
    library may start its thread pool there, a thread's reservation each), and a token overlapping a span
    is 1: transformers' own mask, computed the same way (apply_chat_template's)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = _bounded_render(tokenizer, w, lambda: render_jinja_template(
        conversations=[msgs], chat_template=tokenizer.get_chat_template(), return_assistant_tokens_mask=True,
        **tokenizer.special_tokens_map))
    text, spans = _sized(rendered[0], w), indices[0]
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except PactError:
        raise
    except Exception as e:  # a tokenizer without offsets
        raise PactError(f"{w}: the chat template's assistant mask failed ({type(e).__name__}: {e}): "
                        f"{TEMPLATE_FIX}") from None
    mask, k = [0] * len(enc["input_ids"]), 0
    for i, (a, b) in enumerate(enc["offset_mapping"]):  # spans and offsets both in order: one pass
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if b > spans[k][0]:
            mask[i] = 1
    return list(enc["input_ids"]), mask


def _diffed_mask(tokenizer, msgs: list[dict], w: str) -> tuple[list[int], list[int]]:
    """The same without generation tags, by prefix differences: each assistant turn's text is what
    rendering the conversation through it adds to the conversation before it plus the generation
    prompt. Whitespace the template writes after a turn (after its end-of-turn token) stays
    unlabelled. Each piece is tokenized on its own, so no token straddles a label boundary."""
    full = render_chat(tokenizer, msgs, w)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:  # an opening assistant message has no prompt: context
            continue
        prefix = render_chat(tokenizer, msgs[:i], w, add_generation_prompt=True)
        through = full if i == len(msgs) - 1 else render_chat(tokenizer, msgs[: i + 1], w)
        if not (through.startswith(prefix) and full.startswith(through)) or (spans and len(prefix) < spans[-1][1]):
            raise PactError(f"{w}: the chat template renders earlier turns differently once later ones follow "
                            f"(e.g. it drops past reasoning), so message {i + 1} (the assistant's) cannot be located: "
                            "split the conversation into one record per assistant turn, or give the template "
                            "{% generation %} tags")
        end = len(prefix) + len(through[len(prefix):].rstrip())
        if isinstance(m["content"], str) and (at := through.find(m["content"], len(prefix))) >= 0:
            end = max(end, at + len(m["content"]))  # never cut into the reply's own trailing whitespace
        spans.append((len(prefix), end))
    ids, mask, pos = [], [], 0
    for a, b in spans:
        for text, label in ((full[pos:a], 0), (full[a:b], 1)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            mask += [label] * len(piece)
        pos = b
    return ids, mask


def _chat(tokenizer, rec: dict) -> tuple[list[int], list[int], int, str]:
    """A conversation's ids and labels: every assistant turn's tokens (and the end-of-turn token the
    template writes after it) are targets, everything else is IGNORE; and where the last assistant
    turn starts (its prompt, for evaluation). Templates with ``{% generation %}`` tags mark the
    turns themselves (transformers' assistant mask); others by prefix differences."""
    w, msgs = rec["_where"], rec["messages"]
    _check_messages(msgs, w)
    if tokenizer.chat_template is None:
        raise PactError(f"{w}: the artifact's tokenizer has no chat template: use prompt/completion records")
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # several named templates and none the default: rendering names the problem
        template = ""
    tagged = bool(GENERATION_TAG.search(template or "")) and tokenizer.is_fast  # the mask needs offsets
    ids, mask = (_tagged_mask if tagged else _diffed_mask)(tokenizer, msgs, w)
    if 1 not in mask:
        raise PactError(f"{w}: the chat template marks no assistant tokens in this conversation: nothing to train "
                        "on; put the assistant's reply inside a {% generation %} block, or use prompt/completion")
    last = len(mask) - mask[::-1].index(1)  # after the last target; what follows is never learned
    ids, mask = ids[:last], mask[:last]
    start = last
    while start > 0 and mask[start - 1]:
        start -= 1
    eos = tokenizer.eos_token_id
    if eos is not None and ids[-1] not in _special_ids(tokenizer):  # the template writes no end of turn
        ids, mask = ids + [eos], mask + [1]
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    content = msgs[-1]["content"]
    return ids, labels, start, content if isinstance(content, str) else ""


def _pair(tokenizer, rec: dict) -> tuple[list[int], list[int], int, str]:
    """A prompt/completion record: the completion (and end-of-sequence) tokens are the targets."""
    w = rec["_where"]
    prompt, completion = check_text(rec["prompt"], w, "prompt"), check_text(rec["completion"], w, "completion")
    if not completion:
        raise PactError(f"{w}: the completion is empty: nothing to train on")
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    c = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
    return p + c, [IGNORE] * len(p) + c, len(p), completion


def _special_ids(tokenizer) -> frozenset:
    """The tokenizer's special ids, computed once a tokenizer (transformers builds the list anew each time,
    from every special token the config names: a chat record asked for it once)."""
    got = getattr(tokenizer, "_pact_special_ids", None)
    if got is None:
        got = frozenset(tokenizer.all_special_ids)
        tokenizer._pact_special_ids = got
    return got


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    """Targets end with the end-of-sequence token (the model learns where an answer stops)."""
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _check_vocab(ids: list[int], vocab_size: int | None, where: str) -> None:
    if vocab_size is not None and max(ids) >= vocab_size:
        raise PactError(f"{where}: token id {max(ids)} >= the model's vocabulary {vocab_size}: "
                        "the artifact's tokenizer does not match its weights")


def tokenize(records: list[dict], tokenizer, *, max_len: int, overlong: str = "truncate",
             vocab_size: int | None = None) -> list[Example]:
    """Token ids with everything but the targets masked. ``overlong``: "truncate" (the last target
    turn's tail, then the context from the left; one warning with the count) or "refuse" (error
    naming it)."""
    if overlong not in ("truncate", "refuse"):
        raise PactError(f"--overlong must be truncate or refuse, got {overlong!r}")
    out, cut = [], 0
    for rec in records:
        if isinstance(rec.get("text"), str) and not {"prompt", "messages", "conversations", "instruction"} & set(rec):
            out.extend(_raw_text(tokenizer, rec, max_len, vocab_size))
            continue
        rec = parse_record(rec)
        ids, labels, start, completion = (_chat if "messages" in rec else _pair)(tokenizer, rec)
        if len(ids) > max_len:
            if overlong == "refuse":
                raise PactError(f"{rec['_where']}: {len(ids)} tokens > --max-len {max_len} "
                                "(raise --max-len or pass --overlong truncate)")
            cut += 1
            n = min(len(ids) - start, max(1, max_len - 1))  # the last target turn's head
            keep = max_len - n  # then as much of what comes before it as fits, from the left
            lo = max(0, start - keep)
            ids, labels, start = ids[lo : start + n], labels[lo : start + n], start - lo
        _check_vocab(ids, vocab_size, rec["_where"])
        out.append(Example(ids, labels, completion, ids[:start]))
    if cut:
        log.warning("truncated %d of %d examples to --max-len %d", cut, len(out), max_len)
    return out


def _raw_text(tokenizer, rec: dict, max_len: int, vocab_size: int | None) -> list[Example]:
    """A {"text"} record (continued pretraining): every token is a target, the end-of-sequence token
    after the last; a text longer than ``max_len`` becomes consecutive pieces of ``max_len`` tokens."""
    w = rec["_where"]
    text = check_text(rec["text"], w, "text")
    if not text:
        raise PactError(f"{w}: the text is empty: nothing to train on")
    ids = _with_eos(tokenizer(text, add_special_tokens=True)["input_ids"], tokenizer)
    _check_vocab(ids, vocab_size, w)
    pieces = [ids[i : i + max_len] for i in range(0, len(ids), max_len)]
    return [Example(p, list(p), text, []) for p in pieces if len(p) >= 2]


def pack(examples: list[Example], max_len: int) -> list[Example]:
    """--packing: whole examples into rows of at most ``max_len`` tokens (best fit, longest first; the
    same rows every time). Each keeps its tokens, its targets and its positions from 0
    (``collate_packed``): no token attends across examples, and an example's first token is never a
    target of the one before it."""
    import bisect

    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].ids), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: the tightest row that fits is found by bisect
    for i in order:
        n = len(examples[i].ids)
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            room, r = max_len - n, len(rows) - 1
        else:
            room, r = free.pop(k)
            rows[r].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, r))
    packed = []
    for row in rows:
        ids, labels, segments = [], [], []
        for s, i in enumerate(row):
            e = examples[i]
            ids += e.ids
            labels += [IGNORE] + e.labels[1:]  # (the first token is only ever a target of the previous example)
            segments += [s] * len(e.ids)
        packed.append(Example(ids, labels, "", [], segments))
    return packed


def collate_packed(examples: list[Example], index: list[int], pad_id: int, device, width=None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows -> ids, labels, positions [B, S] (from 0 in each example) and the attention mask
    [B, 1, S, S] (True: may attend): causal inside each example, nothing across them; padding
    attends to itself (never a target)."""
    ids, labels = collate(examples, index, pad_id, "cpu", width=width)
    B, S = ids.shape
    seg = torch.full((B, S), -1, dtype=torch.long)
    for r, i in enumerate(index):
        segs = examples[i].segments or [0] * len(examples[i].ids)
        seg[r, : len(segs)] = torch.tensor(segs)
    # a token's position: its index minus the index where its example starts in the row
    t = torch.arange(S).expand(B, S)
    starts = torch.ones(B, S, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    pos = t - torch.where(starts, t, 0).cummax(dim=1).values
    pos[seg < 0] = 0  # padding
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    mask |= torch.eye(S, dtype=torch.bool)
    return ids.to(device), labels.to(device), pos.to(device), mask[:, None].to(device)


def batches(examples: list[Example], batch_size: int, *, seed: int, epoch: int,
            shuffle: bool = True) -> list[list[int]]:
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


def collate(examples: list[Example], index: list[int], pad_id: int, device, width=None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels (padding is never a target; causal attention ignores it).
    ``width``: the row length as a function of the longest example's (default: that length)."""
    seqs = [examples[i] for i in index]
    longest = max(len(e.ids) for e in seqs)
    width = longest if width is None else width(longest)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for r, e in enumerate(seqs):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
        labels[r, : len(e.labels)] = torch.tensor(e.labels)
    return ids.to(device), labels.to(device)
