"""Red-team findings on artifacts and pact-convert's inputs, one test each: a crafted input is refused
in one line (PactError naming the file / field and the fix), never a traceback, never read as
something else. Helpers and the plain hostile-artifact cases are in test_untrusted.py."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import edit_manifest, make_converted_llama, make_sentiment_jsonl, rehash_artifact
from pact.convert import convert
from pact.formats import ArtifactError, PactError, open_artifact
from pact.formats import nvfp4 as F

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("red_team"), 8)


def _copy(base, tmp_path, what="art"):
    dst = tmp_path / what
    shutil.copytree(base / what, dst, symlinks=True)
    return dst


def _chunk_file(art, name, part):
    d = art / "tensors" / name / part / "c"
    return next(p for p in d.rglob("*") if p.is_file())


def _nothing_written(tmp_path, out="art"):
    return not (tmp_path / out).exists() and not list(tmp_path.glob(f".{out}.*"))


# ---- 1. hub-cache symlinks never smuggle a host file into an artifact


def _snapshot(base, tmp_path):
    """<repo>/snapshots/abc holding the model's files as real files (a local model laid out like the cache)."""
    repo = tmp_path / "m"
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for f in (base / "src").iterdir():
        shutil.copyfile(f, snap / f.name)
    return repo, snap


def test_hub_cache_blobs_linked_out_is_refused(base, tmp_path):
    """m/blobs -> / and added_tokens.json -> ../../blobs/etc/passwd: the file resolves "inside blobs/",
    but blobs/ itself leads out of the repo, so it is not the repo's own store: refused, naming it."""
    repo, snap = _snapshot(base, tmp_path)
    os.symlink("/", repo / "blobs")
    os.symlink("../../blobs/etc/passwd", snap / "added_tokens.json")
    with pytest.raises(PactError, match=r"snapshots/abc/added_tokens.json: a link to /etc/passwd, outside the model "
                                        r"folder: refusing it"):
        convert(str(snap), tmp_path / "art", progress=False)
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("name", ["added_tokens.json", "model.safetensors", "config.json"])
def test_links_out_of_a_model_folder_are_refused(base, tmp_path, name):
    """A side file, the weights or the config linked to a file outside the folder (and outside a real
    blobs/): refused before anything is read from it."""
    repo, snap = _snapshot(base, tmp_path)
    (repo / "blobs").mkdir()
    outside = tmp_path / "host" / name
    outside.parent.mkdir()
    shutil.copyfile(base / "src" / name if (base / "src" / name).exists() else "/etc/passwd", outside)
    (snap / name).unlink(missing_ok=True)
    os.symlink(outside, snap / name)
    with pytest.raises(PactError, match=rf"abc/{name}: a link to .*host/{name}, outside the model folder or its hub "
                                        r"cache's blobs/"):
        convert(str(snap), tmp_path / "art", progress=False)
    assert _nothing_written(tmp_path)


def test_links_into_the_repos_own_blobs_are_followed(base, tmp_path):
    repo, snap = _snapshot(base, tmp_path)
    (repo / "blobs").mkdir()
    for f in list(snap.iterdir()):
        shutil.move(f, repo / "blobs" / f.name)
        os.symlink(f"../../blobs/{f.name}", f)
    art = open_artifact(convert(str(snap), tmp_path / "art", progress=False))
    assert art.verify() > 0 and (art.hf_dir / "tokenizer.json").is_file()


# ---- 2. manifest metadata that disagrees with the bytes is refused on open


def _array(name, part):
    return lambda m: m["tensors"][name]["arrays"][part]


