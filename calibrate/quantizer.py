"""The NVFP4 quantizer the GPTQ core calls: bit-compatible with pact.formats.nvfp4.

Scales: the global scale is fixed before the sweep (shared by a fused group, as at convert
time); block scales are fixed either all before the sweep from the original weights
(``static``, the only option with act-order) or when the sweep reaches each 16-column group,
from the columns as GPTQ has updated them so far (``dynamic``). 1d: one scale per row per
group; 2d: one per 16x16 block. ``scale_rule`` picks each block scale as the converter does
(formats.nvfp4.SCALE_RULES): ``amax`` maps the block's largest magnitude to 6; ``mse`` searches
the E4M3 codes around that one for the least squared error of the block's values (the weights
as the sweep has updated them, for dynamic scales) — the artifact's own rule, so calibration
never falls back to coarser scales than conversion chose.
"""

from __future__ import annotations

import torch

from pact.formats.nvfp4 import (
    BLOCK,
    E2M1_MAX,
    NVFP4Tensor,
    SCALE_RULES,
    block_scales,
    decode_e2m1,
    encode_e2m1,
    encode_with_scales,
    search_block_scales,
)


class NVFP4Quantizer:
    def __init__(self, global_scale: torch.Tensor, *, scaling: str = "2d", static: bool = False,
                 scale_rule: str = "amax"):
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
        self.g = torch.as_tensor(global_scale, dtype=torch.float32)
        self.scaling, self.static, self.scale_rule = scaling, static, scale_rule
        self.scales: torch.Tensor | None = None  # e4m3 [N, K/16], groups in the original column order
        self.perm: torch.Tensor | None = None

    def _group_scales(self, cols: torch.Tensor) -> torch.Tensor:
        """cols [N, 16] -> e4m3 scales [N] (2d: the 16x16 block amax, repeated over its rows)."""
        n, g = cols.shape[0], self.g.to(cols.device)
        cols = cols.float()
        if self.scaling == "1d":
            amax = cols.abs().amax(1)
        else:
            amax = cols.reshape(n // BLOCK, BLOCK * BLOCK).abs().amax(1)
        if self.scale_rule == "mse":
            sc = search_block_scales(cols, amax[:, None], g, self.scaling)[:, 0]
        else:
            sc = block_scales(amax, g)
        return sc if self.scaling == "1d" else sc.repeat_interleave(BLOCK)

    def begin(self, W: torch.Tensor, perm: torch.Tensor | None) -> None:
        n, k = W.shape
        self.perm = perm
        self.g = self.g.to(W.device)
        self.scales = torch.empty(n, k // BLOCK, dtype=torch.float8_e4m3fn, device=W.device)
        if self.static or perm is not None:  # act-order sweeps out of order: groups fixed up front
            orig = W[:, torch.argsort(perm)] if perm is not None else W
            for grp in range(k // BLOCK):
                self.scales[:, grp] = self._group_scales(orig[:, grp * BLOCK : (grp + 1) * BLOCK])

    def quantize(self, block: torch.Tensor, i: int, col: int) -> torch.Tensor:
        orig = int(self.perm[col]) if self.perm is not None else col
        grp = orig // BLOCK
        if not (self.static or self.perm is not None) and col % BLOCK == 0:
            self.scales[:, grp] = self._group_scales(block[:, i : i + BLOCK])
        s = self.scales[:, grp].float()
        w = block[:, i]
        code = encode_e2m1((w * ((1.0 / self.g) / s)).clamp(-E2M1_MAX, E2M1_MAX))
        return (decode_e2m1(code) * s) * self.g

    def pack(self, Q: torch.Tensor) -> NVFP4Tensor:
        """The fake-quantized sweep result as stored NVFP4 (codes re-derived exactly)."""
        t = NVFP4Tensor(encode_with_scales(Q, self.scales, self.g), self.scales, self.g)
        return t
