"""An error-compensating merge: each adapted projection's W + s * B A re-quantized to NVFP4 by
GPTQ, with the Hessian of the layer's inputs as the trained model (the NVFP4 base with its
adapter) produces them on texts like the training data.

A plain merge rounds W + s * B A to the nearest NVFP4 values: where the adapter's delta is smaller
than half an E2M1 step it is rounded away. GPTQ instead quantizes column by column and pushes each
column's rounding error onto the columns not yet quantized, weighted by how the inputs see them,
so the merged layer reproduces the adapted layer's outputs on those inputs. Each layer's inputs
come, by default, from the model merged so far (as GPTQ calibration takes them): each layer is
solved for the inputs the merged layers below it will give it at serving time. On the H200 this
kept more of the gain than the adapted model's inputs on every one of four tasks (BENCHMARKS.md
"What a merged NVFP4 export keeps").
"""

from __future__ import annotations

import logging
import os

import torch
from tqdm.auto import tqdm

from pact.convert.export import merged_weight
from pact.formats import PactError
from pact.formats.nvfp4 import NVFP4Tensor, dequantize, encode_with_scales, global_scale_from_amax
from pact.formats.peft import load_peft_adapter
from pact.runtime.data import read_records, tokenize
from pact.runtime.session import open_session

from .calibrate import GROUPS, _Clock, _output_error, _units, _warn_few_tokens
from .gptq import GPTQ
from .quantizer import NVFP4Quantizer

log = logging.getLogger(__name__)


