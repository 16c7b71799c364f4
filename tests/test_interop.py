"""NVFP4 checkpoints from compressed-tensors (llm-compressor's format, what vLLM loads) imported into
artifacts: written here by compressed-tensors itself, read back by pact, checked against the
library's own decompression."""

import json
import shutil

import pytest
import torch

from conftest import make_converted_llama, make_model, make_sentiment_jsonl
from pact.convert import convert
from pact.formats import PactError, open_artifact
from pact.formats import nvfp4 as F

ct = pytest.importorskip("compressed_tensors")

FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
         "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
         "up_proj": ("gate_proj", "up_proj")}


def write_ct_nvfp4(src, dst, fuse_global_scales: bool = True) -> None:
    """``src`` quantized to NVFP4 with compressed-tensors' own scale functions and compressor, saved
    as llm-compressor saves it (round-to-nearest weights; with ``fuse_global_scales`` q/k/v and
    gate/up share the smallest global scale, as llm-compressor does for vLLM)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    mods = {n: m for n, m in model.named_modules() if hasattr(m, "weight_global_scale")}
    for m in mods.values():
        amax = m.weight.detach().float().abs().amax().reshape(1)
        m.weight_global_scale.data.copy_(generate_gparam(-amax, amax))
    if fuse_global_scales:
        shared = {}
        for n in mods:
            base, leaf = n.rsplit(".", 1)
            fam = [f"{base}.{p}" for p in FUSED.get(leaf, (leaf,))]
            shared[n] = torch.stack([mods[f].weight_global_scale.data for f in fam]).min(0).values
        for n, m in mods.items():
            m.weight_global_scale.data.copy_(shared[n])
    for m in mods.values():
        w = m.weight.detach().float().reshape(m.weight.shape[0], -1, 16)
        scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), scheme.weights, global_scale=m.weight_global_scale.data)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    comp.compress_model(model)
    model.save_pretrained(dst)
    comp.update_config(dst)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ct")
    make_model(d / "src", "llama")
    write_ct_nvfp4(d / "src", d / "nvfp4")
    return d


def _ct_weights(folder):
    """compressed-tensors' own decompression of every quantized Linear (the client's view)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    out = {}
    for k in sd:
        if k.endswith(".weight_packed"):
            base = k.removesuffix(".weight_packed")
            part = {p: sd[f"{base}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
            out[f"{base}.weight"] = NVFP4PackedCompressor.decompress(part, scheme)["weight"].float()
    return out


def test_import_keeps_codes_and_scales(ckpt, tmp_path):
    """The artifact's forward layout is the checkpoint's codes and scales byte for byte; decoded,
    it is compressed-tensors' own dequantization (which computes in bf16: equal to its rounding;
    pact decodes in fp32); the backward layout is W^T of those values re-blocked."""
    from safetensors.torch import load_file

    art = open_artifact(convert(str(ckpt / "nvfp4"), tmp_path / "art", progress=False))
    sd = load_file(ckpt / "nvfp4" / "model.safetensors")
    ref = _ct_weights(ckpt / "nvfp4")
    assert len(ref) == 14
    for name, w in ref.items():
        base = name.removesuffix(".weight")
        fwd = art.nvfp4(name, "fwd")
        assert art.entry(name)["imported"] == "compressed-tensors"
        assert torch.equal(fwd.packed, sd[f"{base}.weight_packed"])
        assert torch.equal(fwd.scales.view(torch.uint8), sd[f"{base}.weight_scale"].view(torch.uint8))
        torch.testing.assert_close(F.dequantize(fwd), w, rtol=2**-7, atol=0)
        exact = (F.dequantize(F.NVFP4Tensor(fwd.packed, fwd.scales, torch.tensor(1.0)))
                 / sd[f"{base}.weight_global_scale"])
        torch.testing.assert_close(F.dequantize(fwd), exact, rtol=2**-22, atol=0)  # (q * s_b) / gs in fp32
        assert F.dequantize(art.nvfp4(name, "bwd")).sub(w.t()).norm() / w.norm() < 0.1
    # one global scale per fused group, as the runtime needs; no quantization_config left to the artifact
    assert len({art.entry(f"model.layers.0.self_attn.{p}_proj.weight")["global_scale"] for p in "qkv"}) == 1
    assert "quantization_config" not in json.loads((art.hf_dir / "config.json").read_text())
    assert "quantization_config" not in art.meta["hf_config"]
    assert art.meta["provenance"]["source_quantization"]["format"] == "nvfp4-pack-quantized"
    art.verify()


def test_imported_artifact_trains_and_matches_transformers(ckpt, tmp_path):
    """pact's forward over the imported artifact, activations unquantized, against transformers on
    compressed-tensors' dequantized weights; then two training steps."""
    from transformers import AutoModelForCausalLM

    from pact.formats.peft import LoraConfig
    from pact.runtime.model import PactModel
    from pact.runtime.trainer import TrainConfig, train

    out = convert(str(ckpt / "nvfp4"), tmp_path / "art", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(ckpt / "src", dtype=torch.float32)
    sd = hf.state_dict()
    for name, w in _ct_weights(ckpt / "nvfp4").items():
        sd[name] = w
    hf.load_state_dict(sd)
    ids = torch.randint(0, 200, (2, 24))
    ref = hf(input_ids=ids).logits.float()
    model = PactModel(open_artifact(out), LoraConfig(), activations="bf16")
    got = model.logits(ids)
    assert float((got - ref.detach()).norm() / ref.detach().norm()) < 0.02
    make_sentiment_jsonl(tmp_path / "train.jsonl", 16)
    r = train(TrainConfig(artifact=str(out), data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"), steps=2,
                          batch_size=4, max_len=64), progress=False)
    assert r["step"] == 2


def test_unshared_global_scales_are_requantized(tmp_path):
    """A checkpoint whose q/k/v carry different global scales (vLLM would refuse to fuse them too):
    the group is re-quantized from its values to one scale, and says so."""
    make_model(tmp_path / "src", "llama")
    write_ct_nvfp4(tmp_path / "src", tmp_path / "nvfp4", fuse_global_scales=False)
    art = open_artifact(convert(str(tmp_path / "nvfp4"), tmp_path / "art", progress=False))
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert len({art.entry(n)["global_scale"] for n in names}) == 1
    assert {art.entry(n)["imported"] for n in names} == {"requantized"}
    assert art.entry("model.layers.0.mlp.down_proj.weight")["imported"] == "compressed-tensors"  # a group of one


def test_import_refusals(ckpt, tmp_path):
    from pact.calibrate import calibrate

    with pytest.raises(PactError, match="drop --scaling 2d"):
        convert(str(ckpt / "nvfp4"), tmp_path / "a", scaling="2d", progress=False)
    art = convert(str(ckpt / "nvfp4"), tmp_path / "art", progress=False)
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "some words to calibrate on"}) + "\n")
    with pytest.raises(PactError, match="GPTQ needs the unquantized weights"):
        calibrate(str(art), tmp_path / "p.jsonl", tmp_path / "cal", progress=False)
    other = tmp_path / "gptq"
    shutil.copytree(ckpt / "nvfp4", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PactError, match="already quantized \\(gptq"):
        convert(str(other), tmp_path / "b", progress=False)
    part = tmp_path / "part"
    shutil.copytree(ckpt / "nvfp4", part)
    from safetensors.torch import load_file, save_file

    sd = load_file(part / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight_scale")
    save_file(sd, part / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PactError, match="up_proj.weight_packed comes without .*weight_scale"):
        convert(str(part), tmp_path / "c", progress=False)
    odd = tmp_path / "odd"  # block scales stored as bf16: not the format's layout
    shutil.copytree(ckpt / "nvfp4", odd)
    sd = load_file(odd / "model.safetensors")
    sd["model.layers.0.mlp.down_proj.weight_scale"] = sd["model.layers.0.mlp.down_proj.weight_scale"].to(torch.bfloat16)
    save_file(sd, odd / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PactError, match="down_proj.weight's NVFP4 parts are not compressed-tensors's NVFP4 layout"):
        convert(str(odd), tmp_path / "d", progress=False)


# -- export


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama converted with the defaults, and an adapter trained on it until it is not zero."""
    from pact.runtime.trainer import TrainConfig, train

    d = make_converted_llama(tmp_path_factory.mktemp("exp"), 16)
    train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(d / "run"), steps=3,
                      batch_size=4, max_len=64, lr=5e-3, warmup_ratio=0.0), progress=False)
    return d


def _pact_logits(art, ids, adapter=None):
    from pact.formats.peft import load_peft_adapter
    from pact.runtime.model import PactModel

    cfg, weights = load_peft_adapter(adapter) if adapter else (None, None)
    model = PactModel(open_artifact(art), cfg, activations="bf16")
    if weights:
        model.load_adapter_state(weights)
    return model.logits(ids)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_export_compressed_tensors_is_what_the_library_reads(trained, tmp_path):
    """compressed-tensors decompresses the export to pact's weights (its bf16 output within one bf16
    step of pact's fp32 dequantization: it computes q * (s_b / gs), pact (q * s_b) * g, so ~4% of
    the values round to the neighbouring bf16), transformers loads it and gives pact's logits, and
    importing the export back gives the same codes, scales and global scales (round trip)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pact.convert.export import export

    art = open_artifact(trained / "art")
    export(str(trained / "art"), tmp_path / "ct")
    ref = _ct_weights(tmp_path / "ct")
    assert len(ref) == 14
    for name, w in ref.items():
        torch.testing.assert_close(w, art.dequantize(name), rtol=2**-8, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16)  # decompressed to bf16
    ids = torch.randint(0, 200, (2, 24))
    assert _rel(hf(input_ids=ids).logits.detach(), _pact_logits(trained / "art", ids)) < 0.02
    back = open_artifact(convert(str(tmp_path / "ct"), tmp_path / "back", progress=False))
    for name in art.names("nvfp4"):
        assert torch.equal(back.nvfp4(name).packed, art.nvfp4(name).packed)
        assert torch.equal(back.nvfp4(name).scales.view(torch.uint8), art.nvfp4(name).scales.view(torch.uint8))
        # compressed-tensors stores 1 / g in fp32, and not every fp32 g is the reciprocal of one: g may
        # come back one fp32 step away (relative 2^-24; the weights move far below bf16's resolution)
        assert back.entry(name)["global_scale"] == pytest.approx(art.entry(name)["global_scale"], rel=2**-22)
    sd = load_file(tmp_path / "ct" / "model.safetensors")
    assert "lm_head.weight" not in sd or sd["lm_head.weight"].dtype == torch.bfloat16


