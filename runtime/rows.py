"""Activation rows as the runtime passes them between kernels (the saved format is
`formats.nvfp4.NVFP4Rows`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pact.formats.nvfp4 import NVFP4Rows

# E4M3 copy of NVFP4 rows: a product q * s_b is at most 6 * 448, so q * s_b * (448 / 2688) fits
# E4M3 for every row, and the copy's per-row decode scale is 2688 / 448 = 6 times the row's.
FP8_FROM_NVFP4 = 448.0 / 2688.0


@dataclass(frozen=True)
class NVFP4RowsFP8(NVFP4Rows):
    """NVFP4 rows plus, for the `fp8` backend's next GEMM, their E4M3 copy written by the same
    kernel that quantized them: fp8 [T', K] (T' = T rounded up to 16, zero padding) and its
    decode scale fp8_scale [T'] (6 * row_scale; padding 1). Never saved for backward."""

    fp8: torch.Tensor | None = None
    fp8_scale: torch.Tensor | None = None