def gptq_merge(artifact: str | os.PathLike, adapter: str | os.PathLike, data: str | os.PathLike, *,
               max_samples: int = 128, max_len: int = 512, damp: float = 0.01, blocksize: int = 128,
               actorder: bool = False, inputs: str = "merged", gain: float | str = "auto",
               device: str | None = None, progress: bool = False) -> tuple[dict[str, NVFP4Tensor], dict]:
    """The merged NVFP4 forward-layout tensor of every projection the adapter adapts (1x16 blocks;
    a fused group's members share one global scale, as vLLM fuses q|k|v and gate|up), and a
    summary: samples, tokens, seconds (``stages``: load, activations, solve) and per projection the
    layer-output error on these inputs of the plain (round-to-nearest) merge and of this one,
    relative to the adapted layer's output.

    ``inputs``: whose activations each layer's Hessian is taken on: "merged" (the default: the merged
    model's so far, as GPTQ calibration does: each layer solved for the inputs the layers merged below
    it will give it at serving time) or "adapted" (the adapted model's: every layer solved for the
    inputs the unmerged model gives it).

    ``gain``: the merge solves for W + gain * s * B A. Rounding to a grid the base's codes already
    sit on pulls the merged weights back toward the base, so the realized change carries only part of
    the adapter's delta; a gain above 1 makes up for it. "auto" (the default) chooses it per fused group: GPTQ on
    every eighth row at each gain of AUTO_GAINS, and the one whose realized change projects closest to
    the whole delta (``delta_kept`` nearest 1) is solved on every row. ``delta_kept`` (reported per
    projection) is that projection in the metric of the layer's inputs: <Q - W, s B A>_H / <s B A, s B A>_H."""
    gain = merge_gain(gain)
    if inputs not in ("adapted", "merged"):
        raise ValueError(f"gptq_merge: inputs must be 'adapted' or 'merged', got {inputs!r}")
    clock = _Clock("cpu")  # as calibration's: the device is known once the session is open
    if max_samples < 1:
        raise PactError(f"--merge-samples must be >= 1, got {max_samples}")
    ses = open_session(artifact, device=device, tool="pact-export")
    art = ses.artifact
    lora_cfg, weights = load_peft_adapter(str(adapter))
    rule = art.block_scale_rule
    # the trained model's layer inputs, unrounded; forward only (no backward layouts loaded)
    model = ses.model(lora_cfg, activations="bf16", backward=False)
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
    gains: dict[str, dict] = {}
    warned = False
    for L in tqdm(model.layers, desc="merge", unit="layer", disable=not progress):
        groups = {n: getattr(L, n) for n in GROUPS}
        todo = {n: g for n, g in groups.items() if g.weight is not None and any(m in weights for m in g.names)}
        hess = {id(g.weight): GPTQ(g.weight.shape[1], dev) for g in todo.values()}
        with torch.no_grad():
            for u in units:

                def add(w, x, u=u):  # the base GEMM's input rows (the LoRA's A reads the same rows)
                    if id(w) in hess:
                        hess[id(w)].add_batch(x if u.real is None else x[u.real])

                with model.observing(add):
                    y = model.layer(L, u.x, u.cos, u.sin, u.B, u.S)
                if inputs == "adapted":
                    u.x = y
        clock.lap("activations")
        if hess and not warned:  # (the first layer with an adapted group: as few tokens as every other)
            _warn_few_tokens(hess.values(), "pact-export --merge", "give --merge-data more or longer texts like the "
                             "training data (or train on more records: the run's own texts are the default)")
            warned = True
        for g in todo.values():
            H = hess[id(g.weight)]
            Ws, Ts = [], []
            for name in g.names:  # export's own W + s * B A (and its refusal of non-finite values), on the device
                base = art.nvfp4(name, "fwd")
                W = dequantize(NVFP4Tensor(base.packed.to(dev), base.scales.to(dev), base.global_scale.to(dev))).float()
                Ws.append(W)
                Ts.append(merged_weight(W, name, lora_on_dev, scale))
            W0, T = torch.cat(Ws), torch.cat(Ts)
            if gain == "auto":
                k, Q, sc, gk, probe = _auto_gain(H, W0, T, rule, blocksize, damp, actorder)
                gains[g.names[0]] = {"gain": k, "probe": {str(c): round(v, 4) for c, v in probe.items()},
                                     "short": probe[k] < AUTO_SHORT}
            else:
                gk = _gain_scales(W0, T, (gain,))
                Q, sc = _solve_gains(H, W0, T, T - W0, (gain,), gk, None, rule, blocksize, damp, actorder)
                gk = gk[0]
            packed = NVFP4Tensor(encode_with_scales(Q, sc, gk), sc, gk)  # codes re-derived exactly
            gs = global_scale_from_amax(float(T.abs().amax()))  # the plain merge's, for its error
            if inputs == "merged":  # the layer runs merged from now on: its members' codes, no adapter
                g.weight = type(g.weight)(packed.packed, packed.scales, packed.global_scale)
                for lo in g.loras:
                    if lo is not None:
                        lo.B.data.zero_()
            r0 = 0
            for name, W, Tn in zip(g.names, Ws, Ts):
                r1 = r0 + W.shape[0]
                out[name] = NVFP4Tensor(packed.packed[r0:r1].cpu(), packed.scales[r0:r1].cpu(),
                                        packed.global_scale.cpu())
                if name in weights:  # against the adapted layer W + s B A
                    plain = _rtn(Tn, gs, rule)
                    errors[name] = {"plain": _output_error(Tn, plain, H.H), "gptq": _output_error(Tn, Q[r0:r1], H.H),
                                    "delta_kept": _delta_kept(Q[r0:r1], W, Tn - W, H.H)}
                r0 = r1
        clock.lap("solve")
        if inputs == "merged":  # the next layer's inputs, from this layer as merged
            with torch.no_grad():
                for u in units:
                    u.x = model.layer(L, u.x, u.cos, u.sin, u.B, u.S)
            clock.lap("activations")
    errors = {k: {m: round(float(v), 6) for m, v in e.items()} for k, e in errors.items()}  # one sync, at the end
    clock.lap("solve")
    stages = clock.report()
    summary = {"method": "gptq", "inputs": inputs, "samples": len(samples),
               "tokens": int(sum(s.numel() for s in samples)), "damp": damp, "gain": gain,
               "seconds": round(stages["total"], 1), "stages": stages, "output_error": errors}
    if gains:
        summary["gains"] = gains
        short = [n for n, g in gains.items() if g["short"]]
        if short:  # no gain tried carried most of the delta
            log.warning("--merge-gain auto: on %d of %d groups no gain of %s carried %d%% of the adapter's delta "
                        "(first: %s); there the merge keeps less of what the adapter learned (a fixed --merge-gain "
                        "up to 4 may carry more; the unmerged export keeps all of it)", len(short), len(gains),
                        "/".join(f"{c:g}" for c in AUTO_GAINS), round(100 * AUTO_SHORT), short[0])
    return out, summary


def merge_gain(value: float | str) -> float | str:
    """--merge-gain: "auto", or a number in (0, 4] (given as a number or its text), else a PactError."""
    if value == "auto":
        return value
    try:
        g = float(value)
    except (TypeError, ValueError):
        g = float("nan")
    if not 0 < g <= 4:
        raise PactError(f"--merge-gain {value!r}: give auto or a number in (0, 4] (1: the delta as trained)")
    return g


AUTO_GAINS = (1.0, 1.25, 1.5, 1.75, 2.0)  # gain="auto": the gains each fused group's probe tries
AUTO_STRIDE = 8  # ... on every AUTO_STRIDE-th row
AUTO_SHORT = 0.9  # a group whose chosen gain's probe stays below this is reported (summary "gains": short)


def _gain_scales(W0: torch.Tensor, T: torch.Tensor, gains: tuple[float, ...]) -> torch.Tensor:
    """Each gain c's global scale [len(gains)]: the whole group's W0 + c (T - W0) (T itself at c = 1), the
    grid the merge at that gain rounds to (one gain's temporary at a time)."""
    return global_scale_from_amax(torch.stack([(T if c == 1 else W0 + c * (T - W0)).abs().amax() for c in gains]))


