"""Artifacts at a URL: fetched into a local content-addressed cache, checked on the way in; and
pushed to one, manifest last.

    open_artifact("https://host/art/")   # http(s)://, s3://, hf://org/repo[/path], file://

What is fetched is the root ``zarr.json`` (the manifest), the hf/ files it lists and per array its
one chunk: every one of them covered by the manifest's sha256, checked as it lands. No other file
comes from the source: the zarr.json of every group and array, which no checksum covers, is written
here from the manifest as pact's writer writes it, so no file of the copy can carry what its
publisher (or a link in a file:// folder) put there unchecked. Before any download the manifest
passes every check a local open runs on one (artifact.py: _upgrade, _check_manifest, the writer's
array paths), each path it names percent-decoded too (no ``..``, ``.``, empty segment, leading
``/``, backslash or NUL; no path both a file and a folder), every URL built from one must lie under
the artifact's URL, and its tensors must fit the cache's disk. The hf/ files come first; then the
copy is checked as a local open checks it (hf/config.json against the tensor shapes included), and
only then is any tensor data fetched. No file may grow past its bound while it streams (a chunk:
its manifest size; an hf/ file: 64 MiB; the manifest: 16 MiB).

The copy is built in ``<digest>.partial/`` under ``$PACT_CACHE/artifacts/`` (digest: sha256 of the
manifest bytes) and renamed to ``<digest>/`` once complete, so the cache never holds half an
artifact under its final name. A fetch the connection or the local disk stopped resumes from what
the partial folder holds (a partly received chunk from its last byte, where the server honours
ranges); a refused one (a check failed, bytes that are not the manifest's) removes it, so the cache
keeps nothing of it. One process fetches a digest at a time (a lock file, removed when released);
others wait for it and then read its copy.

A file:// folder is first checked as a local artifact (no symbolic link, pipe or code anywhere in
it), then read by pact itself, each file opened one path component at a time without following a
link (O_NOFOLLOW) and only if it is a regular file: a link put in after the check leads nowhere.

http(s):// is read by pact's own small client (http.client), not fsspec's: one keep-alive
connection to the artifact's origin; a redirect is followed only within that origin (scheme, host
and port), never to another; every request is bounded in time (``PACT_FETCH_TIMEOUT`` seconds
without a byte, and below ``PACT_FETCH_MIN_RATE`` bytes/s on average once that long has passed).
s3://, hf:// and memory:// go through fsspec with the same size and rate bounds.

Pushing (``pact-push``) writes to a local folder (plain path or file://) through a temp folder
renamed into place, or to s3:// / hf:// / memory:// with the old manifest removed first and the new
one written last; it never writes into the source artifact, a folder holding it, a file, or a
non-empty folder that is not a pact artifact.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import http.client
import json
import os
import posixpath
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote, unquote, urljoin, urlsplit

import numpy as np

from .artifact import Artifact, _check_manifest, _upgrade, _zarr_json
from .errors import ArtifactError, PactError, install_hint, require, write_error
from .files import check_regular, default_cache, sha256_file
from .layout import _STORAGE, FORMAT_NAME, FORMAT_VERSION, HF_DIR, array_nbytes

SCHEMES = ("http", "https", "s3", "hf", "file", "memory")
PUSH_SCHEMES = ("s3", "hf", "file", "memory")  # http(s) servers take no uploads
_META_MAX = 16 << 20  # a manifest or array metadata file larger than this is not one (a 400B model's is ~2 MB)
_SIDE_MAX = 64 << 20  # an hf/ file (config, tokenizer): convert/sources.py copies none larger
_BLOCK = 8 << 20
_REDIRECTS = 5  # same-origin hops per request; more is a loop
_TIMEOUT_S = 60.0  # PACT_FETCH_TIMEOUT default: seconds without a byte, and the grace before the rate floor
_MIN_RATE = 16 << 10  # PACT_FETCH_MIN_RATE default, bytes/s: slower than this on average is a stalled server


def _limits() -> tuple[float, float]:
    """(PACT_FETCH_TIMEOUT seconds, PACT_FETCH_MIN_RATE bytes/s), read at each fetch."""
    out = []
    for name, default, low in (("PACT_FETCH_TIMEOUT", _TIMEOUT_S, 1e-3), ("PACT_FETCH_MIN_RATE", _MIN_RATE, 0)):
        raw = os.environ.get(name, "")
        try:
            v = float(raw) if raw.strip() else float(default)
            assert low <= v < float("inf")
        except (ValueError, AssertionError):
            raise PactError(f"{name}={raw!r} is not a number >= {low}: set it like {name}={default:g}, "
                            "or unset it") from None
        out.append(v)
    return out[0], out[1]


def file_url_path(url: str) -> Path:
    """The local path a file:// URL names: file:///abs/path, or file://localhost/abs/path (RFC 8089).
    Any other host is refused: file://name/p read as a path would be ./name/p, somewhere else."""
    parts = urlsplit(url)
    if parts.query or parts.fragment or url.endswith(("?", "#")):  # (a local folder has neither: never cut there)
        raise PactError(f"{url}: a '?' or '#' in a file:// URL starts a query or fragment, which names no folder: "
                        "write them as %3F and %23, or give the path itself")
    if parts.netloc.lower() not in ("", "localhost") or not parts.path.startswith("/"):
        raise PactError(f"{url}: a file:// URL names an absolute path on this machine: file:///absolute/path (or "
                        f"file://localhost/absolute/path); for a relative folder give the path itself")
    return Path(unquote(parts.path))


