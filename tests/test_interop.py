"""NVFP4 checkpoints from compressed-tensors (llm-compressor's format, what vLLM loads) imported into
artifacts: written here by compressed-tensors itself, read back by pact, checked against the
library's own decompression."""

import json
import shutil

import pytest
import torch

from conftest import make_model, make_sentiment_jsonl
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
        exact = F.dequantize(F.NVFP4Tensor(fwd.packed, fwd.scales, torch.tensor(1.0))) / sd[f"{base}.weight_global_scale"]
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

    from pact.runtime.lora import LoraConfig
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
