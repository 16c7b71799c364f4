"""What an artifact's frozen weights do to the LoRA gradient, forward and backward apart (a diagnostic).

    python benchmarks/bench_weight_grads.py --source BF16_HF_FOLDER --data TASK-train.jsonl \
        [--warm-steps 40 --batches 8 --lr 5e-4 --seed 0 --json-out out.json] ARTIFACT [ARTIFACT ...]

Every frozen projection takes part in two GEMMs while LoRA trains: the forward Y = X W^T (pact reads the
artifact's forward layout) and the input gradient dX = dY W (pact reads the backward layout, W^T stored
apart). This runs transformers + PEFT (LoRA r 16 / alpha 32 on the 7 projections, fp32, nothing else
quantized) with each projection's two GEMMs swapped for an artifact's two layouts, dequantized, and
compares the LoRA gradient to the one on the source's weights, at the same adapter (trained for
--warm-steps on the source first) and the same batches (those after the warm-up). For each artifact
five weight sets: the forward layout with its own exact transpose as the backward (the exact gradient
of the model as it is evaluated), both layouts as stored, the forward alone (backward exact W^T), the
backward alone (forward exact W), and its forward with the converter's backward (W^T rounded to nearest
from the source, as pact-convert makes it: what `pact-calibrate --backward-layout source` writes).

Printed per weight set: the median over adapter tensors of the gradient's cosine to the source's (per
batch, then the median over batches), the same for the lower, middle and upper third of the layers (the
backward error accumulates on the way down), and the median norm ratio; for the stored and the
converter's backward also the cosine to the artifact's own exact gradient (first set): how well the
backward layout serves training the model whose forward is evaluated.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
import torch

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA, BATCH, MAX_LEN = 16, 32, 8, 128


class _TwoLayouts(torch.autograd.Function):
    """Y = X F^T; dX = dY B^T (B [in, out]: the backward layout, W^T as stored). F and B are frozen."""

    @staticmethod
    def forward(ctx, x, F, B):
        ctx.save_for_backward(B)
        return x @ F.t()

    @staticmethod
    def backward(ctx, g):
        (B,) = ctx.saved_tensors
        return g @ B.t(), None, None


def _patch(model) -> dict[str, torch.nn.Linear]:
    """Each target Linear runs _TwoLayouts on its (F, B) buffers, set later per weight set."""
    mods = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in KINDS:
            mod.layouts = (mod.weight.detach().clone(), mod.weight.detach().t().contiguous())

            def fwd(x, mod=mod):
                F, B = mod.layouts
                y = _TwoLayouts.apply(x, F, B)
                return y if mod.bias is None else y + mod.bias
            mod.forward = fwd
            mods[f"{name}.weight"] = mod
    return mods


def _batches(tok, data: Path, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n`` training batches as pact-train makes them for this seed (its tokenization, labels
    on the completion only, length-bucketed batches of BATCH, MAX_LEN tokens)."""
    from pact.runtime.data import batches, collate, pad_id, read_records, tokenize

    examples = tokenize(read_records(data), tok, max_len=MAX_LEN)
    order = batches(examples, BATCH, seed=seed, epoch=0)
    return [collate(examples, idx, pad_id(tok), "cpu") for idx in order[:n]]


@click.command()
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--source", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--warm-steps", default=40, show_default=True)
@click.option("--batches", default=8, show_default=True)
@click.option("--lr", default=5e-4, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(artifacts, source, data, warm_steps, batches, lr, seed, json_out) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pact.formats import open_artifact
    from pact.formats.nvfp4 import dequantize, quantize_weight

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    mods = _patch(model)
    exact = {n: m.layouts for n, m in mods.items()}
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(KINDS)))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    data_b = _batches(tok, data, warm_steps + batches, seed)
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    model.train()
    for ids, lab in data_b[:warm_steps]:  # the adapter part-way into training, on the source's weights
        model(input_ids=ids, labels=lab).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def grads() -> list[dict[str, torch.Tensor]]:
        out = []
        for ids, lab in data_b[warm_steps:]:
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=lab).loss.backward()
            out.append({n: p.grad.detach().flatten().clone() for n, p in params.items()})
        return out

    ref = grads()
    nlayers = model.config.num_hidden_layers

    def compare(got, ref=ref) -> dict:
        cos, norm, third = [], [], {0: [], 1: [], 2: []}
        for n in ref[0]:
            c = statistics.median(float(torch.nn.functional.cosine_similarity(g[n], r[n], dim=0))
                                  for g, r in zip(got, ref))
            cos.append(c)
            norm.append(statistics.median(float(g[n].norm() / r[n].norm()) for g, r in zip(got, ref)))
            layer = int(n.split(".layers.")[1].split(".")[0])
            third[min(2, 3 * layer // nlayers)].append(c)
        return {"cos": statistics.median(cos), "cos_lower": statistics.median(third[0]),
                "cos_middle": statistics.median(third[1]), "cos_upper": statistics.median(third[2]),
                "norm": statistics.median(norm)}

    rows = {}
    click.echo(f"{'weights':<64} {'cos':>6} {'lower':>6} {'middle':>6} {'upper':>6} {'norm':>6}  cos to own")
    for a in artifacts:
        art = open_artifact(a)
        lay, scaling = {}, art.meta["provenance"]["scaling"]
        for n in mods:
            conv = quantize_weight(exact[n][0], global_scale=art.nvfp4(n, "fwd").global_scale, scaling=scaling,
                                   scale_rule=art.block_scale_rule)[1]  # the converter's W^T, from the source
            lay[n] = (dequantize(art.nvfp4(n, "fwd")).float(), dequantize(art.nvfp4(n, "bwd")).float(),
                      dequantize(conv).float())
        sets = {"own gradient": lambda n: (lay[n][0], lay[n][0].t()),
                "stored": lambda n: (lay[n][0], lay[n][1]), "forward only": lambda n: (lay[n][0], exact[n][1]),
                "backward only": lambda n: (exact[n][0], lay[n][1]), "forward + converter's backward":
                lambda n: (lay[n][0], lay[n][2])}
        got = {}
        for what, pick in sets.items():
            for n, m in mods.items():
                m.layouts = pick(n)
            got[what] = grads()
            row = compare(got[what])
            if what in ("stored", "forward + converter's backward"):  # against the forward's own exact gradient
                row["cos_to_own"] = compare(got[what], got["own gradient"])["cos"]
            rows[f"{Path(a).name}: {what}"] = row
            click.echo(f"{Path(a).name[-34:] + ': ' + what:<64} {row['cos']:>6.4f} {row['cos_lower']:>6.4f} "
                       f"{row['cos_middle']:>6.4f} {row['cos_upper']:>6.4f} {row['norm']:>6.3f}"
                       + (f"  {row['cos_to_own']:.4f}" if "cos_to_own" in row else ""))
        for n, m in mods.items():
            m.layouts = exact[n]
    click.echo(f"(medians over {len(ref[0])} adapter tensors and {batches} batches, after {warm_steps} steps on "
               "the source)")
    if json_out:
        json_out.write_text(json.dumps({"data": str(data), "warm_steps": warm_steps, "batches": batches, "lr": lr,
                                        "seed": seed, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
