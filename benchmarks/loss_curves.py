"""Loss curves of every compute backend on one short real run, against the reference path.

    python benchmarks/loss_curves.py ARTIFACT --data train.jsonl --steps 40 --out /tmp/curves \
        --computes bf16-decode,fp8,nvfp4-native [--kernels torch|triton] [--activations-ref]

Each backend trains the same adapter from the same seed on the same batches (pact-train's
trainer, `TrainConfig`); the reference is `bf16-decode` (the exact NVFP4 product). With
`--activations-ref` a run with bf16 activations (weights still NVFP4) is added, to show what
NVFP4 activations cost on the same curve. A step's loss on a small batch is noisy (and
backends drift apart as their adapters do), so the comparison is on the mean loss over each
quarter of the run: printed per backend with its difference to the reference in nats.
Writes curves.csv (step, backend, loss) and, with matplotlib installed, curves.png.
On a CPU every backend runs as its PyTorch twin (the twins are tested against the GPU kernels).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import click


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--steps", default=40, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--max-len", default=256, show_default=True)
@click.option("--computes", default="bf16-decode,fp8,nvfp4-native", show_default=True)
@click.option("--kernels", type=click.Choice(["torch", "triton"]), default=None)
@click.option("--activations-ref", is_flag=True, help="Add a run with bf16 activations (weights NVFP4).")
def main(artifact, data, out, steps, batch_size, lr, max_len, computes, kernels, activations_ref) -> None:
    from pact.runtime.trainer import TrainConfig, train

    runs = [(c, c, "nvfp4") for c in computes.split(",")]
    if activations_ref:
        runs.append(("bf16-decode+bf16-act", "bf16-decode", "bf16"))
    curves: dict[str, list[float]] = {}
    for label, compute, act in runs:
        run = out / label
        if not (run / "metrics.jsonl").is_file():
            cfg = TrainConfig(artifact=artifact, data=data, out=str(run), steps=steps, batch_size=batch_size, lr=lr,
                              warmup_ratio=0.0, max_len=max_len, compute=compute, kernels=kernels, activations=act)
            train(cfg, progress=False)
        lines = (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
        curves[label] = [m["loss"] for m in lines if "loss" in m and "step" in m][:steps]
    ref_label = runs[0][0]
    q = max(1, steps // 4)
    spans = [(i, min(i + q, steps)) for i in range(0, steps, q)]

    def means(c):
        return [sum(c[a:b]) / len(c[a:b]) for a, b in spans]

    ref = means(curves[ref_label])
    head = "".join(f"{f'steps {a + 1}-{b}':>16}" for a, b in spans)
    print(f"\nmean training loss per quarter of the run (difference to {ref_label}, nats)")
    print(f"{'backend':<24}{head}")
    for label, c in curves.items():
        cells = "".join(f"{f'{m:.3f} ({m - r:+.3f})':>16}" for m, r in zip(means(c), ref))
        print(f"{label:<24}{cells}")
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "backend", "loss"])
        for label, c in curves.items():
            w.writerows((i + 1, label, v) for i, v in enumerate(c))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: curves.csv only; pip install matplotlib for curves.png)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=label, lw=1.2)
    ax.set(xlabel="step", ylabel="training loss", title=f"{Path(artifact).name}: loss by compute backend")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    print(f"wrote {out / 'curves.png'}")


if __name__ == "__main__":
    main()
