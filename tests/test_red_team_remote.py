"""Red-team findings on artifacts at URLs and pact-push, one test each: hostile loopback servers
(redirects to another host or port, endless bodies, a drip, a stall) and destinations that a push
must not destroy (the source itself, a user's folder, a file, a full disk). Every failure is one
line naming the URL/destination and the fix; every test runs in a few seconds."""

import contextlib
import errno
import hashlib
import http.server
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
from click.testing import CliRunner

from conftest import make_model
from pact.convert import convert
from pact.formats import ArtifactError, PactError, open_artifact, push, remote
from pact.pipelines.push import main as push_cli

_CAP = 64 << 20  # an "endless" body stops here, so a broken client cannot fill the disk


class _Handler(http.server.BaseHTTPRequestHandler):
    """Files under ``root``, decoded and normalized like a lax server would (so ``%2e%2e`` climbs).
    ``mode`` (chunks are paths with ``/c/``): "redirect-other" / "redirect-manifest" send a chunk /
    the manifest to ``other`` (another origin); "redirect-same" sends chunks to the same path with
    ``?hop=1``; "endless-chunk" / "endless-manifest" never end the body; "drip" sends a chunk one
    byte per 0.2 s; "stall" sends a chunk's headers and then nothing."""

    root, mode, other = ".", None, ""
    seen: list = []
    log_message = lambda *a: None  # noqa: E731

    def do_GET(self):
        self.seen.append(self.path)
        path, _, query = self.path.partition("?")
        chunk, manifest = "/c/" in path, path.endswith("/art/zarr.json")
        if (self.mode == "redirect-other" and chunk) or (self.mode == "redirect-manifest" and manifest):
            return self._redirect(self.other + self.path)
        if self.mode == "redirect-same" and chunk and not query:
            return self._redirect(path.rsplit("/", 1)[-1] + "?hop=1")  # relative, same origin
        if (self.mode == "endless-chunk" and chunk) or (self.mode == "endless-manifest" and manifest):
            return self._endless()
        f = Path(self.root) / Path(unquote(path)).resolve().relative_to("/")
        if not f.is_file():
            return self.send_error(404)
        data = f.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up: so do we
            if chunk and self.mode in ("drip", "stall"):
                for i in range(len(data)):
                    time.sleep(0.2 if self.mode == "drip" else 5)
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
            else:
                self.wfile.write(data)

    def _redirect(self, location):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _endless(self):
        self.send_response(200)  # no Content-Length: the body ends when the connection does
        self.end_headers()
        block = b"\x00" * (64 << 10)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(_CAP // len(block)):
                self.wfile.write(block)


def _serve(root, host="127.0.0.1"):
    handler = type("H", (_Handler,), {"root": str(root), "seen": []})
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, handler, f"http://{host}:{server.server_address[1]}"


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    make_model(d / "src", "llama")
    convert(str(d / "src"), d / "www" / "art", progress=False)
    (d / "www" / "ok").mkdir()
    (d / "www" / "ok" / "secret.json").write_text('{"token": "hunter2"}')
    return d / "www"


@pytest.fixture
def servers(www):
    """The artifact's server, and two other origins: the same host on another port, another host."""
    made = [_serve(www), _serve(www), _serve(www, "127.0.0.2")]
    yield {"main": made[0], "port": made[1], "host": made[2]}
    for server, _, _ in made:
        server.shutdown()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _final_copies(cache):
    return [p for p in (cache / "artifacts").glob("*") if p.is_dir() and not p.name.endswith(".partial")]


# --------------------------------------------------------------------------------------
# fetch


@pytest.mark.parametrize("other", ["port", "host"])
@pytest.mark.parametrize("what", ["chunk", "manifest"])
def test_cross_origin_redirect_refused(servers, cache, other, what):
    """Finding 1: a redirect to another host or port, for a chunk or for the manifest itself, is
    refused in one line naming both URLs; the other origin never gets a request."""
    _, handler, base = servers["main"]
    _, other_handler, other_base = servers[other]
    handler.mode, handler.other = f"redirect-{'other' if what == 'chunk' else 'manifest'}", other_base
    match = rf"^{base}/art: .*redirects to {other_base}/art/.*another host or port: .*only within {base}; .*directly$"
    with pytest.raises(PactError, match=match):
        open_artifact(f"{base}/art")
    assert other_handler.seen == [] and not _final_copies(cache)


def test_same_origin_redirect_followed(servers, cache):
    _, handler, base = servers["main"]
    handler.mode = "redirect-same"
    art = open_artifact(f"{base}/art")
    art.verify()
    assert any(p.endswith("?hop=1") for p in handler.seen)


def test_percent_encoded_path_refused(www, servers, cache):
    """Finding 2: a manifest naming ``%2e%2e/%2e%2e/%2e%2e/ok/secret.json`` (with the secret's true
    sha256) is refused before any chunk is fetched; the secret is never requested nor cached."""
    _, handler, base = servers["main"]
    evil = www / "evil"
    if not evil.exists():
        shutil.copytree(www / "art", evil)
        doc = json.loads((evil / "zarr.json").read_text())
        sha = hashlib.sha256((www / "ok" / "secret.json").read_bytes()).hexdigest()
        doc["attributes"]["pact"]["files"]["%2e%2e/%2e%2e/%2e%2e/ok/secret.json"] = sha
        (evil / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r"manifest names '%2e%2e/.*outside the artifact.*percent-decoded"):
        open_artifact(f"{base}/evil")
    assert handler.seen == ["/evil/zarr.json"]
    assert not list(cache.rglob("secret.json"))


@pytest.mark.parametrize("rel", ["a/../b", "/etc/passwd", "a\\..\\b", "a//b", "a/./b", "", "a/\0b", "%2fetc/passwd",
                                 "%2e%2e/x", "%252e%252e/x", "a/%2e/b", 7])
def test_manifest_paths_refused(rel):
    with pytest.raises(ArtifactError, match="outside the artifact or not a plain relative path"):
        remote._check_rel(rel)


def test_manifest_paths_accepted_and_url_prefix():
    for rel in ("tokenizer.json", "tensors/model.layers.0.mlp.down_proj/fwd_packed/c/0/0"):
        assert remote._check_rel(rel) == rel
    assert remote._under("/pub/art/hf/x.json", "/pub/art/", "http://h/pub/art", "hf/x.json")
    with pytest.raises(ArtifactError, match=r"resolves to /pub/art/%2e%2e/x, outside the artifact's URL"):
        remote._under("/pub/art/%2e%2e/x", "/pub/art/", "http://h/pub/art", "../x")


def test_endless_chunk_stops_at_manifest_size(servers, cache):
    """Finding 3: a chunk body that never ends stops as soon as it passes the manifest's size; the
    partial copy is discarded."""
    _, handler, base = servers["main"]
    handler.mode = "endless-chunk"
    t0 = time.monotonic()
    with pytest.raises(ArtifactError, match=rf"^{base}/art: tensors/.*/c/0.*: the server sent more than the \d+ bytes "
                                            "the manifest gives it: stopped there and discarded the copy"):
        open_artifact(f"{base}/art")
    assert time.monotonic() - t0 < 5
    assert not list(cache.rglob("*.part")) and not _final_copies(cache)


def test_endless_manifest_bounded(servers, cache):
    """Finding 4: a manifest body that never ends is cut at 16 MiB with one line."""
    _, handler, base = servers["main"]
    handler.mode = "endless-manifest"
    with pytest.raises(PactError, match=rf"^{base}/art: zarr.json \(the manifest\) is larger than {16 << 20} bytes, "
                                        "not a metadata file: refusing it$"):
        open_artifact(f"{base}/art")


def test_drip_and_stall_fail_fast(servers, cache, monkeypatch):
    """Finding 5: one byte per 0.2 s fails on the rate floor, a server that goes quiet on the stall
    bound; both in about a second here (PACT_FETCH_TIMEOUT / PACT_FETCH_MIN_RATE set low); run
    again resumes."""
    _, handler, base = servers["main"]
    monkeypatch.setenv("PACT_FETCH_TIMEOUT", "0.5")
    monkeypatch.setenv("PACT_FETCH_MIN_RATE", "1000")
    for mode, why in (("drip", r"\d+ bytes in [\d.]+ s, under the 1000 bytes/s floor \(PACT_FETCH_MIN_RATE\)"),
                      ("stall", r"no data for 0.5 s \(PACT_FETCH_TIMEOUT\)")):
        handler.mode = mode
        t0 = time.monotonic()
        with pytest.raises(PactError, match=rf"broke off after \d+ of \d+ bytes \({why}\); run again to resume$"):
            open_artifact(f"{base}/art")
        assert time.monotonic() - t0 < 4, mode
    monkeypatch.setenv("PACT_FETCH_TIMEOUT", "soon")
    with pytest.raises(PactError, match=r"PACT_FETCH_TIMEOUT='soon' is not a number >= 0.001: set it like "
                                        r"PACT_FETCH_TIMEOUT=60"):
        open_artifact(f"{base}/art")
    monkeypatch.delenv("PACT_FETCH_TIMEOUT")
    handler.mode = None
    open_artifact(f"{base}/art").verify()


# --------------------------------------------------------------------------------------
# push


def _push(*args):
    r = CliRunner().invoke(push_cli, [str(a) for a in args])
    if r.exit_code:
        assert r.output.startswith("Error: ") and r.output.strip().count("\n") == 0, r.output
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


@pytest.fixture
def art(www, tmp_path):
    shutil.copytree(www / "art", tmp_path / "art")
    return tmp_path / "art"


def test_push_onto_itself_refused(art, tmp_path, monkeypatch):
    """Finding 6: the source itself (file:// or plain, by a relative path too), a folder inside it
    or one holding it: refused before anything is touched, --overwrite or not."""
    monkeypatch.chdir(tmp_path)
    for dest in (f"file://{art}", str(art), "art", "./art/../art", f"{art}/hf", str(tmp_path)):
        r = _push(art, dest, "--overwrite")
        assert r.exit_code == 1 and "would destroy it; choose a destination outside it" in r.output, (dest, r.output)
    open_artifact(art).verify()


def test_push_into_users_folder_refused(art, tmp_path):
    """Finding 7: a non-empty folder that is not an artifact is refused with or without --overwrite,
    and left exactly as it was; an empty folder is fine; --overwrite replaces an artifact only."""
    user = tmp_path / "dir"
    (user / "hf").mkdir(parents=True)
    (user / "hf" / "tokenizer.json").write_text("mine")
    for flags in ([], ["--overwrite"]):
        r = _push(art, f"file://{user}", *flags)
        assert r.exit_code == 1 and "holding other files, not a pact artifact" in r.output, r.output
    assert sorted(p.relative_to(user).as_posix() for p in user.rglob("*")) == ["hf", "hf/tokenizer.json"]
    assert (user / "hf" / "tokenizer.json").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert _push(art, tmp_path / "empty").exit_code == 0
    assert _push(art, tmp_path / "empty").exit_code == 1
    assert _push(art, tmp_path / "empty", "--overwrite").exit_code == 0
    open_artifact(tmp_path / "empty").verify()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_push_plain_folder_http_and_file(art, tmp_path, monkeypatch):
    """Finding 8: a plain local path is a destination like file://. Finding 9: http(s):// and an
    existing file are refused, one line each."""
    monkeypatch.chdir(tmp_path)
    r = _push(art, "plain/folder")
    assert r.exit_code == 0, r.output
    open_artifact(tmp_path / "plain" / "folder").verify()
    r = _push(art, "http://127.0.0.1:9/art")
    assert r.exit_code == 1 and "http://127.0.0.1:9/art: pact-push writes to a local folder" in r.output
    assert "http(s) is read-only" in r.output
    (tmp_path / "a-file").write_text("x")
    for dest in ("a-file", f"file://{tmp_path}/a-file"):
        r = _push(art, dest)
        assert r.exit_code == 1 and f"{dest} is a file, not a folder" in r.output, r.output
    assert (tmp_path / "a-file").read_text() == "x"


def test_push_hf_offline_and_s3_without_credentials(art, monkeypatch):
    """Finding 10: the Hub offline, and S3 without credentials (its library's error, raised by a
    stand-in filesystem as botocore would: s3fs is not needed), are one line naming the fix."""
    hub = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    r = _push(art, "hf://pact-no-such-org/no-such-repo")
    assert r.exit_code == 1 and r.output.startswith("Error: hf://pact-no-such-org/no-such-repo: could not push (")
    assert "logged in with write access" in r.output and "HF_HUB_OFFLINE must be unset" in r.output

    class NoCredentialsError(Exception):  # botocore.exceptions.NoCredentialsError's name and text
        pass

    class NoCredentials:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise NoCredentialsError("Unable to locate credentials")
            return fail

    monkeypatch.setattr(remote, "_fs", lambda url: (NoCredentials(), "bucket/art"))
    r = _push(art, "s3://bucket/art")
    assert r.exit_code == 1 and r.output.strip() == (
        "Error: s3://bucket/art: could not push (NoCredentialsError: Unable to locate credentials): check the "
        "network, the bucket and your AWS credentials (AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); "
        "no manifest was written there, so readers see no new artifact")


def test_push_disk_full_local(art, tmp_path, monkeypatch):
    """Finding 11, a local destination: the disk fills on the third file; one line, the temp folder
    removed, the destination (absent, or an artifact under --overwrite) as it was."""
    real, calls = shutil.copyfile, []

    def full(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) % 3 == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *a, **k)

    assert _push(art, tmp_path / "old").exit_code == 0
    before = sorted(p.relative_to(tmp_path / "old") for p in (tmp_path / "old").rglob("*"))
    monkeypatch.setattr(shutil, "copyfile", full)
    for dest, flags in ((tmp_path / "new", []), (tmp_path / "old", ["--overwrite"])):
        r = _push(art, dest, *flags)
        assert r.exit_code == 1 and "could not write (the disk is full)" in r.output, r.output
        assert f"nothing at {dest} was changed" in r.output
    monkeypatch.setattr(shutil, "copyfile", real)
    assert not (tmp_path / "new").exists()
    assert sorted(p.relative_to(tmp_path / "old") for p in (tmp_path / "old").rglob("*")) == before
    open_artifact(tmp_path / "old").verify()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("failing", ["hf/zarr.json", "zarr.json"])
