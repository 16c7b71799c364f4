"""The compact decoder (Llama, Qwen2, Qwen3; the language model of Qwen2-VL / Qwen2.5-VL) bound
to a memory-mapped artifact.

Frozen tensors are views of the artifact's mapped files (moved to the GPU when training
there); fused groups (q|k|v, gate|up) are concatenated once at bind time. Only the LoRA
adapters are parameters. Attention and RoPE run in bf16 with PyTorch SDPA; every frozen
projection goes through runtime/functions.py.
"""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from pact.formats import Artifact, PactError
from pact.formats.families import FAMILIES, GROUPS, check_config
from pact.formats.nvfp4 import NVFP4Tensor

from .backends import get_ops, resolve_compute, resolve_kernels
from .functions import FrozenGroup, Lora, MlpFn, NormProjectionFn, ProjectionFn, RopeFn
from .lora import LoraConfig
from .loss import target_cross_entropy
from .recipe import Recipe, parse_recipe
from .rows import NVFP4TensorFP8

TRAINABLE_FAMILIES = FAMILIES  # the language model of every family pact-convert reads
# fp8 backend: re-encode each frozen weight to E4M3 per GEMM call, or keep E4M3 copies on the GPU
# (1 byte per parameter per layout; no re-encode: cuBLAS FP8 speed).
FP8_WEIGHTS = ("per-call", "resident")


def _rotary(family: str, cfg):
    # Qwen2-VL's M-RoPE is Qwen2's rotary per position component (rope_at() picks the components)
    if family in ("qwen2", "qwen2_vl", "qwen2_5_vl"):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as R
    elif family == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as R
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as R
    return R(cfg)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: fp32 statistics, bf16 result times the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class Layer:
    def __init__(self):
        self.attn_norm = self.mlp_norm = self.q_norm = self.k_norm = None
        self.qkv = self.o = self.gate_up = self.down = None


