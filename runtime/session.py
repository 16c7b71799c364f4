"""The setup every tool runs before its work: the device, the artifact (opened, its checksums
verified once per unchanged copy), its tokenizer, and the model over it. One helper for
pact-train, pact-eval and pact-calibrate."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import queue
import re
import select
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pact.formats import Artifact, PactError, default_cache, open_artifact
from pact.formats.artifact import _stat_key
from pact.formats.files import replace_text
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
    from loading and from every encode and decode. Loading and checking it run first in a child process
    killed past LOAD_S (`_preflight`), then here; every encode and decode after runs under BoundedBackend's
    time bound."""
    _preflight(art)
    return _load_checked(art.hf_dir)


LOAD_S = 15.0  # loading and checking a tokenizer in the child (real ones: 1-3 s on a 2-core CPU)
LOAD_BYTES = 4 << 30  # the address space the child may add to what it was forked with


def _preflight(art: Artifact) -> None:
    """Load and check the artifact's tokenizer in a forked child first, killed past LOAD_S (and limited to
    LOAD_S of CPU and LOAD_BYTES more address space): building it runs its regexes in Rust while holding the
    GIL (transformers normalizes the added tokens marked normalized; pact's own probes run each part on probe
    texts), where no time bound reaches. The parent's own load then repeats what the child finished in
    time. A tokenizer that passed is remembered in $PACT_CACHE/tokenizers/ (`_tokenizer_digest`), so the
    child runs once per tokenizer and machine."""
    hf = art.hf_dir
    where = hf / "tokenizer.json"
    stamp = default_cache() / "tokenizers" / _tokenizer_digest(art)
    if stamp.is_file():
        return
    if not hasattr(os, "fork"):
        log.warning("%s: this platform cannot fork: the tokenizer's load is not time-bounded", where)
        return
    r, w = os.pipe()
    with warnings.catch_warnings():  # (Python 3.12+: fork() in a process with threads; the child only loads)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: load and check, write the verdict, leave without cleanup
        try:
            os.close(r)
            _limit_child()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            logging.disable(logging.CRITICAL)  # (the parent's load says what there is to say)
            try:
                _load_checked(hf)
                verdict = b"ok"
            except PactError as e:
                verdict = b"no" + str(e).encode("utf-8", "replace")
            except BaseException as e:  # (MemoryError past LOAD_BYTES too)
                verdict = b"no" + f"{where}: the tokenizer failed to load ({type(e).__name__}: {e})".encode(
                    "utf-8", "replace")
            os.write(w, verdict[:32768])  # (below a pipe's capacity: one write, never blocking)
        finally:
            os._exit(0)
    os.close(w)
    got, done = b"", False
    try:
        poller, t0 = select.poll(), time.monotonic()
        poller.register(r, select.POLLIN | select.POLLHUP)
        while True:
            left = LOAD_S - (time.monotonic() - t0)
            if left <= 0 or not poller.poll(left * 1000):
                raise PactError(f"{where}: loading and checking the tokenizer took over {LOAD_S:g} s (real ones "
                                f"take 1-3 s): a regex in it works super-linearly on its own tokens or pact's "
                                f"probe texts, or its files list too much; {HOSTILE}")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            got += chunk
        done = True
    finally:
        os.close(r)
        if not done:  # timed out or interrupted (Ctrl-C): the child goes too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # (SIGCHLD ignored: reaped already)
            os.waitpid(pid, 0)
    if got.startswith(b"no"):
        raise PactError(got[2:].decode("utf-8", "replace"))
    if got != b"ok":
        raise PactError(f"{where}: loading the tokenizer ended its process without a verdict (past its memory or "
                        f"CPU bound, or killed); {HOSTILE}")
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        replace_text(stamp, "checked\n")
    except OSError as e:  # a read-only cache: the next load checks again
        log.debug("%s: not remembered (%s)", stamp, e)


def _limit_child() -> None:
    """The forked child's bounds: CPU seconds, address space, and death with its parent (Linux)."""
    import resource

    from .data import _address_space

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CPU, (int(LOAD_S) + 2, int(LOAD_S) + 2))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + LOAD_BYTES, resource.RLIM_INFINITY))
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(0)