@pytest.mark.parametrize("edit,match", [
    # e4m3 block scales declared uint8: the same file, read as raw bytes instead of scales
    (lambda m: _array(Q, "fwd_scales")(m).update(dtype="uint8"),
     r"fwd_scales is uint8 \[64, 4\], where an NVFP4 \[N, K\] = \[64, 64\] stores float8_e4m3fn \[64, 4\]"),
    (lambda m: _array(Q, "bwd_packed")(m).update(dtype="float8_e4m3fn"), r"bwd_packed is float8_e4m3fn"),
    (lambda m: _array(Q, "fwd_packed")(m).update(shape=[32, 64]), r"fwd_packed is uint8 \[32, 64\]"),
    (lambda m: m["tensors"][Q].update(shape=[64, 128]),
     r"fwd_packed is uint8 \[64, 32\], where an NVFP4 \[N, K\] = \[64, 128\]"),
    (lambda m: m["tensors"][Q]["arrays"].pop("bwd_scales"), r"has arrays .* not \['bwd_packed'"),
    (lambda m: _array(NORM, "data")(m).update(dtype="float32", shape=[32]),
     r"array model.norm.weight/data is float32 \[32\]"),
    (lambda m: m["tensors"][NORM].update(dtype="float32"), r"entry dtype 'float32'"),
    (lambda m: m["tensors"][NORM].update(kind="nvfp4"), r"is stored NVFP4 but is a norm"),
    (lambda m: m["tensors"][Q].update(block_size=32), r"block_size 32"),
])
def test_arrays_must_be_what_their_role_stores(base, tmp_path, edit, match):
    art = _copy(base, tmp_path)
    edit_manifest(art, edit)
    with pytest.raises(ArtifactError, match=r"zarr.json: manifest .*" + match):
        open_artifact(art)


def test_array_metadata_that_disagrees_with_the_manifest(base, tmp_path):
    """The array's own zarr.json says another data type (uint16 over the same bytes): not mapped."""
    art = _copy(base, tmp_path)
    zj = art / "tensors" / Q / "fwd_scales" / "zarr.json"
    doc = json.loads(zj.read_text())
    doc.update(data_type="uint16", shape=[64, 2])
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [64, 2]
    zj.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r"fwd_scales: not a single-chunk uncompressed array of float8_e4m3fn"):
        open_artifact(art).verify()


# ---- 3. non-finite scales and values never reach training or scoring


@pytest.mark.parametrize("g", [float("nan"), float("inf"), 0.0, -1.0, 1e39, "0.5", True])
def test_bad_global_scale_is_refused_on_open(base, tmp_path, g):
    art = _copy(base, tmp_path)
    edit_manifest(art, lambda m: m["tensors"][Q].update(global_scale=g))
    with pytest.raises(ArtifactError, match=r"has global_scale .* \(a finite float32 > 0\)"):
        open_artifact(art)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])  # E4M3 NaN: S.1111.111
def test_nan_block_scales_are_refused_by_verification(base, tmp_path, byte):
    art = _copy(base, tmp_path)
    chunk = _chunk_file(art, Q, "bwd_scales")
    b = bytearray(chunk.read_bytes())
    b[7] = byte
    chunk.write_bytes(bytes(b))
    rehash_artifact(art)  # consistent checksums: as a faulty or hostile converter would write it
    with pytest.raises(ArtifactError, match=rf"bwd_scales/c/0/0: {Q} \(bwd_scales\) holds 1 NaN block scales"):
        open_artifact(art).verify()


@pytest.mark.parametrize("bits", [0x7FC0, 0x7F80, 0xFF80])  # bf16 NaN, +Inf, -Inf
def test_non_finite_dense_values_are_refused_by_verification(base, tmp_path, bits):
    art = _copy(base, tmp_path)
    chunk = _chunk_file(art, "model.embed_tokens.weight", "data")
    b = bytearray(chunk.read_bytes())
    b[10:12] = struct.pack("<H", bits)
    chunk.write_bytes(bytes(b))
    rehash_artifact(art)
    with pytest.raises(ArtifactError, match=r"model.embed_tokens.weight \(data\) holds 1 NaN/Inf values"):
        open_artifact(art).verify()


def test_a_stamp_from_an_older_verify_does_not_skip_the_scan(base, tmp_path):
    """An artifact stamped as verified by a pact whose verify() did not look for NaN is verified again."""
    import hashlib

    from pact.formats import artifact as A

    path = _copy(base, tmp_path)
    chunk = _chunk_file(path, Q, "fwd_scales")
    chunk.write_bytes(b"\x7f" * chunk.stat().st_size)
    rehash_artifact(path)
    art = open_artifact(path)
    parts = [art.fingerprint()]  # the stamp as it was made before _VERIFY_CHECKS
    parts += [A._stat_key(A._chunk_path(path / s["path"], len(s["shape"])))
              for e in art.meta["tensors"].values() for s in e["arrays"].values()]
    parts += [A._stat_key(art.hf_dir / rel) for rel in art.meta["files"]]
    old = tmp_path / "cache" / "verified" / hashlib.sha256("\n".join(parts).encode()).hexdigest()
    old.parent.mkdir(parents=True)
    old.write_text(str(path))
    with pytest.raises(ArtifactError, match="NaN block scales"):
        art.verify_cached(tmp_path / "cache")



