"""pact-train --report-to: each step's metrics (and evaluations) to TensorBoard and/or Weights &
Biases besides metrics.jsonl. Rank 0 only; the packages are optional extras."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pact.formats import PactError, require

REPORTERS = ("tensorboard", "wandb", "none")


def parse_report_to(spec: str) -> tuple[str, ...]:
    """``tensorboard,wandb`` -> ("tensorboard", "wandb"); ``none`` -> ()."""
    kinds = tuple(dict.fromkeys(k.strip() for k in str(spec).split(",") if k.strip()))
    bad = [k for k in kinds if k not in REPORTERS]
    if bad or not kinds or ("none" in kinds and len(kinds) > 1):
        raise PactError(f"--report-to {spec!r}: use none, tensorboard, wandb or tensorboard,wandb")
    return tuple(k for k in kinds if k != "none")


def check_available(kinds: tuple[str, ...]) -> None:
    """Each chosen back end's package is installed (before a run loads its model), else one line naming
    its extra."""
    for kind in kinds:
        require(kind, kind, f"--report-to {kind}")


class Reporter:
    """Writes metrics to the chosen back ends: TensorBoard event files in RUN/tensorboard/, a W&B
    run (its files under RUN/wandb/; WANDB_PROJECT names the project, default "pact";
    WANDB_MODE=offline keeps it local). A resumed run appends to the same W&B run."""

    def __init__(self, kinds: tuple[str, ...], run: Path, config: dict):
        self.tb = self.wb = None
        if "tensorboard" in kinds:
            require("tensorboard", "tensorboard", "--report-to tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run / "tensorboard"))
        if "wandb" in kinds:
            wandb = require("wandb", "wandb", "--report-to wandb")
            id_file = run / "wandb_id.txt"  # one W&B run per pact run, resumes included
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
            (run / "wandb").mkdir(exist_ok=True)
            try:
                self.wb = wandb.init(project=os.environ.get("WANDB_PROJECT", "pact"), name=run.name, id=run_id,
                                     resume="allow", dir=str(run), config=config)
            except Exception as e:  # wandb's own errors (no API key, no network): one line
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                self.close()
                raise PactError(f"--report-to wandb: could not start a W&B run ({why}): log in with `wandb login` "
                                "(or set WANDB_API_KEY), or set WANDB_MODE=offline to keep the run local") from None

    def log(self, metrics: dict, step: int) -> None:
        scalars = {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