def _tokenizer_digest(art: Artifact) -> str:
    """What a tokenizer check depends on: the libraries' versions, this module's source, and hf/'s files as the
    manifest lists them (their sha256, verified against the bytes when the artifact is) with each file's stat
    now, as the verified-artifact stamp keys it (`_stat_key`: a file rewritten since is checked again)."""
    import tokenizers
    import transformers

    h = hashlib.sha256(f"{tokenizers.__version__}\0{transformers.__version__}\0".encode())
    h.update(Path(__file__).read_bytes())
    for rel, digest in sorted(art.meta["files"].items()):
        h.update(f"{rel}\0{digest}\0{_stat_key(art.hf_dir / rel)}\n".encode())
    return h.hexdigest()


def _load_checked(hf: Path):
    """The tokenizer of ``hf`` loaded and checked (load_tokenizer's work, in whichever process runs it)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    where = hf / "tokenizer.json"
    if not where.is_file():  # (transformers would build one from vocab/merges files or config keys, unchecked)
        raise PactError(f"{where}: missing: pact loads an artifact's tokenizer from its tokenizer.json only; "
                        f"{HOSTILE}")
    try:
        tok = _unpanicked(AutoTokenizer.from_pretrained, where, hf, trust_remote_code=False)
    except PactError:
        raise
    except Exception as e:  # (OSError, ValueError, KeyError, ..., strict_errors(), and the tokenizers library's
        # bare Exception for a tokenizer.json field of the wrong type: all "these files are not a tokenizer")
        raise PactError(f"{hf}: the tokenizer cannot be loaded from its files and config.json "
                        f"({type(e).__name__}: {e}): the artifact is damaged or crafted; re-copy it or re-run "
                        "pact-convert") from None
    if not isinstance(tok.model_max_length, (int, float)) or isinstance(tok.model_max_length, bool):
        raise PactError(f"{hf / 'tokenizer_config.json'}: 'model_max_length' is "
                        f"{tok.model_max_length!r}, not a number: the artifact is damaged or crafted; re-copy it or "
                        "re-run pact-convert")
    backend = getattr(tok, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tok, "_tokenizer", None) is not backend:
        raise PactError(f"{hf}: the tokenizer loads as {type(tok).__name__}, not one backed by tokenizer.json "
                        "(tokenizer_config.json's 'tokenizer_class' names a Python tokenizer?): pact checks and "
                        f"time-bounds only tokenizer.json's; {HOSTILE}")
    _check_token_lengths(backend, where, _check_components(backend, where))
    tok._tokenizer = BoundedBackend(backend, where)  # every encode and decode under a time bound
    for name in ("_encode_plus", "_decode"):  # what every encode, __call__, tokenize and decode goes through
        if hasattr(tok, name):
            setattr(tok, name, functools.partial(_unpanicked, getattr(tok, name), where))
    return tok


ENCODE_GRACE_S = 5.0  # the encode/decode time a tokenizer may spend before its characters' allowance counts
ENCODE_CHAR_S = 20e-6  # each character encoded allows 20 us (50K characters/s; real tokenizers: 1M and more)
DECODE_ID_CHARS = 64  # a token id decoded counts as 64 characters (real tokens: a few)


class BoundedBackend:
    """A tokenizers-library Tokenizer whose encodes and decodes run under a time bound: a regex can
    pass every check at load and still work super-linearly in Rust on a crafted text or token, where
    nothing interrupts it (a normalizer's: 12.7 s for one 200-character prompt; a decoder's Replace:
    2.8 s for one 2,000-character token). ``encode_batch`` and ``decode_batch`` (they release the
    GIL; ``encode`` and ``decode`` go through them) run on a daemon thread while the caller waits at
    most ENCODE_GRACE_S plus ENCODE_CHAR_S a character encoded so far (a decoded id counting
    DECODE_ID_CHARS), less the time spent so far: past that, one PactError naming tokenizer.json (the
    runaway call is left to the daemon thread, which ends with the process; every later call is
    refused at once). Everything else is the Tokenizer's."""

    def __init__(self, backend, where: Path):
        object.__setattr__(self, "_bounded", {"backend": backend, "where": where, "chars": 0, "spent": 0.0,
                                              "jobs": None, "pid": None, "stuck": False})

    def __getattr__(self, name):
        if name == "_bounded" or name.startswith("__"):  # (a copy being built has no state yet)
            raise AttributeError(name)
        return getattr(self._bounded["backend"], name)

    def __reduce__(self):  # copied or pickled: the same Tokenizer, a fresh allowance and worker
        return BoundedBackend, (self._bounded["backend"], self._bounded["where"])

    def __setattr__(self, name, value):  # (transformers sets e.g. encode_special_tokens on the backend)
        setattr(self._bounded["backend"], name, value)

    def encode(self, sequence, pair=None, is_pretokenized=False, add_special_tokens=True):
        return self.encode_batch([sequence if pair is None else (sequence, pair)], is_pretokenized=is_pretokenized,
                                 add_special_tokens=add_special_tokens)[0]

    def encode_batch(self, inputs, *args, **kw):
        n = _chars(inputs)
        return self._run(functools.partial(self._bounded["backend"].encode_batch, inputs, *args, **kw), n,
                         f"encoding {n} characters")

    def decode(self, ids, skip_special_tokens=True):
        return self.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def decode_batch(self, sequences, skip_special_tokens=True):
        sequences = [list(s) for s in sequences]
        n = sum(len(s) for s in sequences)
        return self._run(functools.partial(self._bounded["backend"].decode_batch, sequences,
                                           skip_special_tokens=skip_special_tokens), DECODE_ID_CHARS * n,
                         f"decoding {n} tokens")

    def _run(self, fn, chars: int, what: str):
        b = self._bounded
        if b["stuck"]:
            raise PactError(f"{b['where']}: an earlier call of this tokenizer ran past its time bound; {HOSTILE}")
        b["chars"] += chars
        allowed = ENCODE_GRACE_S + ENCODE_CHAR_S * b["chars"] - b["spent"]
        if b["jobs"] is None or b["pid"] != os.getpid():  # (a forked child has no worker thread: its own)
            b["jobs"], b["pid"] = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=_encode_worker, args=(b["jobs"],), daemon=True, name="pact-tokenizer").start()
        done, box = threading.Event(), []
        t0 = time.perf_counter()
        b["jobs"].put((fn, box, done))
        finished = done.wait(max(allowed, 0.0))
        b["spent"] += time.perf_counter() - t0
        if not finished:
            b["stuck"] = True
            raise PactError(f"{b['where']}: {what} took over {allowed:.1f} s (this tokenizer's bound: "
                            f"{ENCODE_GRACE_S:g} s plus {ENCODE_CHAR_S * 1e6:g} us a character encoded, a token "
                            f"decoded counting {DECODE_ID_CHARS}; real tokenizers take ~1 us a character): a regex in "
                            f"its normalizer, pre-tokenizer or decoder works super-linearly here; {HOSTILE}")
        ok, value = box[0]
        if not ok:
            raise value
        return value


