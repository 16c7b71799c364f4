"""Calibration prompts -> token ids with the artifact's tokenizer.

.jsonl: one object per line with "text", or "messages" (rendered with the chat template), or
"prompt" + "completion" (joined). .txt: documents separated by blank lines. A folder: images
for vision-language artifacts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pact.formats import PactError
from pact.runtime.data import read_records

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def _texts(path: Path, tokenizer) -> list[str]:
    if path.suffix == ".txt":
        docs = [d.strip() for d in path.read_text(encoding="utf-8").split("\n\n")]
        return [d for d in docs if d]
    if path.suffix != ".jsonl":
        raise PactError(f"--prompts {path}: expected a .jsonl or .txt file, or a folder of images")
    out = []
    for rec in read_records(path, flag="--prompts"):
        if isinstance(rec.get("text"), str):
            out.append(rec["text"])
        elif isinstance(rec.get("messages"), list):
            out.append(tokenizer.apply_chat_template(rec["messages"], tokenize=False))
        elif "prompt" in rec and "completion" in rec:
            out.append(str(rec["prompt"]) + str(rec["completion"]))
        else:
            raise PactError(f"{rec['_where']}: expected an object with 'text', 'messages' or prompt/completion")
    return out


def load_prompts(path: str | Path, tokenizer, *, vision: bool, max_samples: int, seq_len: int) -> list[torch.Tensor]:
    """Token id tensors (1-D, at most ``seq_len`` long), at most ``max_samples`` of them."""
    p = Path(path)
    if not p.exists():
        raise PactError(f"--prompts {p}: no such file or folder")
    if p.is_dir():
        images = [f for f in sorted(p.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
        if not vision:
            raise PactError(f"--prompts {p}: a folder of images, but this artifact is a text-only model: "
                            "give a .jsonl or .txt of text prompts")
        raise PactError(f"--prompts {p}: calibrating vision-language artifacts with images ({len(images)} found) "
                        "is not built yet; use text prompts")
    texts = _texts(p, tokenizer)
    samples = []
    for t in texts[:max_samples]:
        ids = tokenizer(t, return_tensors="pt", truncation=True, max_length=seq_len)["input_ids"][0]
        if ids.numel() >= 2:
            samples.append(ids)
    if not samples:
        raise PactError(f"--prompts {p}: no usable prompts (empty, or every prompt shorter than 2 tokens)")
    return samples
