"""The setup every tool runs before its work: the device, the artifact (opened, its checksums
verified once per unchanged copy), its tokenizer, and the model over it. One helper for
pact-train, pact-eval and pact-calibrate."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pact.formats import Artifact, PactError, default_cache, open_artifact
from pact.formats.peft import LoraConfig

from .distributed import env_world
from .model import TRAINABLE_FAMILIES, PactModel
from .ops import resolve_device

log = logging.getLogger(__name__)


@dataclass
class Session:
    device: torch.device
    artifact: Artifact
    tokenizer: object  # a transformers tokenizer, from the artifact's hf/ folder

    def model(self, lora: LoraConfig | None, **kw) -> PactModel:
        """The model over this artifact (keywords: PactModel's), its embedding checked against the
        tokenizer."""
        model = PactModel(self.artifact, lora, device=self.device, **kw)
        vocab = model.embed.shape[0]
        if len(self.tokenizer) > vocab:
            raise PactError(f"{self.artifact.hf_dir}: tokenizer has {len(self.tokenizer)} tokens but the embedding has "
                            f"{vocab} rows: artifact and tokenizer do not match; "
                            "re-run pact-convert on the model folder")
        return model


def open_session(artifact: str | Artifact, *, device: str | None = None, tool: str = "pact-train",
                 flag: str | None = None) -> Session:
    """Device, verified artifact and tokenizer for ``tool``; ``artifact``: a path or URL, or one the
    caller opened already (its checks are the opening's). ``flag``: the option that named the
    artifact, prefixed to a failed verification."""
    if tool != "pact-train" and env_world() > 1:
        raise PactError(f"{tool} runs in one process (WORLD_SIZE={os.environ['WORLD_SIZE']}): run it without "
                        "torchrun; only pact-train is data-parallel")
    dev = resolve_device(device)
    if dev.type == "cpu" and tool == "pact-train":
        log.warning("no GPU: training on the CPU (correct, slow; fine for tiny models and tests)")
    art = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
    try:  # every checksum, once per unchanged artifact: a damaged one is never used
        art.verify_cached(default_cache())
    except PactError as e:
        raise PactError(f"{flag}: {e}" if flag else str(e)) from None
    if art.meta["family"] not in TRAINABLE_FAMILIES:
        raise PactError(f"{art.path}: {tool} supports {', '.join(TRAINABLE_FAMILIES)} artifacts; "
                        f"this one is {art.meta['family']}")
    return Session(dev, art, load_tokenizer(art))


def load_tokenizer(art: Artifact):
    """The artifact's tokenizer (never its code), or one error naming its folder: a tokenizer file that is
    valid JSON but not a tokenizer fails inside transformers with a KeyError or the like. Its regexes run
    in Rust, where nothing interrupts them: one that looks able to backtrack for long (regex_hazard) is
    warned of, and a panic there (a regex past its backtracking limit) is one error naming tokenizer.json,
    from loading and from every encode and decode."""
    from transformers import AutoTokenizer

    where = art.hf_dir / "tokenizer.json"
    try:
        tok = _unpanicked(AutoTokenizer.from_pretrained, where, art.hf_dir, trust_remote_code=False)
    except PactError:
        raise
    except Exception as e:  # (OSError, ValueError, KeyError, ..., strict_errors(), and the tokenizers library's
        # bare Exception for a tokenizer.json field of the wrong type: all "these files are not a tokenizer")
        raise PactError(f"{art.hf_dir}: the tokenizer cannot be loaded from its files and config.json "
                        f"({type(e).__name__}: {e}): the artifact is damaged or crafted; re-copy it or re-run "
                        "pact-convert") from None
    if not isinstance(tok.model_max_length, (int, float)) or isinstance(tok.model_max_length, bool):
        raise PactError(f"{art.hf_dir / 'tokenizer_config.json'}: 'model_max_length' is "
                        f"{tok.model_max_length!r}, not a number: the artifact is damaged or crafted; re-copy it or "
                        "re-run pact-convert")
    backend = getattr(tok, "backend_tokenizer", None)
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        component = getattr(backend, part, None)
        doc = json.loads(component.__getstate__()) if component is not None else None
        grows = 1  # what the component's inserts can multiply a text by: chained Replaces multiply
        for key, text in _inserted(doc):
            grows *= max(1, len(text))
            if grows > INSERT_CHARS:
                raise PactError(f"{where}: the {part} writes a {key} of {len(text)} characters, which with its other "
                                f"inserts can multiply a text {grows} times (bound {INSERT_CHARS}; real tokenizers "
                                "write a character or two) in Rust, where no bound stops what it grows to: the "
                                "artifact is faulty or crafted; re-copy it or re-run pact-convert on a trusted model")
        for pattern in _regexes(doc) if doc is not None else ():
            if why := regex_hazard(pattern):  # warned, not refused: a heuristic must never refuse a real model
                log.warning("%s: the %s's regex %r %s: it may backtrack for very long on some text, in Rust, where "
                            "nothing stops it (a panic past its limit is one error); if this artifact is not from a "
                            "source you trust, re-run pact-convert on a trusted model", where, part, pattern[:200],
                            why)
    for name in ("_encode_plus", "_decode"):  # what every encode, __call__, tokenize and decode goes through
        if hasattr(tok, name):
            setattr(tok, name, functools.partial(_unpanicked, getattr(tok, name), where))
    return tok


def _unpanicked(fn, where: Path, /, *args, **kw):
    """``fn(*args, **kw)``, a panic in the tokenizers library (pyo3's PanicException: a BaseException, so
    no ``except Exception`` sees it) made one PactError naming ``where``."""
    try:
        return fn(*args, **kw)
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise PactError(f"{where}: the tokenizer failed in its Rust library ({str(e).strip()[:200]}): its "
                        "normalizer, pre-tokenizer or decoder is faulty or hostile (e.g. a regex that backtracks "
                        "past its limit); re-copy the artifact or re-run pact-convert on a trusted model") from None


INSERT_CHARS = 64  # the product of the lengths a normalizer / decoder writes in place of matches (Replace) or before
# the text (Prepend): what chained inserts can multiply a text by


def _inserted(doc):
    """(key, text) for each text a tokenizers component inserts: a Replace's content, a Prepend's prepend (in
    Sequences too): written once per match, so a long one multiplies the text."""
    if isinstance(doc, dict):
        for key in ("content", "prepend"):
            if doc.get("type") in ("Replace", "Prepend") and isinstance(doc.get(key), str):
                yield key, doc[key]
        doc = list(doc.values())
    for v in doc if isinstance(doc, list) else ():
        yield from _inserted(v)


def _regexes(doc):
    """The regex patterns in a tokenizers component's JSON (a Split or Replace, in Sequences too)."""
    if isinstance(doc, dict):
        pattern = doc.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            yield pattern["Regex"]
        doc = list(doc.values())
    for v in doc if isinstance(doc, list) else ():
        yield from _regexes(v)


_QUANTIFIER = re.compile(r"[*+?]|\{(\d*)(,?)(\d*)\}")
REGEX_CHARS = 1024  # a tokenizer regex's bound (real ones: under 500)


def regex_hazard(p: str) -> str | None:
    """Why the tokenizer regex ``p`` could backtrack for long on ordinary text, or None. Oniguruma may take
    ~10^7 steps at each position before it gives up (and panics), so a pattern whose work grows faster
    than the text is refused: one that repeats a group (``(\\w+\\s?)+``) or a quantifier (``a**``), or that
    holds more than two repeats, two optional parts or one alternation group (of at most 8) in one
    alternative (``\\w*\\w*\\w*!``, ``a?a?a?``), a subexpression call or an absent operator. Real
    tokenizers' patterns (GPT-2, Llama 3, Qwen2, o200k and Mistral's tekken, DeepSeek, BLOOM) stay within."""
    if len(p) > REGEX_CHARS:
        return f"is {len(p)} characters (bound {REGEX_CHARS})"
    if any(s in p for s in ("\\g<", "\\g'", "(?~")):
        return "calls a subexpression or has an absent operator"
    counts, groups, i, last = [0, 0, 0], [], 0, None  # last: what a quantifier at i would repeat
    while i < len(p):
        c, m = p[i], _QUANTIFIER.match(p, i)
        if m and last and (c != "{" or m[1] or m[3]):  # (a `{` without a number is a literal)
            if last == "quantifier":
                return "stacks quantifiers (a repeat of a repeat)"
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c) or (
                int(m[1] or 0), None if m[2] and not m[3] else int(m[3] or m[1]))
            if last == "group" and hi != 1:
                return "repeats a group"
            if hi is None or hi > max(lo, 1):
                counts[0] += 1
            elif lo == 0:
                counts[1] += 1
            i, last = m.end() + p.startswith("?", m.end()), "quantifier"  # (a lazy `?` is part of it)
        elif c == "\\":
            i, last = i + 2, "atom"
        elif c == "[":
            i, last = _class_end(p, i), "atom"
            if i is None:
                return "has an unclosed character class"
        elif c == "(":
            groups.append(1)  # its alternatives
            i, last = i + 1 + p.startswith("?", i + 1), None
        elif c == ")":
            if not groups:
                return "has an unbalanced ')'"
            n = groups.pop()
            if n > 8:
                return f"has a group of {n} alternatives"
            counts[2] += n > 1
            i, last = i + 1, "group"
        elif c == "|":
            if groups:
                groups[-1] += 1
            else:  # the next top-level alternative
                counts = [0, 0, 0]
            i, last = i + 1, None
        else:
            i, last = i + 1, "atom"
        if counts[0] > 2 or counts[1] > 2 or counts[2] > 1:
            return "holds more than two repeats, two optional parts or one alternation group in one alternative"
    return None


def _class_end(p: str, i: int) -> int | None:
    """The index after the character class opening at ``p[i]`` (classes nest in Oniguruma, and a ']' first
    in one is a literal), or None if it is not closed."""
    depth = 0
    while i < len(p):
        if p[i] == "\\":
            i += 1
        elif p[i] == "[":
            depth += 1
            i += p.startswith("^", i + 1)
            i += p.startswith("]", i + 1)
        elif p[i] == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