def _encode_worker(jobs: queue.SimpleQueue) -> None:
    while True:
        fn, box, done = jobs.get()
        try:
            box.append((True, fn()))
        except BaseException as e:  # (a PanicException too: _unpanicked names it in the caller)
            box.append((False, e))
        done.set()


def _chars(inputs) -> int:
    """Characters in an encode's inputs: texts, (text, pair) tuples or pre-tokenized word lists, nested."""
    if isinstance(inputs, str):
        return len(inputs)
    if isinstance(inputs, (list, tuple)):
        return sum(_chars(x) for x in inputs)
    return 0


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


# what each refusal of a tokenizer part says to do
HOSTILE = "the artifact is faulty or crafted; re-copy it or re-run pact-convert on a trusted model"
INSERT_CHARS = 64  # the product of what a tokenizer part's components can multiply a text by: a Replace's or
# Prepend's insert, a charsmap's longest replacement, a byte-level map's 4 characters a character
COMPONENTS = 32  # components in one part (Sequences counted through; real tokenizers: 1-8)
TOKEN_CHARS = 4096  # a vocabulary entry's or added token's length (real ones: under 300 characters)
DECODED_CHARS = 16384  # a token's decode: its length times the decoder's growth
UNIGRAM_CHARS = 128  # a Unigram piece's length
PART_CHARS = 32768  # distinct characters a part's strings hold (the probe runs on them)
SPECIAL_IDS = 1024  # a post-processor's template's pieces and special ids (real ones: 2-8)
# a probe of what real text holds (letters, digits, space runs, accents, CJK, an NFKC 18-character expansion, an
# emoji, a combining mark, control characters): each part must leave it at most INSERT_CHARS times as long
PROBE = ("The movie, 1999:  GREAT\tfun\n\u00e9t\u00e9 na\u0131ve \u4e2d\u6587 \ufdfa \U0001f600 e\u0301 "
         "\x00\x7f ##x \u2581")


