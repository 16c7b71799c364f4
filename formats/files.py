"""File helpers every stage shares: hashing, bounded JSON reading, temp paths beside an output and
the rename that swaps a finished folder in (``atomic_folder``), leftovers of killed runs, the
cache folder. Imports nothing of pact's but errors."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import ArtifactError, PactError

log = logging.getLogger(__name__)

JSON_MAX = 64 << 20  # bytes: no manifest, config or tokenizer is larger (a 400B model's manifest is ~2 MB)
JSON_DEPTH = 100  # nesting: configs and tokenizers stay under 10; the tokenizers library stops at 128


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _depth(doc: Any, limit: int) -> int:
    """How deeply lists and objects nest in a parsed JSON document, counted up to ``limit`` + 1: level
    by level, without recursion (a 150k-token tokenizer.json takes ~0.07 s)."""
    deepest, level = 0, [doc] if isinstance(doc, (dict, list)) else []
    while level and deepest <= limit:
        deepest += 1
        nxt: list = []
        for obj in level:
            nxt += [v for v in (obj.values() if type(obj) is dict else obj) if type(v) is list or type(v) is dict]
        level = nxt
    return deepest


def check_regular(path: Path, mode: int, fix: str, error: type[PactError] = ArtifactError) -> None:
    """``mode`` (``path``'s st_mode) is a regular file's: a named pipe, device or socket is refused (opening
    one can block forever, and tar carries them)."""
    if not stat.S_ISREG(mode):
        raise error(f"{path}: not a regular file (a named pipe, device or socket): {fix}")


def own_roots(folder: Path) -> list[Path]:
    """Where a model's or adapter's files may really live: the folder itself and, for a Hugging Face cache
    snapshot (<repo>/snapshots/<rev>/, whose files link to <repo>/blobs/), that blobs/ folder, if it is a
    real folder inside the repo (a blobs/ that is itself a link could lead anywhere: it is not trusted)."""
    real = folder.resolve()
    roots = [real]
    blobs = real.parent.parent / "blobs"
    if real.parent.name == "snapshots" and blobs.is_dir() and not blobs.is_symlink():
        roots.append(blobs)
    return roots


def link_outside(p: Path, roots: list[Path]) -> Path | None:
    """Where ``p`` leads when it is a symbolic link to somewhere outside every one of ``roots``
    (own_roots: a folder's own files, or its hub-cache blobs/); None for a file of its own."""
    target = p.resolve()
    return target if p.is_symlink() and not any(target.is_relative_to(r) for r in roots) else None


def read_json(path: Path, fix: str, error: type[PactError] = ArtifactError) -> Any:
    """``path`` parsed as JSON, or one ``error`` naming the file and ``fix``: a file larger than
    JSON_MAX, not UTF-8, not JSON (NUL bytes included) or nested deeper than JSON_DEPTH is refused
    here, not left to a RecursionError or a parser's traceback in whoever reads it next."""
    try:
        st = path.stat()
        check_regular(path, st.st_mode, fix, error)
        size = st.st_size
        data = path.read_bytes() if size <= JSON_MAX else None
    except OSError as e:
        raise error(f"{path}: unreadable ({e.strerror or e}): {fix}") from None
    if data is None:
        raise error(f"{path}: {size} bytes, more than the {JSON_MAX} bytes a JSON metadata file may hold: {fix}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x}): {fix}") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply to read: {fix}") from None
    except ValueError as e:  # JSONDecodeError (NUL and other control bytes too), an over-long integer
        raise error(f"{path}: not valid JSON ({e}): {fix}") from None
    if _depth(doc, JSON_DEPTH) > JSON_DEPTH:
        raise error(f"{path}: JSON nested deeper than {JSON_DEPTH} levels, which no config or tokenizer is: {fix}")
    return doc


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def work_path(out: Path, kind: str) -> Path:
    """A temp path beside ``out`` (``kind``: tmp, old, gguf, src) named by this process, so a later
    run can tell a killed run's leftovers from a live run's."""
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def replace_by_rename(tmp: Path, out: Path) -> None:
    """The complete folder ``tmp`` becomes ``out`` by renames, never by deleting first: an existing
    ``out`` is renamed aside (``work_path(out, "old")``), ``tmp`` renamed in, the old one removed
    last; if the second rename fails the old one is renamed back. Stopped at any point, ``out`` is
    the complete old folder or the complete new one, or (between the renames) absent with the old
    one aside under this process's name."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = work_path(out, "old")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def open_new(path: Path, mode: str = "w"):
    """``path`` as a new file, open for writing: whatever is there first (a stale temp file, or a link
    planted in a folder from someone else) is removed, not written through, and the file is created
    exclusively without following links."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), mode)


def replace_text(path: Path, text: str) -> None:
    """``path``'s new text, written beside it and renamed over it: a reader (or a killed writer)
    leaves the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open_new(tmp) as f:
        f.write(text)
    os.replace(tmp, path)


def tree_entries(folder: Path, unlistable: Callable[[str, OSError], None], opaque: tuple[str, ...] = ()
                 ) -> Iterator[os.DirEntry]:
    """Every entry below ``folder``, sub-folders entered and links never followed (os.scandir: the entry
    types come with the listing, no stat per file). ``opaque``: names of sub-folders of ``folder`` whose
    contents are not walked (the entry itself is). A folder that cannot be listed goes to
    ``unlistable(folder, error)``, which raises, or returns to skip it."""
    stack = [str(folder)]
    while stack:
        here = stack.pop()
        try:
            listing = list(os.scandir(here))
        except OSError as e:
            unlistable(here, e)
            continue
        for d in listing:
            yield d
            if d.is_dir(follow_symlinks=False) and not (here == str(folder) and d.name in opaque):
                stack.append(d.path)


def check_plain_tree(folder: Path, what: str, fix: str, error: type[PactError] = PactError,
                     opaque: tuple[str, ...] = ()) -> None:
    """Every entry under ``folder`` is a folder or a regular file: a symbolic link (which could lead a
    writer or reader anywhere) or a named pipe, device or socket is refused with one error naming it.
    ``opaque``: names of sub-folders of ``folder`` whose contents are another program's (links there are its
    own; pact neither reads nor writes inside them): the folder itself is checked, not what it holds."""
    def unlistable(here: str, e: OSError) -> None:
        if not isinstance(e, FileNotFoundError):  # (absent: a new --out, or one removed meanwhile)
            raise error(f"{what}: {here}: cannot be listed ({e.strerror}): {fix}") from None

    for d in tree_entries(folder, unlistable, opaque):
        if d.is_symlink():
            raise error(f"{what}: {d.path} is a symbolic link: refusing it (links can lead outside the folder); "
                        f"{fix}")
        if not d.is_dir(follow_symlinks=False) and not d.is_file(follow_symlinks=False):
            raise error(f"{what}: {d.path} is not a regular file (a named pipe, device or socket): {fix}")


def sweep_leftovers(out: Path) -> None:
    """Remove temp folders a killed run left beside ``out`` (their process is gone)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old|gguf|src)-(\d+)-[0-9a-f]{{8}}$")
    for p in out.parent.iterdir() if out.parent.is_dir() else []:
        m = pattern.match(p.name)
        if m and not p.is_symlink() and p.is_dir() and not pid_alive(int(m.group(2))):
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            log.warning("removing %s (%.1f MB), left by an interrupted run (pid %s)", p, size / 1e6, m.group(2))
            shutil.rmtree(p, ignore_errors=True)



