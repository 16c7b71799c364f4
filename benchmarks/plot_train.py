"""bench_train.py CSVs -> one PNG: tokens/s and peak memory per method (needs matplotlib).

    python benchmarks/plot_train.py cap16_1b.csv cap16_3b.csv --out train.png
"""

from __future__ import annotations

import csv
from pathlib import Path

import click


@click.command()
@click.argument("csvs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
def main(csvs: tuple[Path, ...], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise click.ClickException("plotting needs matplotlib: pip install matplotlib") from e
    rows = [r for p in csvs for r in csv.DictReader(open(p)) if r.get("tok_s")]
    if not rows:
        raise click.ClickException(f"{', '.join(map(str, csvs))}: no measured rows (every method OOM or failed?)")
    groups = sorted({(r["model"], r.get("cap_gib") or "") for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for (model, cap), (ax_t, ax_m) in zip(groups, axes):
        sel = [r for r in rows if r["model"] == model and (r.get("cap_gib") or "") == cap]
        labels = [f"{r['method']}" + (f" {r['lora_layers']}" if r.get("lora_layers") not in (None, "", "all") else "")
                  + f"\nbs {r['bs']}" for r in sel]
        colors = ["tab:green" if r["method"].startswith("pact") else "tab:gray" for r in sel]
        ax_t.bar(labels, [float(r["tok_s"]) / 1e3 for r in sel], color=colors)
        ax_m.bar(labels, [float(r["peak_gib"]) for r in sel], color=colors)
        where = f"under {float(cap):g} GiB, best batch" if cap else "same batch"
        ax_t.set(ylabel="K tokens/s", title=f"{model}, {where}: throughput")
        ax_m.set(ylabel="peak GiB", title=f"{model}, {where}: peak memory")
        for ax in (ax_t, ax_m):
            ax.tick_params(axis="x", labelsize=7, rotation=45)
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