def _check_components(backend, where: Path) -> int:
    """Refuse a normalizer, pre-tokenizer, decoder or post-processor that can grow a text past a small factor
    (the tokenizers library runs them in Rust, where no time or memory bound stops them): by what its
    components can write (statically, as a product over chained components, the normalizer's and the
    pre-tokenizer's together: each multiplies what the last wrote; a component pact does not know counts as
    unbounded), by their count and the distinct characters they hold, and by what they make of probe texts.
    Warn of a regex that may backtrack long. The decoder's growth is returned (a token's decode is bounded by
    it times the longest token)."""
    grows, decoder = 1, 1
    for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        component = getattr(backend, part, None)
        if component is None:
            continue
        doc = json.loads(component.__getstate__())
        if (n := _count(doc)) > COMPONENTS:
            raise PactError(f"{where}: the {part} chains {n} components (bound {COMPONENTS}; real tokenizers: "
                            f"1-8): {HOSTILE}")
        strings = list(_strings(doc))  # (a charsmap's replacements decoded once, for the bound and the probe)
        if (n := len(set().union(*(set(t) for _, t in strings)))) > PART_CHARS:
            raise PactError(f"{where}: the {part} holds {n} distinct characters (bound {PART_CHARS}; a real "
                            f"charsmap: about 14000): {HOSTILE}")
        if part == "decoder":
            grows = 1
        for what, factor in _growth(doc, part):
            grows *= factor
            if grows > INSERT_CHARS:
                also = "the normalizer's and " if part == "pre_tokenizer" else ""
                raise PactError(f"{where}: the {part} {what}, which with {also}its other inserts can multiply a text "
                                f"{grows} times (bound {INSERT_CHARS}; real tokenizers write a character or two) "
                                f"in Rust, where no bound stops what it grows to: {HOSTILE}")
        decoder = grows if part == "decoder" else decoder
        for pattern in _regexes(doc):
            if why := regex_hazard(pattern):  # warned, not refused: a heuristic must never refuse a real model
                log.warning("%s: the %s's regex %r %s: it may backtrack for very long on some text, in Rust, where "
                            "nothing stops it (a panic past its limit is one error); if this artifact is not from a "
                            "source you trust, re-run pact-convert on a trusted model", where, part, pattern[:200],
                            why)
        if part == "post_processor":
            _check_template(doc, where)
            continue
        if found := _unpanicked(_probe, where, part, doc, strings):
            text, out = found
            raise PactError(f"{where}: the {part} makes {out} characters of the {len(text)}-character probe text "
                            f"{text[:40]!r} (bound {INSERT_CHARS}x): {HOSTILE}")
    _check_model(backend, where)
    backend.no_padding()  # (transformers sets both per call as asked; tokenizer.json's own, e.g. a fixed padding
    backend.no_truncation()  # of 10^8 or a stride of 1, would apply to any direct use of the backend)
    return decoder