_UMASK = os.umask(0)
os.umask(_UMASK)  # read once, at import (single-threaded): the mode ordinary files get


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the file's mode as any other file pact writes (the library
    creates 0600 files)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_UMASK)


def default_cache() -> Path:
    """pact's cache folder: $PACT_CACHE, else ~/.cache/pact (downloads, verified-artifact stamps)."""
    return Path(os.environ.get("PACT_CACHE", Path.home() / ".cache" / "pact"))


@contextlib.contextmanager
def atomic_folder(out: Path, kind: str = "tmp") -> Iterator[Path]:
    """A temp folder beside ``out`` (``work_path``) to fill; leaving the block normally swaps it in
    as ``out`` (``replace_by_rename``), leaving it by an exception removes it: ``out`` is never a
    half-written folder."""
    tmp = work_path(out, kind)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_by_rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover_aside(out: Path, what: str, valid: Callable[[Path], bool] = lambda p: True) -> None:
    """A run killed between ``replace_by_rename``'s two renames left no ``out`` and the earlier folder
    aside as ``.OUT.old-PID-xxxxxxxx``: rename the newest such folder of a dead process (one that
    ``valid`` accepts) back. Then remove what killed runs left beside ``out`` (``sweep_leftovers``)."""
    if out.exists() or out.is_symlink() or not out.parent.is_dir():
        sweep_leftovers(out)
        return
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.old-(\d+)-[0-9a-f]{{8}}$")
    aside = [p for p in out.parent.iterdir() if (m := pattern.match(p.name)) and not p.is_symlink()
             and not pid_alive(int(m.group(1))) and valid(p)]
    for p in sorted(aside, key=lambda p: p.stat().st_mtime, reverse=True)[:1]:
        log.warning("restoring %s from %s: an earlier run was stopped while replacing %s", out, p, what)
        try:
            os.rename(p, out)
        except OSError as e:
            raise PactError(f"{p}: {what} an interrupted run set aside could not be renamed back to {out} "
                            f"({e.strerror or e}): rename it yourself") from None
    sweep_leftovers(out)
