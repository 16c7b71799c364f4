"""Convert throughput (GB of bf16 source per second) and peak RSS, Llama-3.2-1B shapes.

    python benchmarks/bench_convert.py --model llama-1b --workdir /tmp/pact-bench

Writes a random bf16 model of the given shape as sharded safetensors (once, reused), then
runs `pact-convert` in a child process and reports wall time, GB/s and the child's peak
RSS. Results are appended to benchmarks/results/convert.csv.

    python benchmarks/bench_convert.py --model llama-1b --quantize-only --device cuda

times the quantization math alone (``quantize_member`` on every projection shape, random bf16
weights, no files) on a device, and checks its codes and scales against the CPU path's bit for bit.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=5e5),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=1e5),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}


def write_random_model(folder: Path, shape: str, shard_bytes: int = 1 << 30) -> int:
    """A random bf16 Llama of the given shape as sharded safetensors; returns weight bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    names = {n: tuple(p.shape) for n, p in model.state_dict().items()
             if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    folder.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the random numbers only (8B shapes: 16 GB of them)
    gen = torch.Generator(device=dev).manual_seed(0)
    shard, size, total, index, k = {}, 0, 0, {}, 0

    def flush():
        nonlocal shard, size, k
        fname = f"model-{k:05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        index.update({n: fname for n in shard})
        shard, size, k = {}, 0, k + 1

    for name, shp in names.items():
        t = torch.randn(shp, generator=gen, device=dev).mul_(0.02).to(torch.bfloat16).cpu()
        if "norm" in name:
            t = torch.ones(shp, dtype=torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    cfg.save_pretrained(folder)
    return total


def projection_shapes(shape: str) -> list[tuple[int, int]]:
    """[N, K] of every frozen projection of a Llama of the given shape, in file order."""
    c = SHAPES[shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * c["num_hidden_layers"]


def run_quantize(model: str, device: str, check: bool = True) -> dict:
    """Seconds of quantization math for every projection (host tensor in, host codes out, as the converter
    does); with ``check``, each distinct shape's codes and scales equal the CPU path's."""
    from pact.convert.convert import quantize_member, resolve_device
    from pact.formats.nvfp4 import global_scale_from_amax

    dev = resolve_device(device)
    shapes = projection_shapes(model)
    gen = torch.Generator().manual_seed(0)
    weights = {s: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for s in set(shapes)}
    g = global_scale_from_amax(max(float(w.abs().amax()) for w in weights.values()))
    for w in weights.values():  # warm-up: kernel build, CUDA context
        quantize_member(w[:16, :16], g, scaling="1d", scale_rule="mse", device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in shapes:
        quantize_member(weights[s], g, scaling="1d", scale_rule="mse", device=dev)
    seconds = time.perf_counter() - t0
    same = None
    if check:
        same = True
        for w in weights.values():
            a = quantize_member(w, g, scaling="1d", scale_rule="mse", device=dev)
            b = quantize_member(w, g, scaling="1d", scale_rule="mse", device=torch.device("cpu"))
            same &= all(torch.equal(x.packed, y.packed)
                        and torch.equal(x.scales.view(torch.uint8), y.scales.view(torch.uint8))
                        for x, y in zip(a[:2], b[:2]))
    elements = sum(n * k for n, k in shapes)
    return {"model": model, "device": str(dev), "projections": len(shapes), "seconds": round(seconds, 2),
            "bf16_gb_per_s": round(2 * elements / 1e9 / seconds, 3), "same_bits_as_cpu": same}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "?"


def run(model: str, workdir: Path, scaling: str) -> dict:
    src = workdir / f"src-{model}"
    if not (src / "model.safetensors.index.json").is_file():
        write_random_model(src, model)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    out = workdir / f"art-{model}-{scaling}"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pact.pipelines.convert", str(src), str(out), "--scaling", scaling, "--overwrite",
         "--quiet"],
        check=True,
    )
    seconds = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    art_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": _git_sha(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": model,
        "scaling": scaling,
        "source_gb": round(src_bytes / 1e9, 3),
        "artifact_gb": round(art_bytes / 1e9, 3),
        "seconds": round(seconds, 2),
        "gb_per_s": round(src_bytes / 1e9 / seconds, 3),
        "peak_rss_gb": round(peak_rss / 1e9, 3),
        "peak_rss_over_source": round(peak_rss / src_bytes, 3),
    }


@click.command()
@click.option("--model", type=click.Choice(sorted(SHAPES)), default="llama-1b", show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/pact-bench"),
              show_default=True)
@click.option("--scaling", type=click.Choice(["1d", "2d"]), default="1d", show_default=True,
              help="pact-convert --scaling (its default: 1d).")
@click.option("--csv-out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path(__file__).parent / "results" / "convert.csv", show_default=True)
@click.option("--quantize-only", is_flag=True, help="Time the quantization math alone on --device (no files).")
@click.option("--device", default="auto", show_default=True, help="With --quantize-only: auto, cpu or cuda.")
def main(model: str, workdir: Path, scaling: str, csv_out: Path, quantize_only: bool, device: str) -> None:
    if quantize_only:
        for k, v in run_quantize(model, device).items():
            click.echo(f"{k:>22}: {v}")
        return
    row = run(model, workdir, scaling)
    csv_out.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_out.exists()
    with open(csv_out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)
    for k, v in row.items():
        click.echo(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
