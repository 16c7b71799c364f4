"""What each saved copy does to the LoRA gradient, per adapter tensor: the measure `--activations auto`'s probe
ranks sites by (the whole gradient's squared error with one site's copy NVFP4, the others bf16, over the whole
gradient's energy), and beside it the error of each adapter tensor relative to its own energy.

    python benchmarks/probe_site_errors.py ARTIFACT DATA.jsonl [--steps 20] [--lr 1e-3] [--rows 2] [--batches 4]

Trains STEPS steps of the default recipe (bs 8, max-len 128, r 16) first, as the probe does, then measures on
BATCHES batches of ROWS rows. CPU or GPU (the torch twins on the CPU).
"""

from __future__ import annotations

import collections
import json

import click
import torch

from pact.formats.peft import LoraConfig
from pact.runtime.autorecipe import _grads, with_saved
from pact.runtime.data import batches, collate, pad_id, read_records, tokenize
from pact.runtime.recipe import SITES
from pact.runtime.session import open_session

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tensor_key(name: str) -> str:
    """'model__layers__3__self_attn__o_proj__A' -> 'o_proj.A' (summed over layers)."""
    proj = next(p for p in PROJS if p in name)
    return f"{proj}.{name.rsplit('__', 1)[-1]}"


@click.command()
@click.argument("artifact")
@click.argument("data", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", default=20, show_default=True)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--rows", default=2, show_default=True)
@click.option("--batches", "n_batches", default=4, show_default=True)
@click.option("--device", default=None)
def main(artifact, data, steps, lr, rows, n_batches, device) -> None:
    torch.manual_seed(0)
    ses = open_session(artifact, device=device)
    model = ses.model(LoraConfig(r=16, alpha=32))
    ex = tokenize(read_records(data), ses.tokenizer, max_len=128)
    order = batches(ex, 8, seed=0, epoch=0)
    opt = torch.optim.AdamW(list(model.lora_params.values()), lr=lr)
    pad = pad_id(ses.tokenizer)
    for idx in order[:steps]:
        loss, n = model(*collate(ex, idx, pad, model.device))
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    probe = [collate(ex, idx[:rows], pad, model.device) for idx in order[steps:steps + n_batches]]
    names = list(model.lora_params.keys())
    ref = _grads(model, with_saved(model.recipe, {s: "bf16" for s in SITES}), probe)
    for site in SITES:
        got = _grads(model, with_saved(model.recipe, {**{t: "bf16" for t in SITES}, site: "nvfp4"}), probe)
        num, den = collections.defaultdict(float), collections.defaultdict(float)
        for bg, br in zip(got, ref):
            for name, g, r in zip(names, bg, br):
                num[_tensor_key(name)] += float((g - r).pow(2).sum())
                den[_tensor_key(name)] += float(r.pow(2).sum())
        whole = sum(num.values()) / sum(den.values())
        own = {k: round(num[k] / den[k], 5) for k in num if num[k] > 0 and den[k] > 0}
        click.echo(f"{site}: whole gradient {whole:.2e}; per tensor, of its own energy: {json.dumps(own)}")


if __name__ == "__main__":
    main()