def _fs(url: str):
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise PactError(f"{url}: pact reads artifacts from {', '.join(s + '://' for s in SCHEMES)} or a local folder")
    require("fsspec", "remote", f"{url}")
    import fsspec

    try:
        return fsspec.core.url_to_fs(url.rstrip("/"))
    except ImportError as e:  # the protocol's own package (s3fs, aiohttp) is missing
        raise PactError(f"{url}: {scheme}:// needs a package that is not installed ({e}): "
                        f"{install_hint('remote')}") from None


# --------------------------------------------------------------------------------------
# where a manifest path may point


def _check_rel(rel) -> str:
    """``rel`` when it is a plain relative path inside the artifact, as written and percent-decoded
    (repeatedly, as a lax server might); else one error."""
    forms, p = [rel], rel
    while isinstance(p, str) and (q := unquote(p)) != p:
        forms.append(p := q)
    for p in forms:
        if (not isinstance(p, str) or not p or p.startswith("/") or "\\" in p or "\0" in p
                or any(s in ("", ".", "..") for s in p.split("/"))):
            raise ArtifactError(f"manifest names {rel!r}, outside the artifact or not a plain relative path "
                                "(checked percent-decoded too): refusing it; the artifact is malformed or hostile")
    return rel


def _under(path: str, root: str, url: str, rel: str) -> str:
    """``path`` when, normalized and percent-decoded, it still lies under ``root``; else one error."""
    inside = posixpath.normpath(unquote(root) or "/").rstrip("/") + "/"
    if not posixpath.normpath(unquote(path)).startswith(inside):
        raise ArtifactError(f"{url}: {rel!r} resolves to {path}, outside the artifact's URL: refusing it")
    return path


def _plan(meta: dict) -> list[tuple[str, str | None, int | None]]:
    """(relative path, sha256 or None, size or None) of every file of the artifact but the manifest;
    every path checked to lie inside the artifact, whatever the manifest says."""
    files = [("hf/zarr.json", None, None)]
    try:
        files += [(f"hf/{_check_rel(rel)}", digest, None) for rel, digest in meta["files"].items()]
        for name, e in meta["tensors"].items():
            files.append((f"tensors/{_check_rel(name)}/zarr.json", None, None))
            for spec in e["arrays"].values():
                shape = spec["shape"]
                files.append((f"{_check_rel(spec['path'])}/zarr.json", None, None))
                try:
                    nbytes = array_nbytes(spec)
                except (KeyError, TypeError):
                    raise ArtifactError(f"manifest array {name} has dtype {spec.get('dtype')!r} or shape {shape!r}, "
                                        "which pact does not store: not an artifact this version reads") from None
                files.append(("/".join([spec["path"], "c", *(["0"] * len(shape))]), spec["sha256"], nbytes))
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"manifest is malformed ({type(e).__name__}: {e}): not an artifact this version "
                            "reads") from None
    seen: set[str] = set()
    for rel, _, _ in files:
        if _check_rel(rel) in seen:
            raise ArtifactError(f"manifest names {rel!r} twice: the artifact is malformed or hostile")
        seen.add(rel)
    for rel in seen:  # a file is never also a folder of another's path (mkdir would fail mid-fetch)
        if above := next((rel[:i] for i, c in enumerate(rel) if c == "/" and rel[:i] in seen), None):
            raise ArtifactError(f"manifest names both {above!r} and {rel!r}: a file cannot also be a folder; the "
                                "artifact is malformed or hostile")
    return files