def test_export_with_adapter(trained, tmp_path):
    """bf16 export (adapter merged) and compressed-tensors export with the adapter beside (PEFT on
    top of it) or merged and re-quantized: transformers' logits are pact's with the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pact.convert.export import export

    ids = torch.randint(0, 200, (2, 24))
    ref = _pact_logits(trained / "art", ids, trained / "run")
    base = _pact_logits(trained / "art", ids)
    assert _rel(base, ref) > 0.01  # the adapter moves the logits: the comparisons below see it

    export(str(trained / "art"), tmp_path / "bf16", fmt="bf16", adapter=str(trained / "run"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert _rel(hf(input_ids=ids).logits.detach(), ref) < 0.02

    r = export(str(trained / "art"), tmp_path / "ct", adapter=str(trained / "run"))
    assert r["adapter"] == "beside"
    cfg = json.loads((tmp_path / "ct" / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((tmp_path / "ct").resolve())
    # transformers keeps NVFP4 Linears compressed (no .weight for PEFT to wrap) unless asked to decompress:
    # dequantize=True (the README's spelling), run_compressed=False where transformers predates it
    import inspect

    from transformers.utils.quantization_config import CompressedTensorsConfig

    ask = {"dequantize": True} if "dequantize" in inspect.signature(CompressedTensorsConfig).parameters \
        else {"run_compressed": False}
    base_ct = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16,
                                                   quantization_config=CompressedTensorsConfig(**ask))
    hf = PeftModel.from_pretrained(base_ct, tmp_path / "ct" / "adapter")
    assert _rel(hf(input_ids=ids).logits.detach(), ref) < 0.02

    r = export(str(trained / "art"), tmp_path / "merged", adapter=str(trained / "run"), merge=True)
    err = r["requantization_error"]
    assert len(err["per_projection"]) == 14 and 0 < err["max"] < 0.2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    merged = hf(input_ids=ids).logits.detach()
    # one more NVFP4 rounding of every adapted weight (this tiny random model's weights take it badly),
    # yet far closer to pact-with-adapter than the base without it
    assert _rel(merged, ref) < 0.5 * _rel(base, ref)


def test_gptq_merge_keeps_more_of_the_adapter(trained, tmp_path):
    """pact-export --merge (default: the error-compensating GPTQ merge on the run's training texts)
    reproduces the adapted model's logits on those texts more closely than the plain re-quantizing
    merge (--merge-method rtn); both load in
    transformers. A run whose data is gone is refused unless --merge-data or --merge-method rtn is
    given."""
    import shutil

    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pact.pipelines.export import main as export_cli
    from pact.runtime.data import read_records, tokenize

    art, run = str(trained / "art"), str(trained / "run")
    tok = AutoTokenizer.from_pretrained(open_artifact(art).hf_dir)
    texts = [torch.tensor([e.ids]) for e in tokenize(read_records(trained / "train.jsonl"), tok, max_len=64)[:8]]
    ref = torch.cat([_pact_logits(art, ids, run)[0] for ids in texts])
    got = {}
    for how in ("gptq", "rtn"):
        r = CliRunner().invoke(export_cli, [art, "--out", str(tmp_path / how), "--adapter", run, "--merge",
                                            "--merge-method", how, "--quiet"])
        assert r.exit_code == 0, r.output
        summary = json.loads(r.output)
        assert summary["merge"]["method"] == how and summary["adapter"] == "merged"
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / how, dtype=torch.bfloat16)
        got[how] = _rel(torch.cat([hf(input_ids=ids).logits.detach()[0] for ids in texts]), ref)
    assert summary["merge"] == {"method": "rtn"} and got["gptq"] < 0.8 * got["rtn"], got
    # the run's data is gone: a clear refusal; --merge-data takes other texts
    run2 = tmp_path / "run2"
    shutil.copytree(run, run2)
    cfg = json.loads((run2 / "train_config.json").read_text())
    (run2 / "train_config.json").write_text(json.dumps({**cfg, "data": str(tmp_path / "gone.jsonl")}))
    args = [art, "--out", str(tmp_path / "x"), "--adapter", str(run2), "--merge", "--quiet"]
    r = CliRunner().invoke(export_cli, args)
    assert r.exit_code != 0 and "pass --merge-data FILE, or --merge-method rtn" in r.output, r.output
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(export_cli, args + ["--merge-data", str(trained / "train.jsonl"), "--merge-samples", "4"])
    assert r.exit_code == 0 and json.loads(r.output)["merge"]["samples"] == 4, r.output
    assert json.loads(r.output)["merge"]["inputs"] == "merged"  # the default; the other is selectable
    r = CliRunner().invoke(export_cli, args + ["--merge-data", str(trained / "train.jsonl"), "--merge-samples", "4",
                                               "--merge-inputs", "adapted", "--overwrite"])
    assert r.exit_code == 0 and json.loads(r.output)["merge"]["inputs"] == "adapted", r.output


def test_merge_keeping_the_worst_groups_in_bf16(trained, tmp_path):
    """--merge-keep-bf16: whole fused groups, the largest GPTQ merge error first, are written in bf16
    with the adapter folded in exactly and listed in compressed-tensors' ignore list; the rest is the
    GPTQ merge. transformers loads it, pact imports it back (those groups dense), and the kept
    weights are W + s B A. Without the GPTQ merge, or outside [0, 1), it is refused."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from pact.convert.export import export, merged_weight
    from pact.formats.peft import load_peft_adapter
    from pact.pipelines.export import main as export_cli

    art, run = str(trained / "art"), str(trained / "run")
    r = CliRunner().invoke(export_cli, [art, "--out", str(tmp_path / "k"), "--adapter", run, "--merge",
                                        "--merge-samples", "4", "--merge-keep-bf16", "0.3", "--quiet"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    kept = summary["merge"]["kept_bf16"]
    a = open_artifact(art)
    groups = {}
    for name in a.names("nvfp4"):
        groups.setdefault(a.entry(name).get("group") or name, []).append(name)
    assert 0 < len(kept) < 14 and len(kept) >= 0.3 * 14
    assert all(set(ms) <= set(kept) or not set(ms) & set(kept) for ms in groups.values())  # whole groups
    assert summary["quantized_projections"] == 14 - len(kept)
    assert set(summary["merge"]) >= {"layer_output_error_median", "stages"} and "output_error" not in summary["merge"]
    ignore = json.loads((tmp_path / "k" / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(kept) <= {m + ".weight" for m in ignore}
    back = open_artifact(convert(str(tmp_path / "k"), tmp_path / "back", progress=False))
    cfg, adapters = load_peft_adapter(run)
    for name in kept:
        assert back.entry(name)["kind"] != "nvfp4"
        want = merged_weight(a.dequantize(name), name, adapters, cfg.scale).to(torch.bfloat16)
        assert torch.equal(back.dense(name), want), name
    assert all(back.entry(n)["kind"] == "nvfp4" for n in a.names("nvfp4") if n not in kept)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "k", dtype=torch.bfloat16)
    ids = torch.randint(0, 200, (1, 16))
    assert _rel(hf(input_ids=ids).logits.detach(), _pact_logits(art, ids, run)) < 0.5
    with pytest.raises(PactError, match="needs --merge with --merge-method gptq"):
        export(art, tmp_path / "x", adapter=run, merge=True, merge_keep_bf16=0.2)
    with pytest.raises(PactError, match=r"must be in \[0, 1\)"):
        export(art, tmp_path / "x", adapter=run, merge=True, merge_keep_bf16=1.0)
    assert not (tmp_path / "x").exists()


def test_gptq_merge_of_an_artifact_with_a_member_kept_bf16(trained, tmp_path):
    """An artifact converted with --keep-bf16 holds fused groups with one member dense: the GPTQ merge
    leaves such a group out (the runtime runs it dense), and the export rounds its NVFP4 members to
    nearest and folds the adapter into the dense one exactly, instead of failing on the missing
    solution."""
    from pact.convert.export import export
    from pact.runtime.trainer import TrainConfig, train

    art = convert(str(trained / "src"), tmp_path / "kb", keep_bf16=0.15, progress=False)
    kept = open_artifact(art).meta["provenance"]["kept_bf16"]
    assert kept
    train(TrainConfig(artifact=str(art), data=str(trained / "train.jsonl"), out=str(tmp_path / "run"), steps=2,
                      batch_size=4, max_len=64, lr=5e-3, warmup_ratio=0.0), progress=False)
    from pact.calibrate.merge import gptq_merge

    r = export(str(art), tmp_path / "m", adapter=str(tmp_path / "run"), merge=True, merge_solver=lambda a, run: (
        gptq_merge(a, run, str(trained / "train.jsonl"), max_samples=4)))
    assert r["merge"]["method"] == "gptq" and r["adapter"] == "merged"
    from safetensors.torch import load_file

    sd = load_file(tmp_path / "m" / "model.safetensors")
    ignore = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]["ignore"]
    assert all(sd[n].dtype == torch.bfloat16 and n.removesuffix(".weight") in ignore for n in kept)


def test_gptq_merge_in_act_order(trained):
    """The merge's GPTQ in act-order (a benchmark knob: scales fixed up front from W + BA) also ends
    with less layer-output error than rounding W + BA, on every adapted projection."""
    from pact.calibrate.merge import gptq_merge

    out, summary = gptq_merge(str(trained / "art"), str(trained / "run"), str(trained / "train.jsonl"),
                              max_samples=8, actorder=True, gain=1.0)
    errs = summary["output_error"]
    assert set(summary["stages"]) == {"load", "activations", "solve", "total"}
    assert summary["stages"]["total"] == pytest.approx(summary["seconds"], abs=0.2)
    assert out and set(errs) <= set(out)
    assert all(e["gptq"] < e["plain"] for e in errs.values()), errs


def test_gptq_merge_on_the_merged_models_inputs(trained):
    """inputs="merged" (the default): each layer's Hessian comes from the layers merged below it (as
    calibration does), inputs="adapted" from the unmerged model: layer 0 sees the same inputs either
    way (the same codes), later layers other ones; every adapted projection still ends with less
    layer-output error than rounding W + BA."""
    from pact.calibrate.merge import gptq_merge

    args = (str(trained / "art"), str(trained / "run"), str(trained / "train.jsonl"))
    ref, adapted = gptq_merge(*args, max_samples=8, inputs="adapted", gain=1.0)
    out, summary = gptq_merge(*args, max_samples=8, gain=1.0)
    assert summary["inputs"] == "merged" and adapted["inputs"] == "adapted" and set(out) == set(ref)
    first = [n for n in out if ".layers.0." in n]
    assert first and all(torch.equal(out[n].packed, ref[n].packed) for n in first)
    assert any(not torch.equal(out[n].packed, ref[n].packed) for n in out if n not in first)
    assert all(e["gptq"] < e["plain"] for e in summary["output_error"].values()), summary["output_error"]
    with pytest.raises(ValueError, match="inputs must be"):
        gptq_merge(*args, inputs="source")


def test_gptq_merge_gain(trained, tmp_path):
    """gain: the merge solves for W + gain x s B A; every adapted projection reports delta_kept, the share of
    s B A its merged change carries in the metric of its inputs (exact on a known change). A gain above 1
    carries more of it; gain="auto" picks per fused group the probe's gain nearest a whole delta. Bad gains,
    or a gain with the plain merge, are refused naming the flag."""
    from click.testing import CliRunner

    from pact.calibrate.merge import AUTO_GAINS, _delta_kept, gptq_merge
    from pact.pipelines.export import main as export_cli

    W, d = torch.randn(8, 32), torch.randn(8, 32)
    X = torch.randn(64, 32)
    H = X.T @ X
    assert float(_delta_kept(W + 0.5 * d, W, d, H)) == pytest.approx(0.5, rel=1e-5)
    assert float(_delta_kept(W, W, torch.zeros_like(d), H)) == 0.0
    args = (str(trained / "art"), str(trained / "run"), str(trained / "train.jsonl"))
    kept = {}
    for gain in (1.0, 1.5):
        _, summary = gptq_merge(*args, max_samples=4, gain=gain)
        assert summary["gain"] == gain and "gains" not in summary
        kept[gain] = sorted(e["delta_kept"] for e in summary["output_error"].values())
    assert kept[1.5][len(kept[1.5]) // 2] > kept[1.0][len(kept[1.0]) // 2], kept
    out, summary = gptq_merge(*args, max_samples=4, gain="auto")
    assert summary["gain"] == "auto" and summary["gains"] and set(out) >= set(summary["output_error"])
    for g in summary["gains"].values():  # the probed gain whose realized change is nearest the whole delta
        probe = {float(k): v for k, v in g["probe"].items()}
        assert set(probe) == set(AUTO_GAINS) and g["gain"] == min(probe, key=lambda c: abs(probe[c] - 1))
    with pytest.raises(PactError, match="--merge-gain"):
        gptq_merge(*args, gain=0.0)
    base = [args[0], "--out", str(tmp_path / "g"), "--adapter", args[1], "--merge", "--quiet"]
    r = CliRunner().invoke(export_cli, base + ["--merge-samples", "4", "--merge-gain", "auto"])
    assert r.exit_code == 0, r.output
    m = json.loads(r.output)["merge"]
    assert sum(m["gains_chosen"].values()) == len(summary["gains"]) and 0 < m["delta_kept_median"] < 3
    assert m["gains_short"] == sum(g["short"] for g in summary["gains"].values())
    for bad, why in ((["--merge-gain", "big"], "'big': give auto or a number"), (["--merge-gain", "0"], "give auto"),
                     (["--merge-gain", "1.5", "--merge-method", "rtn"], "a gain is for the GPTQ merge"),
                     (["--merge-gain", "auto", "--merge-method", "rtn"], "a gain is for the GPTQ merge"),
                     (["--merge-gain", "1.5", "--format", "bf16"], "not --format bf16")):
        r = CliRunner().invoke(export_cli, base + ["--overwrite"] + bad)
        assert r.exit_code != 0 and "--merge-gain" in r.output and why in r.output, r.output
    r = CliRunner().invoke(export_cli, [args[0], "--out", str(tmp_path / "u"), "--adapter", args[1], "--merge-gain",
                                        "1.5", "--quiet"])  # without --merge the gain would do nothing
    assert r.exit_code != 0 and "drop it, or merge" in r.output and not (tmp_path / "u").exists(), r.output


def test_merge_gains_stack(monkeypatch):
    """Several gains' rows swept together (each gain with its own global scale, one per row in the
    quantizer) give each gain's codes exactly as its own sweep does, and gain="auto" chooses the same gain
    and writes the same codes whether it sweeps every gain's rows at once (the GPU's way, where the sweep
    is launch-bound) or probes every AUTO_STRIDE-th row and then sweeps the rest at the chosen gain."""
    from pact.calibrate import merge
    from pact.calibrate.gptq import GPTQ
    from pact.formats.nvfp4 import dequantize, quantize

    torch.manual_seed(0)
    W0 = dequantize(quantize(torch.randn(48, 64), scale_rule="mse"))  # a base on its NVFP4 grid
    T = W0 + 0.04 * torch.randn(48, 16) @ torch.randn(16, 64) / 4  # a low-rank delta under half a step
    H = GPTQ(64)
    H.add_batch(torch.randn(256, 64) * torch.linspace(0.2, 3, 64))
    args = ("mse", 32, 0.01, False)

    def solve(gains):
        g = merge._gain_scales(W0, T, gains)
        return (*merge._solve_gains(H, W0, T, T - W0, gains, g, None, *args), g)

    Q, sc, g = solve((1.0, 1.5))
    for i, c in enumerate((1.0, 1.5)):
        Qi, sci, gi = solve((c,))
        assert torch.equal(Q[48 * i : 48 * (i + 1)], Qi) and torch.equal(sc[48 * i : 48 * (i + 1)], sci)
        assert torch.equal(g[i], gi[0])
    assert not torch.equal(Q[:48], Q[48:])
    assert torch.equal(g[0], F.global_scale_from_amax(T.abs().amax()))  # gain 1: T itself, on T's own global scale
    res = {}
    for stack_all in (False, True):
        monkeypatch.setattr(merge, "_stack_all", lambda W0, gains, s=stack_all: s)
        res[stack_all] = merge._auto_gain(H, W0, T, *args)
    (k0, Q0, sc0, g0, p0), (k1, Q1, sc1, g1, p1) = res[False], res[True]
    assert k0 == k1 and p0 == p1 and torch.equal(Q0, Q1) and torch.equal(sc0, sc1) and torch.equal(g0, g1)
    assert k0 == min(merge.AUTO_GAINS, key=lambda c: abs(p0[c] - 1))
    Qk = solve((k0,))[0]
    assert torch.equal(Q0, Qk)  # the probe's rows and the rest's, put together, are the chosen gain's sweep
    # a delta far under half a step: no gain tried carries most of it (the merge reports such groups)
    k, *_, p = merge._auto_gain(H, W0, W0 + 0.02 * (T - W0), *args)
    assert p[k] < merge.AUTO_SHORT and all(v < merge.AUTO_SHORT for v in p.values()), p


def test_export_refusals(trained, tmp_path):
    from pact.convert.export import export

    with pytest.raises(PactError, match="--merge folds an adapter"):
        export(str(trained / "art"), tmp_path / "x", merge=True)
    with pytest.raises(PactError, match="--format must be one of"):
        export(str(trained / "art"), tmp_path / "x", fmt="gguf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(PactError, match="exists: choose a new folder or pass --overwrite"):
        export(str(trained / "art"), tmp_path / "taken")
    with pytest.raises(PactError, match="is not a checkpoint folder pact-export wrote"):
        export(str(trained / "art"), tmp_path / "taken", overwrite=True)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"  # a folder that is not an export is kept
    assert not any(p.name.startswith(".taken") for p in tmp_path.iterdir())
    export(str(trained / "art"), tmp_path / "done")
    export(str(trained / "art"), tmp_path / "done", fmt="bf16", overwrite=True)  # an export is replaced
    assert "quantization_config" not in json.loads((tmp_path / "done" / "config.json").read_text())


def test_adapter_names_the_source_model(trained):
    """A pact-train run's adapter_config.json names the model the artifact came from, so PEFT's
    AutoPeftModelForCausalLM loads the run folder as it is (the base in bf16, the adapter on top)."""
    from peft import AutoPeftModelForCausalLM

    cfg = json.loads((trained / "run" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((trained / "src").resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(trained / "run")
    assert model.peft_config["default"].r == 16


# -- ModelOpt


MODELOPT = __import__("pathlib").Path(__file__).parent / "data" / "modelopt_nvfp4"


def test_import_modelopt_nvfp4(tmp_path):
    """A checkpoint nvidia-modelopt quantized to NVFP4 and exported (tests/data/modelopt_nvfp4, made
    by tests/data/make_modelopt_nvfp4.py): imported as stored, its weights equal modelopt's own
    dequantization (ref.safetensors) to fp32 rounding, and it trains."""
    from safetensors.torch import load_file

    from pact.runtime.trainer import TrainConfig, train

    src = tmp_path / "mo"
    shutil.copytree(MODELOPT, src, ignore=shutil.ignore_patterns("ref.safetensors", "WRITTEN_BY"))
    art = open_artifact(convert(str(src), tmp_path / "art", progress=False))
    ref = load_file(MODELOPT / "ref.safetensors")
    sd = load_file(MODELOPT / "model.safetensors")
    assert len(ref) == 14
    for name, w in ref.items():
        assert art.entry(name)["imported"] == "modelopt"
        assert torch.equal(art.nvfp4(name).packed, sd[name])
        torch.testing.assert_close(art.dequantize(name), w, rtol=2**-22, atol=0)
    assert art.meta["provenance"]["source_quantization"]["quant_algo"] == "NVFP4"
    make_sentiment_jsonl(tmp_path / "train.jsonl", 8)
    r = train(TrainConfig(artifact=str(art.path), data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"),
                          steps=1, batch_size=4, max_len=64), progress=False)
    assert r["step"] == 1


def test_gptq_merge_on_few_tokens_says_so(trained, caplog):
    """A merge on fewer tokens than a projection has input columns (a run on a few short records) says that
    its GPTQ stays near round-to-nearest, as calibration does, naming --merge-data."""
    from pact.calibrate.merge import gptq_merge

    with caplog.at_level("WARNING", logger="pact.calibrate.calibrate"):
        gptq_merge(str(trained / "art"), str(trained / "run"), str(trained / "train.jsonl"), max_samples=2)
    said = [r.getMessage() for r in caplog.records if "rank-deficient" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("pact-export --merge: ") and "--merge-data" in said[0], said