def _probe(part: str, doc, strings: list[tuple[str, str]]) -> tuple[str, int] | None:
    """A probe text the part grows past INSERT_CHARS times, and the length it reaches, or None. Each probe
    runs through the part's components one at a time, stopping at the first step past the bound (so the
    probe itself never grows far: a component alone is bounded by _growth): PROBE; each character the part's
    JSON writes or matches (and its normal forms and case maps), four times (a chain that grows one character
    compounds what the next component does to it: a Replace writing a compatibility character that NFKC
    expands, again and again), and all of them side by side, forwards and backwards, 64 to a probe (a
    Replace may fire only between two different characters); a charsmap's replacement characters, and where
    the part has a normal form or case map every character one makes three or more of (a component after
    it may grow what it made: NFKC makes 18 of U+FDFA, which a Replace then multiplies), eight to a probe.
    A pre-tokenizer's pieces are carried from step to step as pieces (Metaspace prepends to each)."""
    leaves = _leaves(doc)
    steps = [_component(part, leaf) for leaf in leaves]
    own, mapped = _probe_chars(strings)
    if any(leaf.get("type") in _REMAPS for leaf in leaves):
        mapped = mapped + list(_expanders())  # (the user's characters a normal form expands, grown after it)
    side = "".join(own)
    probes = [PROBE, *(c * 4 for c in own), *(t[i:i + 64] for t in (side, side[::-1]) for i in range(0, len(t), 64)),
              *("".join(mapped[i:i + 8]) for i in range(0, len(mapped), 8))]
    for text in probes:
        out = _start(part, text)
        for step in steps:
            out, n = _apply(part, step, out)
            if n > INSERT_CHARS * len(text):
                return text, n
    return None


@functools.lru_cache(maxsize=1)
def _expanders() -> str:
    """The characters a Unicode normal form or case map makes three or more of (about 11,600: Hangul
    syllables, ligatures, squared and compatibility forms, U+FDFA's 18), from the blocks that hold
    decompositions and case expansions (the Basic Multilingual Plane, U+1D000-U+1FFFF, U+2F800-U+2FA1F)."""
    import unicodedata

    out = []
    for lo, hi in ((0, 0xD800), (0xE000, 0x10000), (0x1D000, 0x20000), (0x2F800, 0x2FA20)):
        for cp in range(lo, hi):
            c = chr(cp)
            if max(len(unicodedata.normalize("NFKD", c)), len(c.lower()), len(c.upper())) >= 3:
                out.append(c)
    return "".join(out)


PROBE_CHARS = 1024  # the characters a part's JSON writes or matches that are probed one by one (the rest: by 8)


def _probe_chars(strings: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The characters of a part's JSON strings (``_strings``: Replace contents and patterns, Prepends, ...; with
    their NFC/NFD/NFKC/NFKD forms and case maps), and those of its charsmaps' replacements not among them."""
    import unicodedata

    own: dict[str, None] = {}
    mapped: dict[str, None] = {}
    for key, text in strings:
        into = mapped if key == "precompiled_charsmap" else own
        for c in text:
            forms = [c, c.lower(), c.upper(), *(unicodedata.normalize(f, c) for f in ("NFC", "NFD", "NFKC", "NFKD"))]
            into.update(dict.fromkeys("".join(forms)))
    own_list = list(own)[:PROBE_CHARS]
    return own_list, [c for c in mapped if c not in own] + list(own)[PROBE_CHARS:]


def _strings(doc, key=None):
    """(key, text) for each string a part's JSON holds (a charsmap: its replacements), its "type"s aside."""
    if isinstance(doc, str):
        if key == "precompiled_charsmap":
            yield key, "".join(_charsmap_replacements(doc) or ())
        elif key != "type":
            yield key, doc
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from _strings(v, k)
    elif isinstance(doc, list):
        for v in doc:
            yield from _strings(v, key)


_SEQUENCES = ("normalizers", "pretokenizers", "pre_tokenizers", "decoders", "processors")


def _leaves(doc) -> list[dict]:
    """A part's components in the order they run (Sequences flattened)."""
    if isinstance(doc, dict) and doc.get("type") == "Sequence":
        return [leaf for key in _SEQUENCES for v in doc.get(key) or () for leaf in _leaves(v)]
    return [doc] if isinstance(doc, dict) else []


