"""Training step (fwd + bwd + AdamW) of pact vs peers in the same process, same GPU.

    python benchmarks/bench_train.py --model llama-1b --batch 4,16 --methods pact,peft
    python benchmarks/bench_train.py --model llama-1b --memory-cap-gib 16 \
        --methods pact,pact-ckpt,peft,peft-ckpt,liger,liger-ckpt

Peers: PEFT bf16 and PEFT + Liger kernels (liger-kernel), each with and without gradient
checkpointing. QLoRA (bitsandbytes) is not wired in yet.

Random weights with Llama-3.2 shapes (the artifact is converted once into --workdir), LoRA
r=16 on q,k,v,o,gate,up,down, labels on every token (as the peers' anchor scripts do).
Reports median step ms, tokens/s and peak GiB. Needs a CUDA GPU and `peft`.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import click
import torch

from bench_convert import SHAPES, write_random_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _timed(step, warmup: int, iters: int) -> tuple[float, float]:
    """Median step ms over ``iters`` after ``warmup`` steps, and the peak GiB allocated."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, torch.cuda.max_memory_allocated() / 2**30


def _time_training(loss_fn, params, warmup: int, iters: int) -> tuple[float, float]:
    """A training step = loss_fn().backward() + AdamW; timed by _timed."""
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step():
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, warmup, iters)


def bench_pact(art_path: Path, bs: int, seq: int, warmup: int, iters: int, checkpoint: bool = False) -> dict:
    from pact.formats import open_artifact
    from pact.runtime.lora import LoraConfig
    from pact.runtime.model import PactModel

    model = PactModel(open_artifact(art_path), LoraConfig(r=16, alpha=32), device="cuda", checkpoint=checkpoint)
    ids = torch.randint(0, 128000, (bs, seq), device="cuda")

    def loss():
        total, n = model(ids, ids)
        return total / n

    return _time_training(loss, list(model.lora_params.values()), warmup, iters)


def bench_peft(shape: str, bs: int, seq: int, warmup: int, iters: int, checkpoint: bool = False,
               liger: bool = False) -> tuple[float, float]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    if liger:  # patches transformers' Llama in place: run these last
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ids = torch.randint(0, 128000, (bs, seq), device="cuda")
    return _time_training(lambda: model(input_ids=ids, labels=ids).loss,
                          [p for p in model.parameters() if p.requires_grad], warmup, iters)


METHODS = ("pact", "pact-ckpt", "peft", "peft-ckpt", "liger", "liger-ckpt")  # liger last (patches transformers)
# candidate batch sizes for the capped search (ascending; the search stops at the first OOM)
CAP_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 96)


def measure(method: str, art: Path, shape: str, bs: int, seq: int, warmup: int, iters: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    row = {"method": method, "bs": bs}
    try:
        ckpt = method.endswith("-ckpt")
        if method.startswith("pact"):
            ms, peak = bench_pact(art, bs, seq, warmup, iters, checkpoint=ckpt)
        else:
            ms, peak = bench_peft(shape, bs, seq, warmup, iters, checkpoint=ckpt, liger=method.startswith("liger"))
        row.update(step_ms=round(ms, 1), tok_s=round(bs * seq / ms * 1e3), peak_gib=round(peak, 2))
    except torch.OutOfMemoryError:
        row["oom"] = True
    gc.collect()
    torch.cuda.empty_cache()
    print(row, flush=True)
    return row


@click.command()
@click.option("--model", "shape", type=click.Choice(["llama-1b", "llama-3b"]), default="llama-1b")
@click.option("--batch", "batches", default="4", show_default=True, help="Comma-separated batch sizes (no cap).")
@click.option("--methods", default="pact,peft", show_default=True, help=f"Comma-separated, from {', '.join(METHODS)}.")
@click.option("--memory-cap-gib", type=float, default=None,
              help="Cap GPU memory and find each method's largest fitting batch (tokens/s reported there).")
@click.option("--seq", default=1024, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/pact-bench"))
@click.option("--warmup", default=2, show_default=True)
@click.option("--iters", default=5, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(shape, batches, methods, memory_cap_gib, seq, workdir, warmup, iters, json_out) -> None:
    from pact.convert import convert

    print(f"gpu={torch.cuda.get_device_name()} torch={torch.__version__}")
    src, art = workdir / f"src-{shape}", workdir / f"art-{shape}-2d"
    if not (art / "zarr.json").is_file():
        if not (src / "config.json").is_file():
            write_random_model(src, shape)
        t = time.perf_counter()
        convert(str(src), art, overwrite=True, progress=False)
        print(f"converted {shape} in {time.perf_counter() - t:.1f}s")
    chosen = [m for m in METHODS if m in methods.split(",")]
    rows = []
    if memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(memory_cap_gib * 2**30 / total)
        for method in chosen:
            fits = []
            for bs in CAP_BATCHES:
                r = measure(method, art, shape, bs, seq, warmup, iters)
                if r.get("oom"):
                    break
                fits.append(r)
            if fits:
                best = max(fits, key=lambda r: r["tok_s"])
                rows.append({**best, "cap_gib": memory_cap_gib, "largest_bs": fits[-1]["bs"]})
    else:
        for bs in (int(b) for b in batches.split(",")):
            for method in chosen:
                rows.append(measure(method, art, shape, bs, seq, warmup, iters))
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
    cap = f" under {memory_cap_gib} GiB (best batch)" if memory_cap_gib else ""
    print(f"\n{shape}, seq {seq}{cap}")
    print(f"{'method':<14}{'bs':>4}{'step ms':>10}{'tok/s':>10}{'peak GiB':>10}")
    for r in rows:
        if "oom" not in r:
            print(f"{r['method']:<14}{r['bs']:>4}{r['step_ms']:>10.1f}{r['tok_s']:>10}{r['peak_gib']:>10.2f}")


if __name__ == "__main__":
    main()
