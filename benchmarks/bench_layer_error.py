"""Each projection's output error on a task's own inputs, artifact by artifact (a diagnostic).

    python benchmarks/bench_layer_error.py --source BF16_HF_FOLDER --texts TASK-test.jsonl \
        [--adapter RUN] [--backward] [--samples 32 --max-len 128 --json-out out.json] ARTIFACT [ARTIFACT ...]

The bf16 source model runs on the texts (prompt + completion of each record); every projection's
inputs X are taken there, so each artifact's weights W_q are compared to the source's W on the same
inputs, one layer at a time: error = ||(W_q - W) X|| / ||W X||. With --adapter (a pact-train run),
the inputs are those of the source with that adapter folded in: where a trained model's activations
go, which the untrained model's may not show. Printed per artifact: the mean and
median over projections, the mean per projection kind, and, against the first artifact (the
reference, e.g. round-to-nearest), on how many projections it is larger and the mean of log2 of the
ratio. Which calibration brings the weights nearer the source on the task's inputs, and where.
--backward measures the other GEMM a frozen weight takes part in while training: the input gradient
dX = dY W, through the artifact's backward layout, on the source's output gradients dY (the loss on
each record's completion): ||dY (B^T - W)|| / ||dY W||.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import click
import torch

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _inputs(source: Path, texts: Path, samples: int, max_len: int, adapter: Path | None = None,
            backward: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each projection's input rows (tokens x in_features, float32) on the texts and the source's
    weight, by weight name (inputs with ``adapter`` folded into the source, weights without).
    ``backward``: instead of the inputs, the gradient of the loss on each record's completion (next-token
    cross-entropy, the text after the prompt; a text record: all of it) with respect to each
    projection's output: what the backward GEMM dX = dY W multiplies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    rows: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in KINDS:
            def hook(m, args, out, name=name):
                rows.setdefault(f"{name}.weight", []).append(args[0].reshape(-1, args[0].shape[-1]).detach())

            def grad_hook(m, grad_in, grad_out, name=name):
                rows.setdefault(f"{name}.weight", []).append(grad_out[0].reshape(-1, grad_out[0].shape[-1]).detach())
            hooks.append(mod.register_full_backward_hook(grad_hook) if backward else mod.register_forward_hook(hook))
    records = [json.loads(line) for line in texts.read_text().splitlines() if line.strip()][:samples]
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.set_grad_enabled(backward):
        for r in records:
            text = r["text"] if "text" in r else str(r["prompt"]) + str(r["completion"])
            ids = tok(text, return_tensors="pt", truncation=True, max_length=max_len).input_ids
            if not backward:
                model(input_ids=ids)
                continue
            labels = ids.clone()
            if "text" not in r:  # the loss on the completion, as LoRA training takes it
                labels[:, : len(tok(str(r["prompt"])).input_ids)] = -100
            emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # a graph through every layer
            model(inputs_embeds=emb, labels=labels).loss.backward()
    for h in hooks:
        h.remove()
    return {k: (torch.cat(v), weights[k]) for k, v in rows.items()}


@click.command()
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--source", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The bf16 HF folder the artifacts were made from.")
@click.option("--texts", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL: text, or prompt + completion, records (e.g. a task's held-out file).")
@click.option("--adapter", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A PEFT adapter (pact-train run) folded into the source for the inputs.")
@click.option("--backward", is_flag=True, help="The backward GEMM's error instead: ||dY (B^T - W)|| / ||dY W||, B the "
              "artifact's backward layout (W^T as stored) and dY the source's output gradients on the texts.")
@click.option("--samples", default=32, show_default=True)
@click.option("--max-len", default=128, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(artifacts, source, texts, adapter, backward, samples, max_len, json_out) -> None:
    from pact.formats import open_artifact
    from pact.formats.nvfp4 import dequantize

    taken = _inputs(source, texts, samples, max_len, adapter, backward)
    errs: dict[str, dict[str, float]] = {}
    for a in artifacts:
        art = open_artifact(a)
        e = {}
        for name, (X, W) in taken.items():
            if backward:  # dX = dY W; the backward GEMM reads B = W^T as stored
                Bq = dequantize(art.nvfp4(name, "bwd")).float()
                e[name] = float((X @ (Bq.T - W)).norm() / (X @ W).norm())
            else:
                Wq = dequantize(art.nvfp4(name, "fwd")).float()
                e[name] = float(((Wq - W) @ X.T).norm() / (W @ X.T).norm())
        errs[a] = e
    ref = artifacts[0]
    out = {"texts": str(texts), "adapter": str(adapter) if adapter else None, "samples": samples, "max_len": max_len,
           "gemm": "backward (dX = dY W)" if backward else "forward (Y = X W^T)", "reference": ref, "artifacts": {}}
    for a, e in errs.items():
        row = {"mean": statistics.mean(e.values()), "median": statistics.median(e.values()),
               "by_kind": {k: statistics.mean(v for n, v in e.items() if n.endswith(f"{k}.weight")) for k in KINDS}}
        if a != ref:
            ratios = [e[n] / errs[ref][n] for n in e]
            row["larger_than_reference"] = sum(r > 1 for r in ratios)
            row["mean_log2_ratio"] = statistics.mean(math.log2(r) for r in ratios)
            row["worst_ratio"] = max(zip(ratios, e), key=lambda x: x[0])
        out["artifacts"][a] = row
        click.echo(f"{Path(a).name}: mean {row['mean']:.4f} median {row['median']:.4f} "
                   + " ".join(f"{k.split('_')[0]} {v:.4f}" for k, v in row["by_kind"].items())
                   + (f" | > ref on {row['larger_than_reference']}/{len(e)}, mean log2 ratio "
                      f"{row['mean_log2_ratio']:+.3f}, worst {row['worst_ratio'][0]:.2f}x {row['worst_ratio'][1]}"
                      if a != ref else " (reference)"))
    if json_out:
        out["per_projection"] = errs
        json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
