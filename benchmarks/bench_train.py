"""Training step (fwd + bwd + AdamW) of pact vs peers in the same process, same GPU.

    python benchmarks/bench_train.py --model llama-1b --batch 4,16 --methods pact-fp8,pact-bf16,peft,liger
    python benchmarks/bench_train.py --model llama-1b --memory-cap-gib 16 \
        --methods pact-fp8,pact-fp8-ckpt,peft,peft-ckpt,qlora,qlora-ckpt,liger,liger-ckpt --csv-out cap.csv
    python benchmarks/bench_train.py --model llama-1b --batch 16 --methods pact-fp8 --profile

pact runs each compute backend it can on this GPU (`pact-fp8`: --compute fp8, `pact-fp8res`:
the same with --fp8-weights resident, `pact-bf16`: --compute bf16-decode), with and without
--checkpoint. Peers: PEFT bf16, QLoRA (bitsandbytes NF4, double quant), PEFT + Liger kernels
(liger-kernel), each with and without gradient checkpointing. `--csv-out` writes every row; `benchmarks/plot_train.py`
turns CSVs into a PNG.
`--profile` prints where a pact step's CUDA time goes (kernel categories, like PACT's Table 11).

Random weights with Llama-3.2 shapes (the artifact is converted once into --workdir), LoRA
r=16 on q,k,v,o,gate,up,down, labels on every token (as the peers' anchor scripts do).
Reports median step ms, tokens/s and peak GiB. Needs a CUDA GPU and `peft`.
"""

from __future__ import annotations

import csv
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


ACTIVATIONS = {"spec": None}  # --activations: the precision recipe of every pact method (None: the default)
LAYERS = {"spec": "all"}  # --lora-layers: the decoder blocks that get adapters (pact-train --lora-layers)
VOCAB = {"n": 128000}  # token ids drawn below this (the shape's vocabulary)
GRAPHS = {"on": False}  # --cuda-graphs: pact's steps replay the decoder stack as CUDA graphs
BACKWARD = {"weights": "auto"}  # --backward-weights: what pact's input-gradient GEMMs read
CORRECTION = {"rank": 0}  # --correct-rank: the rank of the artifact's frozen correction (0: none)


def with_random_correction(art_path: Path, rank: int, every: int = 1, scale: float = 1e-2) -> Path:
    """A copy of the artifact at ``art_path`` (beside it, ``-cRANK``) whose projections carry a rank-``rank``
    correction U V of random values (what pact-calibrate --correct-rank stores; the step's cost does not depend on
    the values): every ``every``-th tensor's (1: all; 2 gives a group members with and without one), entries of sd
    ``scale``."""
    from pact.formats import ArtifactWriter, open_artifact

    out = art_path.with_name(f"{art_path.name}-c{rank}")
    CORRECTION["rank"] = rank
    if (out / "zarr.json").is_file():
        return out
    art, gen = open_artifact(art_path), torch.Generator().manual_seed(0)
    with ArtifactWriter(out, overwrite=True) as w:
        for i, name in enumerate(art.names()):
            e, info = art.entry(name), art.entry_info(name)
            if e["kind"] == "nvfp4":
                n, k = e["shape"]
                corr = ((torch.randn(n, rank, generator=gen) * scale, torch.randn(rank, k, generator=gen) * scale)
                        if i % every == 0 else None)
                w.add_nvfp4(name, art.nvfp4(name, "fwd"), art.nvfp4(name, "bwd"), corr, **info)
            else:
                w.add_dense(name, art.dense(name), **info)
        for rel in art.meta["files"]:
            w.add_file(art.hf_dir / rel, rel)
        w.commit(**{k: art.meta[k] for k in ("architecture", "family", "vision", "hf_config", "provenance")})
    return out


