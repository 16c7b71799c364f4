"""Per architecture: which HF tensors are frozen projections (and their fused groups).

Every supported family names its decoder layers ``[model.][language_model.]layers.{i}.
{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj``; what differs is around them (biases in
Qwen2, q/k norms in Qwen3, a vision tower in Qwen2-VL/Qwen2.5-VL), and all of that stays
dense (bf16).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import PactError

# HF `architectures[0]` -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2/3.x, SmolLM2
    "MistralForCausalLM": "mistral",  # Mistral 7B (a sliding window on v0.1), Ministral, Mistral Nemo
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3 text (1B; the language model alone of 4B-27B)
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
# `model_type` -> family, for configs saved without `architectures`
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen2_vl", "qwen2_5_vl")  # each converts and trains
MODEL_TYPES = {**{family: family for family in FAMILIES}, "gemma3_text": "gemma3"}
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")

# projection -> fused group: members of a group share their input (one GEMM over the
# concatenated weights at run time) and one global scale (vLLM's convention).
PROJECTIONS = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}

_LAYER_TENSOR = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?"
                           r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
VISION_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.")
# where a decoder's own tensors (embed_tokens, norm, layers) live: "model." (Llama, Qwen, VL
# checkpoints as published) or "model.language_model." (VL re-saved by transformers 4.52-4.x)
LM_PREFIXES = ("model.", "model.language_model.")


@dataclass(frozen=True)
class FamilySpec:
    """What the runtime needs to know of a family beyond the shared decoder layout: the names of a
    layer's norms (the attention's input norm, the MLP's input norm, and the norms on the attention
    and MLP outputs where the family has them), the norm's form, the MLP's gate activation, the
    embedding scale, the rotary embedding (transformers' module and class), the sliding window
    and the attention's scale. Everything else about a layer is the same for every family."""

    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    post_attn_norm: str | None = None  # applied to the attention's output before the residual add
    post_mlp_norm: str | None = None  # applied to the MLP's output before the residual add
    norm_offset: bool = False  # the norms scale by (1 + weight) (Gemma), else by weight
    act: str = "silu"  # the gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: bool = False  # the embeddings multiplied by sqrt(hidden_size) in their dtype (Gemma)
    rotary: tuple[str, str] = ("llama", "LlamaRotaryEmbedding")
    sliding: str = "none"  # none | all (every layer: config.sliding_window) | layer_types (per layer)
    attn_scale_key: str | None = None  # a config key k: the attention scale is k ** -0.5 (else head_dim ** -0.5)


SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec(),
    "mistral": FamilySpec(rotary=("mistral", "MistralRotaryEmbedding"), sliding="all"),
    "qwen2": FamilySpec(rotary=("qwen2", "Qwen2RotaryEmbedding")),
    "qwen3": FamilySpec(rotary=("qwen3", "Qwen3RotaryEmbedding")),
    "gemma3": FamilySpec(mlp_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
                         post_mlp_norm="post_feedforward_layernorm", norm_offset=True, act="gelu_tanh",
                         embed_scale=True, rotary=("gemma3", "Gemma3RotaryEmbedding"), sliding="layer_types",
                         attn_scale_key="query_pre_attn_scalar"),
    # Qwen2-VL's M-RoPE is Qwen2's rotary per position component (the runtime picks the components)
    "qwen2_vl": FamilySpec(rotary=("qwen2", "Qwen2RotaryEmbedding")),
    "qwen2_5_vl": FamilySpec(rotary=("qwen2", "Qwen2RotaryEmbedding")),
}


def family_spec(family: str) -> FamilySpec:
    """The spec of a family, or one clear error (never another family's)."""
    if family not in SPECS:
        raise PactError(f"family {family!r} has no spec in formats/families.py SPECS: pact supports "
                        f"{', '.join(SPECS)}")
    return SPECS[family]


@dataclass(frozen=True)
class TensorRole:
    role: str  # q_proj..down_proj | bias | embedding | lm_head | norm | vision | other
    layer: int | None = None
    group: str | None = None  # e.g. "layers.3.qkv" for frozen projections

    @property
    def frozen_projection(self) -> bool:
        return self.role in PROJECTIONS


def family_of(config: dict, source: str = "config.json") -> str:
    """The family for an HF config dict, or one clear error listing what is supported."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    supported = ", ".join(sorted(ARCHITECTURES))
    raise PactError(
        f"{source}: architecture {archs or config.get('model_type')!r} is not supported; "
        f"pact converts {supported}"
    )


def text_config(config: dict) -> dict:
    """The language model's config (vision-language models nest it under text_config)."""
    return config.get("text_config") or config


_REQUIRED_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def check_config(config: dict, names, source: str = "config.json") -> None:
    """The config states the sizes the runtime builds from (transformers would fill a missing one with
    a default that does not fit the weights) and as many decoder layers as the weights hold."""
    tc = text_config(config)
    for key in _REQUIRED_INTS:
        v = tc.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PactError(f"{source}: '{key}' is missing or not a positive integer ({v!r}): the config does not "
                            "describe this model; restore the model's own config.json")
    layers = {r.layer for r in map(classify, names) if r.frozen_projection}
    n = tc["num_hidden_layers"]
    fix = "the config does not describe this model; restore the model's own config.json"
    v = tc.get("sliding_window")
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise PactError(f"{source}: 'sliding_window' is {v!r}, not a positive integer or null: {fix}")
    v = tc.get("query_pre_attn_scalar")
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf")):
        raise PactError(f"{source}: 'query_pre_attn_scalar' is {v!r}, not a positive number: {fix}")
    v = tc.get("layer_types")
    if v is not None and (not isinstance(v, list) or len(v) != n
                          or any(t not in ("full_attention", "sliding_attention") for t in v)):
        raise PactError(f"{source}: 'layer_types' must list full_attention or sliding_attention for each of the "
                        f"{n} layers, got {str(v)[:80]}: {fix}")
    if layers != set(range(n)):
        held = f"layers 0..{max(layers)} ({len(layers)} present)" if layers else "no decoder layers"
        raise PactError(f"{source}: num_hidden_layers is {n} but the weights hold {held}: the config does not "
                        "match the weights; restore the model's own config.json")


def classify(name: str) -> TensorRole:
    if name.startswith(VISION_PREFIXES):
        return TensorRole("vision")
    m = _LAYER_TENSOR.match(name)
    if m:
        layer, proj, kind = int(m.group(1)), m.group(3), m.group(4)
        if proj in PROJECTIONS:
            if kind == "bias":
                return TensorRole("bias", layer)
            return TensorRole(proj, layer, f"layers.{layer}.{PROJECTIONS[proj]}")
        return TensorRole("norm" if "norm" in proj else "other", layer)
    if name.endswith("embed_tokens.weight"):
        return TensorRole("embedding")
    if name.startswith("lm_head."):
        return TensorRole("lm_head")
    layer_m = re.search(r"layers\.(\d+)\.", name)
    layer = int(layer_m.group(1)) if layer_m else None
    if "norm" in name:
        return TensorRole("norm", layer)
    return TensorRole("other", layer)
