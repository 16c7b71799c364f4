"""Accuracy over seeds from `bench_accuracy.py` rows (one or more CSVs, e.g. seeds run in parallel).

    python benchmarks/accuracy_table.py benchmarks/results/h200_accuracy_*.csv --steps 250 --train 2000

Per method: mean +- sample std over seeds, the standard error of the mean, and the paired
difference to the reference method (same seed: same batches in the same order) with its
standard error. Rows are filtered by setting (steps, train, test, lr, device) when given.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import click


def load(paths: list[Path], **setting: str | None) -> list[dict]:
    rows = []
    for path in paths:
        for r in csv.DictReader(open(path)):
            if all(v is None or str(r.get(k, "")) == str(v) for k, v in setting.items()):
                rows.append(r)
    return rows


def table(rows: list[dict], reference: str = "peft-bf16") -> list[dict]:
    """One dict per method: n, mean, std, sem, and (where the reference ran the same seeds) the
    paired mean difference and its standard error, all in accuracy points (percent)."""
    by = {}
    for r in rows:
        by.setdefault(r["method"], {})[r["seed"]] = 100.0 * float(r["accuracy"])
    ref = by.get(reference, {})
    out = []
    for method, accs in by.items():
        vals = list(accs.values())
        n = len(vals)
        row = {"method": method, "n": n, "mean": statistics.mean(vals),
               "std": statistics.stdev(vals) if n > 1 else math.nan}
        row["sem"] = row["std"] / math.sqrt(n) if n > 1 else math.nan
        common = sorted(set(accs) & set(ref) - {"-"})
        if method != reference and len(common) > 1:
            d = [accs[s] - ref[s] for s in common]
            row.update(diff=statistics.mean(d), diff_sem=statistics.stdev(d) / math.sqrt(len(d)), paired=len(d))
        out.append(row)
    return out


@click.command()
@click.argument("csvs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--steps", default=None)
@click.option("--train", default=None)
@click.option("--test", default=None)
@click.option("--lr", default=None)
@click.option("--device", default=None)
@click.option("--reference", default="peft-bf16", show_default=True)
def main(csvs, steps, train, test, lr, device, reference) -> None:
    rows = load(list(csvs), steps=steps, train=train, test=test, lr=lr, device=device)
    if not rows:
        raise click.UsageError("no rows match the setting given")
    click.echo(f"{'method':<22}{'seeds':>6}{'mean':>8}{'std':>7}{'sem':>7}   vs {reference} (paired, +- sem)")
    for r in table(rows, reference):
        diff = f"{r['diff']:+.1f} +- {r['diff_sem']:.1f} ({r['paired']} seeds)" if "diff" in r else ""
        click.echo(f"{r['method']:<22}{r['n']:>6}{r['mean']:>8.1f}{r['std']:>7.1f}{r['sem']:>7.1f}   {diff}")


if __name__ == "__main__":
    main()
