"""lm-evaluation-harness over pact: ``PactLM``, an lm_eval model registered as "pact" when this
module is imported (``lm_eval.simple_evaluate(model="pact", model_args="artifact=...,adapter=...")``
after ``import pact.runtime.harness``; `pact lm-eval` does both). Log-likelihoods come from the
same forward pact-eval scores with, generations from runtime/generate.py (key/value cache).
lm_eval is an optional dependency: ``pip install "pact-nvfp4[harness]"``."""

from __future__ import annotations

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from pact.formats import PactError

from .evaluate import load_adapted
from .generate import generate


@register_model("pact")
class PactLM(LM):
    """``artifact`` (a pact artifact folder), ``adapter`` (a pact-train run, optional),
    ``batch_size`` (sequences per forward), ``max_length`` (tokens; default the model's
    max_position_embeddings, at most 4096), ``device``, ``activations``, ``compute``."""

    def __init__(self, artifact: str, adapter: str | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, device: str | None = None, activations: str | None = None,
                 compute: str | None = None, max_gen_toks: int = 256, **_ignored) -> None:
        super().__init__()
        try:
            self.batch = int(batch_size)
        except ValueError:
            self.batch = 0
        if self.batch < 1:
            raise PactError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
        self.model, self.tokenizer = load_adapted(artifact, adapter, device=device, activations=activations,
                                                  compute=compute, tool="pact lm-eval")
        window = getattr(self.model.cfg, "max_position_embeddings", None)  # (what generate() keeps to as well)
        self.max_length = int(max_length or min(window or 2048, 4096))
        self.max_gen_toks = int(max_gen_toks)
        tok = self.tokenizer
        self.prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    # -- tokens
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As transformers-based harness models split it: a context's trailing spaces go with the
        continuation, and the continuation's tokens are those the whole string adds."""
        if not context:
            return [self.prefix], self._encode(continuation)
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return whole[: len(ctx)], whole[len(ctx):]

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding gives the continuation,
        per (context ids, continuation ids); the context is cut from the left to max_length (a
        continuation longer than the window: its last max_length tokens)."""
        out = []
        for i in range(0, len(pairs), self.batch):
            chunk = pairs[i : i + self.batch]
            seqs = [(c + k)[-(self.max_length + 1):][:-1] for c, k in chunk]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.prefix or 0, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
            logp = torch.log_softmax(self.model.logits(ids.to(self.model.device)), dim=-1)
            for r, ((_, k), s) in enumerate(zip(chunk, seqs)):
                k = k[-len(s):]  # (only what fits the window is scored)
                n = len(k)
                rows = logp[r, len(s) - n : len(s)]
                target = torch.tensor(k, device=rows.device)
                out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
        return out

    # -- the harness's three request kinds
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._score([self._pair(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for req in requests:
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self._encode(req.args[0]), prefix_token=self.prefix, max_seq_len=self.max_length,
                context_len=1)]
            totals.append(sum(lp for lp, _ in self._score(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        stops = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        for req in requests:
            context, kw = req.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            want = int(kw.get("max_gen_toks", self.max_gen_toks))
            # the context keeps at least half the window; generation stops at the window's end
            ids = self._encode(context)[-max(self.max_length // 2, self.max_length - want):] or [self.prefix]
            max_new = min(want, self.max_length - len(ids))
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            if max_new < 1:
                results.append("")
                continue

            def seen(toks, until=until):
                return bool(until) and any(u in self.tokenizer.decode(toks, skip_special_tokens=True) for u in until)

            toks = generate(self.model, ids, max_new_tokens=max_new, stop_ids=stops, temperature=temperature,
                            seed=0 if temperature > 0 else None, stop_when=seen)
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            for u in until:
                text = text.split(u)[0]
            results.append(text)
        return results
