"""Artifacts at a URL: fetched through fsspec into a local content-addressed cache, checked on the
way in; and pushed to one, manifest last.

    open_artifact("https://host/art/")   # http(s)://, s3://, hf://org/repo[/path], file://

What is fetched is what the manifest names and nothing else: the root ``zarr.json`` (the manifest),
``hf/zarr.json`` and the hf/ files it lists, and per tensor its group ``zarr.json``, and per array
its ``zarr.json`` and its one chunk. Every chunk and hf/ file is checked against the manifest's
sha256 as it lands; metadata files are size-bounded and checked by the reader when the cached copy
opens. The copy is built in ``<digest>.partial/`` under ``$PACT_CACHE/artifacts/`` (digest: sha256
of the manifest bytes) and renamed to ``<digest>/`` once complete, so the cache never holds half an
artifact under its final name; an interrupted fetch resumes from what the partial folder holds (a
partly received chunk from its last byte, where the server honours ranges). One process fetches
a digest at a time (a lock file); others wait for it and then read its copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

from .artifact import FORMAT_NAME, FORMAT_VERSION, array_nbytes, default_cache
from .errors import ArtifactError, PactError, require, write_error

SCHEMES = ("http", "https", "s3", "hf", "file", "memory")
_META_MAX = 64 << 20  # a manifest or array metadata file larger than this is not one
_BLOCK = 8 << 20


def _fs(url: str):
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise PactError(f"{url}: pact reads artifacts from {', '.join(s + '://' for s in SCHEMES)} or a local folder")
    require("fsspec", "remote", f"{url}")
    import fsspec

    try:
        return fsspec.core.url_to_fs(url.rstrip("/"))
    except ImportError as e:  # the protocol's own package (s3fs, aiohttp) is missing
        raise PactError(f"{url}: reading {scheme}:// needs a package that is not installed ({e}): "
                        "pip install \"pact[remote]\"") from None


def _read_small(fs, url: str, path: str, what: str) -> bytes:
    try:
        data = fs.cat_file(path, start=0, end=_META_MAX + 1)
    except FileNotFoundError:
        raise ArtifactError(f"{url}: {what} is missing on the server: not a pact artifact, or an incomplete "
                            "upload (pact-push writes the manifest last)") from None
    except PactError:
        raise
    except Exception as e:  # network errors come as the protocol library's own types
        raise PactError(f"{url}: could not read {what} ({type(e).__name__}: {e}): check the URL and the "
                        "network, then run again") from None
    if len(data) > _META_MAX:
        raise PactError(f"{url}: {what} is larger than {_META_MAX} bytes, not a metadata file: refusing it")
    return data


def _plan(meta: dict) -> list[tuple[str, str | None, int | None]]:
    """(relative path, sha256 or None, size or None) of every file of the artifact but the manifest."""
    files = [("hf/zarr.json", None, None)]
    files += [(f"hf/{rel}", digest, None) for rel, digest in meta["files"].items()]
    for name, e in meta["tensors"].items():
        files.append((f"tensors/{name}/zarr.json", None, None))
        for spec in e["arrays"].values():
            shape = spec["shape"]
            files.append((f"{spec['path']}/zarr.json", None, None))
            try:
                nbytes = array_nbytes(spec)
            except (KeyError, TypeError):
                raise ArtifactError(f"manifest array {name} has dtype {spec.get('dtype')!r} or shape {shape!r}, which "
                                    "pact does not store: not an artifact this version reads") from None
            files.append(("/".join([spec["path"], "c", *(["0"] * len(shape))]), spec["sha256"], nbytes))
    for rel, _, _ in files:  # nothing outside the folder, whatever the manifest says
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or rel.startswith("/"):
            raise ArtifactError(f"manifest names {rel!r}, outside the artifact: refusing it")
    return files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a second fetch of the same artifact waits here
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_artifact(url: str, cache: Path | None = None) -> Path:
    """The local copy of the artifact at ``url`` (fetched, or already in the cache and complete)."""
    fs, root = _fs(url)
    raw = _read_small(fs, url, f"{root}/zarr.json", "zarr.json (the manifest)")
    try:
        meta = json.loads(raw)["attributes"]["pact"]
        fmt, version = meta.get("format"), meta.get("format_version")
        assert isinstance(meta.get("tensors"), dict) and isinstance(meta.get("files"), dict)
    except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
        raise ArtifactError(f"{url}/zarr.json: no pact manifest: not a pact artifact") from None
    if fmt != FORMAT_NAME:
        raise ArtifactError(f"{url}/zarr.json: format is {fmt!r}, not {FORMAT_NAME!r}")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"{url}: artifact format version {version} is newer than this pact reads "
                            f"({FORMAT_VERSION}): upgrade pact (pip install -U pact)")
    digest = hashlib.sha256(raw).hexdigest()
    base = (cache or default_cache()) / "artifacts"
    final = base / digest
    if (final / "zarr.json").is_file():
        return final
    plan = _plan(meta)
    with _locked(base / f"{digest}.lock"):
        if (final / "zarr.json").is_file():  # another process finished it while this one waited
            return final
        part = base / f"{digest}.partial"
        part.mkdir(parents=True, exist_ok=True)
        for rel, sha, size in plan:
            _fetch_file(fs, url, f"{root}/{rel}", part / rel, rel, sha, size)
        (part / "zarr.json").write_bytes(raw)  # last: the folder is complete
        os.replace(part, final)
    return final


def _fetch_file(fs, url: str, src: str, dst: Path, rel: str, sha: str | None, size: int | None) -> None:
    if dst.is_file() and (sha is None or _sha256(dst) == sha):
        return  # from an interrupted fetch, and right
    dst.parent.mkdir(parents=True, exist_ok=True)
    if sha is None:
        dst.write_bytes(_read_small(fs, url, src, rel))
        return
    tmp = dst.with_name(dst.name + ".part")
    have = tmp.stat().st_size if tmp.is_file() else 0
    if size is not None and have > size:
        tmp.unlink()
        have = 0
    fout = None
    try:
        fin, have = _open_at(fs, src, have)
        with fin:
            try:
                fout = open(tmp, "ab" if have else "wb")
            except OSError as e:
                raise write_error(e, tmp, "nothing else was changed") from None
            while block := fin.read(_BLOCK):
                try:
                    fout.write(block)
                except OSError as e:  # local: a full disk, not the connection
                    raise write_error(e, tmp, f"run again to resume {url}") from None
    except PactError:
        raise
    except FileNotFoundError:
        raise ArtifactError(f"{url}: {rel} is missing on the server: the artifact there is incomplete; "
                            "ask its publisher to push it again") from None
    except Exception as e:  # aiohttp / botocore / OSError from the connection: it dropped
        raise PactError(_broken(url, rel, tmp, size, f"{type(e).__name__}: {e}")) from None
    finally:
        if fout is not None:
            fout.close()
    got = tmp.stat().st_size
    if size is not None and got != size:
        raise PactError(_broken(url, rel, tmp, size, f"{got} bytes arrived"))
    if _sha256(tmp) != sha:
        tmp.unlink()
        raise ArtifactError(f"{url}: {rel}: sha256 differs from the manifest's (the server sent other bytes): "
                            "the copy was discarded; run again, or ask the publisher to push the artifact again")
    os.replace(tmp, dst)


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


def _broken(url: str, rel: str, tmp: Path, size: int | None, why) -> str:
    got = tmp.stat().st_size if tmp.is_file() else 0
    return (f"{url}: {rel}: the download broke off after {got} of {size if size is not None else '?'} bytes "
            f"({why}); run again to resume")


def push_artifact(path, dest: str, *, overwrite: bool = False) -> str:
    """Upload the (verified) artifact at ``path`` to the fsspec destination ``dest``, the manifest
    last, so a reader never sees a partial artifact."""
    from .artifact import open_artifact

    art = open_artifact(path)
    art.verify()
    fs, root = _fs(dest)
    if fs.exists(f"{root}/zarr.json") and not overwrite:
        raise PactError(f"{dest} already holds an artifact: choose another destination or pass --overwrite")
    if fs.exists(f"{root}/zarr.json"):
        fs.rm(f"{root}/zarr.json")  # readers see no artifact until the new manifest lands
    for rel, _, _ in _plan(art.meta):
        fs.makedirs(f"{root}/{Path(rel).parent}", exist_ok=True)
        fs.put_file(str(art.path / rel), f"{root}/{rel}")
    fs.put_file(str(art.path / "zarr.json"), f"{root}/zarr.json")
    return dest

