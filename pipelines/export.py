"""`pact-export ARTIFACT --out DIR [--format compressed-tensors|bf16] [--adapter RUN [--merge]] [--overwrite]`:
the artifact (and a trained adapter) as a checkpoint vLLM / SGLang (compressed-tensors NVFP4) or
transformers (bf16) load. Every export carries pact_export.json (what --overwrite may replace)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from pact.convert.export import FORMATS, export

from .common import ADAPTER, ARTIFACT, OUT, cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.option("--out", required=True, type=OUT, help="The checkpoint folder to write.")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="compressed-tensors", show_default=True,
              help="compressed-tensors: NVFP4 weights as vLLM / SGLang load them (nvfp4-pack-quantized, "
                   "weight-only); bf16: dequantized weights for transformers.")
@click.option("--adapter", default=None, type=ADAPTER,
              help="A pact-train run (PEFT adapter): beside the NVFP4 weights in adapter/ (vLLM serves LoRA on "
                   "quantized bases), or merged (bf16, or --merge).")
@click.option("--merge", is_flag=True, help="Fold the adapter into the weights and re-quantize them to NVFP4 "
                                            "(the added error per projection is printed).")
@click.option("--merge-method", type=click.Choice(["gptq", "rtn"]), default="gptq", show_default=True,
              help="gptq: re-quantize W + BA by GPTQ on the layer inputs the trained model produces on "
                   "--merge-data, which keeps what the adapter learned; "
                   "rtn: round to nearest (faster; a delta below half an NVFP4 step is lost).")
@click.option("--merge-data", default=None, type=click.Path(dir_okay=True),
              help="Texts like the training data for --merge-method gptq (JSONL as pact-train reads it). "
                   "Default: the run's --data, as its train_config.json records it.")
@click.option("--merge-inputs", type=click.Choice(["merged", "adapted"]), default="merged", show_default=True,
              help="--merge-method gptq: each layer solved on the inputs the layers merged below it give it "
                   "(merged, as served), or on the trained model's own (adapted; kept less of the gain, "
                   "BENCHMARKS.md).")
@click.option("--merge-gain", default="auto", show_default=True, callback=lambda c, p, v: _gain(v),
              help="--merge-method gptq: solve for W + GAIN x B A. Rounding to the grid the base's codes sit on "
                   "pulls a small delta back to the base; a gain above 1 makes up for it. auto: chosen per "
                   "q|k|v, o, gate|up, down group (a GPTQ probe on every eighth row at 1 to 2), so that the "
                   "merged change carries the whole delta (a warning names groups where none does); a number "
                   "in (0, 4]; 1: the delta as trained (BENCHMARKS.md).")
@click.option("--merge-samples", default=128, show_default=True, help="Examples of --merge-data used (max-len 512).")
@click.option("--merge-keep-bf16", default=0.0, show_default=True, type=float,
              help="With the GPTQ merge: this share of the adapted projections (whole q|k|v and gate|up groups, "
                   "largest merge error first) stays bf16 with the adapter folded in exactly (4x their bytes).")
@click.option("--overwrite", is_flag=True,
              help="Replace --out if it is an earlier export (it carries pact_export.json, listing every file in "
                   "it); any other folder is refused. Replaced by rename: the old export is removed last.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def main(artifact, out, fmt, adapter, merge, merge_method, merge_data, merge_inputs, merge_gain, merge_samples,
         merge_keep_bf16, overwrite, quiet) -> None:
    """Export ARTIFACT (with --adapter) for inference."""
    gain_given = click.get_current_context().get_parameter_source("merge_gain") != click.core.ParameterSource.DEFAULT
    if gain_given and not (adapter and merge and merge_method == "gptq" and fmt != "bf16"):
        raise click.BadParameter("a gain is for the GPTQ merge into NVFP4 (--adapter RUN --merge, --merge-method "
                                 "gptq, not --format bf16): drop it, or merge", param_hint="--merge-gain")
    if adapter and Path(adapter).is_dir() and Path(artifact).is_dir():
        from pact.formats import open_artifact
        from pact.runtime.evaluate import own_weights, warn_other_weights

        # a run's own calibrated/, given the artifact it was made from (export refuses an --out inside any artifact)
        artifact = own_weights(artifact, adapter)
        warn_other_weights(adapter, open_artifact(artifact), "pact-export")
    solver = None
    if merge_method == "gptq":
        def solver(art_path, run):  # called by export once every input is checked
            from pact.calibrate.merge import gptq_merge

            return gptq_merge(art_path, run, merge_data or _run_data(run), max_samples=merge_samples,
                              inputs=merge_inputs, gain=merge_gain, progress=not quiet)

    r = export(artifact, out, fmt=fmt, adapter=adapter, merge=merge, overwrite=overwrite, progress=not quiet,
               merge_solver=solver, merge_keep_bf16=merge_keep_bf16)
    if "output_error" in r.get("merge", {}):  # of the re-quantized projections (not those kept bf16)
        kept = set(r["merge"].get("kept_bf16", []))
        errs = [e for k, e in r["merge"].pop("output_error").items() if k not in kept]
        if errs:
            median = {k: sorted(e[k] for e in errs)[len(errs) // 2] for k in ("plain", "gptq", "delta_kept")}
            r["merge"]["delta_kept_median"] = median.pop("delta_kept")
            r["merge"]["layer_output_error_median"] = median
    if "gains" in r.get("merge", {}):  # --merge-gain auto: how many groups took each gain
        groups = r["merge"].pop("gains").values()
        gains = [g["gain"] for g in groups]
        r["merge"]["gains_chosen"] = {str(g): gains.count(g) for g in sorted(set(gains))}
        # groups where no gain auto tries carried 90% of the delta (a warning says so)
        r["merge"]["gains_short"] = sum(g["short"] for g in groups)
    if "requantization_error" in r:
        r["requantization_error"] = {k: v for k, v in r["requantization_error"].items() if k != "per_projection"}
    click.echo(json.dumps(r, indent=2))


def _gain(value: str) -> float | str:
    """--merge-gain, checked as gptq_merge checks it, before any work."""
    from pact.calibrate.merge import merge_gain
    from pact.formats import PactError

    try:
        return merge_gain(value)
    except PactError as e:
        raise click.BadParameter(str(e).removeprefix("--merge-gain "), param_hint="--merge-gain") from None


def _run_data(adapter: str) -> str:
    """The training data a pact-train run recorded (its train_config.json), checked to exist."""
    from pact.formats import PactError
    from pact.runtime.evaluate import run_folder, run_record

    cfg = run_folder(adapter) / "train_config.json"  # (RUN/best/, a checkpoint: the run's)
    data = run_record(str(cfg.parent)).get("data")
    if not isinstance(data, str) or not data or not Path(data).exists():
        where = f"the run's --data ({data}) is not there" if data else f"{cfg} does not name the training data"
        raise PactError(f"--merge-method gptq needs texts like the training data and {where}: pass --merge-data FILE, "
                        "or --merge-method rtn")
    # said, not silent: a run folder from elsewhere names a path on this machine that GPTQ will read
    logging.getLogger(__name__).info("merge: GPTQ texts from %s (the run's --data, recorded in %s; --merge-data FILE "
                                     "to choose others)", data, cfg)
    return data


if __name__ == "__main__":
    main()
