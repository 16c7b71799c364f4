"""`pact lm-eval ARTIFACT [--adapter RUN] --tasks a,b`: lm-evaluation-harness tasks through
lm_eval.simple_evaluate with pact's model (runtime/harness.py, registered there as "pact")."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import click

from pact.formats import PactError, require
from pact.formats.artifact import check_writable
from pact.runtime.trainer import TrainConfig

from .common import ADAPTER, ARTIFACT, SCORING_HELPS, cli_errors, config_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.option("--adapter", default=None, type=ADAPTER,
              help="A pact-train run folder (PEFT adapter); none = the base model.")
@click.option("--tasks", required=True, help="Comma-separated lm-eval task names (or groups).")
@click.option("--include-path", default=None, type=click.Path(exists=True, file_okay=False),
              help="A folder of task YAMLs (local tasks; offline, tasks whose data sits on the hub cannot run).")
@click.option("--num-fewshot", type=int, default=None)
@click.option("--limit", type=float, default=None, help="Examples per task (a fraction if < 1).")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--max-length", type=int, default=None, help="Context tokens (default: the model's, at most 4096).")
@click.option("--output", "output", default=None, type=click.Path(dir_okay=False),
              help="Write the results as JSON here (temp file + rename).")
@config_options(TrainConfig, only=("activations", "compute", "device"), helps=SCORING_HELPS)
@cli_errors
def main(artifact, adapter, tasks, include_path, num_fewshot, limit, batch_size, max_length, output, activations,
         compute, device) -> None:
    """Run lm-evaluation-harness TASKS on ARTIFACT (with --adapter); prints lm-eval's table."""
    require("lm_eval", "harness", "pact lm-eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from pact.runtime.harness import PactLM

    if batch_size < 1:
        raise PactError(f"--batch-size must be >= 1, got {batch_size}")
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise PactError(f"--limit must be > 0 (examples per task, or a fraction below 1), got {limit:g}")
    if num_fewshot is not None and num_fewshot < 0:
        raise PactError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if max_length is not None and max_length < 2:
        raise PactError(f"--max-length must be >= 2 (context tokens), got {max_length}")
    if output:  # said now, not after the whole evaluation (whose results would be lost)
        check_writable(Path(output), "--output")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise PactError("--tasks is empty: name at least one lm-eval task")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        raise PactError(f"--tasks: unknown {', '.join(unknown)}: lm-eval has no such task"
                        + ("" if include_path else " (local task YAMLs: pass --include-path DIR)"))
    lm = PactLM(artifact, adapter=adapter, batch_size=batch_size, max_length=max_length, device=device,
                activations=activations, compute=compute)
    try:
        results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                  log_samples=False)
    except (ConnectionError, FileNotFoundError) as e:  # (huggingface_hub's offline / not-cached errors are these)
        if not type(e).__module__.startswith(("huggingface_hub", "datasets", "requests", "urllib3", "builtins")):
            raise
        raise PactError(f"--tasks {','.join(names)}: lm-eval could not fetch a task's dataset ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no message'}): run once where the Hugging Face "
                        "hub is reachable (datasets keeps a copy), or point a local task at local files "
                        "(--include-path DIR)") from None
    click.echo(make_table(results))
    if output:
        out = Path(output)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot", "config")
                                   if k in results}, indent=2, default=str) + "\n")
        tmp.replace(out)
