"""Image-prompt calibration vs text-only calibration on a vision-language model, measured where a
user would feel it: answers to held-out image questions.

No real VL weights can be fetched offline, so the model is the smallest honest stand-in: a tiny
Qwen2-VL (random init, the test suite's config scaled up) trained on the CPU on a synthetic
image-question task (a coloured square on a noisy background: "What colour is the square?", one
of COLORS, answered with one letter). Then, with pact: convert (the converter's defaults, RTN),
and calibrate the same artifact twice with the same GPTQ settings: on image prompts (a folder of
task images with the question beside each) and on text prompts only (the same number of text
prompts: the question and short sentences, no image), as a user without images would.

Measured on held-out images, each artifact against the trained bf16 model (transformers, fp32):
KL divergence of the next-token distribution at the answer position, agreement of the answer
(argmax over the answer letters) with the bf16 model's, accuracy against the truth; paired
differences per image (mean +- standard error), over model seeds.

    python benchmarks/bench_vl_calibrate.py --workdir /tmp/vlcal --seeds 0,1,2

Limits: a 2-layer model of hidden 128 trained on one synthetic task; the vision tower stays bf16
in pact (only the language model's projections are quantized and calibrated).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny-model builders

COLORS = {"r": (220, 40, 40), "g": (40, 200, 60), "b": (40, 70, 230), "y": (230, 210, 40),
          "m": (210, 50, 200), "c": (40, 210, 210)}
QUESTION = "What colour is the square? Answer with its letter."
# head_dim 16: the mrope_section make_model sets
DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)


def make_images(folder: Path, n: int, seed: int) -> list[str]:
    """n 56x56 images (4 image tokens each after the processor) with the question beside each;
    returns the true letters in file order."""
    from PIL import Image

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    truth = []
    for i in range(n):
        letter = rng.choice(sorted(COLORS))
        img = (torch.rand(56, 56, 3, generator=g) * 120 + 60).to(torch.uint8)  # grey noise
        side = rng.randint(12, 30)
        y, x = rng.randint(0, 56 - side), rng.randint(0, 56 - side)
        col = torch.tensor(COLORS[letter]) + torch.randint(-30, 31, (3,), generator=g)
        img[y : y + side, x : x + side] = col.clamp(0, 255).to(torch.uint8)
        Image.fromarray(img.numpy()).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(QUESTION)
        truth.append(letter)
    return truth


def _batch(samples, answer_ids, letters, image_token_id):
    ids = torch.stack([torch.cat([s.input_ids, torch.tensor([answer_ids[c]])]) for s, c in zip(samples, letters)])
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    return dict(input_ids=ids, labels=labels, pixel_values=torch.cat([s.pixel_values for s in samples]),
                image_grid_thw=torch.cat([s.grid_thw for s in samples]),
                mm_token_type_ids=(ids == image_token_id).int())


def train_model(src: Path, samples, letters, answer_ids, image_token_id, seed: int, steps: int, lr: float) -> None:
    import transformers as tf

    model = tf.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    for step in range(steps):
        idx = rng.sample(range(len(samples)), 16)
        loss = model(**_batch([samples[i] for i in idx], answer_ids, [letters[i] for i in idx], image_token_id)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.to(torch.bfloat16).save_pretrained(src)


@torch.no_grad()
def reference_logits(src: Path, samples, image_token_id) -> torch.Tensor:
    """The trained model's next-token logits at the answer position [n, V] (transformers, fp32)."""
    import transformers as tf

    model = tf.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = s.input_ids[None]
        out.append(model(input_ids=ids, pixel_values=s.pixel_values, image_grid_thw=s.grid_thw,
                         mm_token_type_ids=(ids == image_token_id).int()).logits[0, -1].float())
    return torch.stack(out)


@torch.no_grad()
def pact_logits(art_path: Path, samples) -> torch.Tensor:
    from pact.formats import open_artifact
    from pact.runtime.model import PactModel, rmsnorm
    from pact.runtime.vision import VisionTower, image_inputs

    art = open_artifact(art_path)
    model, tower = PactModel(art, None), VisionTower(art, "cpu")
    out = []
    for s in samples:
        x, pos = image_inputs(model, tower, s)
        h = model.run_layers(x, *model.rope_at(x, pos), 1, s.numel())[0, -1]
        out.append((rmsnorm(h[None], model.final_norm, model.eps).float() @ model.lm_head.float().t())[0])
    return torch.stack(out)