def test_bytes_changed_with_the_mtime_put_back_are_verified_again(base, tmp_path):
    """The verified stamp keys on more than size and mtime: a chunk rewritten in place with its
    modification time restored (os.utime, cp -p over it) is checked again, not trusted."""
    path = _copy(base, tmp_path)
    assert open_artifact(path).verify_cached(tmp_path / "cache")
    assert not open_artifact(path).verify_cached(tmp_path / "cache")  # unchanged: the stamp holds
    chunk = _chunk_file(path, Q, "fwd_scales")
    st = chunk.stat()
    with open(chunk, "r+b") as f:
        f.write(b"\x7f" * 16)
    os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        open_artifact(path).verify_cached(tmp_path / "cache")

def test_eval_never_scores_nan_scales(base, tmp_path, monkeypatch):
    """pact-eval verifies before it scores: an artifact with NaN block scales is one line, not a score."""
    from click.testing import CliRunner

    from pact.pipelines.eval import main as eval_cli

    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    art = _copy(base, tmp_path)
    chunk = _chunk_file(art, Q, "fwd_scales")
    chunk.write_bytes(b"\x7f" * chunk.stat().st_size)
    rehash_artifact(art)
    data = make_sentiment_jsonl(tmp_path / "d.jsonl", 4)
    r = CliRunner().invoke(eval_cli, [str(art), "--data", str(data), "--max-len", "32"])
    assert r.exit_code == 1 and "NaN block scales" in r.output and "Traceback" not in r.output, r.output


# ---- 4. safetensors headers are checked as safetensors checks them


def _rewrite_header(f, edit):
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    data = edit(header, data) or data
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _offsets(h, name):
    return h[name]["data_offsets"]


@pytest.mark.parametrize("edit,match", [
    # the norm's bytes read as the next tensor's too
    (lambda h, d: h["model.norm.weight"].update(
        data_offsets=list(_offsets(h, "model.layers.1.post_attention_layernorm.weight"))),
     r"starts at byte \d+ of the data, where the tensor before it ends at \d+ \(overlapping or out of order\)"),
    # a gap: the tensor after it starts late
    (lambda h, d: h["model.norm.weight"].update(data_offsets=[o + 2 for o in _offsets(h, "model.norm.weight")]),
     r"model.norm.weight starts at byte .*\(overlapping or out of order\)"),
    (lambda h, d: h["model.norm.weight"].update(dtype="F32"),
     r"model.norm.weight has 128 bytes for F32 \[64\] \(256 bytes\)"),
    (lambda h, d: h["model.norm.weight"].update(shape=[32]),
     r"model.norm.weight has 128 bytes for BF16 \[32\] \(64 bytes\)"),
    (lambda h, d: h["model.norm.weight"].update(shape=[-64]), r"model.norm.weight has shape \[-64\]"),
    (lambda h, d: h["model.norm.weight"].update(data_offsets=[128, 0]), r"has data_offsets \[128, 0\]"),
    (lambda h, d: h["model.norm.weight"].update(dtype="I4"),
     r"model.norm.weight has dtype 'I4', which pact does not read"),
    (lambda h, d: d[:-64], r"tensors end past the end of the file \(truncated\)"),
    (lambda h, d: d + b"\0" * 64, r"covers \d+ bytes of \d+ after it \(trailing data\)"),
])
def test_crafted_safetensors_header_is_refused(base, tmp_path, edit, match):
    src = _copy(base, tmp_path, "src")
    f = src / "model.safetensors"
    _rewrite_header(f, edit)
    with pytest.raises(Exception):  # safetensors itself refuses the file too
        load_file(f)
    with pytest.raises(PactError, match=r"model.safetensors: .*" + match):
        convert(str(src), tmp_path / "art", progress=False)
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("header,match", [
    (b"[1, 2]", r"header is not an object"),
    (b"[" * 100000 + b"]" * 100000, r"nested too deeply"),
    (b'{"a": \xff}', r"utf-8"),
    (b'{"x": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "x": {}}', r"key 'x' appears twice"),
])
def test_unreadable_safetensors_header_is_one_line(base, tmp_path, header, match):
    src = _copy(base, tmp_path, "src")
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(PactError, match=r"model.safetensors: not a readable safetensors file .*" + match):
        convert(str(src), tmp_path / "art", progress=False)


