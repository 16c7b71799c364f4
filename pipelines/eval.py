"""`pact-eval ARTIFACT [--adapter RUN] --data test.jsonl`: held-out loss, label accuracy or
exact match / token F1 of greedy generations."""

from __future__ import annotations

import json

import click

from pact.runtime.evaluate import collapse_note, evaluate_artifact
from pact.runtime.trainer import TrainConfig

from .common import ADAPTER, ARTIFACT, SCORING_HELPS, cli_errors, config_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.option("--data", required=True, help="Held-out .jsonl (prompt/completion, messages, Alpaca or ShareGPT).")
@click.option("--adapter", default=None, type=ADAPTER,
              help="A pact-train run folder (PEFT adapter); none = zero-shot.")
@config_options(TrainConfig, only=("max_len", "batch_size", "activations", "compute", "device"),  # as pact-train's
                helps=SCORING_HELPS, aliases={"batch_size": ("--per-device-eval-batch-size",)})
@click.option("--generate/--no-generate", default=None,
              help="Score greedy generations (exact match, token F1). Default: when completions are not class labels.")
@click.option("--max-new-tokens", type=int, default=None, help="Generation length (default: longest completion + 8).")
@click.option("--score-eos/--no-score-eos", default=True, show_default=True,
              help="A label's likelihood includes the end-of-sequence token training appends after every completion.")
@click.option("--data-split", default=None, help="The split of a datasets folder (default: test, else validation).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@cli_errors
def main(artifact, data, adapter, max_len, batch_size, activations, compute, device, generate, max_new_tokens,
         score_eos, data_split, quiet) -> None:
    """Evaluate ARTIFACT (with --adapter) on --data: loss; accuracy by label likelihood when the
    completions are class labels, else exact match and token F1 of greedy generations."""
    if max_new_tokens is not None and max_new_tokens < 1:
        raise click.BadParameter(f"must be >= 1, got {max_new_tokens}", param_hint="--max-new-tokens")
    result = evaluate_artifact(artifact, data, adapter=adapter, max_len=max_len, batch_size=batch_size, device=device,
                               activations=activations, generate=generate, max_new_tokens=max_new_tokens,
                               compute=compute, progress=not quiet, score_eos=score_eos,
                               split=data_split)
    click.echo(json.dumps(result, indent=2))
    if (note := collapse_note(result)) is not None:
        click.echo(note, err=True)


if __name__ == "__main__":
    main()
