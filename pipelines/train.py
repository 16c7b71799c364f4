"""`pact-train ARTIFACT --data train.jsonl --out run/`: LoRA on the NVFP4 artifact."""

from __future__ import annotations

import json

import click

from pact.runtime.lora import ALL_TARGETS
from pact.runtime.trainer import TrainConfig, train

from .common import ACTIVATIONS_HELP, cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--data", required=True, help="Train .jsonl ({prompt, completion} or {messages}) or datasets folder.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run folder (adapter, metrics, checkpoints).")
@click.option("--eval-data", default=None, help="Held-out .jsonl: loss, and accuracy when completions are labels.")
@click.option("--max-len", default=1024, show_default=True)
@click.option("--overlong", type=click.Choice(["truncate", "refuse"]), default="truncate", show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--grad-accum", default=1, show_default=True)
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: --epochs).")
@click.option("--epochs", default=1.0, show_default=True)
@click.option("--lr", default=2e-4, show_default=True)
@click.option("--weight-decay", default=0.0, show_default=True)
@click.option("--warmup-ratio", default=0.03, show_default=True)
@click.option("--max-grad-norm", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--lora-r", default=16, show_default=True)
@click.option("--lora-alpha", default=32.0, show_default=True)
@click.option("--lora-dropout", default=0.0, show_default=True)
@click.option("--targets", default=",".join(ALL_TARGETS), show_default=True, help="Comma-separated projections.")
@click.option("--save-every", default=0, show_default=True, help="Checkpoint every N steps (0: none).")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--kernels", type=click.Choice(["torch", "triton"]), default=None, help="Default: triton on GPU, torch on CPU.")
@click.option("--compute", type=click.Choice(["auto", "bf16-decode", "fp8", "nvfp4-native"]), default="auto",
              show_default=True,
              help="Frozen-GEMM backend. auto = bf16-decode (exact NVFP4 products: learns as BF16 LoRA does). "
                   "fp8 (Ada/Hopper) ~11% shorter steps, nvfp4-native (Blackwell, unverified on hardware): "
                   "faster, at a measured accuracy cost (BENCHMARKS.md).")
@click.option("--fp8-weights", type=click.Choice(["per-call", "resident"]), default="per-call", show_default=True,
              help="With --compute fp8: resident keeps E4M3 copies of the frozen weights on the GPU (+2 bytes per "
                   "parameter) instead of re-encoding them from NVFP4 at every GEMM; same numbers, faster steps.")
@click.option("--activations", default=None, metavar="RECIPE", help=ACTIVATIONS_HELP)
@click.option("--checkpoint", is_flag=True, help="Recompute each decoder layer in backward (less memory, ~1/3 more compute).")
@click.option("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available).")
@click.option("--quiet", is_flag=True)
@cli_errors
def main(artifact, data, out, eval_data, max_len, overlong, batch_size, grad_accum, steps, epochs, lr, weight_decay,
         warmup_ratio, max_grad_norm, seed, lora_r, lora_alpha, lora_dropout, targets, save_every, resume, kernels,
         compute, fp8_weights, activations, checkpoint, device, quiet) -> None:
    """Train LoRA adapters on ARTIFACT; the adapter is saved in PEFT format in --out."""
    cfg = TrainConfig(
        artifact=artifact, data=data, out=out, eval_data=eval_data, max_len=max_len, overlong=overlong,
        batch_size=batch_size, grad_accum=grad_accum, steps=steps, epochs=epochs, lr=lr, weight_decay=weight_decay,
        warmup_ratio=warmup_ratio, max_grad_norm=max_grad_norm, seed=seed, lora_r=lora_r, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, targets=tuple(t.strip() for t in targets.split(",") if t.strip()),
        save_every=save_every, kernels=kernels, compute=compute, fp8_weights=fp8_weights, activations=activations,
        checkpoint=checkpoint, device=device,
    )
    result = train(cfg, resume=resume, progress=not quiet)
    click.echo(json.dumps({k: v for k, v in result.items() if k != "eval_labels"}, indent=2))


if __name__ == "__main__":
    main()
