"""Held-out evaluation: token loss, and accuracy by label likelihood when completions are labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE, Example, collate
from .model import rmsnorm


@torch.no_grad()
def sequence_logprobs(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of log p(target) per sequence [B] (logits only at target positions)."""
    h = model.hidden_states(ids)
    targets = labels[:, 1:]
    sel = targets != IGNORE
    rows = torch.nonzero(sel)[:, 0]
    hs = rmsnorm(h[:, :-1][sel], model.final_norm, model.eps)
    out = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
    step = max(1, (1 << 24) // model.lm_head.shape[0])
    t = targets[sel]
    for i in range(0, hs.shape[0], step):
        logp = F.log_softmax((hs[i : i + step] @ model.lm_head.t()).float(), dim=-1)
        out.index_add_(0, rows[i : i + step], logp.gather(1, t[i : i + step, None]).squeeze(1))
    return out


def label_candidates(examples: list[Example], max_labels: int = 32) -> dict[str, list[int]] | None:
    """Completion text -> its token ids, when the completions look like class labels
    (between 2 and ``max_labels`` distinct values, each seen at least twice on average)."""
    cands: dict[str, list[int]] = {}
    for e in examples:
        cands.setdefault(e.completion, e.ids[len(e.prompt_ids):])
    if 2 <= len(cands) <= max_labels and len(cands) * 2 <= len(examples):
        return cands
    return None


@torch.no_grad()
def evaluate(model, examples: list[Example], *, batch_size: int, pad_id: int) -> dict:
    """{"eval_loss", "eval_tokens", and "eval_accuracy" + "eval_labels" for label-style data}.

    Label-style data is scored in one pass: every (example, candidate) sequence of a chunk of
    ``batch_size`` examples runs as one batch; the true candidate's log-likelihood gives the loss.
    """
    device = model.device
    cands = label_candidates(examples)
    total, count = 0.0, 0
    if cands is None:
        for i in range(0, len(examples), batch_size):
            ids, labels = collate(examples, list(range(i, min(i + batch_size, len(examples)))), pad_id, device)
            loss, n = model(ids, labels)
            total, count = total + float(loss), count + n
        return {"eval_loss": total / max(count, 1), "eval_tokens": count}
    names = list(cands)
    correct = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        seqs = [Example(e.prompt_ids + cands[c], [IGNORE] * len(e.prompt_ids) + cands[c], c, e.prompt_ids)
                for e in chunk for c in names]
        ids, labels = collate(seqs, list(range(len(seqs))), pad_id, device)
        logp = sequence_logprobs(model, ids, labels).view(len(chunk), len(names))
        for e, row in zip(chunk, logp):
            correct += names[int(row.argmax())] == e.completion
            total -= float(row[names.index(e.completion)])
            count += len(cands[e.completion])
    return {"eval_loss": total / max(count, 1), "eval_tokens": count, "eval_accuracy": correct / len(examples),
            "eval_labels": names}


def evaluate_artifact(artifact: str, data: str, *, adapter: str | None = None, max_len: int = 1024, batch_size: int = 8,
                      device: str | None = None, activations: str = "nvfp4") -> dict:
    """Held-out loss (and label accuracy) of an artifact, with a PEFT adapter folder or zero-shot."""
    from transformers import AutoTokenizer

    from pact.formats import open_artifact

    from .data import pad_id, read_records, tokenize
    from .lora import load_peft_adapter
    from .model import PactModel

    art = open_artifact(artifact)
    tokenizer = AutoTokenizer.from_pretrained(art.hf_dir)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lora_cfg, weights = load_peft_adapter(adapter) if adapter else (None, None)
    model = PactModel(art, lora_cfg, device=dev, activations=activations)
    if weights is not None:
        model.load_adapter_state(weights)
    examples = tokenize(read_records(data, flag="--data"), tokenizer, max_len=max_len, vocab_size=model.embed.shape[0])
    return {"adapter": adapter, **evaluate(model, examples, batch_size=batch_size, pad_id=pad_id(tokenizer))}
