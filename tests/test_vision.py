"""Vision-language artifacts (Qwen2-VL, Qwen2.5-VL): image prompts through the stored image
processor and vision tower, M-RoPE positions, GPTQ calibration with images, text training."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import make_model, make_realistic, make_sentiment_jsonl, rehash_artifact
from pact.calibrate import calibrate
from pact.calibrate.prompts import load_prompts
from pact.convert import convert
from pact.formats import PactError, open_artifact
from pact.pipelines.calibrate import main as calibrate_cli
from pact.runtime.model import PactModel, rmsnorm
from pact.runtime.trainer import TrainConfig, train
from pact.runtime.vision import VisionTower, image_inputs, mrope_positions

VL_FAMILIES = ["qwen2_vl", "qwen2_5_vl"]


def _real_images(folder: Path) -> Path:
    """Real photographs and drawings shipped with matplotlib (a test dependency)."""
    import matplotlib

    data = Path(matplotlib.get_data_path()) / "sample_data"
    folder.mkdir()
    for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png"):
        shutil.copy(data / name, folder / name)
    (folder / "logo2.txt").write_text("What does this logo say?")
    return folder


@pytest.fixture(scope="module", params=VL_FAMILIES)
def vl(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_model(d / "src", request.param, initializer_range=0.15)
    make_realistic(d / "src")
    convert(str(d / "src"), d / "art", progress=False, scaling="2d", block_scales="amax")
    _real_images(d / "images")
    return d


def test_mrope_positions():
    # text, text, one image of a 1x4x4 patch grid (2x2 merged tokens), text, text
    ids = torch.tensor([7, 8, 5, 5, 5, 5, 9, 10])
    pos = mrope_positions(ids, torch.tensor([[1, 4, 4]]), image_token_id=5, merge=2)
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    with pytest.raises(PactError, match="needs 4 image-pad tokens"):
        mrope_positions(ids[:5], torch.tensor([[1, 4, 4]]), image_token_id=5, merge=2)
    with pytest.raises(PactError, match="more image-pad tokens than the 1 image grid"):
        mrope_positions(torch.tensor([5] * 8), torch.tensor([[1, 4, 4]]), image_token_id=5, merge=2)
    with pytest.raises(PactError, match="2 image grid"):
        mrope_positions(ids, torch.tensor([[1, 4, 4], [1, 2, 2]]), image_token_id=5, merge=2)


def test_image_prompts_match_transformers(vl, tmp_path):
    """Our decoder over image prompts (vision features in place, M-RoPE) gives transformers' logits
    for the same NVFP4 weights (activations kept bf16, so only rounding differs)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    art = open_artifact(vl / "art")
    ref = tmp_path / "ref"
    shutil.copytree(vl / "src", ref)
    tensors = load_file(ref / "model.safetensors")
    for name in art.names("nvfp4"):
        tensors[name] = art.dequantize(name).to(torch.bfloat16)
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    hf = tf.AutoModelForImageTextToText.from_pretrained(ref, dtype=torch.bfloat16).eval()

    tok = tf.AutoTokenizer.from_pretrained(art.hf_dir)
    samples = load_prompts(vl / "images", tok, vision=True, max_samples=8, seq_len=64, hf_dir=art.hf_dir)
    assert len(samples) == 3 and all(s.numel() <= 64 for s in samples)
    model = PactModel(art, None, activations="bf16")
    tower = VisionTower(art, "cpu")
    for s in samples:
        S = s.numel()
        assert 4 <= int((s.input_ids == tower.image_token_id).sum()) <= 16  # resized to the processor's budget
        with torch.no_grad():
            kinds = (s.input_ids == tower.image_token_id).int()[None]  # text 0 / image 1, as processors return it
            want = hf(input_ids=s.input_ids[None], pixel_values=s.pixel_values, image_grid_thw=s.grid_thw,
                      mm_token_type_ids=kinds).logits[0]
            x, pos = image_inputs(model, tower, s)
            h = model.run_layers(x, *model.rope_at(x, pos), 1, S)[0]
            got = rmsnorm(h, model.final_norm, model.eps).float() @ model.lm_head.float().t()
            # the same with plain 1-D positions: M-RoPE must matter for this check to mean anything
            h1 = model.run_layers(x, *model.rope(x, S), 1, S)[0]
            plain = rmsnorm(h1, model.final_norm, model.eps).float() @ model.lm_head.float().t()
        err = ((got - want.float()).norm() / want.float().norm()).item()
        err_1d = ((plain - want.float()).norm() / want.float().norm()).item()
        assert err < 0.02 and err_1d > 3 * err, (s.source, err, err_1d)