def test_push_disk_full_remote(art, monkeypatch, failing):
    """Finding 11, a remote destination (memory://): a metadata write, or the manifest's own, fails
    with a full disk; one line, and no manifest there, so no reader takes it for an artifact."""
    from fsspec.implementations.memory import MemoryFileSystem

    dest = f"memory://pact-red-team/full-{failing.replace('/', '-')}"
    real, real_pipe = MemoryFileSystem.put_file, MemoryFileSystem.pipe_file  # (metadata is written, not copied)
    bad = f"full-{failing.replace('/', '-')}/{failing}"

    def full(self, lpath, rpath, *a, **k):
        if rpath.endswith(bad):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, lpath, rpath, *a, **k)

    def full_pipe(self, path, *a, **k):
        if path.endswith(bad):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pipe(self, path, *a, **k)

    monkeypatch.setattr(MemoryFileSystem, "put_file", full)
    monkeypatch.setattr(MemoryFileSystem, "pipe_file", full_pipe)
    r = _push(art, dest)
    assert r.exit_code == 1 and f"{dest}/{failing}: could not write (the disk is full)" in r.output, r.output
    assert "the manifest was not written, so readers see no artifact there" in r.output
    fs = MemoryFileSystem()
    assert not fs.exists(f"/pact-red-team/full-{failing.replace('/', '-')}/zarr.json")
    with pytest.raises(ArtifactError, match="is missing on the server"):
        open_artifact(dest)
    monkeypatch.setattr(MemoryFileSystem, "put_file", real)
    monkeypatch.setattr(MemoryFileSystem, "pipe_file", real_pipe)
    assert _push(art, dest).exit_code == 0  # a rerun finishes what the failed push left (its marker)
    open_artifact(dest).verify()
    assert not fs.exists(f"/pact-red-team/full-{failing.replace('/', '-')}/{push._MARK}")