def _metadata(meta: dict) -> dict[str, bytes]:
    """The zarr.json of every group and array, as pact's writer makes them (from the manifest's
    shapes and dtypes): written, not fetched, since no checksum covers them."""
    group = _zarr_json(None, None)
    out = {f"{HF_DIR}/zarr.json": group, "tensors/zarr.json": group}
    for name, e in meta["tensors"].items():
        out[f"tensors/{name}/zarr.json"] = group
        for spec in e["arrays"].values():
            out[f"{spec['path']}/zarr.json"] = _zarr_json(tuple(spec["shape"]), np.dtype(_STORAGE[spec["dtype"]][0]))
    return out


# --------------------------------------------------------------------------------------
# reading: one source per URL, every body streamed through _pump's bounds


def _origin(u) -> tuple[str, str, int]:
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), u.port or (443 if scheme == "https" else 80)


class _Http:
    """An http(s) artifact, read over one keep-alive connection to its origin (see the module doc)."""

    def __init__(self, url: str):
        u = urlsplit(url)
        if not u.hostname:
            raise PactError(f"{url}: no host in the URL: write it as http(s)://host[:port]/path/to/artifact")
        self.url = url.rstrip("/")
        self.origin = _origin(u)
        self.base = u.path.rstrip("/") + "/"
        self.query = f"?{u.query}" if u.query else ""
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _abs(self, path: str) -> str:
        s, h, p = self.origin
        return f"{s}://{h}:{p}{path}"

    def _send(self, path: str, headers: dict) -> http.client.HTTPResponse:
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                cls = http.client.HTTPSConnection if self.origin[0] == "https" else http.client.HTTPConnection
                self.conn = cls(self.origin[1], self.origin[2], timeout=_limits()[0])
            try:
                self.conn.request("GET", path, headers={"User-Agent": "pact", **headers})
                return self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()  # a kept-alive connection the server had closed: one fresh try
                if not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    def _get(self, rel: str, headers: dict) -> http.client.HTTPResponse:
        path = _under(self.base + quote(rel, safe="/"), self.base, self.url, rel) + self.query
        for _ in range(_REDIRECTS + 1):
            r = self._send(path, headers)
            if r.status not in (301, 302, 303, 307, 308):
                return r
            here, target = self._abs(path), urljoin(self._abs(path), r.getheader("Location") or "")
            self.close()
            t = urlsplit(target)
            if _origin(t) != self.origin:
                raise PactError(f"{self.url}: {rel}: the server redirects to {target}, another host or port: pact "
                                f"follows redirects only within {self._abs('')}; if you trust that host, fetch the "
                                "artifact from its URL directly")
            path = (t.path or "/") + (f"?{t.query}" if t.query else "")
        raise PactError(f"{self.url}: {rel}: more than {_REDIRECTS} redirects (last from {here}): check the URL")

    @contextlib.contextmanager
    def open(self, rel: str, start: int = 0) -> Iterator[tuple[Callable[[int], bytes], int, int | None]]:
        """(read, first byte, the file's full size or None) of ``rel`` from byte ``start`` (a range
        request; from 0 when the server sends the whole file)."""
        r = self._get(rel, {"Range": f"bytes={start}-"} if start else {})
        try:
            if r.status in (404, 410):
                raise FileNotFoundError(f"{self.url}/{rel}")
            if r.status not in (200, 206):
                raise OSError(f"HTTP {r.status} {r.reason}")
            total = r.length
            if r.status == 206:
                first, _, size = (r.getheader("Content-Range") or "").removeprefix("bytes ").partition("/")
                if not first.split("-")[0].isdigit() or int(first.split("-")[0]) != start:
                    raise OSError(f"the server answered a request for bytes from {start} with {first or 'no range'}")
                total = int(size) if size.isdigit() else None
            else:
                start = 0
            yield r.read1, start, total
        finally:
            if not r.isclosed():  # not read to its end: this connection cannot carry the next request
                r.close()
                self.close()