def test_calibrate_with_images(vl, tmp_path):
    out = tmp_path / "cal"
    r = CliRunner().invoke(calibrate_cli, [str(vl / "art"), "--prompts", str(vl / "images"), "--out", str(out),
                                           "--seq-len", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["output_error_ratio_gptq_over_rtn"]["max"] <= 1.0
    art = open_artifact(out)
    assert art.verify() > 0
    cal = art.meta["provenance"]["calibration"]
    assert cal["modality"] == "images" and cal["samples"] == 3 and len(cal["prompts_sha256"]) == 64
    errs = cal["layer_output_error"]
    assert len(errs) == 14
    for name, e in errs.items():
        assert e["gptq"] <= e["rtn"], name
    # the vision tower is carried over untouched
    src = open_artifact(vl / "art")
    vision = [n for n in src.names() if src.entry(n)["role"] == "vision"]
    assert vision and all(torch.equal(art.dense(n), src.dense(n)) for n in vision)
    # the calibrated vision-language artifact trains its language model on text
    make_sentiment_jsonl(tmp_path / "train.jsonl", 16)
    r = train(TrainConfig(artifact=str(out), data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"), steps=2,
                          batch_size=8, max_len=64), progress=False)
    assert r["step"] == 2


def test_language_model_prefix_binds(vl, tmp_path):
    """VL checkpoints re-saved with transformers' nested names (model.language_model.*,
    model.visual.*) bind to the same model; an artifact without token embeddings is refused."""
    from safetensors.torch import load_file, save_file

    def resave(folder, rename):
        shutil.copytree(vl / "src", folder)
        t = load_file(folder / "model.safetensors")
        save_file({rename(k): v for k, v in t.items()}, folder / "model.safetensors", metadata={"format": "pt"})
        return open_artifact(convert(str(folder), tmp_path / f"{folder.name}-art", progress=False, scaling="2d",
                                     block_scales="amax"))

    nested = resave(tmp_path / "nested", lambda k: "model.language_model." + k[len("model."):]
                    if k.startswith("model.") else "model." + k if k.startswith("visual.") else k)
    ids = torch.tensor([[1, 17, 42, 9, 33]])
    want = PactModel(open_artifact(vl / "art"), None).logits(ids)
    assert torch.equal(PactModel(nested, None).logits(ids), want)
    assert VisionTower(nested, "cpu").image_token_id == 5  # model.visual.* loads too
    bare = resave(tmp_path / "bare", lambda k: k.replace("embed_tokens", "tok_embeddings"))
    with pytest.raises(PactError, match="no model.embed_tokens.weight"):
        PactModel(bare, None)


def test_image_prompt_errors(vl, tmp_path):
    art = vl / "art"
    (tmp_path / "empty").mkdir()
    with pytest.raises(PactError, match="no png/jpg/jpeg/webp images in this folder"):
        calibrate(str(art), tmp_path / "empty", tmp_path / "c1")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.png").write_bytes(b"not a png")
    with pytest.raises(PactError, match="broken.png: not a readable image"):
        calibrate(str(art), bad, tmp_path / "c2")
    with pytest.raises(PactError, match="--seq-len 8: too short"):
        calibrate(str(art), vl / "images", tmp_path / "c3", seq_len=8)
    bare = tmp_path / "bare"
    shutil.copytree(art, bare)
    for f in bare.rglob("preprocessor_config.json"):
        f.unlink()
    rehash_artifact(bare)
    with pytest.raises(PactError, match="no image processor"):
        calibrate(str(bare), vl / "images", tmp_path / "c4")


def test_image_pad_token_mismatch(vl, tmp_path):
    """A config whose image token id names a string the tokenizer does not keep as one token
    (here an ordinary byte-level piece): one error naming the tokenizer, not a silent misplacement."""
    from transformers import AutoTokenizer

    bad = tmp_path / "bad"
    shutil.copytree(vl / "art", bad)
    cfg_path = next(bad.rglob("config.json"))
    tok = AutoTokenizer.from_pretrained(cfg_path.parent)
    piece = tok.convert_tokens_to_ids("\u0120")  # the space byte: as literal text it becomes two other bytes
    cfg = json.loads(cfg_path.read_text())
    cfg["image_token_id"] = piece
    cfg_path.write_text(json.dumps(cfg))
    rehash_artifact(bad)
    with pytest.raises(PactError, match="is not one token; the tokenizer does not match the model config"):
        calibrate(str(bad), vl / "images", tmp_path / "c")

