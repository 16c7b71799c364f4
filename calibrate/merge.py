"""An error-compensating merge: each adapted projection's W + s * B A re-quantized to NVFP4 by
GPTQ, with the Hessian of the layer's inputs as the trained model (the NVFP4 base with its
adapter) produces them on texts like the training data.

A plain merge rounds W + s * B A to the nearest NVFP4 values: where the adapter's delta is smaller
than half an E2M1 step it is rounded away. GPTQ instead quantizes column by column and pushes each
column's rounding error onto the columns not yet quantized, weighted by how the inputs see them,
so the merged layer reproduces the adapted layer's outputs on those inputs. Each layer's inputs
come from the adapted (unmerged) model: the target is what training produced.

``inputs="merged-cv"`` (experimental: bench_merge's ``gptq-cv``, not a pact-export option until a
grid shows it keeps more): each layer is also fed the inputs X~ the already-merged layers below it
produce, and its target moves from W to W + Delta, Delta = W D (H~ + r I)^-1 with H~ = X~^T X~ and
D = (X - X~)^T X~ (the ridge-regularised least-squares map from X~ to the adapted outputs X W^T,
so the layer takes up what the merges below it lost). The unregularised fit (r near 0) matched the
merge texts and did not carry over to held-out text (BENCHMARKS.md: "a sequential solve was
measured and dropped"), so r is chosen per group on held-out merge texts: every fifth text is kept
out of the fit, the ridge r (a multiple of mean diag H~) that lowers their output error most is
taken, and none (Delta = 0, the plain GPTQ merge) where no ridge removes at least MIN_GAIN of
their error; then the fit is redone on every text with that r.
"""

from __future__ import annotations

import os

import torch
from tqdm.auto import tqdm

from pact.convert.export import merged_weight
from pact.formats import PactError
from pact.formats.nvfp4 import NVFP4Tensor, dequantize, global_scale_from_amax
from pact.formats.peft import load_peft_adapter
from pact.runtime.data import read_records, tokenize
from pact.runtime.session import open_session

from .calibrate import GROUPS, _Clock, _output_error, _units
from .gptq import GPTQ
from .quantizer import NVFP4Quantizer

INPUTS = ("adapted", "merged-cv")
RIDGES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # merged-cv: ridges tried, x mean diag H~
HELD_OUT = 5  # merged-cv: every HELD_OUT-th text is held out of the fit to choose its ridge
MIN_GAIN = 0.01  # merged-cv: a ridge is taken only if it removes this share of the held-out texts' error


