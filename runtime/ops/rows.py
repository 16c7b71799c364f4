"""Activation rows as the runtime passes them between kernels (the saved format is
`formats.nvfp4.NVFP4Rows`), and the `fp8` backend's resident weight copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pact.formats.nvfp4 import E2M1_MAX, E4M3_MAX, NVFP4Rows, NVFP4Tensor

# E4M3 copy of NVFP4 activation rows: a product q * s_b is at most 6 * 448 (a per-row scale puts
# each row's largest block scale at 448), so the copy is e4m3(q * s_b * 448 / FP8_ROW_AMAX) for
# every row, and its per-row decode scale is FP8_ROW_AMAX / 448 = 6 times the row's. One
# definition for the fused quantizers, the re-encoding kernel and the twin.
FP8_ROW_AMAX = E2M1_MAX * E4M3_MAX


@dataclass(frozen=True)
class DenseRows:
    """Activation rows kept unquantized (bf16 [T, K]): a recipe site's "bf16" choice (runtime/recipe.py).
    The ops that read saved rows accept these as well as NVFP4 rows. For the `fp8` backend's next
    GEMM they may carry their E4M3 copy (as fp8_rows encodes bf16 rows: per-row amax / 448), written
    by the kernel that made them: fp8 [T', K] (T' = T rounded up to 16) and fp8_scale [T']. Only
    ``data`` is ever saved for backward."""

    data: torch.Tensor
    fp8: torch.Tensor | None = None
    fp8_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


@dataclass(frozen=True)
class E4M3Rows:
    """Activation rows kept for backward as E4M3 with one fp32 scale per row (a recipe site's
    ``saved=fp8``; made by the ops' ``e4m3_rows``, as ``fp8_rows`` encodes bf16 rows): data
    float8_e4m3fn [T, K], scale fp32 [T] (amax / 448; 1 for an all-zero row).
    K + 4 bytes a row, against K/2 + K/16 + 4 for NVFP4 rows and 2K for bf16. E4M3 spans 17 binades
    per row, so the small values beside a large one in a 16-block, which NVFP4 flushes to zero,
    are kept to 3 mantissa bits (SmolLM2's RMSNorm outputs: 2% relative error, against 9% in NVFP4).
    Only the readers of saved rows accept them."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def value(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


@dataclass(frozen=True)
class NVFP4RowsFP8(NVFP4Rows):
    """NVFP4 rows plus, for the `fp8` backend's next GEMM, their E4M3 copy written by the same
    kernel that quantized them: fp8 [T', K] (T' = T rounded up to 16, zero padding) and its
    decode scale fp8_scale [T'] (6 * row_scale; padding 1). Never saved for backward."""

    fp8: torch.Tensor | None = None
    fp8_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class NVFP4TensorFP8(NVFP4Tensor):
    """A frozen NVFP4 weight plus its E4M3 copy, made once when the model binds it (`--fp8-weights
    resident`): fp8 [N, K] and its per-row decode scale fp8_scale [N], the bytes the `fp8`
    backend would otherwise re-encode on every call (same values: fp8_rows). Costs 1 byte per
    parameter per layout on the GPU."""

    fp8: torch.Tensor | None = None
    fp8_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, w: NVFP4Tensor, fp8_rows) -> "NVFP4TensorFP8":
        """``w`` with the E4M3 copy that ``fp8_rows`` (a backend's launcher) makes of it."""
        return cls(w.packed, w.scales, w.global_scale, *fp8_rows(w))