def _solve_gains(H: GPTQ, W0: torch.Tensor, T: torch.Tensor, D: torch.Tensor, gains: tuple[float, ...],
                 g: torch.Tensor, rows: torch.Tensor | None, rule: str, blocksize: int, damp: float, actorder: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of rows ``rows`` (None: all) of W0 + c D (D = T - W0; T itself at c = 1) to NVFP4, for every
    gain c in one sweep, on its global scale in ``g`` (``_gain_scales``): rows are independent, so the
    gains' rows stack. One sweep's launches for all of them: on a GPU the sweep is launch-bound. Returns
    the fake-quantized rows [len(gains) * r, K], gain after gain, and their e4m3 block scales."""
    Tr, Wr, Dr = (T, W0, D) if rows is None else (T[rows], W0[rows], D[rows])
    X = torch.cat([Tr if c == 1 else Wr + c * Dr for c in gains])
    q = NVFP4Quantizer(g.repeat_interleave(Tr.shape[0]), scaling="1d", scale_rule=rule)
    Q = H.quantize(X, q, blocksize=blocksize, percdamp=damp, actorder=actorder)[0]
    return Q, q.scales


def _auto_gain(H: GPTQ, W0: torch.Tensor, T: torch.Tensor, rule: str, blocksize: int, damp: float, actorder: bool
               ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor, dict[float, float]]:
    """gain="auto" for one fused group: the gain of AUTO_GAINS whose solve on every AUTO_STRIDE-th row
    keeps ``delta_kept`` nearest 1, and the group solved at it (fake-quantized weights, e4m3 scales,
    global scale), with each gain's probe. Where every gain's rows of the whole group fit in a
    quarter of the GPU's free memory (``_stack_all``) they are all solved in one sweep and the chosen
    gain's rows are the result; else the probe rows are swept for every gain, then the other rows at the
    chosen gain. The choice reads the same rows either way."""
    n = W0.shape[0]
    every = torch.arange(0, n, AUTO_STRIDE, device=W0.device)
    stack_all = _stack_all(W0, len(AUTO_GAINS))
    D, g = T - W0, _gain_scales(W0, T, AUTO_GAINS)
    Q, sc = _solve_gains(H, W0, T, D, AUTO_GAINS, g, None if stack_all else every, rule, blocksize, damp, actorder)
    r = n if stack_all else every.numel()
    seg = [slice(i * r, (i + 1) * r) for i in range(len(AUTO_GAINS))]
    kept = torch.stack([_delta_kept(Q[s][every] if stack_all else Q[s], W0[every], D[every], H.H) for s in seg])
    probe = dict(zip(AUTO_GAINS, kept.tolist()))  # one host sync: the choice needs them
    i = min(range(len(AUTO_GAINS)), key=lambda j: abs(probe[AUTO_GAINS[j]] - 1))
    k = AUTO_GAINS[i]
    if stack_all:
        return k, Q[seg[i]], sc[seg[i]], g[i], probe
    rest = torch.ones(n, dtype=torch.bool, device=W0.device)
    rest[every] = False
    rest = rest.nonzero().squeeze(1)
    Qr, scr = _solve_gains(H, W0, T, D, (k,), g[i : i + 1], rest, rule, blocksize, damp, actorder)
    Qk, sck = torch.empty_like(W0), torch.empty(n, sc.shape[1], dtype=sc.dtype, device=sc.device)
    Qk[every], sck[every] = Q[seg[i]], sc[seg[i]]
    Qk[rest], sck[rest] = Qr, scr
    return k, Qk, sck, g[i], probe


def _stack_all(W0: torch.Tensor, gains: int) -> bool:
    """Whether auto's gains sweep all the group's rows at once: on a GPU, where the sweep's time is
    its launches, when about six fp32 copies of them (the sweep's own and the stacked inputs) fit in
    a quarter of the free memory; on a CPU never (there the time is arithmetic, as many rows as it sweeps)."""
    if not W0.is_cuda:
        return False
    free, _ = torch.cuda.mem_get_info(W0.device)
    return 6 * gains * W0.numel() * 4 <= free // 4


def _delta_kept(Q: torch.Tensor, W: torch.Tensor, delta: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """How much of ``delta`` the merged weights' change Q - W carries, in the metric of the layer's
    inputs: <Q - W, delta>_H / <delta, delta>_H (1: all of it, along the delta; 0 for no delta).
    A 0-dim tensor, as _output_error's."""
    dH = delta.float() @ H
    den = (dH * delta).sum()
    return torch.where(den > 0, ((Q - W).float() * dH).sum() / den, torch.zeros_like(den))


def _rtn(W: torch.Tensor, gs: torch.Tensor, rule: str) -> torch.Tensor:
    """The plain merge's weights, for its output error: rounded where W lies (a GPU rounds to the same
    codes and scales as the CPU, tests/test_convert.py)."""
    from pact.formats.nvfp4 import quantize

    return dequantize(quantize(W, global_scale=gs.to(W.device), scaling="1d", scale_rule=rule))