def gptq_merge(artifact: str | os.PathLike, adapter: str | os.PathLike, data: str | os.PathLike, *,
               max_samples: int = 128, max_len: int = 512, damp: float = 0.01, blocksize: int = 128,
               actorder: bool = False, inputs: str = "adapted", device: str | None = None,
               progress: bool = False) -> tuple[dict[str, NVFP4Tensor], dict]:
    """The merged NVFP4 forward-layout tensor of every projection the adapter adapts (1x16 blocks;
    a fused group's members share one global scale, as vLLM fuses q|k|v and gate|up), and a
    summary: samples, tokens, seconds (``stages``: load, activations, solve) and per projection the
    layer-output error on these inputs of the plain (round-to-nearest) merge and of this one,
    relative to the adapted layer's output (``inputs="merged-cv"``: this one's against the target it
    fitted, and ``ridge``: per group, named by its first member, the ridge taken or None)."""
    clock = _Clock("cpu")  # as calibration's: the device is known once the session is open
    if inputs not in INPUTS:
        raise PactError(f"merge inputs must be one of {', '.join(INPUTS)}, got {inputs!r}")
    if max_samples < 1:
        raise PactError(f"--merge-samples must be >= 1, got {max_samples}")
    ses = open_session(artifact, device=device, tool="pact-export")
    art = ses.artifact
    lora_cfg, weights = load_peft_adapter(str(adapter))
    rule = (art.meta.get("provenance") or {}).get("block_scales", "amax")
    model = ses.model(lora_cfg, activations="bf16")  # the trained model's layer inputs, unrounded
    model.load_adapter_state(weights)
    examples = tokenize(read_records(data, flag="--merge-data"), ses.tokenizer, max_len=max_len,
                        vocab_size=model.embed.shape[0])[:max_samples]
    samples = [torch.tensor(e.ids) for e in examples if len(e.ids) >= 2]
    if not samples:
        raise PactError(f"--merge-data {data}: no example of 2 tokens or more")
    units = _units(model, art, samples)
    scale, dev = lora_cfg.scale, model.device
    clock.device = torch.device(dev)
    clock.lap("load")  # opening the artifact, the adapter and the texts
    lora_on_dev = {k: tuple(t.to(dev) for t in ab) for k, ab in weights.items()}
    out: dict[str, NVFP4Tensor] = {}
    errors: dict[str, dict[str, float]] = {}
    ridges: dict[str, float | None] = {}
    cv = inputs == "merged-cv"
    xq = [u.x for u in units] if cv else None  # the merged model's stream
    held = _held_out_rows(units) if cv else None
    for L in tqdm(model.layers, desc="merge", unit="layer", disable=not progress):
        groups = {n: getattr(L, n) for n in GROUPS}
        todo = {n: g for n, g in groups.items() if g.weight is not None and any(m in weights for m in g.names)}
        hess = {id(g.weight): GPTQ(g.weight.shape[1], dev) for g in todo.values()}
        pairs = {k: _Pairs(h.columns, dev) for k, h in hess.items()} if cv else {}
        with torch.no_grad():
            for i, u in enumerate(units):
                rows: dict[int, torch.Tensor] = {}
                if cv:  # X~: this layer's GEMM inputs on the merged stream (its own adapters still on)

                    def keep(w, x, u=u):
                        if id(w) in hess:
                            rows[id(w)] = (x if u.real is None else x[u.real]).float()

                    with model.observing(keep):
                        model.layer(L, xq[i], u.cos, u.sin, u.B, u.S)

                def add(w, x, u=u, i=i):  # the base GEMM's input rows (the LoRA's A reads the same rows)
                    if id(w) in hess:
                        x = x if u.real is None else x[u.real]
                        if cv:
                            hess[id(w)].add_batch(rows[id(w)])
                            pairs[id(w)].add(x.float(), rows[id(w)], held[i])
                        else:
                            hess[id(w)].add_batch(x)

                with model.observing(add):
                    u.x = model.layer(L, u.x, u.cos, u.sin, u.B, u.S)
        clock.lap("activations")
        for g in todo.values():
            H = hess[id(g.weight)]
            Ws = []
            for name in g.names:  # export's own W + s * B A (and its refusal of non-finite values), on the device
                base = art.nvfp4(name, "fwd")
                W = dequantize(NVFP4Tensor(base.packed.to(dev), base.scales.to(dev), base.global_scale.to(dev)))
                Ws.append(merged_weight(W.float(), name, lora_on_dev, scale))
            Wc = torch.cat(Ws)
            if cv:
                Wc, ridges[g.names[0]] = pairs[id(g.weight)].target(Wc)
            gs = global_scale_from_amax(float(Wc.abs().amax()))
            q = NVFP4Quantizer(gs, scaling="1d", scale_rule=rule)
            Q, _ = H.quantize(Wc, q, blocksize=blocksize, percdamp=damp, actorder=actorder)
            packed = q.pack(Q)
            r0 = 0
            for name, W in zip(g.names, Ws):
                r1 = r0 + W.shape[0]
                out[name] = NVFP4Tensor(packed.packed[r0:r1].cpu(), packed.scales[r0:r1].cpu(),
                                        packed.global_scale.cpu())
                if name in weights:
                    plain = _rtn(W, gs, rule)
                    # merged-cv: GPTQ's error against the target it fitted (W + Delta), not against W + BA
                    errors[name] = {"plain": _output_error(W, plain, H.H),
                                    "gptq": _output_error(Wc[r0:r1], Q[r0:r1], H.H)}
                r0 = r1
            if cv:  # the merged stream runs this group as exported: merged codes, no adapter
                g.weight = type(g.weight)(packed.packed, packed.scales, packed.global_scale)
                for lo in g.loras:
                    if lo is not None:
                        lo.B.data.zero_()
        clock.lap("solve")
        if cv:
            with torch.no_grad():
                for i, u in enumerate(units):
                    xq[i] = model.layer(L, xq[i], u.cos, u.sin, u.B, u.S)
            clock.lap("activations")
    errors = {k: {m: round(float(v), 6) for m, v in e.items()} for k, e in errors.items()}  # one sync, at the end
    clock.lap("solve")
    stages = clock.report()
    summary = {"method": "gptq", **({"inputs": inputs, "ridge": ridges} if cv else {}), "samples": len(samples),
               "tokens": int(sum(s.numel() for s in samples)),
               "damp": damp, "seconds": round(stages["total"], 1), "stages": stages, "output_error": errors}
    return out, summary