class _Fsspec:
    """An artifact at an fsspec URL (s3://, hf://, file://, memory://)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = _fs(url)

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def open(self, rel: str, start: int = 0) -> Iterator[tuple[Callable[[int], bytes], int, int | None]]:
        src = _under(f"{self.root}/{rel}", self.root, self.url, rel)
        f, start = _open_at(self.fs, src, start)
        with f:
            yield f.read, start, None


class _Local:
    """A file:// artifact folder (checked as a local artifact first), read without following any
    symbolic link below it: each path component is opened from its parent with O_NOFOLLOW, and a
    file is read only if it is a regular one (O_NONBLOCK: opening a pipe does not wait)."""

    def __init__(self, root: Path):
        self.root = root

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def open(self, rel: str, start: int = 0) -> Iterator[tuple[Callable[[int], bytes], int, int | None]]:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # (the folder the user named)
        at = self.root
        try:
            for name in rel.split("/"):
                at = at / name
                try:
                    nxt = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise ArtifactError(f"{at}: a symbolic link inside the artifact: refusing it "
                                            "(links can lead outside the folder); copy the artifact without links "
                                            "from a source you trust") from None
                    if e.errno == errno.ENOTDIR:  # a file where the path needs a folder
                        raise FileNotFoundError(self.root / rel) from None
                    raise
                os.close(fd)
                fd = nxt
            st = os.fstat(fd)
            check_regular(at, st.st_mode, "remove it, or re-copy the artifact from a source you trust")
            os.lseek(fd, start, os.SEEK_SET)
            yield functools.partial(os.read, fd), start, st.st_size
        finally:
            os.close(fd)


def _open_at(fs, src: str, have: int):
    """The remote file positioned at byte ``have`` (a range request), or from its start when the
    server does not honour ranges (then ``have`` is 0): (file, position)."""
    if have:
        try:
            f = fs.open(src, "rb", block_size=_BLOCK)
            f.seek(have)
            return f, have
        except (ValueError, OSError):
            pass
    return fs.open(src, "rb", block_size=0), 0


def _source(url: str):
    return _Http(url) if url.split("://", 1)[0].lower() in ("http", "https") else _Fsspec(url)


class _TooLong(Exception):
    pass


class _Interrupted(PactError):
    """A fetch stopped by the connection or the local disk, not by what it fetched: its partial copy
    stays for a rerun to resume."""


class _TooSlow(Exception):
    pass


def _pump(read: Callable[[int], bytes], put: Callable[[bytes], object], have: int, limit: int) -> int:
    """Stream blocks into ``put`` until the body ends; the bytes held then (``have`` before). Stops
    with _TooLong the moment more than ``limit`` would be held, and with _TooSlow when, past
    PACT_FETCH_TIMEOUT seconds, the average rate is under PACT_FETCH_MIN_RATE."""
    timeout, min_rate = _limits()
    t0, got = time.monotonic(), 0
    while block := read(_BLOCK):
        if have + got + len(block) > limit:
            raise _TooLong(limit)
        put(block)
        got += len(block)
        elapsed = time.monotonic() - t0
        if elapsed > timeout and got < min_rate * elapsed:
            raise _TooSlow(f"{got} bytes in {elapsed:.1f} s, under the {min_rate:g} bytes/s floor "
                           "(PACT_FETCH_MIN_RATE)")
    return have + got


def _why(e: BaseException) -> str:
    """A connection failure in a few words (a timeout named with the setting that bounds it)."""
    if isinstance(e, TimeoutError):
        return f"no data for {_limits()[0]:g} s (PACT_FETCH_TIMEOUT)"
    if isinstance(e, _TooSlow):
        return str(e)
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'no detail'}"


def _read_small(src, url: str, rel: str, what: str) -> bytes:
    out: list[bytes] = []
    limit = _META_MAX
    try:
        with src.open(rel) as (read, _, _):
            _pump(read, out.append, 0, limit)
    except FileNotFoundError:
        raise ArtifactError(f"{url}: {what} is missing on the server: not a pact artifact, or an incomplete "
                            "upload (pact-push writes the manifest last)") from None
    except _TooLong:
        raise PactError(f"{url}: {what} is larger than {limit} bytes, not a metadata file: refusing it") from None
    except PactError:
        raise
    except Exception as e:  # network errors come as the protocol library's own types
        raise PactError(f"{url}: could not read {what} ({_why(e)}): check the URL and the network, then run "
                        "again (a slow link: raise PACT_FETCH_TIMEOUT or lower PACT_FETCH_MIN_RATE)") from None
    return b"".join(out)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """``lock`` held (a second fetch of the same artifact waits here), and removed before its release,
    so the cache keeps no lock files: a waiter that then holds a removed file's lock takes it again."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(lock, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(f.fileno()).st_ino:
                break
        f.close()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        f.close()