def _pact(art_path: Path, compute: str, checkpoint: bool):
    """``compute``: a key of COMPUTE (fp8, fp8res = fp8 with resident E4M3 weights, bf16)."""
    from pact.formats import open_artifact
    from pact.formats.peft import LoraConfig
    from pact.runtime.model import PactModel

    return PactModel(open_artifact(art_path), LoraConfig(r=16, alpha=32, layers=LAYERS["spec"]), device="cuda",
                     compute=COMPUTE[compute],
                     checkpoint=checkpoint, fp8_weights="resident" if compute == "fp8res" else "per-call",
                     activations=ACTIVATIONS["spec"], cuda_graphs=GRAPHS["on"], backward_weights=BACKWARD["weights"])


def bench_pact(art_path: Path, bs: int, seq: int, warmup: int, iters: int, compute: str,
               checkpoint: bool = False) -> tuple[float, float]:
    model = _pact(art_path, compute, checkpoint)
    ids = torch.randint(0, VOCAB["n"], (bs, seq), device="cuda")

    def loss():
        total, n = model(ids, ids)
        return total / n

    return _time_training(loss, list(model.lora_params.values()), warmup, iters)


# Our launchers, annotated while profiling: every CUDA kernel they launch (cuBLAS included)
# is counted in their category; other kernels are classified by name.
# (dgrad_gemm: the input-gradient GEMMs, which a name match would file under "other GEMMs")
OP_CATEGORIES = {"nvfp4_gemm": "frozen GEMMs (incl. operand decode/re-encode)",
                 "dgrad_gemm": "frozen GEMMs (incl. operand decode/re-encode)",
                 "ce_grad_": "softmax / cross-entropy", "rope": "elementwise / copies / other"}
NORM_OPS = ("rmsnorm_quant", "silu_mul_quant", "rmsnorm_rows", "silu_mul_rows", "quant_rows", "quant_saved",
            "quant_saved_sr", "e4m3_rows", "dequant_rows", "rmsnorm_backward", "silu_mul_h", "silu_mul_backward")
OP_CATEGORIES.update({op: "RMSNorm / SiLU-mul / NVFP4 (de)quantize" for op in NORM_OPS})
KERNEL_CATEGORIES = (  # Triton launches are not attached to the annotated op: matched by kernel name
    ("frozen GEMMs (incl. operand decode/re-encode)", ("_fp8_rows", "_nvfp4_gemm", "_nvfp4_native")),
    ("RMSNorm / SiLU-mul / NVFP4 (de)quantize", ("_rmsnorm", "_silu_mul", "_quant_rows", "_dequant_rows")),
    ("attention (SDPA)", ("flash", "fmha", "attention", "attn")),
    ("optimizer (AdamW)", ("multi_tensor", "adam")),
    ("other GEMMs (LoRA, lm_head CE chunks)", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "splitk", "cublas")),
    ("softmax / cross-entropy", ("softmax", "nll", "cross_entropy", "logsumexp")),
)


def _annotate(ops):
    """``ops`` with each launcher in OP_CATEGORIES run under a profiler label."""
    import dataclasses

    from torch.profiler import record_function

    def wrap(name, fn):
        def run(*args, **kwargs):
            with record_function(f"pact::{name}"):
                return fn(*args, **kwargs)
        return run

    return dataclasses.replace(ops, **{name: wrap(name, getattr(ops, name)) for name in OP_CATEGORIES})


