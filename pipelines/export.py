"""`pact-export ARTIFACT --out DIR [--format compressed-tensors|bf16] [--adapter RUN [--merge]] [--overwrite]`:
the artifact (and a trained adapter) as a checkpoint vLLM / SGLang (compressed-tensors NVFP4) or
transformers (bf16) load. Every export carries pact_export.json (what --overwrite may replace)."""

from __future__ import annotations

import json

import click

from pact.runtime.export import FORMATS, export

from .common import cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The checkpoint folder to write.")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="compressed-tensors", show_default=True,
              help="compressed-tensors: NVFP4 weights as vLLM / SGLang load them (nvfp4-pack-quantized, "
                   "weight-only); bf16: dequantized weights for transformers.")
@click.option("--adapter", default=None, type=click.Path(file_okay=False),
              help="A pact-train run (PEFT adapter): beside the NVFP4 weights in adapter/ (vLLM serves LoRA on "
                   "quantized bases), or merged (bf16, or --merge).")
@click.option("--merge", is_flag=True, help="Fold the adapter into the weights and re-quantize them to NVFP4 "
                                            "(the added error per projection is printed).")
@click.option("--overwrite", is_flag=True,
              help="Replace --out if it is an earlier export (it carries pact_export.json, listing every file in "
                   "it); any other folder is refused. Replaced by rename: the old export is removed last.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def main(artifact, out, fmt, adapter, merge, overwrite, quiet) -> None:
    """Export ARTIFACT (with --adapter) for inference."""
    r = export(artifact, out, fmt=fmt, adapter=adapter, merge=merge, overwrite=overwrite, progress=not quiet)
    if "requantization_error" in r:
        r["requantization_error"] = {k: v for k, v in r["requantization_error"].items() if k != "per_projection"}
    click.echo(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