def test_push_remote_refuses_other_files(art):
    """Finding 7 for a remote destination: files that are not an artifact are never overwritten."""
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem().pipe_file("/pact-red-team/user/notes.txt", b"mine")
    for flags in ([], ["--overwrite"]):
        r = _push(art, "memory://pact-red-team/user", *flags)
        assert r.exit_code == 1 and "holds other files and is not a pact artifact" in r.output, r.output
    assert MemoryFileSystem().cat_file("/pact-red-team/user/notes.txt") == b"mine"
    assert not MemoryFileSystem().exists("/pact-red-team/user/zarr.json")


def test_file_urls_localhost_and_other_hosts(art, tmp_path, monkeypatch):
    """file://localhost/abs is the local path (RFC 8089), for reading and pushing alike; file://name/p (which
    read as a path would be ./name/p, elsewhere) is refused in one line; a missing folder is said as one."""
    monkeypatch.chdir(tmp_path)
    assert open_artifact(f"file://localhost{art}").fingerprint() == open_artifact(art).fingerprint()
    with pytest.raises(ArtifactError, match=f"no such folder {tmp_path}/missing"):
        open_artifact(f"file://{tmp_path}/missing")
    with pytest.raises(PactError, match="a file:// URL names an absolute path on this machine"):
        open_artifact("file://otherhost/art")
    r = _push(art, f"file://localhost{tmp_path}/pushed")
    assert r.exit_code == 0, r.output
    open_artifact(tmp_path / "pushed").verify()
    r = _push(art, "file://relhost/p")
    assert r.exit_code == 1 and "a file:// URL names an absolute path" in r.output
    assert not (tmp_path / "relhost").exists()
    for url in (f"file://{tmp_path}/p#1", f"file://{tmp_path}/q?x=1"):  # (urlsplit would cut them: p, q)
        r = _push(art, url)
        assert r.exit_code == 1 and "write them as %3F and %23" in r.output, r.output
    assert not (tmp_path / "p").exists() and not (tmp_path / "q").exists()
    r = _push(art, tmp_path / "pushed" / "inner")  # never into another artifact
    assert r.exit_code == 1 and f"is inside the artifact {tmp_path / 'pushed'}" in r.output, r.output