def profile_pact(art_path: Path, bs: int, seq: int, compute: str, checkpoint: bool, top: int = 40
                 ) -> tuple[list[tuple[str, float]], list[tuple[str, str, float, int, str]]]:
    """CUDA time of one training step by category, ms (after two warm-up steps), and the
    ``top`` kernels by (kernel, launching op) (category, name, ms, calls, launching op)."""
    from torch.profiler import ProfilerActivity, profile

    model = _pact(art_path, compute, checkpoint)
    model.ops = _annotate(model.ops)
    ids = torch.randint(0, VOCAB["n"], (bs, seq), device="cuda")
    opt = torch.optim.AdamW(list(model.lora_params.values()), lr=1e-4, foreach=True)

    def step():
        total, n = model(ids, ids)
        (total / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return _attribute(prof.events(), top)


def _attribute(events, top: int) -> tuple[list[tuple[str, float]], list[tuple[str, str, float, int, str]]]:
    """A profile's events -> CUDA ms by category, and the ``top`` (kernel, launching op) pairs."""
    sums: dict[str, float] = {}
    kernels: dict[tuple[str, str, str], list] = {}
    for ev in events:
        for k in getattr(ev, "kernels", ()):  # kernels launched by this CPU op
            cat, e, owner = None, ev, None
            while e is not None and cat is None:
                if e.name.startswith("pact::"):
                    cat, owner = OP_CATEGORIES[e.name[6:]], e.name
                root, e = e, e.cpu_parent
            if cat is None:
                name = k.name.lower()
                cat = next((c for c, keys in KERNEL_CATEGORIES if any(w in name for w in keys)),
                           "elementwise / copies / other")
                # who launched it: the CPU op itself and the outermost one (an autograd node's name in
                # backward, a module's op in forward), so "other" GEMMs and copies can be told apart
                owner = ev.name if root is ev else f"{root.name[-48:]} > {ev.name}"
            sums[cat] = sums.get(cat, 0.0) + k.duration / 1e3
            acc = kernels.setdefault((cat, k.name[:90], owner[:90]), [0.0, 0])
            acc[0] += k.duration / 1e3
            acc[1] += 1
    if not sums:
        raise RuntimeError("the profiler attached no CUDA kernels to CPU ops (torch version?)")
    tops = sorted(((c, n, ms, calls, o) for (c, n, o), (ms, calls) in kernels.items()), key=lambda r: -r[2])[:top]
    return sorted(sums.items(), key=lambda kv: -kv[1]), tops


class LoadOOM(RuntimeError):
    """A peer ran out of memory while loading (before any step)."""


def bench_peft(shape: str, bs: int, seq: int, warmup: int, iters: int, checkpoint: bool = False,
               liger: bool = False, qlora_src: Path | None = None) -> tuple[float, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if qlora_src is not None:  # QLoRA: the same random weights, quantized to NF4 by bitsandbytes on load
        from transformers import BitsAndBytesConfig

        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=True)
        try:
            model = LlamaForCausalLM.from_pretrained(qlora_src, quantization_config=q, dtype=torch.bfloat16,
                                                     device_map={"": 0}, attn_implementation="sdpa")
        except torch.OutOfMemoryError as e:  # loading, not the step: say so in the row
            raise LoadOOM(f"loading: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak") from e
        print(f"qlora loaded: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated", flush=True)
        return _peft_step(model, bs, seq, warmup, iters, checkpoint)
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
    return _peft_step(model, bs, seq, warmup, iters, checkpoint)


def _peft_step(model, bs: int, seq: int, warmup: int, iters: int, checkpoint: bool) -> tuple[float, float]:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    model.train()  # from_pretrained (the QLoRA peer) returns eval mode, where transformers skips checkpointing
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ids = torch.randint(0, VOCAB["n"], (bs, seq), device="cuda")
    return _time_training(lambda: model(input_ids=ids, labels=ids).loss,
                          [p for p in model.parameters() if p.requires_grad], warmup, iters)


# liger last: it patches transformers' Llama in place
METHODS = ("pact-fp8", "pact-fp8-ckpt", "pact-fp8res", "pact-fp8res-ckpt", "pact-bf16", "pact-bf16-ckpt",
           "peft", "peft-ckpt", "qlora", "qlora-ckpt", "liger", "liger-ckpt")
COMPUTE = {"fp8": "fp8", "fp8res": "fp8", "bf16": "bf16-decode"}  # method's middle word -> --compute
# candidate batch sizes for the capped search (ascending; the search stops at the first OOM)
CAP_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 96)