def _component(part: str, leaf: dict):
    """The tokenizers object of one component's JSON (through a tokenizer that holds it alone)."""
    from tokenizers import Tokenizer

    return getattr(Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}, part: leaf})), part)


def _start(part: str, text: str):
    """A probe text as the part's first component takes it (a pre-tokenizer: one piece)."""
    if part == "pre_tokenizer":
        from tokenizers import PreTokenizedString

        return PreTokenizedString(text)
    return text


def _apply(part: str, component, text):
    """What one component makes of ``text`` (a decoder: of its characters as tokens; a pre-tokenizer: of a
    PreTokenizedString, in place), and its length in characters."""
    if part == "normalizer":
        text = component.normalize_str(text)
    elif part == "pre_tokenizer":
        component.pre_tokenize(text)
        return text, sum(len(piece) for piece, *_ in text.get_splits())
    else:
        text = component.decode(list(text))
    return text, len(text)


def _check_template(doc, where: Path) -> None:
    """A post-processor's templates: at most one copy of each input ($A, $B: a template repeating $A 1000
    times copied the encoding 1000 times), at most SPECIAL_IDS pieces and special ids, special tokens'
    texts at most TOKEN_CHARS long (Sequences of processors: each)."""
    if (n := _special_ids(doc)) > SPECIAL_IDS:
        raise PactError(f"{where}: the post_processor's template for a text has {n} pieces and special ids "
                        f"(bound {SPECIAL_IDS}; real ones: 2-8): {HOSTILE}")
    for leaf in _leaves(doc):
        for key in ("single", "pair"):
            pieces = leaf.get(key) if isinstance(leaf.get(key), list) else []
            seqs = [(p.get("Sequence") or {}).get("id") for p in pieces if isinstance(p, dict) and "Sequence" in p]
            if len(seqs) != len(set(seqs)):
                raise PactError(f"{where}: the post_processor's {key} template holds {len(seqs)} copies of "
                                f"{len(set(seqs))} input(s) (${', $'.join(map(str, sorted(set(map(str, seqs)))))}): "
                                f"each copies the whole encoding; {HOSTILE}")
        texts = [t for v in (leaf.get("special_tokens") or {}).values() if isinstance(v, dict)
                 for t in v.get("tokens") or () if isinstance(t, str)]
        texts += [v[0] for k in ("cls", "sep") if isinstance(v := leaf.get(k), list) and v and isinstance(v[0], str)]
        if (longest := max(map(len, texts), default=0)) > TOKEN_CHARS:
            raise PactError(f"{where}: the post_processor adds a special token of {longest} characters (bound "
                            f"{TOKEN_CHARS}): {HOSTILE}")


AFFIX_CHARS = 16  # a BPE / WordPiece subword prefix or suffix ('##', '</w>')
WORD_CHARS = 256  # WordPiece's max_input_chars_per_word (100 in every converter): its work grows as its cube


def _check_model(backend, where: Path) -> None:
    """The tokenizer model's own settings that grow an encode: a subword prefix or suffix written for each
    piece (8 MB one: every character allocated it), WordPiece's longest word (10^9: cubic in a word)."""
    model = backend.model
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if isinstance(v := getattr(model, key, None), str) and len(v) > AFFIX_CHARS:
            raise PactError(f"{where}: the model's {key} is {len(v)} characters (bound {AFFIX_CHARS}; real ones: "
                            f"'##', '</w>'): {HOSTILE}")
    if isinstance(v := getattr(model, "max_input_chars_per_word", None), int) and v > WORD_CHARS:
        raise PactError(f"{where}: the model's max_input_chars_per_word is {v} (bound {WORD_CHARS}; real ones: "
                        f"100): {HOSTILE}")


def _count(doc) -> int:
    """The components (typed objects other than Sequences) in a tokenizer part's JSON."""
    n = 0
    if isinstance(doc, dict):
        n += doc.get("type") not in (None, "Sequence")
        doc = list(doc.values())
    return n + sum(_count(v) for v in doc) if isinstance(doc, list) else n


