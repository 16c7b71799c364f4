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
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
# `model_type` -> family, for configs saved without `architectures`
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl")  # every family converts and trains
MODEL_TYPES = {family: family for family in FAMILIES}
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
