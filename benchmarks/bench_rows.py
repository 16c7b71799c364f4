"""The chunked row kernels (SiLU-mul quantize / recompute / backward, dequantize, E4M3 rows)
at Llama-3.2-1B MLP widths, per (ROW_CHUNK, warps) choice; prints the best.

    python benchmarks/bench_rows.py --tokens 16384        # needs a CUDA GPU

Times are medians of CUDA-event timings (bench_gemm.time_ms); GB/s counts the bytes each
kernel must move (inputs read once, outputs written once).
"""

from __future__ import annotations

import itertools

import click
import torch

from bench_gemm import time_ms


@click.command()
@click.option("--tokens", default=16384, show_default=True)
@click.option("--inter", default=8192, show_default=True)
@click.option("--chunks", default="1024,2048,4096", show_default=True)
@click.option("--warps", "warps_csv", default="4,8,16", show_default=True)
def main(tokens: int, inter: int, chunks: str, warps_csv: str) -> None:
    from pact.runtime.ops import triton as K
    from pact.runtime.ops.triton import codec as KN
    from pact.runtime.ops.triton.fp8 import fp8_rows

    chunks, warps_list = [int(c) for c in chunks.split(",")], [int(w) for w in warps_csv.split(",")]

    torch.manual_seed(0)
    gu = torch.randn(tokens, 2 * inter, device="cuda").to(torch.bfloat16)
    h, g, u = K.silu_mul_quant(gu)
    dh = torch.randn(tokens, inter, device="cuda").to(torch.bfloat16)
    nv = tokens * inter * (0.5 + 1 / 16) + tokens * 4  # bytes of one NVFP4 [T, I]
    cases = {  # name -> (fn, bytes moved)
        "silu_mul_quant+fp8": (lambda: K.silu_mul_quant(gu, fp8=True), gu.numel() * 2 + 3 * nv + tokens * inter),
        "silu_mul_h": (lambda: K.silu_mul_h(g, u), 2 * nv + tokens * inter * 2),
        "silu_mul_backward": (lambda: K.silu_mul_backward(dh, g, u), 2 * nv + dh.numel() * 2 + gu.numel() * 2),
        "dequant_rows": (lambda: K.dequant_rows(h), nv + tokens * inter * 2),
        "fp8_rows(dY 2I)": (lambda: fp8_rows(gu), gu.numel() * 3),
    }
    results = {}
    print(f"{'chunk':>6}{'warps':>6}" + "".join(f"{n:>20}" for n in cases) + f"{'sum ms':>10}", flush=True)
    for chunk, warps in itertools.product(chunks, warps_list):
        if warps * 32 > chunk:
            continue
        KN.ROW_CHUNK, KN.ROW_WARPS = chunk, warps
        r = results[(chunk, warps)] = {name: time_ms(fn) for name, (fn, _) in cases.items()}
        # one line per choice as soon as it is measured (each choice compiles five kernels)
        print(f"{chunk:>6}{warps:>6}" + "".join(f"{r[n]:>20.3f}" for n in cases) + f"{sum(r.values()):>10.3f}",
              flush=True)
    best = min(results, key=lambda c: sum(results[c].values()))
    print("GB/s at the best: " + ", ".join(f"{n} {b / results[best][n] / 1e6:.0f}" for n, (_, b) in cases.items()))
    print(f"best ROW_CHUNK={best[0]} ROW_WARPS={best[1]}")


if __name__ == "__main__":
    main()
