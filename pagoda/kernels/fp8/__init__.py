"""FP8 (e4m3) linear kernels: activation quantization, the FP8 GEMM and the FP8-weight GEMV.

`ops.py` holds the torch references and the cuBLASLt FP8 GEMM (`torch._scaled_mm`, sm_89+);
`triton_quant.py` quantizes activations per token (or with a static scale) in one launch;
`triton_gemv.py` is the batch-1 GEMV over FP8 weights with bf16 activations, `triton_gemm.py` the
small-M GEMM (bf16 or e4m3 rows); `triton_e4m3.py` decodes e4m3 with integer ops where Triton
has no e4m3 conversion (sm_80 / 87). Triton modules are
imported only by the layer's kernel registry (`pagoda/layers/fp8_linear.py`) when it picks them.
"""