# --------------------------------------------------------------------------------------
# what a fetch copies, and when it checks it


def _files(cache):
    """Everything a fetch left in the cache but folders (a refused fetch leaves nothing)."""
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if not p.is_dir())


@pytest.fixture
def served_copy(www, tmp_path):
    """A copy of the artifact to edit, served: (its folder, the server's handler, its URL)."""
    shutil.copytree(www / "art", tmp_path / "srv" / "art")
    server, handler, base = _serve(tmp_path / "srv")
    yield tmp_path / "srv" / "art", handler, f"{base}/art"
    server.shutdown()


def _edit(art, edit):
    doc = json.loads((art / "zarr.json").read_text())
    edit(doc["attributes"]["pact"])
    (art / "zarr.json").write_text(json.dumps(doc))


_LINK = "a symbolic link inside the artifact: refusing it"
_NORM = "tensors/model.norm.weight"


@pytest.mark.parametrize("where", ["tensors/model.norm.weight/zarr.json", "hf/zarr.json", "notes.txt", "tensors/x",
                                   "fifo"])
def test_file_url_links_and_pipes_refused(art, tmp_path, cache, where):
    """HIGH: a file:// folder is checked as a local artifact before anything is copied: a link (to a
    secret file, or a folder) anywhere in it, named by the manifest or not, or a named pipe, is one
    error naming it; the cache gets nothing, and pact-push publishes nothing."""
    secret = tmp_path / "id_rsa"
    secret.write_text('{"token": "hunter2"}')
    p = art / where
    if where == "fifo":
        os.mkfifo(p)
    else:
        p.unlink(missing_ok=True)
        p.symlink_to(tmp_path if where == "tensors/x" else secret)
    why = "not a regular file" if where == "fifo" else _LINK
    with pytest.raises(ArtifactError, match=rf"^{re.escape(str(p))}: {why}"):
        open_artifact(f"file://{art}")
    r = _push(f"file://{art}", tmp_path / "published")
    assert r.exit_code == 1 and r.output.startswith(f"Error: {p}: {why}"), r.output
    assert not (tmp_path / "published").exists() and _files(cache) == []


