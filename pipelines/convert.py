"""`pact-convert SRC OUT`: pack Hugging Face weights into an NVFP4 artifact."""

from __future__ import annotations

import click

from pact.convert import convert
from pact.formats import open_artifact

from .common import OUT, cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("out", type=OUT)
@click.option("--scaling", type=click.Choice(["1d", "2d"]), default="1d", show_default=True,
              help="NVFP4 weight scale blocks: 1d = 1x16 (W and W^T each quantized along their contraction dim; "
                   "smaller error, learns as BF16 LoRA does: BENCHMARKS.md), 2d = 16x16 (forward and backward "
                   "use identical weights).")
@click.option("--block-scales", type=click.Choice(["amax", "mse"]), default="mse", show_default=True,
              help="How each block's E4M3 scale is chosen: mse keeps the least-squared-error scale of ten near "
                   "the amax rule's (same format, more conversion time); amax maps the block's largest value "
                   "to 6 (NVIDIA's / torchao's rule, bit-identical to torchao's nvfp4_quantize).")
@click.option("--keep-bf16", type=float, default=0.0, show_default=True, metavar="FRACTION",
              help="Keep this fraction of frozen projections (largest NVFP4 error first) in bf16.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) when SRC is a hub id.")
@click.option("--device", default="auto", show_default=True,
              help="Where the quantization math runs: auto (cuda when torch sees a GPU, else the CPU), cpu, cuda, "
                   "cuda:1. Same codes on every device.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def main(src: str, out: str, scaling: str, block_scales: str, keep_bf16: float, revision: str | None, device: str,
         overwrite: bool, quiet: bool) -> None:
    """Convert SRC (a Hugging Face model folder, a .gguf file or a hub id) into the artifact OUT."""
    path = convert(src, out, scaling=scaling, block_scales=block_scales, keep_bf16=keep_bf16, overwrite=overwrite,
                   revision=revision, progress=not quiet, device=device, require_tokenizer=True)
    art = open_artifact(path)
    kept = art.meta["provenance"]["kept_bf16"]
    imported = sum(art.entry(n).get("imported") not in (None, "requantized") for n in art.names("nvfp4"))
    how = (f"({imported} imported as stored, W^T re-blocked)" if imported else
           f"({scaling}){' with searched block scales' if block_scales == 'mse' else ''}")
    click.echo(f"wrote {path}: {art.meta['architecture']}, {len(art.names('nvfp4'))} NVFP4 projections "
               f"{how}, {len(kept)} kept bf16, {len(art.names('dense'))} dense tensors")


if __name__ == "__main__":
    main()
