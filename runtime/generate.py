"""Text generation over a PactModel with a key/value cache: the prompt runs once, then each new
token runs alone against the cached keys and values of every layer. Greedy by default;
``temperature`` and ``top_p`` sample (seeded)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from pact.formats import PactError

from .matmul import mm
from .model import rmsnorm


@torch.no_grad()
def next_logits(model, ids: list[int], cache: list, pos: int) -> torch.Tensor:
    """fp32 logits [V] after ``ids`` (new tokens at positions pos, pos + 1, ...), the cache extended."""
    return _last_logits(model, torch.tensor([ids], device=model.device), cache, pos)[0]


def _last_logits(model, ids: torch.Tensor, cache: list, pos: int) -> torch.Tensor:
    """fp32 logits [B, V] after each row of ``ids`` [B, S] (new tokens at positions pos .. pos + S - 1
    of every row), the cache extended."""
    B, S = ids.shape
    x = model.embed_ids(ids).reshape(B * S, model.hidden)
    cos, sin = model.rope_at(x, torch.arange(pos, pos + S, device=model.device))
    for i, L in enumerate(model.layers):
        x = model.layer(L, x, cos, sin, B, S, None, cache=(cache, i))
    h = rmsnorm(x.view(B, S, model.hidden)[:, -1], model.final_norm, model.eps)
    return mm(h, model.lm_head.t()).float()


def truncate(cache: list, n: int) -> None:
    """Keep the first ``n`` tokens' keys and values (a chat whose next rendering differs after them)."""
    for i, kv in enumerate(cache):
        if kv is not None:
            cache[i] = (kv[0][:, :, :n], kv[1][:, :, :n]) if n else None


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest head whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, on_token: Callable[[int], None] | None = None,
             cache: list | None = None, pos: int = 0, stop_when: Callable[[list[int]], bool] | None = None
             ) -> list[int]:
    """Tokens after ``prompt_ids`` until one in ``stop_ids`` (not returned) or ``max_new_tokens``.
    ``cache``/``pos``: continue an earlier call's cache (a chat's next turn: ``prompt_ids`` are then
    only the new tokens, at position ``pos``). ``on_token`` sees each token as it is chosen;
    ``stop_when(tokens so far)`` True ends it (e.g. a stop string appeared)."""
    if max_new_tokens < 1:
        raise PactError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0) or not 0 < top_p <= 1:
        raise PactError(f"--temperature must be >= 0 and finite, and --top-p in (0, 1], got {temperature} and {top_p}")
    if not prompt_ids:
        raise PactError("the prompt is empty: nothing to continue")
    window = int(getattr(model.cfg, "max_position_embeddings", 0) or 0)  # the model's context
    if window and pos + len(prompt_ids) >= window:
        what, fix = ("the conversation", "/reset the chat or shorten it") if pos else ("the prompt", "shorten it")
        raise PactError(f"{what} takes {pos + len(prompt_ids)} tokens; the model's context is {window}: {fix}")
    if window:
        max_new_tokens = min(max_new_tokens, window - pos - len(prompt_ids))  # generation stops at the context's end
    cache = [None] * len(model.layers) if cache is None else cache
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out: list[int] = []
    logits = next_logits(model, list(prompt_ids), cache, pos)
    pos += len(prompt_ids)
    for _ in range(max_new_tokens):
        if not bool(torch.isfinite(logits).all()):  # (a finite artifact or adapter can still compute NaN: said)
            raise PactError(f"the model computes non-finite values (NaN or inf) at token {pos}: its weights or its "
                            "adapter are not usable (an adapter's update is scaled by lora_alpha / r in its "
                            "adapter_config.json); re-copy the artifact or re-run pact-convert, or retrain the adapter")
        nxt = _pick(logits, temperature, top_p, gen)
        if nxt in stop_ids:
            break
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if stop_when is not None and stop_when(out):
            break
        logits = next_logits(model, [nxt], cache, pos)
        pos += 1
    return out


@torch.no_grad()
def sample_texts(model, start_id: int, n: int, length: int, *, temperature: float = 1.0, seed: int = 0,
                 rows: int | None = None, allowed: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``n`` token sequences of ``length`` tokens that the model writes itself: each starts with
    ``start_id`` (a BOS or end-of-text token) and continues by sampling the full distribution at
    ``temperature``, ``rows`` sequences at a time (default: 16384 tokens' worth) against one key/value
    cache (an end-of-text token sampled mid-way starts another text; the row goes on). Seeded: the
    same tokens for the same model, device, seed, ``n``, ``length`` and ``rows``. ``allowed`` (bool
    [vocab]): the only ids it may sample. Data-free calibration texts (`pact-calibrate --model-texts`)."""
    if n < 1 or length < 2:
        raise PactError(f"model texts: need n >= 1 and length >= 2, got {n} x {length}")
    if temperature <= 0:
        raise PactError(f"model texts: temperature must be > 0, got {temperature}")
    window = int(getattr(model.cfg, "max_position_embeddings", 0) or 0)
    if window and length > window:
        raise PactError(f"model texts: {length} tokens is longer than the model's context ({window})")
    gen = torch.Generator(device=model.device).manual_seed(seed)
    rows = rows or max(1, min(n, 16384 // length))
    out: list[torch.Tensor] = []
    for r0 in range(0, n, rows):
        B = min(rows, n - r0)
        ids = torch.full((B, 1), start_id, dtype=torch.long, device=model.device)
        cache = [None] * len(model.layers)
        for pos in range(length - 1):
            logits = _last_logits(model, ids[:, -1:], cache, pos)
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp_(min=1e-20)
            nxt = (logits / temperature - torch.log(-torch.log(u))).argmax(-1, keepdim=True)  # Gumbel-max
            ids = torch.cat([ids, nxt], dim=1)
        out += [row.cpu() for row in ids]
    return out
