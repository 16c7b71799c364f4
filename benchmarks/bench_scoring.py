"""Held-out label scoring time (pact-eval, `pact demo`): each prompt run once with every candidate
after it (`shared_prefix_batches`, what evaluate() runs) vs once per (prompt, candidate)
(`candidate_batches`), on one artifact and JSONL, with the accuracy each gives.

    python benchmarks/bench_scoring.py --artifact ART --data test.jsonl [--limit 48] [--repeats 2]
"""

from __future__ import annotations

import json
import time

import click
import torch


@click.command()
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--limit", default=0, show_default=True, help="Score the first N examples (0: all).")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--max-len", default=128, show_default=True)
@click.option("--repeats", default=2, show_default=True, help="Timed passes per path (best kept; one untimed first).")
def main(artifact, data, limit, batch_size, max_len, repeats) -> None:
    from pact.runtime.data import pad_id, read_records, tokenize
    from pact.runtime.evaluate import candidate_batches, candidate_logprobs, label_candidates, sequence_logprobs
    from pact.runtime.session import open_session

    ses = open_session(artifact)
    model, tok = ses.model(None), ses.tokenizer
    examples = tokenize(read_records(data), tok, max_len=max_len)
    cands = label_candidates(examples)
    if cands is None:
        raise click.BadParameter(f"{data}: completions are not class labels", param_hint="--data")
    examples = examples[:limit] if limit else examples
    pad, names = pad_id(tok), list(cands)

    def per_candidate():
        return [sequence_logprobs(model, ids, labels).view(len(chunk), len(names))
                for chunk, ids, labels in candidate_batches(examples, cands, batch_size, pad, model.device)]

    def shared_prefix():
        return [lp for _, lp in candidate_logprobs(model, examples, cands, batch_size, pad)]

    def timed(fn):
        fn()  # warm-up (kernel compilation on a GPU)
        best, out = float("inf"), None
        for _ in range(repeats):
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = torch.cat(fn())
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        truth = torch.tensor([names.index(e.completion) for e in examples], device=out.device)
        return best, float((out.argmax(1) == truth).float().mean())

    (t_old, acc_old), (t_new, acc_new) = timed(per_candidate), timed(shared_prefix)
    row = {"device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
           "examples": len(examples), "labels": len(names), "batch_size": batch_size,
           "per_candidate_s": round(t_old, 2), "shared_prefix_s": round(t_new, 2), "speedup": round(t_old / t_new, 2),
           "accuracy_per_candidate": round(acc_old, 4), "accuracy_shared_prefix": round(acc_new, 4)}
    click.echo(json.dumps(row))


if __name__ == "__main__":
    main()