def test_huge_header_length_is_refused(base, tmp_path):
    src = _copy(base, tmp_path, "src")
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(PactError, match=r"model.safetensors: not a readable safetensors file \(header length"):
        convert(str(src), tmp_path / "art", progress=False)


def test_a_tensor_in_two_shards_is_refused(base, tmp_path):
    src = _copy(base, tmp_path, "src")
    save_file({"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}, src / "model-extra.safetensors")
    with pytest.raises(PactError, match=r"model.safetensors: model.norm.weight is also in model-extra.safetensors"):
        convert(str(src), tmp_path / "art", progress=False)


# ---- 5. manifest fields missing or of the wrong type: one line on open


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("family"), r"has no 'family' str"),
    (lambda m: m.update(family=3), r"has no 'family' str"),
    (lambda m: m.pop("provenance"), r"has no 'provenance' dict"),
    (lambda m: m.update(provenance=[]), r"has no 'provenance' dict"),
    (lambda m: m["provenance"].pop("scaling"), r"provenance has 'scaling' None"),
    (lambda m: m["provenance"].update(source=None), r"provenance has 'source' None"),
    (lambda m: m["provenance"].update(block_scales="max"), r"provenance has 'block_scales' 'max'"),
    (lambda m: m.update(vision="no"), r"has no 'vision' bool"),
    (lambda m: m.update(architecture=["LlamaForCausalLM"]), r"has 'architecture' \['LlamaForCausalLM'\]"),
    (lambda m: m["tensors"][Q].pop("role"), r"entry '.*q_proj.weight' has no 'role' str"),
    (lambda m: m["tensors"][Q].update(role="k_proj"), r"has role 'k_proj', .* but its name makes it 'q_proj'"),
    (lambda m: m["tensors"][Q].update(layer=1), r"has role 'q_proj', layer 1, .* makes it 'q_proj', 0"),
    (lambda m: m["tensors"][Q].update(group="layers.0.o"), r"group 'layers.0.o'.*'layers.0.qkv'"),
    (lambda m: m["tensors"][Q].update(shape=[64, 4, 16]), r"is NVFP4 of shape \[64, 4, 16\]"),
    (lambda m: m["tensors"][Q].update(shape=[64, True]), r"has shape \[64, True\]"),
    (lambda m: m["tensors"][NORM].update(shape=[1, 1, 64]), r"is a norm of shape \[1, 1, 64\]: a norm has 1"),
    (lambda m: [x.update(shape=[2**40, 2**40]) for x in (m["tensors"][NORM], _array(NORM, "data")(m))],
     r"\d+ bytes, more than any model's array \(the byte count overflows int64\)"),
    (lambda m: _array(Q, "fwd_packed")(m).update(sha256="zz"), r"has sha256 'zz'"),
    (lambda m: m["files"].update({"config.json": 7}), r"file 'config.json' has sha256 7"),
    (lambda m: m["tensors"].update({Q: []}), r"entry '.*q_proj.weight' is not an object"),
    (lambda m: m["tensors"][Q]["arrays"].update(fwd_packed="x"), r"array .*fwd_packed is not an object"),
])
def test_manifest_fields_are_checked_on_open(base, tmp_path, edit, match):
    art = _copy(base, tmp_path)
    edit_manifest(art, edit)
    with pytest.raises(ArtifactError, match=r"zarr.json: manifest (.*)?" + match + ".*re-run pact-convert"):
        open_artifact(art)


