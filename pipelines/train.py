"""`pact-train ARTIFACT --data train.jsonl --out run/`: LoRA on the NVFP4 artifact. The options
are TrainConfig's fields (runtime/trainer.py: names, defaults, help and choices live there)."""

from __future__ import annotations

import json

import click

from pact.runtime.trainer import TrainConfig, train

from .common import cli_errors, config_from, config_options, main_rank


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options(TrainConfig)
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--quiet", is_flag=True)
@cli_errors
def main(resume: bool, quiet: bool, **params) -> None:
    """Train LoRA adapters on ARTIFACT; the adapter is saved in PEFT format in --out."""
    result = train(config_from(TrainConfig, params), resume=resume, progress=not quiet)
    if main_rank():  # under torchrun, one result
        click.echo(json.dumps({k: v for k, v in result.items() if k != "eval_labels"}, indent=2))


if __name__ == "__main__":
    main()
