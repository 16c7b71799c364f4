"""The ops contract: what every frozen projection, norm, activation and loss of the model runs.

`get_ops(recipe, kernels)` builds one `Ops` (build.py) from the torch twins (reference.py: the CPU
path and the reference) or the Triton kernels (triton/), with the recipe's compute backend applied.
rows.py holds the row formats the ops pass between each other (NVFP4 rows, unquantized rows, E4M3 rows
saved for backward, the fp8 backend's E4M3 copies)."""

from .build import (
    BACKWARD_WEIGHTS,
    COMPUTE,
    FP8_WEIGHTS,
    KERNELS,
    Ops,
    check_dgrad,
    check_dgrad_flags,
    get_ops,
    resolve_backward_weights,
    resolve_compute,
    resolve_device,
    resolve_fp8_weights,
    resolve_kernels,
)
from .rows import DenseRows, E4M3Rows, NVFP4RowsFP8, NVFP4TensorFP8

__all__ = ["BACKWARD_WEIGHTS", "COMPUTE", "FP8_WEIGHTS", "KERNELS", "DenseRows", "E4M3Rows", "NVFP4RowsFP8",
           "NVFP4TensorFP8", "Ops", "check_dgrad", "check_dgrad_flags", "get_ops", "resolve_backward_weights",
           "resolve_compute", "resolve_device", "resolve_fp8_weights", "resolve_kernels"]