def test_array_path_must_be_its_own(base, tmp_path):
    """Two arrays naming one file (the scales read as another tensor's): refused."""
    art = _copy(base, tmp_path)
    edit_manifest(art, lambda m: _array(Q, "bwd_scales")(m).update(path=f"tensors/{Q}/fwd_scales"))
    with pytest.raises(ArtifactError, match=r"bwd_scales has path .*fwd_scales', not tensors/.*/bwd_scales"):
        open_artifact(art)


# ---- 6. malformed JSON: one line naming the file


BAD_JSON = {
    "deep": (b"[" * 100000 + b"]" * 100000, r"JSON nested too deeply to read"),
    "deep-but-parseable": (b"[" * 200 + b"]" * 200, r"JSON nested deeper than 100 levels"),
    "latin-1": ('{"name": "caf\xe9"}'.encode("latin-1"), r"not UTF-8 text \(byte 13 is 0xe9\)"),
    "nul": (b'{"a": 1}\x00\x00', r"not valid JSON \(Extra data"),
    "nul-in-string": (b'{"a": "x\x00y"}', r"not valid JSON \(Invalid control character"),
}


@pytest.mark.parametrize("kind", sorted(BAD_JSON))
@pytest.mark.parametrize("rel", ["zarr.json", "hf/tokenizer.json", "hf/config.json", f"tensors/{NORM}/data/zarr.json"])
def test_malformed_json_in_an_artifact(base, tmp_path, rel, kind):
    art = _copy(base, tmp_path)
    data, match = BAD_JSON[kind]
    (art / rel).write_bytes(data)
    with pytest.raises(ArtifactError, match=rf"{rel}: " + match):
        open_artifact(art).verify()


@pytest.mark.parametrize("kind", sorted(BAD_JSON))
@pytest.mark.parametrize("rel", ["config.json", "tokenizer.json"])
def test_malformed_json_in_a_source(base, tmp_path, rel, kind):
    src = _copy(base, tmp_path, "src")
    data, match = BAD_JSON[kind]
    (src / rel).write_bytes(data)
    with pytest.raises(PactError, match=rf"src/{rel}: " + match):
        convert(str(src), tmp_path / "art", progress=False)
    assert _nothing_written(tmp_path)


def test_oversized_json_is_refused_unread(base, tmp_path, monkeypatch):
    from pact.formats import files

    art = _copy(base, tmp_path)
    monkeypatch.setattr(files, "JSON_MAX", 1000)  # read_json's bound
    with pytest.raises(ArtifactError, match=r"art/zarr.json: \d+ bytes, more than the 1000 bytes a JSON metadata file"):
        open_artifact(art)


def test_malformed_manifest_on_the_cli_is_one_line(base, tmp_path):
    from click.testing import CliRunner

    from pact.pipelines.train import main as train_cli

    art = _copy(base, tmp_path)
    (art / "zarr.json").write_bytes(b"[" * 100000)
    data = make_sentiment_jsonl(tmp_path / "d.jsonl", 4)
    r = CliRunner().invoke(train_cli, [str(art), "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1"])
    assert (r.exit_code == 1 and "zarr.json: JSON nested too deeply" in r.output
            and "Traceback" not in r.output), r.output


# ---- 7. a config the forward cannot be built from is refused on open and at convert


