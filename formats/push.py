"""pact-push: an artifact to a local folder (a temp folder renamed into place) or to s3:// / hf://
(the manifest last, so readers never see a partial artifact). Reads with formats/artifact.py,
writes through formats/remote.py's file systems."""

from __future__ import annotations

import contextlib
import errno
import json
import posixpath
import shutil
from pathlib import Path

from . import remote
from .artifact import check_outside_artifacts, check_replaceable, open_artifact
from .errors import PactError, write_error
from .files import atomic_folder, recover_aside, sweep_leftovers
from .layout import FORMAT_NAME
from .layout import is_artifact as _is_artifact
from .remote import _META_MAX, PUSH_SCHEMES, _metadata, _plan, _why


def push_artifact(path, dest: str, *, overwrite: bool = False) -> str:
    """Upload the (verified) artifact at ``path`` to ``dest``: a local folder (plain path or file://)
    through a temp folder renamed into place, or s3:// / hf:// with the manifest last, so a reader
    never sees a partial artifact. Refused before anything is written: an http(s) destination, the
    source itself (or a folder inside it or holding it), a file, and a non-empty destination that
    is not a pact artifact; an artifact already there only with ``overwrite``."""
    scheme = dest.split("://", 1)[0].lower() if "://" in dest else "file"
    if scheme not in PUSH_SCHEMES:
        serve = ", then serve that folder over HTTP" if scheme in ("http", "https") else ""
        raise PactError(f"{dest}: pact-push writes to a local folder, {', '.join(s + '://' for s in PUSH_SCHEMES)}, "
                        f"not {scheme}:// (http(s) is read-only): push to one of those{serve}")
    art = open_artifact(path)
    if scheme == "file":
        local = _local_dest(art.path, remote.file_url_path(dest) if "://" in dest else Path(dest), dest, overwrite)
        art.verify()
        _push_local(art, local, dest)
        return dest
    fs, root = remote._fs(dest)  # (looked up at call time: tests stand in a file system)
    try:
        _push_remote(art, fs, root, dest, overwrite)
    except PactError:
        raise
    except Exception as e:  # hf / s3 / network libraries' own errors: one line at this boundary
        raise PactError(_push_failed(dest, scheme, e)) from None
    return dest


def _push_failed(dest: str, scheme: str, e: Exception) -> str:
    fix = {"hf": "check the network, that the repo exists and that you are logged in with write access "
                 "(hf auth login, or HF_TOKEN; HF_HUB_OFFLINE must be unset)",
           "s3": "check the network, the bucket and your AWS credentials (AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                 "AWS_SECRET_ACCESS_KEY)"}.get(scheme, "check the destination and run again")
    return f"{dest}: could not push ({_why(e)}): {fix}; no manifest was written there, so readers see no new artifact"


def _local_dest(src: Path, dst: Path, dest: str, overwrite: bool) -> Path:
    """The resolved folder a local push may write, or one error (checked before anything is written)."""
    s, d = src.resolve(), dst.resolve()
    recover_aside(d, "the artifact", _is_artifact)  # (a push killed between its two renames left it aside)
    if d == s or s in d.parents or d in s.parents:
        raise PactError(f"{dest} is the artifact {src} itself, inside it or a folder holding it: pushing there would "
                        "destroy it; choose a destination outside it")
    check_outside_artifacts(d, "destination")
    if d.exists() and not d.is_dir():
        raise PactError(f"{dest} is a file, not a folder: choose a new or empty folder as the destination")
    if d.is_dir() and any(d.iterdir()):
        if not _is_artifact(d):
            raise PactError(f"{dest} is a folder holding other files, not a pact artifact: pact-push writes only to a "
                            "new or empty folder, or with --overwrite over an artifact; choose another destination")
        if not overwrite:
            raise PactError(f"{dest} already holds an artifact: choose another destination or pass --overwrite")
        check_replaceable(d, "--overwrite")
    return d


def _push_local(art, d: Path, dest: str) -> None:
    """Copy every file into a temp folder beside ``d`` (the manifest last), then rename it into place;
    a failure removes the temp folder and leaves ``d`` as it was."""
    sweep_leftovers(d)
    rel = "zarr.json"
    try:
        with atomic_folder(d) as tmp:  # d: absent, empty or an artifact (checked by _local_dest)
            for rel, data in _metadata(art.meta).items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
            for rel in _checked_files(art):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(art.path / rel, tmp / rel)
    except OSError as e:
        raise write_error(e, d / rel, f"nothing at {dest} was changed") from None


def _checked_files(art) -> list[str]:
    """What a push copies as it is: the files the manifest's sha256 covers (hf/ files, chunks), then the
    manifest. The zarr.json of groups and arrays, which no checksum covers, are written from the manifest
    (remote._metadata) as the writer writes them: a copy never carries what an artifact from someone
    else put there unchecked."""
    return [r for r, sha, _ in _plan(art.meta) if sha is not None] + ["zarr.json"]


_MARK = ".pact-push"  # written first by a remote push, removed last: what it left, a rerun may resume


def _remote_state(fs, root: str) -> str:
    """"artifact" (a pact manifest at ``root``), "empty" (nothing, or only dotfiles such as a new
    Hub repo's .gitattributes, or what an interrupted pact-push left: its marker, no manifest) or
    "other"."""
    manifest = f"{root}/zarr.json"
    if fs.exists(manifest):
        try:
            doc = json.loads(fs.cat_file(manifest, start=0, end=_META_MAX))
            return "artifact" if doc["attributes"]["pact"]["format"] == FORMAT_NAME else "other"
        except (ValueError, KeyError, TypeError):
            return "other"
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return "empty"
    return "other" if _MARK not in names and any(not n.startswith(".") for n in names) else "empty"


def _push_remote(art, fs, root: str, dest: str, overwrite: bool) -> None:
    state = _remote_state(fs, root)
    if state == "other":
        raise PactError(f"{dest} holds other files and is not a pact artifact: pact-push writes only to an empty "
                        "destination, or with --overwrite over an artifact; choose another destination")
    if state == "artifact" and not overwrite:
        raise PactError(f"{dest} already holds an artifact: choose another destination or pass --overwrite")
    art.verify()
    manifest, rel = f"{root}/zarr.json", _MARK
    try:
        fs.pipe_file(f"{root}/{_MARK}", b"an interrupted pact-push; run it again to finish\n")
        if state == "artifact":
            fs.rm(manifest)  # readers see no artifact until the new manifest lands
        for rel, data in _metadata(art.meta).items():
            fs.makedirs(posixpath.dirname(f"{root}/{rel}"), exist_ok=True)
            fs.pipe_file(f"{root}/{rel}", data)
        for rel in _checked_files(art):  # the manifest last
            fs.makedirs(posixpath.dirname(f"{root}/{rel}"), exist_ok=True)
            fs.put_file(str(art.path / rel), f"{root}/{rel}")
    except Exception as e:
        if rel == "zarr.json":  # never leave a half-written manifest that reads as an artifact
            with contextlib.suppress(Exception):
                fs.rm(manifest)
        if not isinstance(e, OSError) or e.errno != errno.ENOSPC:
            raise
        raise write_error(e, f"{dest}/{rel}", "the manifest was not written, so readers see no artifact there; "
                          "run again") from None
    with contextlib.suppress(Exception):  # complete: the marker is only a leftover now
        fs.rm(f"{root}/{_MARK}")
