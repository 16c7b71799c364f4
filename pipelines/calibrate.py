"""`pact-calibrate ARTIFACT --prompts P | --model-texts --out CALIBRATED`: NVFP4-aware GPTQ."""

from __future__ import annotations

import json

import click

from pact.calibrate import calibrate
from pact.calibrate.calibrate import BACKWARD_LAYOUTS
from pact.formats import open_artifact

from .common import ARTIFACT, OUT, cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.option("--prompts", default=None,
              help="Calibration prompts: .jsonl (text | messages | prompt+completion), .txt, the tables and "
              "datasets folders pact-train --data reads, or a folder of images (png/jpg/webp; vision-language "
              "artifacts; a <image>.txt beside an image is its request).")
@click.option("--model-texts", is_flag=True,
              help="Instead of --prompts: calibrate on --max-samples texts of --seq-len tokens that the model "
              "samples itself from its BOS token (no data needed). Measured downstream it is not safe: -5.8 points "
              "on one of nine tasks where --prompts with the task's texts lost nothing (BENCHMARKS.md).")
@click.option("--seed", type=int, default=None, help="--model-texts: the sampling seed (default 0).")
@click.option("--out", required=True, type=OUT, help="Where the calibrated artifact goes.")
@click.option("--source", default=None, help="The original model (default: the artifact's recorded source).")
@click.option("--max-samples", default=128, show_default=True)
@click.option("--seq-len", default=512, show_default=True, help="Longest prompt in tokens (images are resized to fit).")
@click.option("--min-tokens", default=0, show_default=True,
              help="Text prompts: read past --max-samples until the texts hold this many tokens (each cut to "
              "--seq-len; short texts give GPTQ few); 0: off. Measured downstream, 16384 was no better on the mean "
              "than the default 128 texts (BENCHMARKS.md \"The draw of calibration texts\").")
@click.option("--damp", default=0.01, show_default=True, help="Dampening, as a fraction of mean(diag H).")
@click.option("--act-order", is_flag=True, help="Quantize columns in order of decreasing H diagonal (static scales).")
@click.option("--static-scales", is_flag=True, help="Fix every block scale before the sweep (default: when reached).")
@click.option("--blocksize", default=128, show_default=True)
@click.option("--block-scales", type=click.Choice(["auto", "amax", "mse"]), default="auto", show_default=True,
              help="How GPTQ picks each E4M3 block scale: auto = the rule the artifact was converted with "
                   "(pact-convert --block-scales); amax maps the block's largest value to 6; mse searches the "
                   "nearby scales for the least squared error.")
@click.option("--backward-layout", type=click.Choice(BACKWARD_LAYOUTS), default="forward", show_default=True,
              help="The backward layout (W^T, what training's input gradients go through): forward = the "
                   "calibrated weights transposed and rounded again; source = W^T rounded to nearest from the "
                   "source, as pact-convert makes it (GPTQ's weights lower the forward error on texts like the "
                   "prompts and raise the backward error on gradients).")
@click.option("--correct-rank", type=int, default=0, show_default=True, metavar="R",
              help="Also store, per projection, a frozen rank-R bf16 correction of what the NVFP4 weights miss, "
                   "fitted to the prompts' inputs; the model computes with the NVFP4 weights + the correction "
                   "(0: none; an NVFP4 checkpoint export cannot hold it: README \"Calibrate\").")
@click.option("--device", default=None, help="cuda or cpu (default: cuda if available).")
@click.option("--overwrite", is_flag=True)
@click.option("--quiet", is_flag=True)
@cli_errors
def main(artifact, prompts, model_texts, seed, out, source, max_samples, seq_len, min_tokens, damp, act_order,
         static_scales, blocksize, block_scales, backward_layout, correct_rank, device, overwrite, quiet) -> None:
    """Calibrate ARTIFACT's NVFP4 weights with GPTQ on PROMPTS (or on texts the model writes
    itself: --model-texts); writes a new artifact."""
    path = calibrate(artifact, prompts, out, model_texts=model_texts, seed=seed, source=source,
                     max_samples=max_samples, seq_len=seq_len, min_tokens=min_tokens, damp=damp,
                     actorder=act_order, static_scales=static_scales, blocksize=blocksize, block_scales=block_scales,
                     backward_layout=backward_layout, correct_rank=correct_rank, device=device,
                     overwrite=overwrite, progress=not quiet)
    errs = open_artifact(path).meta["provenance"]["calibration"]["layer_output_error"]
    ratios = sorted(e["gptq"] / e["rtn"] for e in errs.values() if e["rtn"] > 0)
    doc = {"out": str(path), "projections": len(errs), "backward_layout": backward_layout,
           "output_error_ratio_gptq_over_rtn": {"median": ratios[len(ratios) // 2], "max": ratios[-1]}}
    if correct_rank:
        fixed = sorted(e["corrected"] / e["rtn"] for e in errs.values() if e["rtn"] > 0)
        doc["output_error_ratio_corrected_over_rtn"] = {"median": fixed[len(fixed) // 2], "max": fixed[-1]}
    click.echo(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