# the components each part may hold, as tokenizers 0.2x writes them: one of another type counts as unbounded
KNOWN = {
    "normalizer": {"BertNormalizer", "Strip", "StripAccents", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Nmt",
                   "Precompiled", "Replace", "Prepend", "ByteLevel"},
    "pre_tokenizer": {"BertPreTokenizer", "ByteLevel", "Delimiter", "CharDelimiterSplit", "Metaspace", "Whitespace",
                      "WhitespaceSplit", "Split", "Punctuation", "Digits", "UnicodeScripts", "FixedLength"},
    "decoder": {"BPEDecoder", "ByteLevel", "WordPiece", "Metaspace", "CTC", "Replace", "Fuse", "Strip",
                "ByteFallback"},
    "post_processor": {"RobertaProcessing", "BertProcessing", "ByteLevel", "TemplateProcessing"},
}
_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_REMAPS = _FORMS | {"Lowercase", "BertNormalizer"}  # a normal form or case map: what it makes of a character


def _growth(doc, part: str):
    """(what, factor) for each component of a tokenizer part (Sequences flattened, in order) that can make a
    text longer, by the most it can multiply a text's length: a Replace's or Prepend's insert (a Replace
    whose pattern can match the empty string inserts between every two characters too: one more), a
    charsmap's longest replacement (SentencePiece's Precompiled), BertNormalizer's spaces around CJK
    characters, a byte-level map (4 characters for one), a decoder that writes a space per character or
    token (BPEDecoder or CTC with an empty suffix / delimiter, WordPiece). A normal form or case map counts
    what it makes of the characters the components before it write (NFKC makes 18 of one), since those can
    be fed to it again and again; of the user's own characters it makes at most 18 once, which is not
    counted. A component of a type not in KNOWN counts as unbounded."""
    import unicodedata

    written: set[str] = set()  # what the components so far write: what a later normal form may expand again
    for leaf in _leaves(doc):
        kind = leaf.get("type")
        if kind not in KNOWN[part]:
            yield f"has a component of type {kind!r}, whose growth pact does not know", INSERT_CHARS + 1
            continue
        if kind in ("Replace", "Prepend"):
            key = "content" if kind == "Replace" else "prepend"
            text = leaf.get(key) if isinstance(leaf.get(key), str) else ""
            written.update(text)
            if kind == "Replace" and _matches_empty(leaf.get("pattern")):
                yield (f"writes a {key} of {len(text)} characters at every position (its pattern matches the empty "
                       "string)"), len(text) + 1
            else:
                yield f"writes a {key} of {len(text)} characters", max(1, len(text))
        elif kind == "Precompiled":
            got = _charsmap_replacements(leaf.get("precompiled_charsmap"))
            n = 1 << 30 if got is None else max(map(len, got), default=0)
            written.update("".join(got or ()))
            yield f"maps a character to up to {n} characters (its precompiled_charsmap)", max(1, n)
        elif kind in _REMAPS:
            def made(c, kind=kind):
                if kind in _FORMS:
                    return unicodedata.normalize(kind, c)
                return unicodedata.normalize("NFD", c.lower()) if kind == "BertNormalizer" else c.lower()
            n = max((len(made(c)) for c in written), default=1)
            written.update("".join(made(c) for c in list(written)))
            if kind == "BertNormalizer" and leaf.get("handle_chinese_chars") is not False:
                yield f"writes spaces around each CJK character and maps a character it is given to up to {n}", 3 * n
            elif n > 1:
                yield f"expands a character the components before it write to {n} ({kind})", n
        elif kind == "ByteLevel" and part in ("normalizer", "pre_tokenizer"):  # (a decoder's shrinks the text)
            yield "maps a character to up to 4 characters (ByteLevel)", 4
        elif kind == "Metaspace" and isinstance(leaf.get("replacement"), str):
            written.update(leaf["replacement"])
        elif (kind == "BPEDecoder" and leaf.get("suffix") == "") or (
                kind == "CTC" and leaf.get("cleanup") and leaf.get("word_delimiter_token") == ""):
            yield f"writes a space between every two characters ({kind} with an empty delimiter)", 3
        elif kind == "WordPiece" and part == "decoder":
            yield "writes a space before each token (WordPiece)", 2


