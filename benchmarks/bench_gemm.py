"""Our NVFP4 GEMMs vs cuBLAS bf16 and FP8 (rowwise `torch._scaled_mm`) at projection shapes.

    python benchmarks/bench_gemm.py --tokens 8192 --model llama-1b

Forward: C[T,N] = Xq[T,K] (NVFP4 rows) @ W[N,K]^T (NVFP4); input gradient: dX[T,K] =
dY[T,N] (bf16) @ (W^T[K,N] NVFP4)^T. `pact_fp8_*`: A arrives with its E4M3 copy (written by the
quantizer, as in training; dY is re-encoded), W re-encoded per call; `pact_fp8res_*`: W's
E4M3 copy resident (--fp8-weights resident). Each case is timed twice: eager (median of single
calls between events, CPU launch gaps included) and as device time (10 calls in a CUDA graph,
replays timed); TFLOP/s from the device time. TFLOP/s = 2*T*N*K / time. Needs a CUDA GPU.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import click
import torch

SHAPES = {  # (name, N, K) per projection group
    "llama-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
    "llama-3b": [("qkv", 5120, 3072), ("o", 3072, 3072), ("gate_up", 16384, 3072), ("down", 3072, 8192)],
}


def time_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median of per-call CUDA-event timings (eager: includes any gap while the CPU launches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_graph_ms(fn, reps: int = 10, iters: int = 20) -> float:
    """Device time per call: ``reps`` calls captured in one CUDA graph, replays timed with events
    (median over ``iters``), divided by ``reps``. No launch gaps, as in a training step where
    the CPU runs ahead of the GPU; operands stay the same buffers (partly L2-resident, for
    every case alike)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def run(model: str, tokens: int) -> list[dict]:
    from pact.formats.nvfp4 import quantize_weight
    from pact.runtime.ops import NVFP4TensorFP8
    from pact.runtime.ops import triton as K
    from pact.runtime.ops.triton.codec import decode_qs
    from pact.runtime.ops.triton.fp8 import fp8_rows, nvfp4_gemm_fp8
    from pact.runtime.ops.triton.gemm import nvfp4_gemm_cublas, nvfp4_gemm_fused

    rows = []
    for name, n, k in SHAPES[model]:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda") * 0.02
        fwd, bwd = quantize_weight(w)
        x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
        dy = torch.randn(tokens, n, device="cuda").to(torch.bfloat16)
        xq = K.quant_rows(x)
        xq8 = K.quant_rows(x, fp8=True)  # as the fp8 backend's quantizers hand it over: E4M3 copy attached
        x_hat = K.dequant_rows(xq)  # what training's forward hands the cuBLAS path (the LoRA branch needs it too)
        fwd8, bwd8 = (NVFP4TensorFP8.of(t, fp8_rows) for t in (fwd, bwd))
        wb = w.to(torch.bfloat16)
        flop = 2 * tokens * n * k
        xf8, wf8 = x.to(torch.float8_e4m3fn), wb.to(torch.float8_e4m3fn)
        sa = torch.ones(tokens, 1, device="cuda")
        sb = torch.ones(1, n, device="cuda")
        dyf8, wtf8 = dy.to(torch.float8_e4m3fn), wb.t().contiguous().to(torch.float8_e4m3fn)
        sk = torch.ones(1, k, device="cuda")
        cases = {
            "pact_fused_fwd": lambda: nvfp4_gemm_fused(xq, fwd),
            "pact_fused_dgrad": lambda: nvfp4_gemm_fused(dy, bwd),
            "pact_cublas_fwd": lambda: nvfp4_gemm_cublas(xq, fwd),
            "pact_cublas_fwd_ahat": lambda: nvfp4_gemm_cublas(x_hat, fwd),
            "pact_cublas_dgrad": lambda: nvfp4_gemm_cublas(dy, bwd),
            "pact_decode_w": lambda: decode_qs(fwd.packed, fwd.scales),
            "pact_quant_rows": lambda: K.quant_rows(x),
            "pact_fp8_fwd": lambda: nvfp4_gemm_fp8(xq8, fwd),
            "pact_fp8_dgrad": lambda: nvfp4_gemm_fp8(dy, bwd),
            "pact_fp8res_fwd": lambda: nvfp4_gemm_fp8(xq8, fwd8),
            "pact_fp8res_dgrad": lambda: nvfp4_gemm_fp8(dy, bwd8),
            "pact_fp8_encode_w": lambda: fp8_rows(fwd),
            "pact_fp8_encode_a": lambda: fp8_rows(xq),
            "pact_fp8_encode_dy": lambda: fp8_rows(dy),
            "cublas_bf16_fwd": lambda: x @ wb.t(),
            "cublas_bf16_dgrad": lambda: dy @ wb,
            "cublas_fp8_rowwise_fwd": lambda: torch._scaled_mm(xf8, wf8.t(), scale_a=sa, scale_b=sb,
                                                               out_dtype=torch.bfloat16),
            "cublas_fp8_rowwise_dgrad": lambda: torch._scaled_mm(dyf8, wtf8.t(), scale_a=sa, scale_b=sk,
                                                                 out_dtype=torch.bfloat16),
        }
        for case, fn in cases.items():
            ms = time_ms(fn)
            try:
                graph_ms = time_graph_ms(fn)
            except RuntimeError as e:  # not capturable: reported as such, the eager time stands alone
                print(f"{name} {case}: no CUDA graph ({str(e)[:120]})")
                graph_ms = float("nan")
            gemm = not any(w in case for w in ("quant", "decode", "encode"))
            rows.append({"model": model, "proj": name, "T": tokens, "N": n, "K": k, "case": case, "ms": round(ms, 4),
                         "graph_ms": round(graph_ms, 4), "tflops": round(flop / graph_ms / 1e9, 1) if gemm else None})
    return rows


@click.command()
@click.option("--model", type=click.Choice(sorted(SHAPES)), default="llama-1b")
@click.option("--tokens", default=8192, show_default=True)
@click.option("--csv-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: str, tokens: int, csv_out: Path | None) -> None:
    print(f"gpu={torch.cuda.get_device_name()} torch={torch.__version__}")
    rows = run(model, tokens)
    if csv_out:
        with open(csv_out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    base = {(r["proj"], r["case"]): r for r in rows}
    print(f"{'proj':<8}{'case':<26}{'eager ms':>9}{'vs bf16':>8}{'graph ms':>9}{'vs bf16':>8}{'TFLOP/s':>9}")
    for r in rows:
        ref = base[(r["proj"], "cublas_bf16_dgrad" if "dgrad" in r["case"] else "cublas_bf16_fwd")]
        print(f"{r['proj']:<8}{r['case']:<26}{r['ms']:>9.3f}{ref['ms'] / r['ms']:>8.2f}{r['graph_ms']:>9.3f}"
              f"{ref['graph_ms'] / r['graph_ms']:>8.2f}{r['tflops'] or 0:>9.1f}")


if __name__ == "__main__":
    main()
