"""Artifact -> decoder layers: the frozen tensors as views of the artifact's mapped files (moved to
the model's device), fused groups (q|k|v, gate|up) concatenated once, and the LoRA adapters made
(PEFT's init) for the targets the LoRA config names. The model (model.py) only runs what this binds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from pact.formats import Artifact, PactError
from pact.formats.families import GROUPS, LM_PREFIXES, FamilySpec
from pact.formats.nvfp4 import NVFP4Tensor
from pact.formats.peft import LoraConfig

from .functions import FrozenGroup, Lora, corr_fused


@dataclass
class Layer:
    """One decoder layer's frozen tensors: the two input RMSNorm weights (Qwen3's and Gemma's per-head
    q/k norms, Gemma's norms on the attention and MLP outputs) and the four frozen groups; what the
    layer's attention sees: its own sliding window (Gemma's local layers; None: the model's) and
    which RoPE table it reads (0, or 1: Gemma's local table)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: FrozenGroup
    o: FrozenGroup
    gate_up: FrozenGroup
    down: FrozenGroup
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    window: int | None = None
    rope: int = 0


@dataclass
class Bound:
    """What a model runs: embeddings, final norm, LM head, the layers, and the LoRA adapters
    (``params``: every trainable tensor, keyed as the adapter files key them; ``adapters``: per
    frozen member's name)."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[Layer]
    params: nn.ParameterDict = field(default_factory=nn.ParameterDict)
    adapters: dict[str, Lora] = field(default_factory=dict)


# the order `bind` walks a layer's groups in, and so the order it draws their adapters' A from the generator
GROUP_ORDER = ("qkv", "o", "gate_up", "down")
DRAW_ORDER = tuple(m for group in GROUP_ORDER for m in GROUPS[group])  # q k v o gate up down


def bind(artifact: Artifact, n_layers: int, lora: LoraConfig | None, device: torch.device, *, seed: int = 0,
         resident=None, spec: FamilySpec | None = None, backward_layout: bool = True) -> Bound:
    """Bind ``n_layers`` decoder layers of ``artifact`` on ``device``, their norms named as the family's
    ``spec`` names them (a (1 + w) norm kept as that fp32 sum: the kernels multiply by it in fp32, as
    Gemma does). ``resident``: how the backend keeps a frozen weight (`Ops.resident`: E4M3 copies
    beside it with `--fp8-weights resident`); None: as it is. ``backward_layout``: False leaves the
    backward layouts unread (``weight_t`` None: the input gradients read the forward layout)."""
    spec = spec or FamilySpec()
    names = set(artifact.names())
    p = next((p for p in LM_PREFIXES if f"{p}embed_tokens.weight" in names), None)
    if p is None:
        raise PactError(f"{artifact.path}: no model.embed_tokens.weight: not a decoder this version can bind")
    dense = lambda name: artifact.dense(name).to(device)  # noqa: E731

    def norm(name: str) -> torch.Tensor | None:
        if name not in names:
            return None
        return 1.0 + dense(name).float() if spec.norm_offset else dense(name)

    embed = dense(f"{p}embed_tokens.weight")
    out = Bound(embed, norm(f"{p}norm.weight"), dense("lm_head.weight") if "lm_head.weight" in names else embed, [])
    gen = torch.Generator().manual_seed(seed)
    adapted = set(lora.layer_ids(n_layers)) if lora is not None else set()
    for i in range(n_layers):
        lp = f"{p}layers.{i}"
        groups = {}
        for group in GROUP_ORDER:
            sub = "self_attn" if group in ("qkv", "o") else "mlp"
            members = [f"{lp}.{sub}.{m}.weight" for m in GROUPS[group]]
            groups[group] = _bind_group(artifact, members, names, device, lora if i in adapted else None, gen, out,
                                        resident, backward_layout)
        for name in (spec.attn_norm, spec.mlp_norm, spec.post_attn_norm, spec.post_mlp_norm):
            if name and f"{lp}.{name}.weight" not in names:
                raise PactError(f"{artifact.path}: {lp}.{name}.weight is missing: the artifact does not hold this "
                                "family's layers; re-run pact-convert")
        post = lambda name: norm(f"{lp}.{name}.weight") if name else None  # noqa: E731
        out.layers.append(Layer(norm(f"{lp}.{spec.attn_norm}.weight"), norm(f"{lp}.{spec.mlp_norm}.weight"), **groups,
                                q_norm=norm(f"{lp}.self_attn.q_norm.weight"),  # Qwen3, Gemma: per-head q/k norms
                                k_norm=norm(f"{lp}.self_attn.k_norm.weight"),
                                post_attn_norm=post(spec.post_attn_norm), post_mlp_norm=post(spec.post_mlp_norm)))
    return out


def lora_init_A(r: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """One adapter's A (r x k, fp32) drawn from ``gen``: PEFT's init, kaiming-uniform with a = sqrt(5) (B
    starts at zero, so training starts at the base model). `bind` draws every adapted projection's A from
    one generator seeded with ``seed``, layer by layer, in DRAW_ORDER."""
    bound = math.sqrt(6.0 / ((1 + 5.0) * k))
    return torch.empty(r, k).uniform_(-bound, bound, generator=gen)


def _bind_group(art: Artifact, members: list[str], names: set[str], dev: torch.device, cfg: LoraConfig | None,
                gen: torch.Generator, out: Bound, resident, backward_layout: bool = True) -> FrozenGroup:
    entries = [art.entry(m) for m in members]
    g = FrozenGroup(names=members, sizes=[e["shape"][0] for e in entries])
    if all(e["kind"] == "nvfp4" for e in entries):
        scales = {e["global_scale"] for e in entries}
        if len(scales) != 1:
            raise PactError(f"{art.path}: {members} do not share one global scale: re-run pact-convert")
        fwd = [art.nvfp4(m, "fwd") for m in members]

        def cat(ts, dim):  # one member: keep the mapped tensor itself (no copy on CPU)
            return (ts[0] if len(ts) == 1 else torch.cat(ts, dim)).to(dev)

        gs = fwd[0].global_scale.to(dev)
        g.weight = NVFP4Tensor(cat([t.packed for t in fwd], 0), cat([t.scales for t in fwd], 0), gs)
        if backward_layout:
            bwd = [art.nvfp4(m, "bwd") for m in members]
            g.weight_t = NVFP4Tensor(cat([t.packed for t in bwd], 1), cat([t.scales for t in bwd], 1), gs)
        if resident is not None:
            g.weight = resident(g.weight)
            g.weight_t = None if g.weight_t is None else resident(g.weight_t)
        corr = [art.correction(m) for m in members]
        if any(c is not None for c in corr):
            g.corr = [None if c is None else (c[0].to(dev, torch.bfloat16), c[1].to(dev, torch.bfloat16)) for c in corr]
            corr_fused(g)  # made here, not at the first step (which may be inside a CUDA graph's capture)
    else:
        # a member kept in bf16: the group runs dense (NVFP4 members decoded once to bf16)
        g.dense = torch.cat([art.dequantize(m).to(torch.bfloat16) for m in members], 0).to(dev)
    biases = [m.removesuffix(".weight") + ".bias" for m in members]
    if any(b in names for b in biases):
        g.bias = torch.cat([
            art.dense(b) if b in names else torch.zeros(n, dtype=torch.bfloat16)
            for b, n in zip(biases, g.sizes)
        ]).to(dev)
    for m, e in zip(members, entries):
        role = e["role"]
        if cfg is None or role not in cfg.targets:
            g.loras.append(None)
            continue
        n, k = e["shape"]
        A = lora_init_A(cfg.r, k, gen)
        key = m.removesuffix(".weight").replace(".", "__")
        out.params[key + "__A"] = nn.Parameter(A.to(dev))
        out.params[key + "__B"] = nn.Parameter(torch.zeros(n, cfg.r, device=dev))
        lo = Lora(out.params[key + "__A"], out.params[key + "__B"], cfg.scale, cfg.dropout)
        out.adapters[m] = lo
        g.loras.append(lo)
    return g