@pytest.mark.parametrize("where", [f"{_NORM}/data/c/0", _NORM, "hf/config.json"])
def test_file_url_link_planted_after_check_not_followed(art, tmp_path, cache, monkeypatch, where):
    """HIGH: a link put in after the folder was checked (a race on a shared disk), to a file or a
    folder holding the very bytes the manifest wants, is never followed: one error naming it."""
    real = remote.Artifact

    def check_then_plant(path):
        out = real(path)
        if path == art:
            target = tmp_path / "elsewhere"
            shutil.move(art / where, target)
            (art / where).symlink_to(target)
        return out

    monkeypatch.setattr(remote, "Artifact", check_then_plant)
    with pytest.raises(ArtifactError, match=rf"^{re.escape(str(art / where))}: {_LINK}"):
        open_artifact(f"file://{art}")
    assert _files(cache) == []


def test_fetch_writes_metadata_never_copies_it(served_copy, cache, www):
    """HIGH: no file the manifest's sha256 does not cover comes from the source: every group's and
    array's zarr.json is written from the manifest (the array ones byte for byte the writer's), so
    what a server put in them never reaches the cache; none is even requested."""
    art, handler, url = served_copy
    for f in art.rglob("zarr.json"):
        if f != art / "zarr.json":
            doc = json.loads(f.read_text())
            doc.setdefault("attributes", {})["leak"] = "hunter2"
            f.write_text(json.dumps(doc))
    got = open_artifact(url)
    got.verify()
    assert not [f for f in got.path.rglob("*") if f.is_file() and b"hunter2" in f.read_bytes()]
    assert [p for p in handler.seen if p.endswith("zarr.json")] == ["/art/zarr.json"]
    for f in (www / "art").rglob("zarr.json"):
        if f.parent.name != "hf":  # (the writer's hf/zarr.json carries a descriptive attribute)
            assert (got.path / f.relative_to(www / "art")).read_bytes() == f.read_bytes(), f


