"""Data-parallel scaling of pact's training step: run under torchrun with 1 and then N processes
and compare global tokens/s (same per-rank batch; one gradient all-reduce per step, as pact-train
does under torchrun).

    torchrun --nproc-per-node 1 benchmarks/bench_ddp.py --model llama-1b --batch 16
    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --model llama-1b --batch 16   # scaling = ratio
    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --model tiny --batch 2 --seq 64   # CPU (gloo) smoke run

Random weights (bench_convert.py's shapes), converted once by rank 0 into --workdir; LoRA r 16 on
the seven projections; median step over --iters after --warmup, synchronized per step.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import click
import torch

from bench_convert import SHAPES, write_random_model


@click.command()
@click.option("--model", "shape", type=click.Choice(sorted(SHAPES)), default="llama-1b")
@click.option("--batch", default=16, show_default=True, help="Per-rank batch.")
@click.option("--seq", default=1024, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--iters", default=10, show_default=True)
@click.option("--compute", default="auto", show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/pact-bench"))
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(shape, batch, seq, warmup, iters, compute, workdir, json_out) -> None:
    from pact.convert import convert
    from pact.formats import open_artifact
    from pact.formats.peft import LoraConfig
    from pact.runtime.distributed import from_env, leave
    from pact.runtime.model import PactModel

    dist, device = from_env(None)
    src, art = workdir / f"src-{shape}", workdir / f"art-{shape}-ddp"
    if dist.main and not (art / "zarr.json").is_file():
        if not (src / "config.json").is_file():
            write_random_model(src, shape)
        convert(str(src), art, overwrite=True, progress=False)
    dist.barrier()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = PactModel(open_artifact(art), LoraConfig(r=16, alpha=32), device=dev, compute=compute)
    params = list(model.lora_params.values())
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=dev.type == "cuda")
    vocab = model.embed.shape[0]
    ids = torch.randint(0, vocab, (batch, seq), device=dev, generator=torch.Generator(dev).manual_seed(dist.rank))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        total, n = model(ids, ids)
        (total / n).backward()
        dist.sum_grads(params)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    ms = dist.sum([statistics.median(times) * 1e3], dev)[0] / dist.world  # mean over ranks of each's median
    row = {"model": shape, "ranks": dist.world, "batch_per_rank": batch, "seq": seq, "step_ms": round(ms, 1),
           "tok_s": round(batch * seq * dist.world / ms * 1e3),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None}
    if dist.main:
        print(json.dumps(row))
        if json_out:
            json_out.write_text(json.dumps(row) + "\n")
    leave(dist)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
