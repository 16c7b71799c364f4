"""`--activations auto[:F]`: each site's saved copy (what backward reads: NVFP4, E4M3 or bf16) chosen
by a short probe of the run itself, under a memory budget.

The run trains its first steps with the default recipe; then, on a few small batches of its own data and
with the adapter as trained so far (at step 0 B is zero and dA sees no saved copy), the probe
computes the LoRA gradient once with every saved copy in bf16 (the reference) and once per site and
candidate precision with only that site's copy rounded. A site's cost is the relative squared error
of the whole LoRA gradient, sum ||g - g_ref||^2 / sum ||g_ref||^2 over adapter tensors and batches
(errors from different sites are close to independent, so they add). Of the 3^4 assignments, the
probe keeps the one with the least summed error whose saved bytes per token (`saved_bytes_per_token`,
the memory model the tests check against measured peaks) fit the budget: F times the default
recipe's (F = 1 for plain `auto`). The GEMM and LoRA inputs stay as the default has them.

The gradient error is a proxy: on a hard task the saved copies' cost shows in accuracy while the
gradient's cosine stays at 0.998 (BENCHMARKS.md, learning fidelity). The probe ranks the sites
against each other on this run's data; whether that ranking beats a fixed preset downstream is
measured, not assumed, and `auto` is not the default.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import torch

from pact.formats import PactError

from .functions import saved_bytes_per_token
from .recipe import DEFAULT, SAVED, SITES, Recipe, parse_recipe

CANDIDATES = ("nvfp4", "fp8", "bf16")  # a site's saved copy, cheapest first
PROBE_BATCHES = 4  # of a quarter of the training batch's rows each: one batch's tokens, and the reference
# pass (every copy bf16, ~2.5x the saved bytes) stays under the memory the training batch needs
PROBE_STEP_MAX = 20  # the probe runs at step min(20, steps // 10): an adapter that has started to learn


def parse_auto(spec, flag: str = "--activations") -> float | None:
    """The budget factor of ``auto`` / ``auto:F`` (F > 0); None for any other recipe."""
    if not isinstance(spec, str) or spec.split(":", 1)[0].split(",", 1)[0].strip() != "auto":
        return None
    if "," in spec:
        raise PactError(f"{flag} {spec!r}: auto takes no overrides (auto or auto:F alone: the probe picks the saved "
                        "copies); for dgrad or a site's precision name a preset, e.g. mixed,dgrad=fp8")
    _, colon, tail = spec.partition(":")
    if not colon:
        return 1.0
    try:
        f = float(tail)
    except ValueError:
        f = float("nan")
    if not (math.isfinite(f) and f > 0):
        raise PactError(f"{flag} {spec!r}: auto takes an optional budget factor, auto:F with F > 0 (the saved "
                        f"copies' memory as a multiple of the default recipe's), e.g. auto:1.5")
    return f


def auto_spec(factor: float) -> str:
    """The canonical spelling (what train_config.json records and --resume compares)."""
    return "auto" if factor == 1.0 else f"auto:{factor:g}"


def probe_step(total: int) -> int:
    return min(PROBE_STEP_MAX, total // 10)


def probe_rows(batch_size: int) -> int:
    """Rows of a probe batch: a quarter of the training batch's."""
    return max(1, -(-batch_size // 4))


def _bytes(model, recipe: Recipe) -> int:
    ranks = {t: model.lora_cfg.r for t in model.lora_cfg.targets} if model.lora_cfg else {}
    return saved_bytes_per_token(model.hidden, model.n_heads * model.head_dim, model.cfg.intermediate_size, ranks,
                                 recipe)


def with_saved(base: Recipe, saved: dict[str, str]) -> Recipe:
    """``base`` with the saved copies ``saved`` gives (site -> precision); the rest as it is."""
    return dataclasses.replace(base, **{s: dataclasses.replace(base.site(s), saved=p) for s, p in saved.items()})


def _grads(model, recipe: Recipe, batches: list) -> list[list[torch.Tensor]]:
    params = list(model.lora_params.values())
    out = []
    with model.recipe_as(recipe):
        for ids, labels in batches:
            loss, n = model(ids, labels)
            (loss / max(int(n), 1)).backward()
            out.append([p.grad.detach().float().clone() if p.grad is not None
                        else torch.zeros_like(p, dtype=torch.float32) for p in params])
            for p in params:
                p.grad = None
    return out


def choose(model, batches: list, factor: float) -> tuple[Recipe, dict]:
    """The recipe the probe picks on ``batches`` [(ids, labels)] and its record: per site and
    precision the gradient's relative squared error, the budget and the chosen bytes per token,
    the probe's seconds and passes."""
    t0 = time.perf_counter()
    base = model.recipe
    ref = _grads(model, with_saved(base, {s: "bf16" for s in SITES}), batches)
    den = sum(float(r.pow(2).sum()) for b in ref for r in b)
    error: dict[str, dict[str, float]] = {s: {"bf16": 0.0} for s in SITES}
    for s in SITES:
        for p in CANDIDATES[:-1]:
            got = _grads(model, with_saved(base, {**{t: "bf16" for t in SITES}, s: p}), batches)
            num = sum(float((g - r).pow(2).sum()) for bg, br in zip(got, ref) for g, r in zip(bg, br))
            error[s][p] = num / den if den > 0 else 0.0
    budget = factor * _bytes(model, parse_recipe(DEFAULT).on(base.compute))
    best = None
    for combo in itertools.product(CANDIDATES, repeat=len(SITES)):
        r = with_saved(base, dict(zip(SITES, combo)))
        b = _bytes(model, r)
        if b > budget:
            continue
        key = (sum(error[s][p] for s, p in zip(SITES, combo)), b)
        if best is None or key < best[0]:
            best = (key, r)
    if best is None:  # not even every copy NVFP4 fits: the cheapest
        r = with_saved(base, {s: CANDIDATES[0] for s in SITES})
        best = ((sum(error[s][CANDIDATES[0]] for s in SITES), _bytes(model, r)), r)
    (err, used), chosen = best
    record = {"chosen": chosen.spec(), "factor": factor, "budget_bytes_per_token": round(budget),
              "bytes_per_token": used, "gradient_error": {s: {p: round(v, 6) for p, v in e.items()}
                                                          for s, e in error.items()},
              "chosen_error": round(err, 6), "batches": len(batches),
              "passes": len(batches) * (1 + len(SITES) * (len(CANDIDATES) - 1)),
              "seconds": round(time.perf_counter() - t0, 2)}
    return chosen, record


def saved_codes(recipe: Recipe) -> list[int]:
    """The sites' saved precisions as indices of SAVED (what ranks all-reduce to share a choice)."""
    return [SAVED.index(recipe.site(s).saved) for s in SITES]


def from_codes(base: Recipe, codes: list[int]) -> Recipe:
    return with_saved(base, {s: SAVED[c] for s, c in zip(SITES, codes)})


def chosen_recipe(base: Recipe, spec, where: str) -> Recipe:
    """A recorded choice (a checkpoint's state): its saved precisions on ``base``; one clear error
    when the record is not a recipe."""
    try:
        got = parse_recipe(spec) if isinstance(spec, str) else None
    except PactError:
        got = None
    if got is None:
        raise PactError(f"{where}: its recipe_auto record {spec!r} is not a recipe: the checkpoint is damaged; "
                        "delete it to resume from an earlier one, or train anew")
    return with_saved(base, {s: got.site(s).saved for s in SITES})