def _matches_empty(pattern) -> bool:
    """Whether a Replace's pattern ({"String": s} or {"Regex": r}, Oniguruma) can match the empty string: a
    regex whose shortest match is empty (a lookaround, ``\\b``, ``a*``), judged by Python's regex parser where
    the two syntaxes agree; a pattern it cannot read counts as matching it."""
    if not isinstance(pattern, dict):
        return True
    if isinstance(pattern.get("String"), str):
        return pattern["String"] == ""
    try:
        from re import _parser
    except ImportError:  # Python 3.10
        import sre_parse as _parser
    if not isinstance(pattern.get("Regex"), str) or len(pattern["Regex"]) > REGEX_CHARS:
        return True  # (unread: a long pattern would cost Python's parser seconds at load)
    try:  # (Oniguruma reads a lazy fixed count, `x{2}?`, as optional: `(?:x{2})?`; Python as `x{2}`)
        regex = re.sub(r"(?<!\\)\{\s*(\d+)\s*\}\?", r"{0,\1}", pattern.get("Regex"))
        return _parser.parse(regex).getwidth()[0] == 0
    except Exception:  # (re.error, TypeError, OverflowError, RecursionError, ...: unreadable)
        return True


def _charsmap_replacements(b64) -> list[str] | None:
    """A SentencePiece precompiled charsmap's replacements (base64 of: the trie's byte length, u32
    little-endian; the double-array trie; the replacements, NUL-terminated UTF-8), or None where it does
    not parse."""
    import base64
    import binascii

    try:
        blob = base64.b64decode(b64 or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        return None
    if len(blob) < 4 or (trie := int.from_bytes(blob[:4], "little")) + 4 > len(blob):
        return [] if not blob else None
    return [seg.decode("utf-8", "replace") for seg in blob[4 + trie:].split(b"\0")]


def _special_ids(doc) -> int:
    """What a post-processor's templates can add to a text: for its longer template (single or pair), its
    pieces plus the ids its special tokens stand for (TemplateProcessing; Sequences of them summed)."""
    n = 0
    if isinstance(doc, dict):
        specials = doc.get("special_tokens") if isinstance(doc.get("special_tokens"), dict) else {}
        sizes = [0]
        for key in ("single", "pair"):
            pieces = doc.get(key) if isinstance(doc.get(key), list) else []
            ids = (specials.get((p.get("SpecialToken") or {}).get("id"), {}) for p in pieces if isinstance(p, dict))
            sizes.append(len(pieces) + sum(len(s.get("ids") or ()) for s in ids if isinstance(s, dict)))
        n += max(sizes)
        doc = list(doc.values())
    return n + sum(_special_ids(v) for v in doc) if isinstance(doc, list) else n


def _check_token_lengths(backend, where: Path, decoder: int = 1) -> None:
    """Refuse a vocabulary entry or added token past TOKEN_CHARS characters (decoding one printed megabytes
    per generated token), one whose decode the decoder grows past DECODED_CHARS, and a Unigram piece past
    UNIGRAM_CHARS (its lattice grows as the square of the longest piece, per character)."""
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=0)
    if longest > TOKEN_CHARS:
        raise PactError(f"{where}: a token of the vocabulary is {longest} characters long (bound {TOKEN_CHARS}; "
                        f"real ones are under 300): {HOSTILE}")
    if longest * decoder > DECODED_CHARS:
        raise PactError(f"{where}: a token of {longest} characters decodes to up to {longest * decoder} (the decoder "
                        f"multiplies by {decoder}; bound {DECODED_CHARS}): {HOSTILE}")
    if type(backend.model).__name__ == "Unigram":
        pieces = max(map(len, backend.get_vocab(with_added_tokens=False)), default=0)
        if pieces > UNIGRAM_CHARS:
            raise PactError(f"{where}: a Unigram piece is {pieces} characters long (bound {UNIGRAM_CHARS}; "
                            f"SentencePiece's default: 16): {HOSTILE}")


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