CONFIG_EDITS = [
    (lambda c: c.update(hidden_size=96), r"is \[\d+, 64\] but the config's .*hidden_size.* give"),
    (lambda c: (c.pop("head_dim"), c.update(num_attention_heads=5)),
     r"'num_attention_heads' is 5, which does not divide hidden_size 64"),
    (lambda c: c.update(num_attention_heads=8),  # q_proj or o_proj, whichever is listed first
     r"[qo]_proj.weight is \[64, 64\] but the config's .*num_attention_heads x head_dim.* give \[(128, 64|64, 128)\]"),
    (lambda c: c.update(num_key_value_heads=3),
     r"'num_key_value_heads' is 3, which does not divide num_attention_heads 4"),
    (lambda c: c.update(num_key_value_heads=0), r"'num_key_value_heads' is 0, not a positive integer"),
    (lambda c: c.update(head_dim=15), r"'head_dim' is 15, odd"),
    (lambda c: c.update(intermediate_size=-128), r"'intermediate_size' is missing or not a positive integer"),
    (lambda c: c.update(vocab_size=0), r"'vocab_size' is 0, not a positive integer"),
    (lambda c: c["rope_parameters"].update(rope_theta=-1.0),
     r"'rope_parameters.rope_theta' is -1.0, not a finite number > 0"),
    (lambda c: c["rope_parameters"].update(rope_theta=0), r"'rope_parameters.rope_theta' is 0, not a finite number"),
    (lambda c: c.update(rope_theta=float("nan")), r"'rope_theta' is nan, not a finite number > 0"),
    (lambda c: c.update(rope_parameters="fast"), r"'rope_parameters' is 'fast', not an object"),
    (lambda c: c.update(rms_norm_eps=-1e-6), r"'rms_norm_eps' is -1e-06, not a finite number > 0"),
    (lambda c: c.update(num_hidden_layers=10**12),
     r"num_hidden_layers is 1000000000000 but the weights hold \d+ tensors"),
    (lambda c: c.update(sliding_window=0), r"'sliding_window' is 0, not a positive integer or null"),
    (lambda c: c.update(query_pre_attn_scalar=-4), r"'query_pre_attn_scalar' is -4, not a positive number"),
    (lambda c: c.update(layer_types=["full_attention"]),
     r"'layer_types' must list full_attention or sliding_attention for each of the \d+ layers"),
]


@pytest.mark.parametrize("edit,match", CONFIG_EDITS)
def test_config_values_are_checked_on_open(base, tmp_path, edit, match):
    art = _copy(base, tmp_path)
    c = json.loads((art / "hf" / "config.json").read_text())
    edit(c)
    (art / "hf" / "config.json").write_text(json.dumps(c))
    rehash_artifact(art)
    with pytest.raises(PactError, match=r"hf/config.json: .*" + match + ".*restore the model's own config.json"):
        open_artifact(art)


@pytest.mark.parametrize("edit,match", CONFIG_EDITS[::2] + [
    (lambda c: c.update(architectures=7), r"'architectures' is 7, not a list of class names"),
    (lambda c: c.update(model_type=["llama"]), r"'model_type' is \['llama'\], not a name"),
])
def test_config_values_are_checked_at_convert(base, tmp_path, edit, match):
    src = _copy(base, tmp_path, "src")
    c = json.loads((src / "config.json").read_text())
    edit(c)
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(PactError, match=r"src/config.json: .*" + match):
        convert(str(src), tmp_path / "art", progress=False)
    assert _nothing_written(tmp_path)


def test_config_not_an_object(base, tmp_path):
    art = _copy(base, tmp_path)
    (art / "hf" / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(PactError, match=r"hf/config.json: not a JSON object of the model's sizes"):
        open_artifact(art)


# ---- 8. an NVFP4 checkpoint whose parts do not fit each other or the config: refused at import


def _write_ct(src, dst):
    """``src`` as a compressed-tensors nvfp4-pack-quantized checkpoint, written with pact's own
    quantizer (the layout is what matters here: packed uint8 [N, K/2], e4m3 [N, K/16], fp32 1/g)."""
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    out = {}
    for name, w in sd.items():
        if name.endswith("_proj.weight"):
            t = F.quantize(w.float(), global_scale=F.global_scale_from_amax(w.float().abs().amax()))
            base = name.removesuffix(".weight")
            out[f"{base}.weight_packed"] = t.packed
            out[f"{base}.weight_scale"] = t.scales
            out[f"{base}.weight_global_scale"] = (1.0 / t.global_scale).reshape(1).float()
        else:
            out[name] = w
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, dst / f)


@pytest.fixture(scope="module")
def ct(base):
    _write_ct(base / "src", base / "ct")
    return base / "ct"


O_PROJ = "model.layers.1.self_attn.o_proj"


def test_consistent_ct_checkpoint_imports(ct, tmp_path):
    art = open_artifact(convert(str(ct), tmp_path / "art", progress=False))
    assert art.entry(f"{O_PROJ}.weight")["imported"] == "compressed-tensors"  # a group of one: codes kept as stored