def fetch_artifact(url: str, cache: Path | None = None) -> Path:
    """The local copy of the artifact at ``url`` (fetched, or already in the cache and complete)."""
    if url.split("://", 1)[0].lower() == "file":
        local = file_url_path(url)
        if not local.is_dir():  # said missing as a folder, not as a bad upload
            raise ArtifactError(f"{url}: no such folder {local}")
        Artifact(local)  # checked as a local open checks it (no link, pipe or code in it) before anything is copied
        src = _Local(local)
    else:
        src = _source(url)
    try:
        return _fetch(src, url, cache)
    finally:
        src.close()


def _checked_manifest(raw: bytes, url: str) -> tuple[dict, list[tuple[str, str | None, int | None]]]:
    """The manifest (its ``pact`` attributes) and its _plan, after every check a local open runs on a
    manifest: nothing is downloaded for one that fails."""
    where = url.rstrip("/")
    try:
        meta = json.loads(raw)["attributes"]["pact"]
        fmt, version = meta.get("format"), meta.get("format_version")
        assert isinstance(meta.get("tensors"), dict) and isinstance(meta.get("files"), dict)
    except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
        raise ArtifactError(f"{where}/zarr.json: no pact manifest: not a pact artifact") from None
    if fmt != FORMAT_NAME:
        raise ArtifactError(f"{where}/zarr.json: format is {fmt!r}, not {FORMAT_NAME!r}")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"{url}: artifact format version {version} is newer than this pact reads "
                            f"({FORMAT_VERSION}): upgrade pact ({install_hint(upgrade=True)})")
    meta = _upgrade(meta, where)
    _check_manifest(meta, where)  # (its messages name where/zarr.json)
    try:
        plan = _plan(meta)
    except ArtifactError as e:
        raise ArtifactError(f"{where}/zarr.json: {e}") from None
    for name, entry in meta["tensors"].items():
        for part, spec in entry["arrays"].items():
            if spec["path"] != f"tensors/{name}/{part}":  # where the writer puts it: no array read as another's
                raise ArtifactError(f"{where}/zarr.json: manifest array {name}/{part} has path {spec['path']!r}, "
                                    f"not tensors/{name}/{part}: the artifact is damaged or was not written by pact")
    return meta, plan


def _held(f: Path) -> int:
    """A file's size in an interrupted fetch's copy; 0 for a folder or a file gone since it was listed."""
    try:
        return f.stat().st_size if f.is_file() else 0
    except FileNotFoundError:
        return 0


def _check_room(base: Path, part: Path, plan: list, url: str) -> None:
    """The cache's disk holds the tensors the manifest declares (less what an interrupted fetch of it
    holds): a manifest's sizes never fill the disk."""
    need = sum(size for _, _, size in plan if size)
    try:  # (outside the fetch's lock: another fetch may rename a file of it, or the whole copy, meanwhile)
        need -= sum(_held(f) for f in part.rglob("*")) if part.is_dir() else 0
    except FileNotFoundError:  # the copy was finished and renamed while it was counted: count none of it
        pass
    where = base
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise PactError(f"{url}: its tensors need {need / 2**30:.2f} GiB in {base}, where {free / 2**30:.2f} GiB "
                        "are free: free space, or set PACT_CACHE to a folder on a larger disk")


def _fetch(src, url: str, cache: Path | None) -> Path:
    raw = _read_small(src, url, "zarr.json", "zarr.json (the manifest)")
    meta, plan = _checked_manifest(raw, url)
    digest = hashlib.sha256(raw).hexdigest()
    base = (cache or default_cache()) / "artifacts"
    final, part = base / digest, base / f"{digest}.partial"
    if (final / "zarr.json").is_file():
        return final
    _check_room(base, part, plan, url)
    try:
        with _locked(base / f"{digest}.lock"):
            if (final / "zarr.json").is_file():  # another process finished it while this one waited
                return final
            try:
                _fill(src, url, part, meta, plan, raw)
            except _Interrupted:
                raise
            except PactError as e:  # refused: nothing of it stays; said with the URL, not the cache's temp path
                shutil.rmtree(part, ignore_errors=True)
                raise type(e)(str(e).replace(str(part), url.rstrip("/"))) from None
            os.replace(part, final)
    except OSError as e:  # the cache folder itself: not writable, or its disk full
        raise _Interrupted(str(write_error(e, base, f"run again to resume {url}"))) from None
    return final