def test_declared_size_refused_before_download(served_copy, cache):
    """MEDIUM: a manifest declaring the final norm as 2**29 values (1 GiB) is refused by the config
    check a local open runs, before any tensor data is requested; the cache keeps nothing."""
    art, handler, url = served_copy

    def grow(m):
        e = m["tensors"]["model.norm.weight"]
        e["shape"] = e["arrays"]["data"]["shape"] = [1 << 29]

    _edit(art, grow)
    with pytest.raises(PactError, match=rf"^{url}/hf/config.json: model.norm.weight is \[536870912\] but the "
                                        r"config's hidden_size give \[64\]"):
        open_artifact(url)
    assert not [p for p in handler.seen if "/c/" in p] and _files(cache) == []


def test_manifest_checked_before_any_download(served_copy, cache):
    """MEDIUM: the local open's manifest checks run on the fetched manifest: a 2-D norm is refused
    with only the manifest requested."""
    art, handler, url = served_copy

    def flat(m):
        e = m["tensors"]["model.norm.weight"]
        e["shape"] = e["arrays"]["data"]["shape"] = [8, 8]

    _edit(art, flat)
    with pytest.raises(ArtifactError, match=rf"^{url}/zarr.json: manifest entry 'model.norm.weight' is a norm of "
                                            r"shape \[8, 8\]: a norm has 1 dimension\(s\)"):
        open_artifact(url)
    assert handler.seen == ["/art/zarr.json"] and _files(cache) == []