@pytest.mark.parametrize("edit,match", [
    # K from the codes is 64, but the scales hold 2 groups a row (K = 32)
    (lambda sd: sd.update({f"{O_PROJ}.weight_scale": sd[f"{O_PROJ}.weight_scale"][:, :2].contiguous()}),
     rf"{O_PROJ}.weight's NVFP4 parts are not compressed-tensors's NVFP4 layout \(packed torch.uint8 \[64, 32\], "
     r"scales torch.float8_e4m3fn \[64, 2\]"),
    (lambda sd: sd.update({f"{O_PROJ}.weight_packed": sd[f"{O_PROJ}.weight_packed"][:, :12].contiguous(),  # K = 24
                           f"{O_PROJ}.weight_scale": sd[f"{O_PROJ}.weight_scale"][:, :1].contiguous()}),
     r"packed torch.uint8 \[64, 12\]"),
    (lambda sd: sd.update({f"{O_PROJ}.weight_packed": sd[f"{O_PROJ}.weight_packed"].reshape(64, 32, 1)}),
     r"packed torch.uint8 \[64, 32, 1\]"),
    (lambda sd: sd.update({f"{O_PROJ}.weight_global_scale": torch.ones(2)}), r"global scale torch.float32 \[2\]"),
    (lambda sd: sd.update({f"{O_PROJ}.weight_packed": sd[f"{O_PROJ}.weight_packed"].view(torch.int8)}),
     r"packed torch.int8"),
    # codes and scales agree with each other (K = 128), but the config's hidden_size is 64
    (lambda sd: sd.update({f"{O_PROJ}.weight_packed": sd[f"{O_PROJ}.weight_packed"].repeat(1, 2),
                           f"{O_PROJ}.weight_scale": sd[f"{O_PROJ}.weight_scale"].repeat(1, 2)}),
     rf"config.json: {O_PROJ}.weight is \[64, 128\] but the config's hidden_size, "
     r"num_attention_heads x head_dim give \[64, 64\]"),
    (lambda sd: sd.update({f"{O_PROJ}.weight_packed": sd[f"{O_PROJ}.weight_packed"][:32].contiguous(),
                           f"{O_PROJ}.weight_scale": sd[f"{O_PROJ}.weight_scale"][:32].contiguous()}),
     rf"{O_PROJ}.weight is \[32, 64\] but the config's hidden_size"),
])
def test_inconsistent_ct_checkpoint_is_refused_at_import(ct, tmp_path, edit, match):
    bad = tmp_path / "ct"
    shutil.copytree(ct, bad)
    sd = load_file(bad / "model.safetensors")
    edit(sd)
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PactError, match=match):
        convert(str(bad), tmp_path / "art", progress=False)
    assert _nothing_written(tmp_path)


def test_is_artifact_reads_zarr_json_as_metadata(tmp_path):
    """What --overwrite and pact-push's destination check read: a pipe or a deeply nested zarr.json is no
    artifact (False at once), never a hang or a RecursionError."""
    from pact.formats.layout import is_artifact

    deep, pipe = tmp_path / "deep", tmp_path / "pipe"
    deep.mkdir()
    pipe.mkdir()
    (deep / "zarr.json").write_text("[" * 200_000 + "]" * 200_000)
    os.mkfifo(pipe / "zarr.json")
    assert not is_artifact(deep) and not is_artifact(pipe)


@pytest.mark.parametrize("change", [{"architectures": ["Gemma3ForCausalLM"]},
                                    {"architectures": None, "model_type": "gemma3_text"},
                                    {"architectures": "LlamaForCausalLM"}])
def test_a_config_of_another_family_is_refused(base, tmp_path, change):
    """hf/config.json naming another family than the manifest's (a gemma3_text config under family llama ran as
    Llama: its norms, activation and embedding scale were Llama's), or naming none in a readable form: refused
    at open, naming the file and both families."""
    art = _copy(base, tmp_path)
    f = art / "hf" / "config.json"
    cfg = {k: v for k, v in json.loads(f.read_text()).items() if k not in change or change[k] is not None}
    cfg.update({k: v for k, v in change.items() if v is not None})
    f.write_text(json.dumps(cfg))
    rehash_artifact(art)
    with pytest.raises(PactError, match=r"hf/config.json: describes a (gemma3|different) model \(.*\), the manifest a "
                                        r"llama one: the artifact is damaged or crafted"):
        open_artifact(art)
