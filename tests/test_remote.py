"""Artifacts at URLs: served by a loopback HTTP server started here (the standard library's, with
ranges, and modes that corrupt a byte or cut a response short), fetched through fsspec into the
content-addressed cache; pushed to an fsspec destination, manifest last."""

import http.server
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import make_model, make_sentiment_jsonl
from pact.convert import convert
from pact.formats import ArtifactError, PactError, open_artifact

pytest.importorskip("aiohttp")


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Files under the server's root, with single byte ranges. ``mode``: None; "corrupt" flips one
    byte of every chunk; "cut" sends half of each chunk, then closes; "missing" 404s chunks."""

    mode = None
    root = "."
    ranges: list = []  # (path, first byte) of every ranged GET
    log_message = lambda *a: None  # noqa: E731

    def translate_path(self, path):
        return os.path.join(self.root, path.split("?", 1)[0].lstrip("/"))

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        chunk = "/c/" in self.path
        if not path.is_file() or (chunk and self.mode == "missing"):
            self.send_error(404)
            return
        data = path.read_bytes()
        if chunk and self.mode == "corrupt":
            data = bytes([data[0] ^ 1]) + data[1:]
        start, end = 0, len(data) - 1
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            self.ranges.append((self.path, int(a or 0)))
            start, end = int(a or 0), min(int(b) if b else len(data) - 1, len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start : end + 1]
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if chunk and self.mode == "cut" and len(body) > 64:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            time.sleep(0.5)  # the half is read before the connection drops (else the client may see none of it)
            self.connection.shutdown(2)
            return
        self.wfile.write(body)

    def do_HEAD(self):
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    make_model(d / "src", "llama")
    convert(str(d / "src"), d / "www" / "art", progress=False)
    handler = type("H", (_Handler,), {"root": str(d / "www")})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield d, f"http://127.0.0.1:{server.server_address[1]}/art", handler
    server.shutdown()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fetch_train_and_reuse(served, cache, tmp_path):
    """pact-train on an http:// artifact: fetched once into the cache (every chunk checked), memory-mapped
    from there; a second open reads the cache without the server."""
    from pact.runtime.trainer import TrainConfig, train

    d, url, handler = served
    handler.mode = None
    art = open_artifact(url + "/")
    assert art.url == url + "/" and art.path.parent == cache / "artifacts"
    local = open_artifact(d / "www" / "art")
    for name in local.names("nvfp4"):
        assert torch.equal(art.nvfp4(name).packed, local.nvfp4(name).packed)
    art.verify()
    assert not list((cache / "artifacts").glob("*.partial"))
    make_sentiment_jsonl(tmp_path / "train.jsonl", 16)
    r = train(TrainConfig(artifact=url, data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"), steps=1,
                          batch_size=4, max_len=64), progress=False)
    assert r["step"] == 1
    handler.mode = "missing"  # the cached copy needs nothing from the server
    try:
        assert open_artifact(url).path == art.path
    finally:
        handler.mode = None


def test_corrupt_and_cut_downloads(served, cache):
    """A wrong byte: one error naming the URL and the array, the bad copy dropped. A response cut
    short: one error saying how far it got; run again and it resumes to a complete, checked copy.
    Nothing under the final name until the copy is complete."""
    d, url, handler = served
    handler.mode = "corrupt"
    try:
        with pytest.raises(ArtifactError, match=r"http://127\.0\.0\.1:\d+/art: tensors/.*/c/0.*: sha256 differs"):
            open_artifact(url)
        handler.mode = "cut"
        with pytest.raises(PactError, match=r"the download broke off after \d+ of \d+ bytes .*run again to resume"):
            open_artifact(url)
    finally:
        handler.mode = None
    assert [p.name.endswith(".partial") for p in (cache / "artifacts").iterdir() if p.is_dir()] == [True]
    part = next((cache / "artifacts").glob("*.partial/**/*.part"))
    cut_at = part.stat().st_size
    cut_path = "/art/" + str(part.relative_to(next((cache / "artifacts").glob("*.partial"))))
    assert cut_at > 0
    handler.ranges.clear()
    art = open_artifact(url)  # resumes: the cut chunk from its last byte (a range request)
    art.verify()
    assert (cut_path.removesuffix(".part"), cut_at) in handler.ranges
    handler.mode = "missing"
    try:
        import shutil

        shutil.rmtree(cache / "artifacts")
        with pytest.raises(ArtifactError, match="is missing on the server"):
            open_artifact(url)
    finally:
        handler.mode = None


def test_concurrent_fetches_share_one_download(served, cache):
    d, url, handler = served
    handler.mode = None
    out = []
    threads = [threading.Thread(target=lambda: out.append(open_artifact(url).path)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1 and len(out) == 3


def test_bad_urls_and_newer_format(served, cache, tmp_path):
    d, url, handler = served
    with pytest.raises(ArtifactError, match="zarr.json \\(the manifest\\) is missing on the server"):
        open_artifact(url.rsplit("/", 1)[0] + "/nothing-here")
    with pytest.raises(PactError, match="pact reads artifacts from"):
        open_artifact("ftp://example.com/art")
    newer = d / "www" / "newer"
    import shutil

    shutil.copytree(d / "www" / "art", newer)
    doc = json.loads((newer / "zarr.json").read_text())
    doc["attributes"]["pact"]["format_version"] = 99
    (newer / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="version 99 is newer than this pact reads .*upgrade pact"):
        open_artifact(url.rsplit("/", 1)[0] + "/newer")
    evil = d / "www" / "evil"  # a manifest naming a file outside the folder is refused before any download
    shutil.copytree(d / "www" / "art", evil)
    doc = json.loads((evil / "zarr.json").read_text())
    name = next(iter(doc["attributes"]["pact"]["tensors"]))
    arrays = doc["attributes"]["pact"]["tensors"][name]["arrays"]
    arrays["data" if "data" in arrays else "fwd_packed"]["path"] = "../../outside"
    (evil / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        open_artifact(url.rsplit("/", 1)[0] + "/evil")
    # s3:// and hf:// get as far as the network, then one line (no network here)
    for bad in ("s3://pact-no-such-bucket-xyz/art", "hf://pact-no-such-org/no-such-repo"):
        with pytest.raises(PactError, match=rf"{bad.split(':')[0]}://"):
            open_artifact(bad)


def test_push_then_fetch(served, cache, tmp_path):
    """pact-push to an fsspec destination (a local file:// folder here), manifest last; the pushed
    artifact opens by URL and equals the original."""
    from click.testing import CliRunner

    from pact.pipelines.push import main as push_cli

    d, _, _ = served
    dest = f"file://{tmp_path}/pushed"
    r = CliRunner().invoke(push_cli, [str(d / "www" / "art"), dest])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "pushed" / "zarr.json").is_file()
    art = open_artifact(dest)
    art.verify()
    r = CliRunner().invoke(push_cli, [str(d / "www" / "art"), dest])
    assert r.exit_code != 0 and "already holds an artifact" in r.output


def test_room_is_counted_while_another_fetch_renames(tmp_path, monkeypatch):
    """_check_room counts an interrupted copy outside the fetch's lock: a file another thread renames meanwhile
    (a concurrent fetch of the same artifact raised FileNotFoundError from here) counts as gone, not as an error."""
    from pact.formats import remote

    part = tmp_path / "x.partial"
    (part / "hf").mkdir(parents=True)
    (part / "hf" / "a.json.part").write_bytes(b"x" * 10)
    (part / "hf" / "b.json").write_bytes(b"y" * 5)
    real = Path.stat

    def racing(self, **kw):
        if self.name == "a.json.part":
            raise FileNotFoundError(self)
        return real(self, **kw)

    monkeypatch.setattr(Path, "stat", racing)
    remote._check_room(tmp_path, part, [("t", "s", 100)], "http://h/art")  # needs 95 bytes: no error