def _held_out_rows(units) -> list[torch.Tensor | None]:
    """Per unit, which of its real rows belong to held-out texts (every HELD_OUT-th text, counted
    across units in their order); None where the unit holds none."""
    out, seen = [], 0
    for u in units:
        text = torch.arange(u.B, device=u.x.device).repeat_interleave(u.S) + seen  # each row's text
        if u.real is not None:
            text = text[u.real]
        held = text % HELD_OUT == HELD_OUT - 1
        out.append(held if bool(held.any()) else None)
        seen += u.B
    return out


class _Pairs:
    """merged-cv's sums over (X, X~) row pairs, apart for the fitted and the held-out texts:
    H~ = X~^T X~ and D = (X - X~)^T X~ (exactly 0 where the merged stream has lost nothing); for the
    held-out ones also G = (X - X~)^T (X - X~), their error with Delta = 0 being tr(W G W^T)."""

    def __init__(self, k: int, dev):
        self.H, self.D = torch.zeros(2, k, k, device=dev), torch.zeros(2, k, k, device=dev)  # [fit, held out]
        self.G = torch.zeros(k, k, device=dev)

    def add(self, x: torch.Tensor, xq: torch.Tensor, held: torch.Tensor | None) -> None:
        parts = [(0, x, xq)] if held is None else [(0, x[~held], xq[~held]), (1, x[held], xq[held])]
        for j, a, b in parts:
            self.H[j].addmm_(b.t(), b)
            self.D[j].addmm_((a - b).t(), b)
            if j:
                self.G.addmm_((a - b).t(), a - b)

    @staticmethod
    def _delta(W: torch.Tensor, H: torch.Tensor, D: torch.Tensor, r: float) -> torch.Tensor:
        Hd = H.clone()
        dead = Hd.diagonal() == 0
        Hd.diagonal().masked_fill_(dead, 1)
        Hd.diagonal().add_(r * float(H.diagonal().mean()))
        return torch.cholesky_solve((W @ D).t(), torch.linalg.cholesky(Hd)).t()  # W D Hd^-1

    def target(self, W: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """W + Delta at the ridge that lowers the held-out texts' output error most (tr(Delta Hh
        Delta^T) - 2 tr(Delta Dh^T W^T): the change of ||X~h (W + Delta)^T - Xh W^T||^2 from Delta = 0),
        refitted on every text; W and None where no ridge removes MIN_GAIN of that error (a fit of
        chance moves it by less) or nothing was held out."""
        if not bool(self.H[1].any()):
            return W, None
        WDh = W @ self.D[1]
        best, best_f = None, -MIN_GAIN * float((W @ self.G * W).sum())
        for r in RIDGES:
            d = self._delta(W, self.H[0], self.D[0], r)
            f = float((d @ self.H[1] * d).sum() - 2 * (d * WDh).sum())
            if f < best_f:
                best, best_f = r, f
        if best is None:
            return W, None
        return W + self._delta(W, self.H.sum(0), self.D.sum(0), best), best


def _rtn(W: torch.Tensor, gs: torch.Tensor, rule: str) -> torch.Tensor:
    """The plain merge's weights, for its output error: rounded where W lies (a GPU rounds to the same
    codes and scales as the CPU, tests/test_convert.py)."""
    from pact.formats.nvfp4 import quantize

    return dequantize(quantize(W, global_scale=gs.to(W.device), scaling="1d", scale_rule=rule))

