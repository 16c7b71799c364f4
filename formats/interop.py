"""The NVFP4 checkpoint layouts pact reads (convert/sources.py) and writes (convert/export.py),
defined once.

- compressed-tensors' ``nvfp4-pack-quantized`` (what llm-compressor writes and vLLM / SGLang load):
  per quantized Linear, ``weight_packed`` uint8 [N, K/2] (E2M1 codes, low nibble first, bit 3 the
  sign: pact's own packing), ``weight_scale`` e4m3 [N, K/16] and ``weight_global_scale`` fp32 [1] in
  the encode direction (1 / pact's g); the rest (``input_global_scale``, ...) concerns
  inference-time activations and is not read.
- NVIDIA ModelOpt's NVFP4 export (TensorRT-LLM / vLLM "modelopt"): ``weight`` uint8 [N, K/2] (same
  packing), ``weight_scale`` e4m3 [N, K/16] and ``weight_scale_2`` fp32 in the decode direction
  (pact's g itself).
"""

from __future__ import annotations

import torch

from .nvfp4 import NVFP4Tensor

CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
CT_PARTS = ("weight_packed", "weight_scale", "weight_global_scale")
CT_IGNORED = ("input_global_scale", "input_scale", "weight_zero_point", "output_scale", "k_scale", "v_scale")
MO_PARTS = ("weight", "weight_scale", "weight_scale_2")

# compressed-tensors' weight-only NVFP4 scheme (its preset "NVFP4A16"), as its own config serializer
# writes it; `ignore` lists the Linear modules left unquantized (lm_head at least)
CT_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
              "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
              "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}


def ct_quantization_config(ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` for a weight-only NVFP4 compressed-tensors checkpoint."""
    return {
        "quant_method": "compressed-tensors",
        "format": CT_NVFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS, "input_activations": None,
                                      "output_activations": None, "format": CT_NVFP4_FORMAT}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": None,
    }


def ct_tensors(name: str, t: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """The three compressed-tensors tensors of the projection ``name`` ("...q_proj.weight") holding ``t``."""
    base = name.removesuffix(".weight")
    return {f"{base}.weight_packed": t.packed.contiguous(), f"{base}.weight_scale": t.scales.contiguous(),
            f"{base}.weight_global_scale": encode_global_scale(t.global_scale).reshape(1)}


def encode_global_scale(g: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale (encode direction) for pact's g: the fp32 value next to 1/g
    whose reciprocal is g again, where one is (so export -> import keeps g bit for bit)."""
    g = g.float().reshape(())
    gs = torch.tensor(1.0) / g
    for cand in (gs, torch.nextafter(gs, torch.tensor(0.0)), torch.nextafter(gs, torch.tensor(float("inf")))):
        if torch.equal(torch.tensor(1.0) / cand, g):
            return cand
    return gs
