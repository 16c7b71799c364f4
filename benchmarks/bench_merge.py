"""What a merged NVFP4 export keeps of what the adapter learned: held-out accuracy of zero-shot,
the NVFP4 base + adapter unmerged (pact, the reference: 100% of the gain), the plain
re-quantizing merge (`pact-export --merge --merge-method rtn`), the GPTQ merge (`--merge`, its
default) and the bf16 merge (`--format bf16`, scored by PEFT-free transformers).

    python benchmarks/bench_merge.py run --artifact ART --train train.jsonl --test test.jsonl --seeds 0 \\
        --workdir W [--name rt --steps 250 --lr 5e-4 --limit 200 --json-out rows.json]
    python benchmarks/bench_merge.py table rows/*.json
    python benchmarks/bench_merge.py flips --seed-dir W/seed0 --test W/test-200.jsonl   # the serving check per example


Gain kept = (merged - zero-shot) / (unmerged - zero-shot). The merged NVFP4 exports are imported
back with pact-convert (compressed-tensors, as stored) and scored by the same pact-eval code as the
unmerged run; the bf16 export is scored the same way after pact-convert (RTN of the merged bf16
weights would be one more rounding, so it is scored as bf16 with transformers instead). Where
compressed-tensors is installed, the default export (gptq-auto's where scored, else gptq's) is also
scored as a server's client loads it (transformers + compressed-tensors, `merged_gptq_hf`; `hf_scored`
names which): the serving check.
"""

from __future__ import annotations

import collections
import json
import shutil
import statistics
import time
from pathlib import Path

import click


