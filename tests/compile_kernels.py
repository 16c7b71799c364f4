"""Compile every Triton kernel for an NVIDIA target without a GPU (run by test_kernels.py).

    python tests/compile_kernels.py 90     # Hopper; prints one "ok" line per compiled kernel
"""

import sys

CAPABILITY = 90


def _compile_sm(fn, signature: dict, constexprs: dict):
    """Compile a kernel for an NVIDIA target without a GPU (Triton ships ptxas): catches
    what the interpreter lets through (non-constexpr globals, layout/shape errors)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                   target=GPUTarget("cuda", CAPABILITY, 32), options={"num_warps": 8})
    print(f"ok {fn.__name__} sm_{CAPABILITY} {constexprs}")


def native(capability: int) -> None:
    """The Blackwell FP4 tensor-core GEMM (sm_100 / sm_120 only)."""
    global CAPABILITY
    from pact.runtime.ops.triton import native as V

    CAPABILITY = capability
    sig = {"a_ptr": "*u8", "a_scales_ptr": "*fp8e4nv", "a_rs_ptr": "*fp32", "b_ptr": "*u8", "b_scales_ptr": "*fp8e4nv",
           "b_gs_ptr": "*fp32", "c_ptr": "*bf16", "stride_cm": "i32", "M": "i32", "N": "i32"}
    _compile_sm(V._nvfp4_native_gemm_kernel, sig, {"K": 2048, **V.NATIVE_BLOCKS})


def main(capability: int) -> None:
    global CAPABILITY
    import triton.language as tl

    CAPABILITY = capability
    from pact.runtime.ops.triton import codec as C
    from pact.runtime.ops.triton import gemm as G
    from pact.runtime.ops.triton import rows as N

    e4m3 = 2 if capability >= 90 else 1  # as ops.triton.codec.e4m3_mode picks it on that GPU

    rows = {"packed_ptr": "*u8", "scales_ptr": "*u8", "rs_ptr": "*fp32"}
    _compile_sm(N._quant_rows_kernel, {"x_ptr": "*bf16", "stride_x": "i32", **rows, "f8_ptr": "*u8", "K": "i32"},
                {"BLOCK_K": 16384, "CHUNK": 2048, "EMIT_FP8": e4m3})
    _compile_sm(N._rmsnorm_quant_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "w_ptr": "*bf16", "eps": "fp32", **rows,
                                          "rstd_ptr": "*fp32", "f8_ptr": "*u8", "K": "i32"},
                {"BLOCK_K": 2048, "EMIT_FP8": e4m3})
    three = {f"{p}{s}": t for p in "hgu" for s, t in (("p", "*u8"), ("s", "*u8"), ("r", "*fp32"))}
    for act in (0, 1):  # SwiGLU, GeGLU
        _compile_sm(N._silu_mul_quant_kernel, {"gu_ptr": "*bf16", "stride_gu": "i32", **three, "h8_ptr": "*u8",
                                               "K": "i32"},
                    {"BLOCK_K": 8192, "CHUNK": 2048, "EMIT_FP8": e4m3, "ACT": act})
    for nvfp4, fp8 in ((True, e4m3), (True, 0), (False, e4m3)):
        _compile_sm(N._rmsnorm_rows_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "w_ptr": "*bf16", "eps": "fp32",
                                             "y_ptr": "*bf16", **rows, "rstd_ptr": "*fp32", "f8_ptr": "*u8",
                                             "f8s_ptr": "*fp32", "K": "i32"},
                    {"BLOCK_K": 2048, "NVFP4": nvfp4, "FP8": fp8})
        two = {f"{p}{s}": t for p in "gu" for s, t in (("p", "*u8"), ("s", "*u8"), ("r", "*fp32"))}
        for act in (0, 1):
            _compile_sm(N._silu_mul_rows_kernel, {"gu_ptr": "*bf16", "stride_gu": "i32", "h_ptr": "*bf16", **two,
                                                  "f8_ptr": "*u8", "f8s_ptr": "*fp32", "K": "i32"},
                        {"BLOCK_K": 8192, "CHUNK": 2048, "NVFP4": nvfp4, "FP8": fp8, "ACT": act, "E4M3": 0})
    # gate and up written as E4M3 rows (down.saved=fp8), with and without h's E4M3 copy
    two8 = {f"{p}{s}": t for p in "gu" for s, t in (("p", "*u8"), ("s", "*fp32"), ("r", "*fp32"))}
    for fp8 in (0, e4m3):
        _compile_sm(N._silu_mul_rows_kernel, {"gu_ptr": "*bf16", "stride_gu": "i32", "h_ptr": "*bf16", **two8,
                                              "f8_ptr": "*u8", "f8s_ptr": "*fp32", "K": "i32"},
                    {"BLOCK_K": 8192, "CHUNK": 2048, "NVFP4": False, "FP8": fp8, "ACT": 0, "E4M3": e4m3})
    _compile_sm(N._dequant_rows_kernel, {**rows, "out_ptr": "*fp32", "K": "i32"}, {"BLOCK_K": 8192, "CHUNK": 2048})
    for what in (C.PAIRS_QS, C.PAIRS_ROWS, C.PAIRS_E4M3_W, C.PAIRS_E4M3_ROWS):
        _compile_sm(C._decode_pairs_kernel, {"packed_ptr": "*u8", "scales_ptr": "*u8", "sc_ptr": "*fp32",
                                             "out_ptr": "*i32" if what < C.PAIRS_E4M3_W else "*i16",
                                             "out_scale_ptr": "*fp32", "ROWS": "i32"},
                    {"KB": 1024, "OUT": what, "MODE": e4m3, "R": C.PAIR_ROWS, "CB": C.PAIR_BYTES, "SB": 128})
    for saved_e4m3 in (False, True):  # the saved RMSNorm output as NVFP4 rows, or as E4M3 rows (saved=fp8)
        _compile_sm(N._rmsnorm_backward_kernel, {"dy_ptr": "*bf16", "stride_dy": "i32", "yp": "*u8",
                                                 "ys": "*fp32" if saved_e4m3 else "*u8", "yr": "*fp32",
                                                 "rstd_ptr": "*fp32", "w_ptr": "*bf16", "dx_ptr": "*bf16", "K": "i32"},
                    {"BLOCK_K": 2048, "E4M3": saved_e4m3})
    _compile_sm(N._dequant_e4m3_kernel, {"f8_ptr": "*u8", "sc_ptr": "*fp32", "out_ptr": "*bf16", "K": "i32"},
                {"BLOCK_K": 2048, "CHUNK": 2048})
    for saved_e4m3 in (False, True):  # gate and up saved as NVFP4 rows, or as E4M3 rows (down.saved=fp8)
        gu = {f"{p}{s}": t for p in "gu" for s, t in (("p", "*u8"), ("s", "*fp32" if saved_e4m3 else "*u8"),
                                                        ("r", "*fp32"))}
        for act in (0, 1) if not saved_e4m3 else (0,):
            _compile_sm(N._silu_mul_h_kernel, {**gu, "h_ptr": "*bf16", "K": "i32"},
                        {"BLOCK_K": 8192, "CHUNK": 2048, "ACT": act, "E4M3": saved_e4m3})
            _compile_sm(N._silu_mul_backward_kernel,
                        {"dh_ptr": "*bf16", "stride_dh": "i32", **gu, "dgu_ptr": "*bf16", "K": "i32"},
                        {"BLOCK_K": 8192, "CHUNK": 2048, "ACT": act, "E4M3": saved_e4m3})
    # Gemma's (1 + w) norm weights are bound as fp32
    _compile_sm(N._rmsnorm_rows_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "w_ptr": "*fp32", "eps": "fp32",
                                         "y_ptr": "*bf16", **rows, "rstd_ptr": "*fp32", "f8_ptr": "*u8",
                                         "f8s_ptr": "*fp32", "K": "i32"}, {"BLOCK_K": 2048, "NVFP4": True, "FP8": 0})
    _compile_sm(N._rmsnorm_backward_kernel, {"dy_ptr": "*bf16", "stride_dy": "i32", "yp": "*u8", "ys": "*u8",
                                             "yr": "*fp32", "rstd_ptr": "*fp32", "w_ptr": "*fp32", "dx_ptr": "*bf16",
                                             "K": "i32"}, {"BLOCK_K": 2048, "E4M3": False})
    gemm = {"a_ptr": "*u8", "a_scales_ptr": "*u8", "a_rs_ptr": "*fp32", "stride_am": "i32", "b_ptr": "*u8",
            "b_scales_ptr": "*u8", "b_gs_ptr": "*fp32", "c_ptr": "*bf16", "stride_cm": "i32", "M": "i32", "N": "i32"}
    for a_nvfp4 in (True, False):
        sig = dict(gemm, a_ptr="*u8" if a_nvfp4 else "*bf16")
        _compile_sm(G._nvfp4_gemm_kernel, sig, {"K": 2048, "A_NVFP4": a_nvfp4, **G._gemm_blocks(8192, 2048, 2048),
                                                 "DOT_DTYPE": tl.bfloat16})
    from pact.runtime.ops.triton import fp8 as F8

    _compile_sm(F8._fp8_rows_kernel, {"src_ptr": "*bf16", "stride_src": "i32", "out_ptr": "*u8",
                                      "out_scale_ptr": "*fp32", "K": "i32"},
                {"BLOCK_K": 16384, "CHUNK": 2048, "MODE": e4m3})
    from pact.runtime.ops.triton import rotary as RO

    for inverse in (False, True):
        _compile_sm(RO._rope_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                                      "out_ptr": "*bf16", "S": "i32", "HEADS": "i32"},
                    {"HALF": 64, "BLOCK_H": 32, "INVERSE": inverse})
    from pact.runtime.ops.triton import xent as XE

    _compile_sm(XE._ce_grad_kernel, {"z_ptr": "*bf16", "stride_z": "i32", "t_ptr": "*i64", "loss_ptr": "*fp32"},
                {"V": 128256, "BLOCK_V": 4096})


if __name__ == "__main__":
    cap = int(sys.argv[1])
    native(cap) if len(sys.argv) > 2 and sys.argv[2] == "native" else main(cap)