def _fill(src, url: str, part: Path, meta: dict, plan: list, raw: bytes) -> None:
    """``part`` made a complete copy: the metadata pact writes, the hf/ files, the manifest; then the
    checks of a local open (hf/config.json against the tensor shapes included), and only then the
    tensor data."""
    for rel, data in _metadata(meta).items():
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        _write_local(part / rel, data, url)
    for rel, sha, size in plan:
        if sha is not None and size is None:  # an hf/ file
            _fetch_file(src, url, rel, part / rel, sha, size)
    _write_local(part / "zarr.json", raw, url)
    Artifact(part)
    for rel, sha, size in plan:
        if size is not None:  # a chunk
            _fetch_file(src, url, rel, part / rel, sha, size)


def _write_local(dst: Path, data: bytes, url: str) -> None:
    """``data`` into ``dst`` through a temp file, so a full disk never leaves a short file that a
    resumed fetch would take as complete."""
    tmp = dst.with_name(dst.name + ".part")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _Interrupted(str(write_error(e, dst, f"run again to resume {url}"))) from None


def _fetch_file(src, url: str, rel: str, dst: Path, sha: str, size: int | None) -> None:
    if dst.is_file() and sha256_file(dst) == sha:
        return  # from an interrupted fetch, and right
    dst.parent.mkdir(parents=True, exist_ok=True)
    limit = size if size is not None else _SIDE_MAX
    tmp = dst.with_name(dst.name + ".part")
    have = tmp.stat().st_size if tmp.is_file() else 0
    if have > limit:
        tmp.unlink()
        have = 0
    total = None
    fout = None

    def put(block: bytes) -> None:
        try:
            fout.write(block)
        except OSError as e:  # local: a full disk, not the connection
            raise _Interrupted(str(write_error(e, tmp, f"run again to resume {url}"))) from None

    try:
        with src.open(rel, have) as (read, have, total):
            if size is not None and total is not None and total != size:
                raise ArtifactError(f"{url}: {rel} is {total} bytes on the server, the manifest says {size}: the "
                                    "artifact there is inconsistent; ask its publisher to push it again")
            try:
                fout = open(tmp, "ab" if have else "wb")
            except OSError as e:
                raise _Interrupted(str(write_error(e, tmp, "nothing else was changed"))) from None
            _pump(read, put, have, limit)
    except PactError:
        raise
    except FileNotFoundError:
        raise ArtifactError(f"{url}: {rel} is missing on the server: the artifact there is incomplete; "
                            "ask its publisher to push it again") from None
    except _TooLong:
        fout.close()
        tmp.unlink(missing_ok=True)
        bound = (f"the {size} bytes the manifest gives it" if size is not None
                 else f"{limit} bytes (no hf/ file is larger)")
        raise ArtifactError(f"{url}: {rel}: the server sent more than {bound}: stopped there and discarded the copy; "
                            "the server or the artifact there is broken") from None
    except Exception as e:  # OSError, timeouts, aiohttp / botocore errors from the connection: it dropped
        raise _Interrupted(_broken(url, rel, tmp, size, _why(e))) from None
    finally:
        if fout is not None:
            fout.close()
    got = tmp.stat().st_size
    if (size is not None and got != size) or (size is None and total is not None and got != total):
        raise _Interrupted(_broken(url, rel, tmp, size if size is not None else total, "the connection closed early"))
    if sha256_file(tmp) != sha:
        tmp.unlink()
        raise ArtifactError(f"{url}: {rel}: sha256 differs from the manifest's (the server sent other bytes): "
                            "the copy was discarded; run again, or ask the publisher to push the artifact again")
    os.replace(tmp, dst)


def _broken(url: str, rel: str, tmp: Path, size: int | None, why) -> str:
    got = tmp.stat().st_size if tmp.is_file() else 0
    return (f"{url}: {rel}: the download broke off after {got} of {size if size is not None else '?'} bytes "
            f"({why}); run again to resume")
