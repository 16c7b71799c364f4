"""--packing vs one example per row: real (non-padding) tokens per second of one epoch of pact-train.

    python benchmarks/bench_packing.py --artifact ART --data train.jsonl [--batch-size 8 --max-len 512]

Each mode trains one epoch of --data at the same --batch-size (rows per step) and --max-len; the
rate is the data's token count over the run's elapsed time (metrics.jsonl), so padding counts as
the cost it is. Prints one JSON line per mode and their ratio.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import click


@click.command()
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--data", required=True, type=click.Path(exists=True))
@click.option("--batch-size", default=8, show_default=True)
@click.option("--max-len", default=512, show_default=True)
@click.option("--limit", default=0, show_default=True, help="Use the first N records (0: all).")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(artifact, data, batch_size, max_len, limit, json_out) -> None:
    from transformers import AutoTokenizer

    from pact.formats import open_artifact
    from pact.runtime.data import read_records, tokenize
    from pact.runtime.trainer import TrainConfig, train

    work = Path(tempfile.mkdtemp(prefix="pact-packing-"))
    try:
        recs = read_records(data)[: limit or None]
        path = work / "data.jsonl"
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "_where"}) + "\n" for r in recs))
        tok = AutoTokenizer.from_pretrained(open_artifact(artifact).hf_dir)
        real = sum(len(e.ids) for e in tokenize(read_records(path), tok, max_len=max_len))
        rows = []
        for packing in (False, True):
            run = work / f"run-{packing}"
            train(TrainConfig(artifact=artifact, data=str(path), out=str(run), batch_size=batch_size, max_len=max_len,
                              epochs=1.0, packing=packing), progress=False)
            m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            first = m[0]["elapsed_s"]  # the first step (compilation, warm-up) left out of the rate
            steady = m[-1]["elapsed_s"] - first
            seen = real * (len(m) - 1) / len(m)  # tokens of the steps after the first (steps carry ~equal shares)
            rows.append({"packing": packing, "steps": len(m), "elapsed_s": round(m[-1]["elapsed_s"], 2),
                         "real_tokens": real, "real_tok_s": round(seen / steady) if steady > 0 else None,
                         "padded_tokens": sum(x["tokens"] for x in m)})
            click.echo(json.dumps(rows[-1]))
        if all(r["real_tok_s"] for r in rows):
            click.echo(f"packed / unpacked real tokens/s: {rows[1]['real_tok_s'] / rows[0]['real_tok_s']:.2f}x")
        if json_out:
            json_out.write_text(json.dumps(rows, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