def measure(method: str, art: Path, src: Path, shape: str, bs: int, seq: int, warmup: int, iters: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() / 2**30  # what earlier measurements left allocated (should be ~0)
    row = {"model": shape, "method": method, "bs": bs, "seq": seq, "held_before_gib": round(held, 2),
           "correct_rank": CORRECTION["rank"] if method.startswith("pact") else 0,
           "recipe": ACTIVATIONS["spec"] if method.startswith("pact") else "",
           "lora_layers": LAYERS["spec"] if method.startswith("pact") else "all",
           "graphs": GRAPHS["on"] and method.startswith("pact"),
           "backward_weights": BACKWARD["weights"] if method.startswith("pact") else ""}
    try:
        ckpt = method.endswith("-ckpt")
        if method.startswith("pact"):
            ms, peak = bench_pact(art, bs, seq, warmup, iters, method.split("-")[1], checkpoint=ckpt)
        else:
            ms, peak = bench_peft(shape, bs, seq, warmup, iters, checkpoint=ckpt, liger=method.startswith("liger"),
                                  qlora_src=src if method.startswith("qlora") else None)
        # reserved: what the process holds (a CUDA graph's pool, allocated during the capture in the warm-up, counts
        # here; the peak allocated is reset after the warm-up)
        row.update(step_ms=round(ms, 1), tok_s=round(bs * seq / ms * 1e3), peak_gib=round(peak, 2),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    except torch.OutOfMemoryError:
        row["oom"] = True
    except LoadOOM as e:
        row.update(oom=True, error=f"out of memory while {e}")
    except Exception as e:  # a peer that cannot run here (e.g. bitsandbytes without its CUDA library)
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    gc.collect()
    torch.cuda.empty_cache()
    print(row, flush=True)
    return row


@click.command()
@click.option("--model", "shape", type=click.Choice(["smollm2-135m", "llama-1b", "llama-3b", "llama-8b"]),
              default="llama-1b")
@click.option("--batch", "batches", default="4", show_default=True, help="Comma-separated batch sizes (no cap).")
@click.option("--methods", default="pact-fp8,peft", show_default=True,
              help=f"Comma-separated, from {', '.join(METHODS)}.")
@click.option("--memory-cap-gib", type=float, default=None,
              help="Cap GPU memory and find each method's largest fitting batch (tokens/s reported there).")
@click.option("--seq", default=1024, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/pact-bench"))
@click.option("--warmup", default=2, show_default=True)
@click.option("--iters", default=5, show_default=True)
@click.option("--cap-batches", default=",".join(map(str, CAP_BATCHES)), show_default=True,
              help="Batch sizes tried (ascending) under --memory-cap-gib; the search stops at the first OOM.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--csv-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--profile", is_flag=True, help="Also print a CUDA-time breakdown of one step of each pact method.")
@click.option("--activations", default=None,
              help="pact's precision recipe (pact-train --activations; default: its default).")
@click.option("--lora-layers", default="all", show_default=True,
              help="Decoder blocks of pact's adapters (pact-train --lora-layers: all, top:N, A-B); peers adapt all.")
@click.option("--cuda-graphs", is_flag=True, help="pact's steps replay the decoder layers as CUDA graphs "
                                                  "(pact-train --cuda-graphs on; the capture is in the warm-up).")
@click.option("--backward-weights", type=click.Choice(["auto", "layout", "forward"]), default="auto", show_default=True,
              help="What pact's input-gradient GEMMs read (pact-train --backward-weights).")
@click.option("--correct-rank", default=0, show_default=True,
              help="pact's artifact carries a frozen rank-R correction per projection (pact-calibrate --correct-rank; "
                   "random U, V here: its cost, not its accuracy). Peers are unchanged.")
def main(shape, batches, methods, memory_cap_gib, seq, workdir, warmup, iters, cap_batches, json_out, csv_out,
         profile, activations, lora_layers, cuda_graphs, backward_weights, correct_rank) -> None:
    from pact.convert import convert
    from pact.runtime.recipe import parse_recipe

    ACTIVATIONS["spec"] = parse_recipe(activations).spec()
    LAYERS["spec"] = lora_layers
    GRAPHS["on"] = cuda_graphs
    BACKWARD["weights"] = backward_weights
    VOCAB["n"] = min(VOCAB["n"], SHAPES[shape]["vocab_size"])
    print(f"pact recipe: --activations {ACTIVATIONS['spec']} --lora-layers {lora_layers} --cuda-graphs {cuda_graphs} "
          f"--backward-weights {backward_weights}")

    print(f"gpu={torch.cuda.get_device_name()} torch={torch.__version__}")
    src, art = workdir / f"src-{shape}", workdir / f"art-{shape}-2d"
    if not (src / "config.json").is_file() and (not (art / "zarr.json").is_file() or "qlora" in methods):
        write_random_model(src, shape)
    if not (art / "zarr.json").is_file():
        t = time.perf_counter()
        convert(str(src), art, overwrite=True, progress=False)
        print(f"converted {shape} in {time.perf_counter() - t:.1f}s")
    if correct_rank:
        art = with_random_correction(art, correct_rank)
    unknown = sorted(set(methods.split(",")) - set(METHODS))
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {', '.join(METHODS)}", param_hint="--methods")
    chosen = [m for m in METHODS if m in methods.split(",")]
    rows = []
    if memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(memory_cap_gib * 2**30 / total)
        for method in chosen:
            fits = []
            for bs in (int(b) for b in cap_batches.split(",")):
                r = measure(method, art, src, shape, bs, seq, warmup, iters)
                if r.get("oom") or r.get("error"):
                    break
                fits.append(r)
            if fits:
                best = max(fits, key=lambda r: r["tok_s"])
                rows.append({**best, "cap_gib": memory_cap_gib, "largest_bs": fits[-1]["bs"]})
            else:  # not even the smallest batch ran: keep why
                rows.append({**r, "cap_gib": memory_cap_gib})
    else:
        for bs in (int(b) for b in batches.split(",")):
            for method in chosen:
                rows.append(measure(method, art, src, shape, bs, seq, warmup, iters))
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
    if csv_out:
        fields = ["model", "method", "recipe", "lora_layers", "graphs", "backward_weights", "correct_rank", "bs", "seq",
                  "step_ms", "tok_s", "peak_gib", "reserved_gib", "held_before_gib", "cap_gib",
                  "largest_bs", "oom", "error"]
        with open(csv_out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    cap = f" under {memory_cap_gib} GiB (best batch)" if memory_cap_gib else ""
    print(f"\n{shape}, seq {seq}{cap}")
    print(f"{'method':<14}{'bs':>4}{'step ms':>10}{'tok/s':>10}{'peak GiB':>10}")
    for r in rows:
        if "step_ms" in r:
            print(f"{r['method']:<14}{r['bs']:>4}{r['step_ms']:>10.1f}{r['tok_s']:>10}{r['peak_gib']:>10.2f}")
        else:
            print(f"{r['method']:<14}{r['bs']:>4}  {r.get('error') or 'out of memory'}")
    if profile:
        torch.cuda.set_per_process_memory_fraction(1.0)
        bs = int(batches.split(",")[-1])
        for method in (m for m in chosen if m.startswith("pact")):
            gc.collect()
            torch.cuda.empty_cache()
            parts, tops = profile_pact(art, bs, seq, method.split("-")[1], method.endswith("-ckpt"))
            total = sum(ms for _, ms in parts)
            print(f"\n{method} bs {bs}: CUDA time of one step by kernel category ({total:.1f} ms)")
            for cat, ms in parts:
                print(f"  {cat:<48}{ms:>9.1f} ms {100 * ms / total:>5.1f}%")
            print("  top kernels:")
            for cat, name, ms, calls, owner in tops:
                print(f"    {ms:>8.2f} ms {calls:>5}x  {name}  [{cat.split(' ')[0]}]  <- {owner}")


if __name__ == "__main__":
    main()