class PactModel(nn.Module):
    """LoRA training model over an NVFP4 artifact. ``forward`` returns (summed loss, #targets)."""

    def __init__(self, artifact: Artifact, lora: LoraConfig | None, *, device: str | torch.device = "cpu",
                 kernels: str | None = None, compute: str | None = None, activations: str | Recipe | None = None,
                 checkpoint: bool = False, seed: int = 0, fp8_weights: str = "per-call"):
        super().__init__()
        from transformers import AutoConfig

        self.artifact, self.lora_cfg = artifact, lora
        self.family = artifact.meta["family"]
        if self.family not in TRAINABLE_FAMILIES:
            raise PactError(
                f"{artifact.path}: pact-train supports {', '.join(TRAINABLE_FAMILIES)} artifacts; "
                f"this one is {self.family}"
            )
        self.device = torch.device(device)
        self.checkpoint = checkpoint
        self.kernels = resolve_kernels(kernels, self.device)
        self.compute = resolve_compute(compute, self.device)
        self.recipe = parse_recipe(activations)  # per site: GEMM input, LoRA input, saved (runtime/recipe.py)
        self.ops = get_ops(self.kernels, self.compute, self.recipe.dgrad)
        if fp8_weights not in FP8_WEIGHTS:
            raise PactError(f"--fp8-weights must be one of {', '.join(FP8_WEIGHTS)}, got {fp8_weights!r}")
        if fp8_weights == "resident" and self.compute != "fp8":
            raise PactError(f"--fp8-weights resident keeps E4M3 copies for the fp8 backend; this run computes with "
                            f"{self.compute}: add --compute fp8 or leave --fp8-weights at per-call")
        self._fp8_copy = self.ops.fp8_rows if fp8_weights == "resident" else None
        cfg_file = artifact.hf_dir / "config.json"
        try:
            check_config(json.loads(cfg_file.read_text(encoding="utf-8")), artifact.names(), str(cfg_file))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PactError(f"{cfg_file}: unreadable ({e}): the artifact is damaged; re-copy it or re-run pact-convert") from None
        cfg = AutoConfig.from_pretrained(artifact.hf_dir, trust_remote_code=False).get_text_config()
        self.cfg = cfg
        self.hidden = cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.rotary = _rotary(self.family, cfg).to(self.device)
        rope_cfg = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        self.mrope_section = rope_cfg.get("mrope_section")  # Qwen2-VL: frequencies per (t, h, w) component

        names = set(artifact.names())
        dev = self.device
        # "model." (Llama, Qwen, VL checkpoints as published) or "model.language_model." (VL re-saved
        # by transformers 4.52-4.x)
        p = next((p for p in ("model.", "model.language_model.") if f"{p}embed_tokens.weight" in names), None)
        if p is None:
            raise PactError(f"{artifact.path}: no model.embed_tokens.weight: not a decoder this version can bind")
        self.embed = artifact.dense(f"{p}embed_tokens.weight").to(dev)
        self.final_norm = artifact.dense(f"{p}norm.weight").to(dev)
        self.lm_head = artifact.dense("lm_head.weight").to(dev) if "lm_head.weight" in names else self.embed
        gen = torch.Generator().manual_seed(seed)
        self.lora_params = nn.ParameterDict()
        self.adapters: dict[str, Lora] = {}
        self.layers: list[Layer] = []
        for i in range(cfg.num_hidden_layers):
            lp = f"{p}layers.{i}"
            L = Layer()
            L.attn_norm = artifact.dense(f"{lp}.input_layernorm.weight").to(dev)
            L.mlp_norm = artifact.dense(f"{lp}.post_attention_layernorm.weight").to(dev)
            if f"{lp}.self_attn.q_norm.weight" in names:
                L.q_norm = artifact.dense(f"{lp}.self_attn.q_norm.weight").to(dev)
                L.k_norm = artifact.dense(f"{lp}.self_attn.k_norm.weight").to(dev)
            for group, attr in (("qkv", "qkv"), ("o", "o"), ("gate_up", "gate_up"), ("down", "down")):
                sub = "self_attn" if group in ("qkv", "o") else "mlp"
                members = [f"{lp}.{sub}.{m}.weight" for m in GROUPS[group]]
                setattr(L, attr, self._bind_group(members, names, gen))
            self.layers.append(L)

    # -- binding
    def _bind_group(self, members: list[str], names: set[str], gen: torch.Generator) -> FrozenGroup:
        art, dev = self.artifact, self.device
        entries = [art.entry(m) for m in members]
        g = FrozenGroup(names=members, sizes=[e["shape"][0] for e in entries])
        if all(e["kind"] == "nvfp4" for e in entries):
            scales = {e["global_scale"] for e in entries}
            if len(scales) != 1:
                raise PactError(f"{art.path}: {members} do not share one global scale: re-run pact-convert")
            fwd = [art.nvfp4(m, "fwd") for m in members]
            bwd = [art.nvfp4(m, "bwd") for m in members]

            def cat(ts, dim):  # one member: keep the mapped tensor itself (no copy on CPU)
                return (ts[0] if len(ts) == 1 else torch.cat(ts, dim)).to(dev)

            gs = fwd[0].global_scale.to(dev)
            g.weight = NVFP4Tensor(cat([t.packed for t in fwd], 0), cat([t.scales for t in fwd], 0), gs)
            g.weight_t = NVFP4Tensor(cat([t.packed for t in bwd], 1), cat([t.scales for t in bwd], 1), gs)
            if self._fp8_copy is not None:
                g.weight, g.weight_t = (NVFP4TensorFP8.of(w, self._fp8_copy) for w in (g.weight, g.weight_t))
        else:
            # a member kept in bf16: the group runs dense (NVFP4 members decoded once to bf16)
            g.dense = torch.cat([art.dequantize(m).to(torch.bfloat16) for m in members], 0).to(dev)
        biases = [m.removesuffix(".weight") + ".bias" for m in members]
        if any(b in names for b in biases):
            g.bias = torch.cat([
                art.dense(b) if b in names else torch.zeros(n, dtype=torch.bfloat16)
                for b, n in zip(biases, g.sizes)
            ]).to(dev)
        cfg = self.lora_cfg
        for m, e in zip(members, entries):
            role = e["role"]
            if cfg is None or role not in cfg.targets:
                g.loras.append(None)
                continue
            n, k = e["shape"]
            A = torch.empty(cfg.r, k)
            # PEFT's init: kaiming-uniform A (a = sqrt(5)), zero B, so training starts at the base model
            bound = math.sqrt(6.0 / ((1 + 5.0) * k))
            A.uniform_(-bound, bound, generator=gen)
            key = m.removesuffix(".weight").replace(".", "__")
            self.lora_params[key + "__A"] = nn.Parameter(A.to(dev))
            self.lora_params[key + "__B"] = nn.Parameter(torch.zeros(n, cfg.r, device=dev))
            lora = Lora(self.lora_params[key + "__A"], self.lora_params[key + "__B"], cfg.scale, cfg.dropout)
            self.adapters[m] = lora
            g.loras.append(lora)
        return g

    # -- forward
    def _attention(self, L: Layer, x: torch.Tensor, cos, sin, B: int, S: int) -> torch.Tensor:
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = NormProjectionFn.apply(x, L.attn_norm, self.eps, L.qkv, self.ops, self.recipe.qkv, *L.qkv.lora_params())
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        if L.q_norm is not None:  # Qwen3: per-head RMSNorm before the rotation
            q = rmsnorm(q.view(B * S, nh, hd), L.q_norm, self.eps).view(B * S, nh * hd)
            k = rmsnorm(k.view(B * S, nkv, hd), L.k_norm, self.eps).view(B * S, nkv * hd)
        q, k = RopeFn.apply(q, cos, sin, self.ops), RopeFn.apply(k, cos, sin, self.ops)
        q, k, v = (t.view(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        o = o.transpose(1, 2).reshape(B * S, nh * hd)
        return ProjectionFn.apply(o, L.o, self.ops, self.recipe.o, *L.o.lora_params())

    def rope(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [seq_len, head_dim / 2] for positions 0..seq_len-1, in x's dtype."""
        return self.rope_at(x, torch.arange(seq_len, device=x.device))

    def rope_at(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, head_dim / 2] for token positions [S], or for M-RoPE positions [3, S]
        (temporal, height, width: frequency j rotates by the component its mrope_section gives it).
        transformers' tables, rounded as it rounds them (both halves of its table are equal)."""
        half = self.head_dim // 2
        if positions.dim() == 1:
            cos, sin = self.rotary(x, positions.unsqueeze(0))
            return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()
        if not self.mrope_section:
            raise PactError(f"{self.artifact.path}: 3-component (M-RoPE) positions given to a model "
                            "without mrope_section")
        if sum(self.mrope_section) != half:
            raise PactError(f"{self.artifact.path}: mrope_section {self.mrope_section} does not sum to "
                            f"head_dim / 2 = {half}")
        cos, sin = self.rotary(x, positions)  # [3, S, head_dim]: one table per component
        dev = cos.device
        comp = torch.repeat_interleave(torch.arange(len(self.mrope_section), device=dev) % 3,
                                       torch.tensor(self.mrope_section, device=dev))
        j = torch.arange(half, device=dev)
        return cos[comp, :, j].t().contiguous(), sin[comp, :, j].t().contiguous()

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Last decoder layer's output (before the final norm), [B, S, H] bf16."""
        B, S = input_ids.shape
        x = F.embedding(input_ids, self.embed).reshape(B * S, self.hidden)
        return self.run_layers(x, *self.rope(x, S), B, S)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, B: int, S: int) -> torch.Tensor:
        """The decoder layers over input embeddings x [B * S, H] -> [B, S, H] bf16."""
        for L in self.layers:
            if self.checkpoint and torch.is_grad_enabled():
                # keep only the layer input; the layer runs again in backward (same RNG state)
                x = torch.utils.checkpoint.checkpoint(self.layer, L, x, cos, sin, B, S, use_reentrant=False)
            else:
                x = self.layer(L, x, cos, sin, B, S)
        return x.view(B, S, self.hidden)

    def layer(self, L: Layer, x: torch.Tensor, cos, sin, B: int, S: int) -> torch.Tensor:
        """Decoder layer L on rows x [B * S, H] (RoPE tables cos/sin): the public hook calibration runs."""
        x = x + self._attention(L, x, cos, sin, B, S)
        return x + MlpFn.apply(x, L.mlp_norm, self.eps, L.gate_up, L.down, self.ops,
                               (self.recipe.gate_up, self.recipe.down),
                               *L.gate_up.lora_params(), *L.down.lora_params())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed next-token loss over positions whose label is not -100, and their count."""
        h = self.hidden_states(input_ids)
        targets = labels[:, 1:]
        sel = targets != -100
        hs = rmsnorm(h[:, :-1][sel], self.final_norm, self.eps)
        return target_cross_entropy(hs, self.lm_head, targets[sel], self.ops.ce_grad_), int(sel.sum())

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits [B, S, V] (evaluation and tests only: training never builds these)."""
        h = rmsnorm(self.hidden_states(input_ids), self.final_norm, self.eps)
        return (h @ self.lm_head.t()).float()

    def adapter_state(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: (lo.A, lo.B) for name, lo in self.adapters.items()}

    def load_adapter_state(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        missing = set(self.adapters) - set(adapters)
        if missing:
            raise PactError(f"adapter lacks {len(missing)} of this model's LoRA modules, e.g. {sorted(missing)[0]}")
        with torch.no_grad():
            for name, lo in self.adapters.items():
                A, B = adapters[name]
                if A.shape != lo.A.shape or B.shape != lo.B.shape:
                    raise PactError(f"adapter {name}: shapes {tuple(A.shape)}/{tuple(B.shape)} do not match "
                                    f"{tuple(lo.A.shape)}/{tuple(lo.B.shape)} (different rank or model)")
                lo.A.copy_(A)
                lo.B.copy_(B)
