"""Calibration prompts -> model inputs with the artifact's tokenizer and image processor.

.jsonl: one object per line with "text", or any record pact-train reads (runtime/data.py
parse_record): "messages" or ShareGPT "conversations" (rendered with the chat template), or
"prompt" + "completion" and Alpaca instruction/input/output (joined); the same records from a
.parquet / .csv / .json table, a `datasets.save_to_disk` folder or a hub dataset id (read_records,
as pact-train --data). .txt: documents separated by blank lines. A folder: images
(png/jpg/jpeg/webp) for vision-language artifacts, one prompt each: the image and a request to
describe it (or the text of a ``<image stem>.txt`` beside it), rendered with the chat template;
each image is resized so its tokens fit ``seq_len``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pact.formats import PactError, require
from pact.runtime.data import (
    TABLE_FORMATS,
    check_conversation,
    check_text,
    looks_like_hub_id,
    parse_record,
    read_records,
    render_chat,
)
from pact.runtime.vision import ImageSample

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
IMAGE_REQUEST = "Describe this image in detail."


def datasets_folder(path: Path) -> bool:
    """``path`` is a `datasets.save_to_disk` folder (text records), not a folder of images."""
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_dict.json", "dataset_info.json", "state.json"))


def _texts(path: Path, tokenizer) -> list[str]:
    if path.suffix == ".txt" and path.is_file():
        docs = [d.strip() for d in path.read_text(encoding="utf-8").split("\n\n")]
        return [d for d in docs if d]
    if path.is_file() and path.suffix.lower() not in (".jsonl", *TABLE_FORMATS):
        raise PactError(f"--prompts {path}: expected a .jsonl, .txt, .parquet, .csv or .json file, a "
                        "datasets.save_to_disk folder, or a folder of images")
    out = []
    for rec in read_records(path, flag="--prompts"):  # (the readers of pact-train --data: tables, folders, hub ids)
        rec = parse_record(rec, text=True)  # the forms pact-train reads, and {"text"}
        if "text" in rec:
            out.append(rec["text"])
        elif "messages" in rec:
            check_conversation(rec["messages"], rec["_where"], null_content=True)  # a data error, not the template's
            out.append(render_chat(tokenizer, rec["messages"], rec["_where"]))
        else:  # (strings, as pact-train asks: never the text of a number, a list or null)
            w = rec["_where"]
            out.append(check_text(rec["prompt"], w, "prompt") + check_text(rec["completion"], w, "completion"))
    return out


def _size(size, *keys) -> int:
    """A pixel budget from an image processor's ``size`` (a dict, or transformers 5's SizeDict)."""
    for k in keys:
        v = size.get(k) if isinstance(size, dict) else getattr(size, k, None)
        if v:
            return int(v)
    raise PactError(f"image processor size {size} has none of {keys}")


def _image_samples(folder: Path, hf_dir: Path, tokenizer, *, max_samples: int, seq_len: int) -> list[ImageSample]:
    pil = require("PIL.Image", "vision", f"--prompts {folder} (image prompts)")
    Image, UnidentifiedImageError = pil, pil.UnidentifiedImageError
    from transformers import AutoConfig, AutoImageProcessor

    images = [f for f in sorted(folder.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES][:max_samples]
    if not images:
        raise PactError(f"--prompts {folder}: no {'/'.join(s[1:] for s in IMAGE_SUFFIXES)} images in this folder")
    if not (hf_dir / "preprocessor_config.json").is_file():
        raise PactError(f"{hf_dir.parent}: the artifact has no image processor (preprocessor_config.json): "
                        "convert from a model folder that has one")
    cfg = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    processor = AutoImageProcessor.from_pretrained(hf_dir, trust_remote_code=False)
    unit = processor.patch_size * processor.merge_size  # one image token per unit x unit pixels
    start, pad, end = tokenizer.convert_ids_to_tokens([cfg.vision_start_token_id, cfg.image_token_id,
                                                       cfg.vision_end_token_id])
    longest_px = _size(processor.size, "longest_edge", "max_pixels")
    shortest_px = _size(processor.size, "shortest_edge", "min_pixels")
    samples = []
    for f in images:
        side = f.with_suffix(".txt")
        request = side.read_text(encoding="utf-8").strip() if side.is_file() else IMAGE_REQUEST
        text = None
        if tokenizer.chat_template:
            text = render_chat(tokenizer,
                               [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": request}]}],
                               str(f), add_generation_prompt=True)
        if not text or text.count(pad) != 1:  # a template that does not place the image: a bare prompt
            text = f"{start}{pad}{end}{request}"
        budget = seq_len - len(tokenizer(text)["input_ids"]) + 1
        if budget < 4:
            raise PactError(f"--seq-len {seq_len}: too short for {f.name} and its prompt; raise it")
        longest = min(longest_px, budget * unit * unit)
        shortest = min(shortest_px, longest)
        try:
            with Image.open(f) as im:
                rgb = im.convert("RGB")
        except (OSError, UnidentifiedImageError) as e:
            raise PactError(f"--prompts {f}: not a readable image ({e})") from None
        px = processor(images=[rgb], return_tensors="pt", size={"shortest_edge": shortest, "longest_edge": longest})
        grid = px["image_grid_thw"]
        n = int(grid.prod()) // processor.merge_size ** 2
        ids = tokenizer(text.replace(pad, pad * n), return_tensors="pt")["input_ids"][0]
        if int((ids == cfg.image_token_id).sum()) != n:
            raise PactError(f"{hf_dir / 'tokenizer.json'}: {pad!r} is not one token; the tokenizer does not match "
                            "the model config")
        samples.append(ImageSample(ids, px["pixel_values"], grid, source=str(f)))
    return samples


def take_texts(texts: list[str], tokenizer, *, max_samples: int, seq_len: int,
               min_tokens: int = 0) -> tuple[list[torch.Tensor], int]:
    """The token ids (<= ``seq_len`` each) of the first ``max_samples`` of ``texts``, and of more after
    them until they hold ``min_tokens`` tokens; and how many texts that read. Texts shorter than 2
    tokens are read and dropped."""
    samples, tokens = [], 0
    for i, t in enumerate(texts):
        if i >= max_samples and tokens >= min_tokens:
            return samples, i
        ids = tokenizer(t, return_tensors="pt", truncation=True, max_length=seq_len)["input_ids"][0]
        if ids.numel() >= 2:
            samples.append(ids)
            tokens += ids.numel()
    return samples, len(texts)


def load_prompts(path: str | Path, tokenizer, *, vision: bool, max_samples: int, seq_len: int,
                 hf_dir: Path | None = None, min_tokens: int = 0) -> list[torch.Tensor] | list[ImageSample]:
    """Token id tensors (1-D, at most ``seq_len`` long), or for a folder of images ImageSamples;
    the first ``max_samples`` texts, and (``min_tokens``) more after them until they hold that many
    tokens or the file ends (short texts give GPTQ few tokens). Images: at most ``max_samples``."""
    p = Path(path)
    if not p.exists() and not looks_like_hub_id(str(path)):
        raise PactError(f"--prompts {p}: no such file or folder")
    if p.is_dir() and not datasets_folder(p):
        if not vision:
            raise PactError(f"--prompts {p}: a folder of images, but this artifact is a text-only model: "
                            "give a .jsonl or .txt of text prompts")
        if min_tokens:
            raise PactError(f"--prompts {p}: a folder of images; --min-tokens reads text prompts only: drop it "
                            "(--max-samples sets how many images)")
        return _image_samples(p, hf_dir, tokenizer, max_samples=max_samples, seq_len=seq_len)
    samples, _ = take_texts(_texts(p, tokenizer), tokenizer, max_samples=max_samples, seq_len=seq_len,
                            min_tokens=min_tokens)
    if not samples:
        raise PactError(f"--prompts {p}: no usable prompts (empty, or every prompt shorter than 2 tokens)")
    return samples
