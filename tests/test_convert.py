"""pact-convert -> open_artifact -> dequantize, on tiny random models; bad input; zero-copy."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from conftest import make_model
from pact.convert import convert
from pact.formats import ArtifactError, PactError, open_artifact
from pact.formats import nvfp4 as F
from pact.pipelines.convert import main as convert_cli


def _source_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _check_against_source(art, src, scaling):
    for name, w in src.items():
        e = art.entry(name)
        if e["kind"] == "dense":
            assert torch.equal(art.dense(name), w.to(torch.bfloat16)), name
            continue
        w = w.float()
        fwd = art.dequantize(name, "fwd")
        bwd = art.dequantize(name, "bwd")
        assert fwd.shape == w.shape and bwd.shape == w.t().shape
        # Within half a grid step of each element's own block: |w - w_hat| <= s_b * g (see test_nvfp4)
        step = (art.nvfp4(name).scales.float() * e["global_scale"]).repeat_interleave(16, 1)
        assert bool(((w - fwd).abs() <= step * (1 + 1e-6)).all()), name
        assert F.sqnr_db(w, fwd) > 15, name  # ~20 dB on Gaussian init; 15 leaves room for 2d's larger blocks
        if scaling == "2d":
            assert torch.equal(bwd, fwd.t()), name
        # the stored bytes are exactly what the codec makes from the source
        f_ref, _ = F.quantize_weight(w, global_scale=torch.tensor(e["global_scale"]), scaling=scaling)
        assert torch.equal(art.nvfp4(name).packed, f_ref.packed), name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_vl"])
@pytest.mark.parametrize("scaling", ["2d", "1d"])
def test_convert_roundtrip(tmp_path, family, scaling):
    src = tmp_path / "src"
    make_model(src, family)
    out = convert(str(src), tmp_path / "art", scaling=scaling, block_scales="amax", progress=False)  # the codec's bits
    art = open_artifact(out)
    tensors = _source_tensors(src)
    assert set(art.names()) == set(tensors)
    _check_against_source(art, tensors, scaling)
    assert art.verify() > 0
    # zarr itself reads what our zero-copy reader maps
    import zarr

    root = zarr.open_group(str(out), mode="r")
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(torch.from_numpy(root[f"tensors/{q}/fwd_packed"][...]), art.nvfp4(q).packed)
    n = "model.norm.weight"
    stored = torch.from_numpy(root[f"tensors/{n}/data"][...].view("int16")).view(torch.bfloat16)
    assert torch.equal(stored, art.dense(n))
    meta = art.meta
    assert meta["family"] == family and meta["hf_config"]["architectures"]
    assert meta["provenance"]["scaling"] == scaling and meta["provenance"]["source_kind"] == "folder"
    assert (art.hf_dir / "tokenizer.json").is_file() and (art.hf_dir / "config.json").is_file()
    # fused groups share one global scale
    g = {art.entry(f"model.layers.0.self_attn.{p}_proj.weight")["global_scale"] for p in "qkv"}
    assert len(g) == 1
    if family == "qwen2_vl":
        assert art.entry("visual.blocks.0.attn.qkv.weight")["kind"] == "dense"
        assert art.entry("visual.blocks.0.attn.qkv.weight")["role"] == "vision"
    # the tokenizer ships inside the artifact and loads from there
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(art.hf_dir)("fresh plot").input_ids


def test_sharded_source(tmp_path):
    src = tmp_path / "src"
    model = make_model(src, "llama")
    model.save_pretrained(src, max_shard_size="40KB")  # several shards + index
    for f in src.glob("model.safetensors"):
        f.unlink()
    assert len(list(src.glob("*.safetensors"))) > 2
    art = open_artifact(convert(str(src), tmp_path / "art", progress=False, scaling="2d", block_scales="amax"))
    _check_against_source(art, _source_tensors(src), "2d")


def test_keep_bf16_protects_worst(tmp_path, tiny_llama):
    src = _source_tensors(tiny_llama)
    plain = open_artifact(convert(str(tiny_llama), tmp_path / "plain", progress=False))
    errors = {}
    for name in plain.names("nvfp4"):
        w = src[name].float()
        errors[name] = float((w - plain.dequantize(name)).norm() / w.norm())
        assert plain.entry(name)["error"] == pytest.approx(errors[name], rel=1e-5)  # fp32 norms
    art = open_artifact(convert(str(tiny_llama), tmp_path / "art", keep_bf16=0.25, progress=False))
    kept = art.meta["provenance"]["kept_bf16"]
    worst = sorted(errors, key=errors.get, reverse=True)[:4]  # 14 projections * 0.25 -> 4
    assert sorted(kept) == sorted(worst)
    for name in kept:
        e = art.entry(name)
        assert e["kind"] == "dense" and e["kept_bf16"] and e["nvfp4_error"] == plain.entry(name)["error"]
        assert torch.equal(art.dense(name), src[name].to(torch.bfloat16))
    assert len(art.names("nvfp4")) == 10
    assert art.verify() > 0


def test_mmap_is_zero_copy(tmp_path, tiny_llama):
    art = open_artifact(convert(str(tiny_llama), tmp_path / "art", progress=False))
    name = "model.layers.0.mlp.gate_proj.weight"
    packed = art.nvfp4(name).packed
    chunk = art.path / art.entry(name)["arrays"]["fwd_packed"]["path"] / "c" / "0" / "0"
    # 1. the tensor's memory lies inside a mapping of the chunk file (Linux /proc/self/maps)
    ptr = packed.data_ptr()
    maps = [line.split() for line in open("/proc/self/maps")]
    mapped = [m for m in maps if len(m) >= 6 and m[5] == str(chunk.resolve())]
    assert mapped, "chunk file is not memory-mapped"
    assert any(int(m[0].split("-")[0], 16) <= ptr < int(m[0].split("-")[1], 16) for m in mapped)
    # 2. a change to the file shows through the tensor (it is the page cache, not a copy)
    before = packed[0, 0].item()
    with open(chunk, "r+b") as f:
        f.write(bytes([before ^ 0xFF]))
    assert packed[0, 0].item() == before ^ 0xFF
    # 3. and verify() now sees the corruption
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        open_artifact(art.path).verify()


def test_cli(tmp_path, tiny_qwen2):
    runner = CliRunner()
    out = tmp_path / "art"
    r = runner.invoke(convert_cli, [str(tiny_qwen2), str(out), "--scaling", "1d", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "14 NVFP4 projections (1d)" in r.output
    r = runner.invoke(convert_cli, [str(tiny_qwen2), str(out), "--quiet"])
    assert r.exit_code == 1 and "already exists: pass --overwrite" in r.output
    r = runner.invoke(convert_cli, [str(tiny_qwen2), str(out), "--quiet", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert open_artifact(out).meta["provenance"]["scaling"] == "1d"  # the defaults: 1x16 blocks, searched scales
    assert open_artifact(out).meta["provenance"]["block_scales"] == "mse"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    amax = tmp_path / "amax"
    r = runner.invoke(convert_cli, [str(tiny_qwen2), str(amax), "--quiet", "--block-scales", "amax"])
    assert r.exit_code == 0 and "searched block scales" not in r.output, r.output
    b, a = open_artifact(out), open_artifact(amax)
    assert b.meta["provenance"]["block_scales"] == "mse"
    assert sum(b.entry(n)["error"] for n in b.names("nvfp4")) < sum(a.entry(n)["error"] for n in a.names("nvfp4"))


# ---- bad input: each one clear error naming the file/flag and the fix


def test_missing_and_empty_source(tmp_path):
    with pytest.raises(PactError, match="does not exist"):
        convert(str(tmp_path / "nope" / "x" / "y"), tmp_path / "art")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PactError, match="is empty"):
        convert(str(tmp_path / "empty"), tmp_path / "art")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(PactError, match="not .gguf"):
        convert(str(tmp_path / "weights.bin"), tmp_path / "art")


def test_no_safetensors(tmp_path, tiny_llama):
    for f in tiny_llama.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(PactError, match=r"no \*\.safetensors.*found model\.bin.*never loaded"):
        convert(str(tiny_llama), tmp_path / "art")


def test_no_config(tmp_path, tiny_llama):
    (tiny_llama / "config.json").unlink()
    with pytest.raises(PactError, match="no config.json"):
        convert(str(tiny_llama), tmp_path / "art")


def test_unsupported_architecture(tmp_path, tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PactError,
                       match=r"config.json: architecture \['GPT2LMHeadModel'\] is not supported.*LlamaForCausalLM"):
        convert(str(tiny_llama), tmp_path / "art")


def test_dimension_not_divisible(tmp_path):
    src = tmp_path / "src"
    make_model(src, "llama", intermediate_size=120)
    with pytest.raises(PactError, match=r"model.safetensors: model.layers.0.mlp.down_proj.weight has shape "
                                        r"\[64, 120\].*divisible by 16"):
        convert(str(src), tmp_path / "art")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_weights(tmp_path, tiny_llama, bad):
    f = tiny_llama / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.1.self_attn.v_proj.weight"][2, 3] = bad
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(PactError, match=r"model.safetensors: model.layers.1.self_attn.v_proj.weight has 1 NaN/Inf"):
        convert(str(tiny_llama), tmp_path / "art")
    assert not (tmp_path / "art").exists()
    assert not list(tmp_path.glob(".art*"))  # the temp dir is cleaned up too


def test_output_exists(tmp_path, tiny_llama):
    (tmp_path / "art").mkdir()
    with pytest.raises(ArtifactError, match="already exists: pass --overwrite"):
        convert(str(tiny_llama), tmp_path / "art")


def test_bad_flags(tmp_path, tiny_llama):
    with pytest.raises(PactError, match="--keep-bf16"):
        convert(str(tiny_llama), tmp_path / "art", keep_bf16=1.5)
    with pytest.raises(PactError, match="--scaling"):
        convert(str(tiny_llama), tmp_path / "art", scaling="4d")
    with pytest.raises(PactError, match="--block-scales"):
        convert(str(tiny_llama), tmp_path / "art", block_scales="max")


def test_truncated_and_corrupted_chunks(tmp_path, tiny_llama):
    path = convert(str(tiny_llama), tmp_path / "art", progress=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    chunk = path / "tensors" / name / "fwd_scales" / "c" / "0" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-3])
    with pytest.raises(ArtifactError, match=r"fwd_scales/c/0/0: \d+ bytes, expected \d+ \(truncated"):
        open_artifact(path).nvfp4(name)
    chunk.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    art = open_artifact(path)
    art.nvfp4(name)  # same size: opens
    with pytest.raises(ArtifactError, match=r"fwd_scales/c/0/0: checksum mismatch.*re-copy"):
        art.verify()
    chunk.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        open_artifact(path).nvfp4(name)


def test_format_versions(tmp_path, tiny_llama):
    path = convert(str(tiny_llama), tmp_path / "art", progress=False)
    root = path / "zarr.json"
    doc = json.loads(root.read_text())
    for version, msg in [(99, "newer than this pact reads.*upgrade pact"),
                         (0, "unknown to this pact.*re-run pact-convert")]:
        doc["attributes"]["pact"]["format_version"] = version
        root.write_text(json.dumps(doc))
        with pytest.raises(ArtifactError, match=msg):
            open_artifact(path)
    shutil.rmtree(path / "tensors")
    root.unlink()
    with pytest.raises(ArtifactError, match="not a pact artifact"):
        open_artifact(path)


def test_compressed_array_is_refused(tmp_path, tiny_llama):
    path = convert(str(tiny_llama), tmp_path / "art", progress=False)
    name = "model.norm.weight"
    zj = path / "tensors" / name / "data" / "zarr.json"
    doc = json.loads(zj.read_text())
    doc["codecs"].append({"name": "zstd", "configuration": {"level": 0, "checksum": False}})
    zj.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="cannot be memory-mapped"):
        open_artifact(path).dense(name)


def test_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PactError, match="'nosuch-org/nosuch-model' is not a local path and could not be fetched"):
        convert("nosuch-org/nosuch-model", tmp_path / "art")


# --- the CPU kernel and the device path: the same bits as the torch twin ---------------------------

from pact.convert import cpu_kernel, relative_error  # noqa: E402
from pact.convert.convert import quantize_member  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU")])]


def _awkward_weight(rows, cols, dtype, seed=0):
    """Heavy-tailed values with what the bit paths must get right: an outlier (blocks clamped at the
    smallest e4m3 scale), an all-zero block, negative zeros, values far below the global scale."""
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(3.0).sample((rows, cols)) * 0.02
    w *= torch.logspace(-6, 1, rows).unsqueeze(1)[torch.randperm(rows, generator=g)]
    w[0, 0] = 300.0
    w[1, :16] = 0.0
    w[2, 16:32] = -0.0
    return w.to(dtype)


def _same(a: F.NVFP4Tensor, b: F.NVFP4Tensor) -> bool:
    return (torch.equal(a.packed, b.packed) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
            and float(a.global_scale) == float(b.global_scale))


@pytest.mark.parametrize("rule", ["amax", "mse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows,cols", [(16, 16), (48, 80), (432, 64), (64, 1040)])
def test_cpu_kernel_matches_twin(rows, cols, dtype, rule):
    if cpu_kernel.library() is None:
        pytest.skip("no C compiler: the converter runs the torch twin itself")
    w = _awkward_weight(rows, cols, dtype)
    g = F.global_scale_from_amax(w.float().abs().amax())
    fwd, bwd = F.quantize_weight(w, global_scale=g, scaling="1d", scale_rule=rule)
    f2, b2, err = cpu_kernel.quantize_weight_cpu(w, g, rule)
    assert _same(fwd, f2) and _same(bwd, b2)  # rtol=0, atol=0: stored bytes
    assert err == pytest.approx(relative_error(w, F.dequantize(fwd)), rel=1e-5)  # double vs fp32 norms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["amax", "mse"])
@pytest.mark.parametrize("scaling", ["1d", "2d"])
def test_quantize_member_same_bits_on_every_device(device, rule, scaling):
    """What the converter stores is the CPU twin's codes and scales whatever runs it: the C kernel on
    the CPU (1d), torch on CUDA (fixed summation order, no atomics, first-minimum argmin)."""
    w = _awkward_weight(432, 1040, torch.bfloat16, seed=1)
    g = F.global_scale_from_amax(w.float().abs().amax())
    fwd, bwd = F.quantize_weight(w, global_scale=g, scaling=scaling, scale_rule=rule)
    f2, b2, err = quantize_member(w, g, scaling=scaling, scale_rule=rule, device=torch.device(device))
    assert f2.packed.device.type == "cpu"
    assert _same(fwd, f2) and _same(bwd, b2)
    assert err == pytest.approx(relative_error(w, F.dequantize(fwd)), rel=1e-5)  # fp32 norms in another order


def test_artifact_same_with_and_without_the_kernel(tmp_path, tiny_llama, monkeypatch):
    """The default conversion (1d, mse) stores the same bytes through the C kernel and the torch twin."""
    a = open_artifact(convert(str(tiny_llama), tmp_path / "a", progress=False, device="cpu"))
    monkeypatch.setattr(cpu_kernel, "quantize_weight_cpu", lambda *args: None)
    b = open_artifact(convert(str(tiny_llama), tmp_path / "b", progress=False, device="cpu"))
    assert a.names("nvfp4") == b.names("nvfp4") and len(a.names("nvfp4")) == 14
    for name in a.names():
        assert {k: v["sha256"] for k, v in a.entry(name)["arrays"].items()} == \
               {k: v["sha256"] for k, v in b.entry(name)["arrays"].items()}, name
        if name in a.names("nvfp4"):
            assert a.entry(name)["error"] == pytest.approx(b.entry(name)["error"], rel=1e-5)  # double vs fp32 norms


def test_device_option(tmp_path, tiny_llama):
    from pact.convert.convert import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(PactError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(PactError, match="no CUDA"):
            convert(str(tiny_llama), tmp_path / "art", progress=False, device="cuda")


def test_cli_refuses_a_source_without_tokenizer_and_outputs_inside_artifacts(tmp_path, tiny_qwen2):
    """pact-convert refuses, before any work, a folder without tokenizer files (its artifact could never be
    trained or evaluated, nor mended: its files are checksummed; the library still converts bare weights, as
    the benchmarks do), and an output inside an existing artifact."""
    runner = CliRunner()
    bare = tmp_path / "bare"
    shutil.copytree(tiny_qwen2, bare)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        (bare / f).unlink(missing_ok=True)
    r = runner.invoke(convert_cli, [str(bare), str(tmp_path / "a"), "--quiet"])
    assert r.exit_code == 1 and f"{bare}: no tokenizer (tokenizer.json, tokenizer.model" in r.output, r.output
    assert not (tmp_path / "a").exists()
    convert(str(bare), tmp_path / "a", progress=False)  # the library: bare weights for benchmarks
    # `pact-convert . art`: the source is read from its top-level files, so an artifact in its folder is fine
    r = runner.invoke(convert_cli, [str(tiny_qwen2), str(tiny_qwen2 / "art"), "--quiet"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(convert_cli, [str(tiny_qwen2), str(tmp_path / "a" / "sub"), "--quiet"])
    assert r.exit_code == 1 and f"is inside the artifact {tmp_path / 'a'}: choose a folder outside it" in r.output
    assert not (tmp_path / "a" / "sub").exists()
    open_artifact(tmp_path / "a").verify()
