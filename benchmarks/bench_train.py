"""Training step (fwd + bwd + AdamW) of pact vs PEFT bf16 in the same process, same GPU.

    python benchmarks/bench_train.py --model llama-1b --batch 4 --seq 1024 --workdir /tmp/pact-bench

Random weights with Llama-3.2 shapes (the artifact is converted once into --workdir), LoRA
r=16 on q,k,v,o,gate,up,down, labels on every token (as the peers' anchor scripts do).
Reports median step ms, tokens/s and peak GiB. Needs a CUDA GPU and `peft`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch

from bench_convert import SHAPES, write_random_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _timed(step, warmup: int, iters: int) -> tuple[float, float]:
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


def bench_pact(art_path: Path, bs: int, seq: int, warmup: int, iters: int, activations: str = "nvfp4") -> dict:
    from pact.formats import open_artifact
    from pact.runtime.lora import LoraConfig
    from pact.runtime.model import PactModel

    torch.cuda.empty_cache()
    model = PactModel(open_artifact(art_path), LoraConfig(r=16, alpha=32), device="cuda", activations=activations)
    opt = torch.optim.AdamW(list(model.lora_params.values()), lr=1e-4, foreach=True)
    ids = torch.randint(0, 128000, (bs, seq), device="cuda")

    def step():
        loss, n = model(ids, ids)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms, peak = _timed(step, warmup, iters)
    method = f"pact-{model.kernels}-{activations}"
    del model, opt
    return {"method": method, "bs": bs, "step_ms": round(ms, 1), "tok_s": round(bs * seq / ms * 1e3),
            "peak_gib": round(peak, 2)}


def bench_peft(shape: str, bs: int, seq: int, warmup: int, iters: int, ckpt: bool = False) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.cuda.empty_cache()
    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 128000, (bs, seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms, peak = _timed(step, warmup, iters)
    del model, opt
    return {"method": "peft-bf16" + ("-ckpt" if ckpt else ""), "bs": bs, "step_ms": round(ms, 1),
            "tok_s": round(bs * seq / ms * 1e3), "peak_gib": round(peak, 2)}


@click.command()
@click.option("--model", "shape", type=click.Choice(["llama-1b", "llama-3b"]), default="llama-1b")
@click.option("--batch", "batches", default="4", show_default=True, help="Comma-separated batch sizes.")
@click.option("--seq", default=1024, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/pact-bench"))
@click.option("--warmup", default=2, show_default=True)
@click.option("--iters", default=5, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(shape, batches, seq, workdir, warmup, iters, json_out) -> None:
    from pact.convert import convert

    print(f"gpu={torch.cuda.get_device_name()} torch={torch.__version__}")
    src, art = workdir / f"src-{shape}", workdir / f"art-{shape}-2d"
    if not (art / "zarr.json").is_file():
        if not (src / "config.json").is_file():
            write_random_model(src, shape)
        t = time.perf_counter()
        convert(str(src), art, overwrite=True, progress=False)
        print(f"converted {shape} in {time.perf_counter() - t:.1f}s")
    rows = []
    for bs in (int(b) for b in batches.split(",")):
        for fn in (lambda: bench_pact(art, bs, seq, warmup, iters), lambda: bench_peft(shape, bs, seq, warmup, iters)):
            try:
                rows.append(fn())
            except torch.OutOfMemoryError:
                rows.append({"bs": bs, "oom": True})
            print(rows[-1], flush=True)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
    print(f"\n{'method':<24}{'bs':>4}{'step ms':>10}{'tok/s':>10}{'peak GiB':>10}")
    for r in rows:
        if "oom" not in r:
            print(f"{r['method']:<24}{r['bs']:>4}{r['step_ms']:>10.1f}{r['tok_s']:>10}{r['peak_gib']:>10.2f}")


if __name__ == "__main__":
    main()