def test_tensors_larger_than_the_disk_refused(served_copy, cache, monkeypatch):
    """MEDIUM: tensors that would not fit the cache's disk are refused before anything is written."""
    _, handler, url = served_copy
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    with pytest.raises(PactError, match=rf"^{url}: its tensors need 0.00 GiB in {cache}/artifacts, where 0.00 GiB are "
                                        "free: free space, or set PACT_CACHE to a folder on a larger disk$"):
        open_artifact(url)
    assert handler.seen == ["/art/zarr.json"] and _files(cache) == []


def test_refused_download_leaves_nothing(served_copy, cache):
    """MEDIUM: a chunk longer than the manifest's size (a file:// source: refused before a byte
    is read) or with other bytes (http): one error, and the partial copy is removed, lock file and
    all."""
    art, _, url = served_copy
    chunk = art / _NORM / "data" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes() + b"\0\0")
    with pytest.raises(ArtifactError, match=rf"^file://{art}: {_NORM}/data/c/0 is 130 bytes on the server, the "
                                            "manifest says 128"):
        open_artifact(f"file://{art}")
    assert _files(cache) == []
    chunk.write_bytes(b"\1" * 128)
    with pytest.raises(ArtifactError, match=rf"^{url}: {_NORM}/data/c/0: sha256 differs from the manifest's"):
        open_artifact(url)
    assert _files(cache) == []


@pytest.mark.parametrize("names", [["a", "a/b"], ["a/b", "a"], ["zarr.json"]])
def test_manifest_file_and_folder_collide(served_copy, cache, names):
    """LOW: a manifest naming hf/a and hf/a/b (in either order), or an hf/ file where the group's
    zarr.json goes, is one error before any download (not a FileExistsError traceback)."""
    art, handler, url = served_copy
    sha = hashlib.sha256(b"x").hexdigest()
    _edit(art, lambda m: m["files"].update(dict.fromkeys(names, sha)))
    why = "names both 'hf/a' and 'hf/a/b': a file cannot also be a folder;" if len(names) == 2 else \
        "names 'hf/zarr.json' twice:"
    with pytest.raises(ArtifactError, match=rf"^{url}/zarr.json: manifest {why} the artifact is malformed or hostile$"):
        open_artifact(url)
    assert handler.seen == ["/art/zarr.json"] and _files(cache) == []


def test_push_writes_metadata_never_copies_it(art, tmp_path):
    """A local artifact from someone else whose group / array zarr.json (no checksum covers them) carry
    other bytes: pact-push publishes the writer's metadata, not theirs."""
    name = next(p.name for p in (art / "tensors").iterdir() if p.is_dir())
    spots = [art / "hf" / "zarr.json", art / "tensors" / name / "zarr.json"]
    spots.append(next(p for p in (art / "tensors" / name).iterdir() if p.is_dir()) / "zarr.json")
    made = {p: p.read_bytes() for p in spots}
    for p in spots:  # (an array's keeps what the reader checks of it)
        p.write_text(json.dumps({**json.loads(p.read_text()), "attributes": {"HF_TOKEN": "hunter2"}}))
    assert _push(art, tmp_path / "out").exit_code == 0
    for p, data in made.items():
        sent = (tmp_path / "out" / p.relative_to(art)).read_bytes()
        assert b"hunter2" not in sent and (sent == data or p.parent.name == "hf")  # (hf/: a bare group)
    open_artifact(tmp_path / "out").verify()