def _hf_scores(folder: Path, examples: list, cands: dict, pad: int):
    """[n, C] log-likelihood of every label candidate after each prompt, by transformers on a folder
    (bf16, or compressed-tensors NVFP4 decompressed on load): pact-eval's candidates, full sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    from pact.runtime.evaluate import candidate_batches

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    packed = "quantization_config" in json.loads((folder / "config.json").read_text())
    # compressed-tensors decompresses NVFP4 to the checkpoint's bf16 (its layers compute in it)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if packed else torch.float32)
    model = model.to(dev).eval()
    out = []
    with torch.no_grad():
        for chunk, ids, labels in candidate_batches(examples, cands, 16, pad, dev):
            logits = model(input_ids=ids).logits[:, :-1].float()
            t = labels[:, 1:]
            lp = torch.log_softmax(logits, -1).gather(2, t.clamp_min(0)[..., None])[..., 0] * (t != -100)
            out.append(lp.sum(1).view(len(chunk), len(cands)).cpu())
    return torch.cat(out)


def _score_hf(folder: Path, test: Path, max_len: int, limit: int) -> float:
    """Label accuracy of a transformers folder by the same candidate scoring as pact-eval."""
    from transformers import AutoTokenizer

    from pact.runtime.data import pad_id, read_records, tokenize
    from pact.runtime.evaluate import label_candidates

    tok = AutoTokenizer.from_pretrained(folder)
    ex = tokenize(read_records(test), tok, max_len=max_len)
    cands = label_candidates(ex)
    ex = ex[:limit] if limit else ex
    return _accuracy(_hf_scores(folder, ex, cands, pad_id(tok)), ex, cands)


def _accuracy(scores, examples: list, cands: dict) -> float:
    """Share of examples whose best-scored candidate ([n, C] scores, candidates in ``cands``' order) is the label."""
    names = list(cands)
    return sum(names[int(r.argmax())] == e.completion for e, r in zip(examples, scores)) / len(examples)


def _flips(a, b) -> dict:
    """Two scorers' [n, C] candidate scores of the same examples: the examples whose top candidate
    differs, each scorer's margin there (top minus second), and how far the scores differ overall."""
    def margin(s):
        top = s.topk(2, dim=1).values
        return top[:, 0] - top[:, 1]

    ma, mb = margin(a), margin(b)
    flip = (a.argmax(1) != b.argmax(1)).nonzero().flatten().tolist()
    diff = (a - b).abs().flatten()
    return {"n": len(a), "flips": len(flip), "margins_a": [round(ma[i].item(), 4) for i in flip],
            "margins_b": [round(mb[i].item(), 4) for i in flip], "median_margin_a": round(ma.median().item(), 4),
            "score_diff_median": round(diff.median().item(), 5), "score_diff_p99": round(diff.quantile(0.99).item(), 5)}


@click.group()
def cli() -> None:
    """What a merged export keeps of the adapter's gain (see the module docstring)."""


@cli.command()
@click.option("--name", default="", help="The task's name, written into every row.")
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--train", "train_f", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--test", "test_f", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--workdir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seeds", default="0", show_default=True)
@click.option("--steps", default=250, show_default=True)
@click.option("--lr", default=5e-4, show_default=True)
@click.option("--max-len", default=128, show_default=True)
@click.option("--limit", default=0, show_default=True, help="Score the first N held-out examples (0: all).")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--reuse-runs", is_flag=True, help="A seed whose run folder holds an adapter is not trained again.")
@click.option("--train-only", is_flag=True, help="Train each seed's run (kept in --workdir) and stop: no scores.")
@click.option("--variants", default="rtn,gptq,gptq-auto,bf16,hf", show_default=True,
              help="Merges scored: rtn (plain), gptq (GPTQ on the merged model's inputs, the delta as "
                   "trained: --merge-gain 1), gptq-keepNN (that with NN% of the adapted projections kept bf16: "
                   "--merge-keep-bf16), gptq-ai (GPTQ on the adapted model's inputs: --merge-inputs adapted), "
                   "gptq-ampNNN (the GPTQ merge of W + NNN/100 x the adapter's delta: --merge-gain), "
                   "gptq-auto (pact-export --merge's default: the gain chosen per fused group, "
                   "--merge-gain auto), "
                   "bf16, hf (the default export, gptq-auto's or else gptq's, read by transformers). "
                   "Rows made before commit 'merged inputs by "
                   "default' name the adapted-inputs merge gptq and the merged-inputs one gptq-mi.")
@click.option("--merge-samples", default=128, show_default=True, help="The GPTQ merge's texts (gptq_merge).")
@click.option("--merge-damp", default=0.01, show_default=True, help="The GPTQ merge's damping.")
@click.option("--merge-act-order", is_flag=True, help="The GPTQ merge in act-order (scales fixed up front).")
def run(name, artifact, train_f, test_f, workdir, seeds, steps, lr, max_len, limit, json_out, reuse_runs,
        train_only, variants, merge_samples, merge_damp, merge_act_order) -> None:
    """Train each seed, then score zero-shot, unmerged and every merge of its adapter."""
    import importlib.util

    from pact.calibrate.merge import gptq_merge
    from pact.convert import convert
    from pact.convert.export import export
    from pact.runtime.evaluate import evaluate_artifact
    from pact.runtime.trainer import TrainConfig, train

    test = Path(test_f)
    if limit:  # pact-eval scores a file: the first N examples
        workdir.mkdir(parents=True, exist_ok=True)
        lines = test.read_text().splitlines()[:limit]
        test = workdir / f"test-{limit}.jsonl"
        test.write_text("\n".join(lines) + "\n")

    def acc(art, adapter=None) -> float:
        return evaluate_artifact(str(art), str(test), adapter=adapter, max_len=max_len, batch_size=16)["eval_accuracy"]

    rows = []
    # --reuse-runs with the --json-out of an earlier call cut short: its rows go on from the merges they hold
    scored = {(r["task"], r["seed"], r["lr"]): r for r in json.loads(json_out.read_text())} \
        if reuse_runs and json_out and json_out.is_file() else {}
    zero = None
    for seed in (int(s) for s in seeds.split(",")):
        d = workdir / f"seed{seed}"
        run = d / "run"
        t = time.perf_counter()
        reuse = reuse_runs and (run / "adapter_model.safetensors").is_file()
        if not reuse:
            shutil.rmtree(run, ignore_errors=True)
            train(TrainConfig(artifact=str(artifact), data=str(train_f), out=str(run), steps=steps, batch_size=8,
                              max_len=max_len, lr=lr, lora_r=16, lora_alpha=32, warmup_ratio=0.1, seed=seed),
                  progress=False)
        if train_only:
            click.echo(f"{name} seed {seed}: trained in {time.perf_counter() - t:.0f} s")
            continue
        if reuse and (name, seed, lr) in scored:
            row = {k: v for k, v in scored[name, seed, lr].items() if not k.startswith("kept_")}
        else:
            zero = acc(artifact) if zero is None else zero
            row = {"task": name, "lr": lr, "seed": seed, "zero_shot": zero,
                   "train_s": None if reuse else round(time.perf_counter() - t, 1),
                   "unmerged": acc(artifact, str(run))}
        rows.append(row)

        def save():  # after every merge: a grid cut short keeps the merges it scored
            if json_out:
                json_out.write_text(json.dumps([_with_kept(r) for r in rows], indent=1))
        solved = {}

        def solver_on(inputs, gain=1.0):  # the GPTQ merge once per seed, inputs and gain: the -keepNN variants reuse it
            def solver(a, r):
                k = inputs, str(r), gain
                if k not in solved:
                    solved[k] = gptq_merge(a, r, train_f, max_samples=merge_samples, damp=merge_damp,
                                           actorder=merge_act_order, inputs=inputs, gain=gain)
                return solved[k][0], dict(solved[k][1])
            return solver

        hows = [h for h in variants.split(",") if h in ("rtn", "gptq", "gptq-ai", "gptq-auto")
                or h.startswith(("gptq-keep", "gptq-amp"))]
        served = "gptq-auto" if "gptq-auto" in hows else "gptq"  # the export the serving check scores
        for how in [h for h in hows if f"merged_{h}" not in row]:
            t = time.perf_counter()
            keep = int(how.removeprefix("gptq-keep")) / 100 if how.startswith("gptq-keep") else 0.0
            gain = ("auto" if how == "gptq-auto" else
                    int(how.removeprefix("gptq-amp")) / 100 if how.startswith("gptq-amp") else 1.0)
            solver = None if how == "rtn" else solver_on("adapted" if how == "gptq-ai" else "merged", gain)
            summary = export(str(artifact), d / f"ct-{how}", adapter=str(run), merge=True, overwrite=True,
                             merge_solver=solver, merge_keep_bf16=keep)["merge"]
            row[f"{how}_merge_s"] = round(time.perf_counter() - t, 1)
            back = convert(str(d / f"ct-{how}"), d / f"art-{how}", overwrite=True, progress=False)
            row[f"merged_{how}"] = acc(back)
            row[f"{how}_total_s"] = round(time.perf_counter() - t, 1)
            save()
            if how == served and "hf" in variants and importlib.util.find_spec("compressed_tensors"):  # as served
                row["merged_gptq_hf"] = _score_hf(d / f"ct-{how}", test, max_len, 0)
                row["hf_scored"] = how
            if keep:
                row[f"{how}_kept_bf16"] = len(summary.get("kept_bf16", []))
            if "output_error" in summary and not keep:
                errs = summary["output_error"].values()
                row[f"{how}_layer_error_plain_vs_gptq"] = [statistics.median(e["plain"] for e in errs),
                                                           statistics.median(e["gptq"] for e in errs)]
                row[f"{how}_delta_kept"] = round(statistics.median(e["delta_kept"] for e in errs), 4)
            if summary.get("gains"):  # gain="auto": how many groups took each gain
                row[f"{how}_gains"] = dict(collections.Counter(str(v["gain"]) for v in summary["gains"].values()))
        if "bf16" in variants.split(",") and "merged_bf16" not in row:
            export(str(artifact), d / "bf16", fmt="bf16", adapter=str(run), overwrite=True)
            row["merged_bf16"] = _score_hf(d / "bf16", test, max_len, 0)
        save()
        click.echo(json.dumps(row))


def _with_kept(row: dict) -> dict:
    """``row`` with kept_X = (merged_X - zero-shot) / (unmerged - zero-shot) for every merge it scored."""
    gain = row["unmerged"] - row["zero_shot"]
    kept = {k.replace("merged", "kept"): round((v - row["zero_shot"]) / gain, 3) if gain else None
            for k, v in row.items() if k.startswith("merged_") and k != "merged_gptq_hf"}
    return {**row, **kept}


def _mse(xs: list[float]) -> str:
    if not xs:
        return ""
    m = statistics.mean(xs)
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{100 * m:+.1f} +- {100 * se:.1f}"


@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def table(files) -> None:
    """A markdown table of `run` rows: per task, mean accuracy of each merge its rows hold, the gain
    kept (mean merged gain / mean unmerged gain) and the paired difference merged - unmerged."""
    rows = [r for f in files for r in json.loads(Path(f).read_text())]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(f"{r.get('task', '')} (lr {r.get('lr', '')})", []).append(r)
    # gptq-seq: a removed method (BENCHMARKS.md re-tables its rows)
    names = {"rtn": "plain", "gptq": "GPTQ", "gptq-ai": "GPTQ adapted inputs", "gptq-mi": "GPTQ merged inputs",
             "gptq-seq": "GPTQ-seq", "gptq-auto": "GPTQ, gain auto", "bf16": "bf16"}
    for k in sorted({k for r in rows for k in r if k.startswith("merged_gptq-keep")}):  # GPTQ, NN% kept bf16
        names[k.removeprefix("merged_")] = f"GPTQ + {k.removeprefix('merged_gptq-keep')}% bf16"
    for k in sorted({k for r in rows for k in r if k.startswith("merged_gptq-amp")}):  # GPTQ of gain x delta
        names[k.removeprefix("merged_")] = f"GPTQ of {int(k.removeprefix('merged_gptq-amp')) / 100:g} x delta"
    shown = [v for v in names if any(f"merged_{v}" in r for r in rows)]
    paired = [v for v in shown if v != "bf16"]
    hf = any("merged_gptq_hf" in r for r in rows)
    head = (["task", "seeds", "zero-shot", "unmerged"] + [f"{names[v]} merge" for v in shown]
            + (["kept: " + " / ".join(names[v] for v in shown)] if shown else [])
            + [f"{names[v]} - unmerged (paired)" for v in paired]
            + (["transformers - pact (default export)"] if hf else []))
    click.echo("| " + " | ".join(head) + " |")
    click.echo("|---" * len(head) + "|")
    kept_all: dict[str, list[float]] = {v: [] for v in shown}
    for key, rs in sorted(by.items()):
        mean = {k: statistics.mean(r[k] for r in rs) for k in ("zero_shot", "unmerged")}
        gain = mean["unmerged"] - mean["zero_shot"]
        cells, kept = [], []
        for v in shown:  # a variant some of this task's rows lack: a blank cell
            have = all(f"merged_{v}" in r for r in rs)
            m = statistics.mean(r[f"merged_{v}"] for r in rs) if have else None
            cells.append(f"{100 * m:.1f}" if have else "")
            k = (m - mean["zero_shot"]) / gain if have and gain else None
            kept.append(f"{100 * k:.0f}%" if k is not None else "-")
            if k is not None:
                kept_all[v].append(k)
        line = [key, str(len(rs)), f"{100 * mean['zero_shot']:.1f}", f"{100 * mean['unmerged']:.1f}", *cells]
        line += [" / ".join(kept)] if shown else []
        line += [_mse([r[f"merged_{v}"] - r["unmerged"] for r in rs if f"merged_{v}" in r]) for v in paired]
        if hf:
            line.append(_mse([r["merged_gptq_hf"] - r[f"merged_{r.get('hf_scored', 'gptq')}"] for r in rs
                              if "merged_gptq_hf" in r]))
        click.echo("| " + " | ".join(line) + " |")
    click.echo("\nmean gain kept: " + ", ".join(f"{names[v]} {100 * statistics.mean(k):.0f}% ({len(k)} tasks)"
                                              for v, k in kept_all.items() if k))


@cli.command()
@click.option("--seed-dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A `run` seed folder (WORKDIR/seedN): its ct-HOW export and art-HOW import.")
@click.option("--test", "test_f", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The examples `run` scored (WORKDIR/test-LIMIT.jsonl with --limit).")
@click.option("--how", default="gptq-auto", show_default=True, help="Which merge's export.")
@click.option("--max-len", default=128, show_default=True)
def flips(seed_dir, test_f, how, max_len) -> None:
    """The serving check example by example: pact's candidate scores of the imported export (art-HOW)
    against transformers' of the export as a client loads it (ct-HOW), the examples whose answer
    differs and the two scorers' margins there (JSON)."""
    import torch

    from pact.runtime.data import pad_id, read_records, tokenize
    from pact.runtime.evaluate import candidate_logprobs, label_candidates, load_adapted

    for need in (seed_dir / f"art-{how}", seed_dir / f"ct-{how}"):
        if not need.is_dir():
            raise click.BadParameter(f"{need} is missing: run `bench_merge.py run --variants {how}` first",
                                     param_hint="--seed-dir")
    model, tok = load_adapted(str(seed_dir / f"art-{how}"), None)
    ex = tokenize(read_records(str(test_f)), tok, max_len=max_len, vocab_size=model.embed.shape[0])
    cands = label_candidates(ex)
    with torch.no_grad():
        pact = torch.cat([lp.float().cpu() for _, lp in candidate_logprobs(model, ex, cands, 16, pad_id(tok))])
    hf = _hf_scores(seed_dir / f"ct-{how}", ex, cands, pad_id(tok))
    out = {"pact_accuracy": _accuracy(pact, ex, cands), "transformers_accuracy": _accuracy(hf, ex, cands),
           **_flips(pact, hf)}
    click.echo(json.dumps(out))


if __name__ == "__main__":
    cli()
