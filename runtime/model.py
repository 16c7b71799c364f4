"""The compact decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3; the language model of Qwen2-VL / Qwen2.5-VL) over a
memory-mapped artifact: forward, RoPE / M-RoPE and loss. What it runs is bound by bind.py (frozen
tensors as views of the artifact's files, LoRA adapters the only parameters) and computed by the
ops runtime/ops builds from the recipe. Attention and RoPE run in bf16 with PyTorch SDPA; every frozen
projection goes through runtime/functions.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from pact.formats import Artifact, PactError
from pact.formats.families import FAMILIES, check_config, family_spec
from pact.formats.peft import LoraConfig

from .bind import Layer, bind
from .functions import TRAINING, Lora, MlpFn, NormProjectionFn, ProjectionFn, RopeFn
from .graphs import GraphBuffers, GraphedLayersFn, LayerGraphs, graphable
from .loss import target_cross_entropy
from .matmul import mm
from .ops import check_dgrad, get_ops, resolve_compute, resolve_kernels
from .recipe import Recipe, parse_recipe

log = logging.getLogger(__name__)

TRAINABLE_FAMILIES = FAMILIES  # the language model of every family pact-convert reads


LOCAL_ROPE = "sliding_attention"  # Gemma 3: the local layers' RoPE table (rope_at's second), the global one first


def _rotary(spec, cfg):
    """transformers' rotary embedding of the family (formats/families.py FamilySpec.rotary)."""
    import importlib

    module, name = spec.rotary
    rotary = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    try:
        rot = rotary(cfg)
    except (KeyError, ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise PactError(f"config.json: RoPE settings transformers cannot build a rotary embedding from "
                        f"({type(e).__name__}: {e}): the artifact is damaged or crafted; re-copy it or re-run "
                        "pact-convert") from None
    # settings it builds from but warns about (a scaling factor of 0, say) give inf frequencies: a model
    # computing NaN would score and train as if fine
    scales = [v for k, v in vars(rot).items() if k.endswith("attention_scaling") and isinstance(v, (int, float))]
    if not (all(bool(torch.isfinite(b).all()) for b in rot.buffers() if b.is_floating_point())
            and all(math.isfinite(v) and v > 0 for v in scales)):
        raise PactError("config.json: its RoPE settings (rope_parameters / rope_scaling) give non-finite rotary "
                        "frequencies or scaling: the artifact is damaged or crafted; re-copy it or re-run "
                        "pact-convert")
    return rot


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: fp32 statistics; a bf16 weight multiplies the bf16-rounded result
    (Llama, Qwen), an fp32 one (Gemma's 1 + w, bound so) the fp32 result, rounded once after."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w.dtype == torch.float32:
        return (xf * w).to(x.dtype)
    return w * xf.to(x.dtype)


def strict_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's validation errors of transformers' config dataclasses (a value of the wrong JSON type:
    hidden_act a list, use_cache a string), which derive from Exception alone."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def load_text_config(artifact: Artifact):
    """The artifact's decoder config (the text config of a vision-language model), checked against
    the artifact's tensors first (formats/families.py) so a damaged or hostile one is one error."""
    from transformers import AutoConfig

    cfg_file = artifact.hf_dir / "config.json"
    try:
        check_config(json.loads(cfg_file.read_text(encoding="utf-8")), artifact.names(), str(cfg_file))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PactError(f"{cfg_file}: unreadable ({e}): the artifact is damaged; "
                        "re-copy it or re-run pact-convert") from None
    try:
        return AutoConfig.from_pretrained(artifact.hf_dir, trust_remote_code=False).get_text_config()
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, *strict_errors()) as e:
        raise PactError(f"{cfg_file}: transformers cannot read it ({type(e).__name__}: {e}): the artifact is damaged "
                        "or crafted; re-copy it or re-run pact-convert") from None


class PactModel(nn.Module):
    """LoRA training model over an NVFP4 artifact. ``forward`` returns (summed loss, #targets).

    ``backward_weights`` (`--backward-weights`): what the input gradients multiply (runtime/ops/build.py);
    ``backward`` False: a model that only runs forward (scoring, generation) and never loads the backward
    layouts."""

    def __init__(self, artifact: Artifact, lora: LoraConfig | None, *, device: str | torch.device = "cpu",
                 kernels: str | None = None, compute: str | None = None, activations: str | Recipe | None = None,
                 checkpoint: bool = False, seed: int = 0, fp8_weights: str = "per-call",
                 cuda_graphs: bool | str = False, backward_weights: str | None = None, backward: bool = True):
        super().__init__()
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
        # per site: GEMM input, LoRA input, saved; and the backend (runtime/recipe.py)
        self.recipe = parse_recipe(activations).on(resolve_compute(compute, self.device))
        if backward:
            check_dgrad(self.recipe.dgrad, self.device)
        else:  # no input-gradient GEMM runs: a run's recorded dgrad is nothing to check or build
            self.recipe = dataclasses.replace(self.recipe, dgrad="auto")
        self._no_backward = self.recipe.forward_only()  # under torch.no_grad: no saved copies encoded
        self.compute = self.recipe.compute
        self.ops = get_ops(self.recipe, self.kernels, fp8_weights, backward_weights)
        cfg = self.cfg = load_text_config(artifact)
        self.hidden = cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.spec = spec = family_spec(self.family)
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
            raise PactError(f"{artifact.path}: the config caps logits (final_logit_softcapping / "
                            "attn_logit_softcapping, Gemma 2): pact does not train such models")
        self.attn_scale = getattr(cfg, spec.attn_scale_key) ** -0.5 if spec.attn_scale_key else None
        self.embed_scale = self.hidden ** 0.5 if spec.embed_scale else None
        self.rotary = _rotary(spec, cfg).to(self.device)
        self.rope_types = sorted(set(cfg.layer_types), key=lambda t: t == LOCAL_ROPE) if spec.sliding == "layer_types" \
            else None  # Gemma 3: a RoPE table per layer type, the local one last
        rope_cfg = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        self.mrope_section = rope_cfg.get("mrope_section")  # Qwen2-VL: frequencies per (t, h, w) component
        bound = bind(artifact, cfg.num_hidden_layers, lora, self.device, seed=seed, resident=self.ops.resident,
                     spec=spec, backward_layout=backward and self.ops.dgrad_reads == "layout")
        self.embed, self.final_norm, self.lm_head = bound.embed, bound.final_norm, bound.lm_head
        self.layers: list[Layer] = bound.layers
        # Layer.window: a layer's tokens attend to the last `sliding_window` tokens only (None: to all):
        # every layer of Mistral v0.1, Gemma 3's local layers
        for i, L in enumerate(self.layers):
            kind = cfg.layer_types[i] if self.rope_types is not None else None
            if kind is not None:
                L.rope = self.rope_types.index(kind)
            local = spec.sliding == "all" or kind == LOCAL_ROPE
            L.window = getattr(cfg, "sliding_window", None) if local else None
        self.lora_params = bound.params  # the only parameters
        self.adapters: dict[str, Lora] = bound.adapters
        # the lowest decoder block with an adapter (--lora-layers): training runs the blocks below it
        # without autograd (no input gradients, no saved activations)
        self.first_adapted = min((i for i, L in enumerate(self.layers)
                                  if any(lo is not None for g in (L.qkv, L.o, L.gate_up, L.down) for lo in g.loras)),
                                 default=0)
        # --cuda-graphs: training steps replay the decoder stack's captured forward and backward
        # (runtime/graphs.py), one capture per input shape, all in one memory pool
        self._graphs: dict[tuple, LayerGraphs] = {}
        self._graph_pool, self._graph_bufs = None, None
        self.graph_tokens = 0  # the largest micro-batch (tokens) the run will meet, when known: buffers sized once
        why = graphable(self) if cuda_graphs else None
        if why and cuda_graphs is True:
            raise PactError(f"--cuda-graphs on: {why}; use --cuda-graphs auto (eager where graphs cannot run) or off")
        if why:  # (on the CPU the run has said so already: no GPU, eager is all there is)
            (log.debug if self.device.type != "cuda" else log.info)("--cuda-graphs auto: eager steps (%s)", why)
        self.cuda_graphs = bool(cuda_graphs) and not why  # train_config.json records it ("graphed")
        self._graphs_asked = cuda_graphs is True  # on: a failed capture is an error; auto: eager from then on

    @contextlib.contextmanager
    def observing(self, observe):
        """Within: every forward GEMM hands ``observe(weight, x)`` its bf16 input rows first
        (`Ops.observed`; calibration's Hessians)."""
        plain = self.ops
        self.ops = plain.observed(observe)
        try:
            yield
        finally:
            self.ops = plain

    @contextlib.contextmanager
    def recipe_as(self, recipe: Recipe):
        """Within: forward and backward under ``recipe``'s site precisions (this model's backend and
        dgrad: the ops stay as built). `--activations auto`'s probe."""
        kept, graphs, self._graphs, on = self.recipe, self._graphs, {}, self.cuda_graphs
        self.cuda_graphs = False  # a probe's few steps run eagerly; the run's captures are kept for after
        self.use_recipe(recipe)
        try:
            yield
        finally:
            self.use_recipe(kept)
            self._graphs, self.cuda_graphs = graphs, on

    def use_recipe(self, recipe: Recipe) -> None:
        """Train from now on with ``recipe``'s site precisions (backend and dgrad as built)."""
        recipe = dataclasses.replace(recipe, compute=self.compute)
        if recipe.dgrad != self.recipe.dgrad:
            raise ValueError(f"use_recipe: dgrad {recipe.dgrad} differs from the model's ({self.recipe.dgrad})")
        if recipe != self.recipe:
            self._graphs.clear()  # captured under the old site precisions
        self.recipe, self._no_backward = recipe, recipe.forward_only()

    # -- forward
    def _recipe(self):
        return self.recipe if torch.is_grad_enabled() else self._no_backward

    def _attention(self, L: Layer, x: torch.Tensor, cos, sin, B: int, S: int, mask=None, cache=None) -> torch.Tensor:
        """Self-attention of x [B * S, H]. ``cache`` (generation): (a list with one (k, v) per layer or
        None, this layer's index): the earlier tokens' keys and values are read from it, these are added."""
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = NormProjectionFn.apply(x, L.attn_norm, self.eps, L.qkv, self.ops, self._recipe().qkv,
                                     *L.qkv.lora_params())
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        if cos.dim() == 3:  # one table per layer type (Gemma 3): this layer's
            cos, sin = cos[L.rope], sin[L.rope]
        if L.q_norm is not None:  # Qwen3, Gemma 3: per-head RMSNorm before the rotation
            q = rmsnorm(q.view(B * S, nh, hd), L.q_norm, self.eps).view(B * S, nh * hd)
            k = rmsnorm(k.view(B * S, nkv, hd), L.k_norm, self.eps).view(B * S, nkv * hd)
        q, k = RopeFn.apply(q, cos, sin, self.ops), RopeFn.apply(k, cos, sin, self.ops)
        q, k, v = (t.view(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))
        causal = mask is None
        if cache is not None:
            store, i = cache
            if store[i] is not None:  # S new tokens after P cached ones: each sees the cache and its own past
                k, v = torch.cat([store[i][0], k], dim=2), torch.cat([store[i][1], v], dim=2)
                P = k.shape[2] - S
                causal = False
                if S > 1:
                    seen = torch.arange(P + S, device=x.device)
                    mask = seen[None, :] <= seen[P:, None]
            store[i] = (k, v)
        T = k.shape[2]
        if L.window and T > L.window:  # a sliding window the sequence exceeds: band of the last `window`
            seen = torch.arange(T, device=x.device)
            band = (seen[None, :] <= seen[T - S:, None]) & (seen[None, :] > seen[T - S:, None] - L.window)
            mask = band if mask is None else mask & band
            causal = False
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=nkv != nh,
                                           scale=self.attn_scale)
        o = o.transpose(1, 2).reshape(B * S, nh * hd)
        return ProjectionFn.apply(o, L.o, self.ops, self._recipe().o, *L.o.lora_params())

    def rope(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [seq_len, head_dim / 2] for positions 0..seq_len-1, in x's dtype."""
        return self.rope_at(x, torch.arange(seq_len, device=x.device))

    def rope_at(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, head_dim / 2] for token positions [S], or for M-RoPE positions [3, S]
        (temporal, height, width: frequency j rotates by the component its mrope_section gives it).
        transformers' tables, rounded as it rounds them (both halves of its table are equal)."""
        half = self.head_dim // 2
        if positions.dim() == 1 and self.rope_types is not None:  # [types, S, head_dim / 2]: Layer.rope picks
            tables = [self.rotary(x, positions.unsqueeze(0), kind) for kind in self.rope_types]
            return (torch.stack([c[0, :, :half] for c, _ in tables]).contiguous(),
                    torch.stack([s[0, :, :half] for _, s in tables]).contiguous())
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

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Last decoder layer's output (before the final norm), [B, S, H] bf16. Default: causal
        attention, positions 0..S-1 in every row. ``positions`` [B, S] and ``mask`` [B, 1, S, S]
        (True: may attend) give each token its own position and what it sees instead."""
        B, S = input_ids.shape
        x = self.embed_ids(input_ids).reshape(B * S, self.hidden)
        # per-token positions: a table row per token (RoPE reads row t at t % len(table))
        tables = self.rope(x, S) if positions is None else self.rope_at(x, positions.reshape(-1))
        return self.run_layers(x, *tables, B, S, mask=mask)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., H] (Gemma's times sqrt(hidden) rounded to their dtype, as transformers)."""
        x = F.embedding(ids, self.embed)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, B: int, S: int,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers over input embeddings x [B * S, H] -> [B, S, H] bf16 (with --cuda-graphs,
        a training step's by replay: runtime/graphs.py)."""
        if self.cuda_graphs and torch.is_grad_enabled() and not x.requires_grad:
            key = (B, S, tuple(cos.shape), None if mask is None else tuple(mask.shape))
            graphs = self._graphs.get(key) or self._capture(key, x, cos, sin, B, S, mask)
            if graphs is not None:
                return GraphedLayersFn.apply(x, cos, sin, mask, graphs, *graphs.params)
        return self._run_layers(x, cos, sin, B, S, mask)

    def _capture(self, key, x, cos, sin, B, S, mask) -> LayerGraphs | None:
        """A new shape's capture; None (and eager steps from now on, said once) where it fails under
        --cuda-graphs auto, e.g. out of memory, or an op a CUDA graph cannot hold."""
        stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
        try:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            params = list(self.lora_params.values())
            if self._graph_bufs is None or self._graph_bufs.capacity < x.shape[0]:
                self._graphs.clear()  # captured on the smaller buffers
                self._graph_bufs = None
                self._graph_bufs = GraphBuffers(max(x.shape[0], self.graph_tokens), x, params)
            self._graphs[key] = LayerGraphs(
                lambda x_, c_, s_, m_: self._run_layers(x_, c_, s_, B, S, m_), list(self.adapters.values()),
                params, self._graph_bufs, x, cos, sin, mask, self._graph_pool)
            return self._graphs[key]
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if self._graphs_asked:
                raise PactError(f"--cuda-graphs on: capturing a step of shape {B} x {S} failed ({e}); "
                                "use --cuda-graphs off") from e
            log.warning("--cuda-graphs auto: capturing a step of shape %d x %d failed (%s); every step runs "
                        "eagerly from here (--cuda-graphs off says so up front)", B, S, str(e).splitlines()[0])
            self.cuda_graphs, self._graphs, self._graph_pool, self._graph_bufs = False, {}, None, None
            if stream is not None:  # a capture that failed in its end left its own stream current
                torch.cuda.set_stream(stream)
                torch.cuda.empty_cache()
            return None

    def _run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, B: int, S: int,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
        for i, L in enumerate(self.layers):
            if i < self.first_adapted and torch.is_grad_enabled():
                with torch.no_grad():  # below the lowest adapter: no gradient flows here, nothing is saved
                    x = self.layer(L, x, cos, sin, B, S, mask)
            elif self.checkpoint and torch.is_grad_enabled():
                # keep only the layer input; the layer runs again in backward (same RNG state)
                # graphed: nothing random runs (graphable), and torch < 2.10 cannot read the RNG state in a capture
                x = torch.utils.checkpoint.checkpoint(self.layer, L, x, cos, sin, B, S, mask, use_reentrant=False,
                                                      preserve_rng_state=not self.cuda_graphs)
            else:
                x = self.layer(L, x, cos, sin, B, S, mask)
        return x.view(B, S, self.hidden)

    def layer(self, L: Layer, x: torch.Tensor, cos, sin, B: int, S: int, mask: torch.Tensor | None = None,
              cache=None) -> torch.Tensor:
        """Decoder layer L on rows x [B * S, H] (RoPE tables cos/sin; ``mask`` None: causal; ``cache``:
        generation's keys and values, see _attention): the public hook calibration runs. LoRA dropout applies
        only under grad mode (a training step and its checkpointed recomputation; never scoring or generation)."""
        token = TRAINING.set(torch.is_grad_enabled())
        try:
            a = self._attention(L, x, cos, sin, B, S, mask, cache)
            x = x + (a if L.post_attn_norm is None else rmsnorm(a, L.post_attn_norm, self.eps))
            recipe = self._recipe()
            m = MlpFn.apply(x, L.mlp_norm, self.eps, L.gate_up, L.down, self.ops, (recipe.gate_up, recipe.down),
                            self.spec.act, *L.gate_up.lora_params(), *L.down.lora_params())
            return x + (m if L.post_mlp_norm is None else rmsnorm(m, L.post_mlp_norm, self.eps))
        finally:
            TRAINING.reset(token)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Summed next-token loss over positions whose label is not -100, and their count (``positions``
        and ``mask``: as hidden_states takes them; packed rows)."""
        h = self.hidden_states(input_ids, positions, mask)
        targets = labels[:, 1:]
        sel = targets != -100
        hs = rmsnorm(h[:, :-1][sel], self.final_norm, self.eps)
        return target_cross_entropy(hs, self.lm_head, targets[sel], self.ops.ce_grad_), int(sel.sum())

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits [B, S, V] (evaluation and tests only: training never builds these)."""
        h = rmsnorm(self.hidden_states(input_ids), self.final_norm, self.eps)
        return mm(h, self.lm_head.t()).float()

    def adapter_state(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: (lo.A, lo.B) for name, lo in self.adapters.items()}

    def load_adapter_state(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        missing = set(self.adapters) - set(adapters)
        if missing:
            raise PactError(f"adapter lacks {len(missing)} of this model's LoRA modules, e.g. {sorted(missing)[0]}")
        extra = set(adapters) - set(self.adapters)
        if extra:  # (pact-export refuses them too: scored without them, the adapter would be another model)
            raise PactError(f"adapter holds LoRA weights for {len(extra)} module(s) this model has no adapter on, "
                            f"e.g. {sorted(extra)[0]} (another model's adapter, or its config's layers_to_transform "
                            "and its weights disagree): give the adapter trained for this model")
        with torch.no_grad():
            for name, lo in self.adapters.items():
                A, B = adapters[name]
                if A.shape != lo.A.shape or B.shape != lo.B.shape:
                    raise PactError(f"adapter {name}: shapes {tuple(A.shape)}/{tuple(B.shape)} do not match "
                                    f"{tuple(lo.A.shape)}/{tuple(lo.B.shape)} (different rank or model)")
                lo.A.copy_(A)
                lo.B.copy_(B)