def text_prompts(path: Path, n: int, seed: int) -> Path:
    """n text-only prompts: the question in the chat format, after a few of the tokenizer's
    training sentences (so no two are the same)."""
    from conftest import TINY_TEXT

    rng = random.Random(seed)
    recs = [{"messages": [{"role": "user", "content": " ".join(rng.sample(TINY_TEXT[:5], 2)) + " " + QUESTION}]}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def one_seed(workdir: Path, seed: int, n_train: int, n_calib: int, n_test: int, steps: int, lr: float) -> list[dict]:
    from transformers import AutoTokenizer

    from conftest import make_model
    from pact.calibrate import calibrate
    from pact.calibrate.prompts import load_prompts
    from pact.convert import convert

    d = workdir / f"seed{seed}"
    make_model(d / "src", "qwen2_vl", seed=seed, **DIMS)
    tok = AutoTokenizer.from_pretrained(d / "src")
    image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
    answer_ids = {c: tok(c, add_special_tokens=False)["input_ids"][0] for c in COLORS}
    assert len(set(answer_ids.values())) == len(COLORS), "each answer letter must be one token"
    sets = {}
    for name, n, s in (("train", n_train, 1000 + seed), ("calib", n_calib, 2000 + seed), ("test", n_test, 3000 + seed)):
        letters = make_images(d / name, n, s)
        sets[name] = (load_prompts(d / name, tok, vision=True, max_samples=n, seq_len=128, hf_dir=d / "src"), letters)
    t = time.perf_counter()
    train_model(d / "src", *sets["train"], answer_ids, image_token_id, seed, steps, lr)
    t_train = time.perf_counter() - t
    convert(str(d / "src"), d / "art", progress=False, overwrite=True)
    common = dict(max_samples=n_calib, seq_len=128, overwrite=True, progress=False)
    calibrate(str(d / "art"), d / "calib", d / "gptq-images", **common)
    calibrate(str(d / "art"), text_prompts(d / "calib-text.jsonl", n_calib, seed), d / "gptq-text", **common)
    test, truth = sets["test"]
    ref = reference_logits(d / "src", test, image_token_id)
    cols = torch.tensor([answer_ids[c] for c in sorted(COLORS)])
    want = torch.tensor([sorted(COLORS).index(c) for c in truth])
    ref_answer = ref[:, cols].argmax(1)
    rows = [{"seed": seed, "weights": "bf16 (transformers)", "train_s": round(t_train, 1),
             "accuracy": float((ref_answer == want).float().mean())}]
    for name in ("art", "gptq-text", "gptq-images"):
        got = pact_logits(d / name, test)
        kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
        ans = got[:, cols].argmax(1)
        rows.append({"seed": seed, "weights": {"art": "RTN"}.get(name, name), "kl": kl.tolist(),
                     "agree": (ans == ref_answer).float().tolist(), "accuracy": float((ans == want).float().mean())})
    return rows


def _se(v: list[float]) -> float:
    return statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan")


@click.command()
@click.option("--workdir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--train", "n_train", default=512, show_default=True)
@click.option("--calib", "n_calib", default=64, show_default=True)
@click.option("--test", "n_test", default=256, show_default=True)
@click.option("--steps", default=300, show_default=True)
@click.option("--lr", default=2e-3, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(workdir, seeds, n_train, n_calib, n_test, steps, lr, json_out) -> None:
    rows = [r for s in seeds.split(",") for r in one_seed(workdir, int(s), n_train, n_calib, n_test, steps, lr)]
    if json_out:
        json_out.write_text(json.dumps(rows))
    by = {}
    for r in rows:
        by.setdefault(r["weights"], []).append(r)
    click.echo("| weights | KL to bf16 at the answer (mean +- se) | answer agrees with bf16 | accuracy | seeds |")
    click.echo("|---|---|---|---|---|")
    for w, rs in by.items():
        if "kl" not in rs[0]:
            click.echo(f"| {w} | 0 | 100% | {100 * statistics.mean(r['accuracy'] for r in rs):.1f}% | {len(rs)} |")
            continue
        kl = [k for r in rs for k in r["kl"]]
        agree = [a for r in rs for a in r["agree"]]
        click.echo(f"| {w} | {statistics.mean(kl):.3g} +- {_se(kl):.2g} | {100 * statistics.mean(agree):.1f}% | "
                   f"{100 * statistics.mean(r['accuracy'] for r in rs):.1f}% | {len(rs)} |")
    img = [k for r in by["gptq-images"] for k in r["kl"]]
    for other in ("gptq-text", "RTN"):
        ref = [k for r in by[other] for k in r["kl"]]
        d = [a - b for a, b in zip(img, ref)]
        ratio = statistics.mean(img) / statistics.mean(ref)
        click.echo(f"image-prompt calibration vs {other}: KL difference per image {statistics.mean(d):+.3g} +- "
                   f"{_se(d):.2g} ({sum(x < 0 for x in d)} of {len(d)} images lower); KL ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
