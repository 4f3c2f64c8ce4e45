"""The W4A16 GEMV's fused bias, and programmatic dependent launch (PDL) on the decode kernels.

CPU: the interpreter (PDL is off there by construction). GPU (`gpu`): the same kernels launched
with PDL, chained the way a decode step chains them, and inside a CUDA graph, against the
references; and with `PAGODA_PDL=0` the flag is off.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_w4a16 import _case, _check


@pytest.mark.parametrize(
    "m,split,reduce",
    [(1, 1, "serial"), (1, 4, "serial"), (2, 3, "serial"), (1, 2, "atomic"), (5, 2, "serial")],
)
def test_gemv_bias_interpreter(m, split, reduce) -> None:
    from pagoda.kernels.wna16.triton_w4a16 import GemvConfig, wna16_gemv

    x, qt, st, zt, gs, ref = _case(m, 256, 512, 128, 4, False, dtype=torch.bfloat16, seed=m + split)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    use_dot = m > 2
    cfg = GemvConfig(
        128, 128 if use_dot else 64, split, 1 if not use_dot else 4, 3, use_dot, reduce
    )
    if use_dot:  # the interpreter's bf16 tl.dot is broken (see test_triton_w4a16.py): fp16
        x = x.to(torch.float16)
    out = wna16_gemv(x, qt, st, zt, gs, 4, cfg, out_dtype=torch.float32, bias=bias)
    _check(out, ref + bias.float(), torch.float32)
    # and the bias really is added: without it the result differs by the bias
    plain = wna16_gemv(x, qt, st, zt, gs, 4, cfg, out_dtype=torch.float32)
    torch.testing.assert_close(out - plain, bias.float().expand_as(out), rtol=0, atol=1e-4)


def test_gemv_bias_shape_error() -> None:
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv

    x, qt, st, zt, gs, _ = _case(1, 64, 128, 32, 4, False)
    with pytest.raises(ValueError, match="bias must be a contiguous \\[64\\]"):
        wna16_gemv(x, qt, st, zt, gs, 4, bias=torch.zeros(65))


def test_pdl_is_off_without_a_gpu() -> None:
    from pagoda.kernels.pdl import pdl_launch_args

    assert pdl_launch_args(torch.zeros(1)) == {"USE_PDL": False}


@pytest.mark.gpu
def test_pdl_decode_chain_in_a_cuda_graph_gpu() -> None:
    """norm -> GEMV(+bias) -> SiLU-and-mul -> GEMV -> norm with PDL, eager and graph-replayed:
    every stage reads its predecessor's output, so a missing wait would show as wrong sums."""
    from pagoda.kernels.norm_act.ops import fused_add_rms_norm_ref, silu_and_mul_ref
    from pagoda.kernels.norm_act.triton_fused_ops import (
        fused_add_rms_norm_triton,
        silu_and_mul_triton,
    )
    from pagoda.kernels.pdl import pdl_enabled
    from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_enabled(torch.zeros(1, device=dev))
    hidden, inter = 3584, 18944
    x1, qt1, st1, zt1, gs, _ = _case(1, 2 * inter, hidden, 128, 4, False, dev, torch.bfloat16, 1)
    _, qt2, st2, zt2, _, _ = _case(1, hidden, inter, 128, 4, False, dev, torch.bfloat16, 2)
    w_norm = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
    bias = torch.randn(2 * inter, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    static_x = x1.clone()

    def chain(use_triton: bool):
        if use_triton:
            h, res = fused_add_rms_norm_triton(static_x, residual, w_norm, 1e-6)
            gu = wna16_gemv(h, qt1, st1, zt1, gs, 4, bias=bias)
            a = silu_and_mul_triton(gu)
            d = wna16_gemv(a, qt2, st2, zt2, gs, 4)
            out, _ = fused_add_rms_norm_triton(d, res, w_norm, 1e-6)
            return out
        from pagoda.kernels.wna16.triton_w4a16 import wna16_gemm

        h, res = fused_add_rms_norm_ref(static_x, residual, w_norm, 1e-6)
        gu = wna16_gemm(h, qt1, st1, zt1, gs, 4) + bias
        a = silu_and_mul_ref(gu)
        d = wna16_gemm(a, qt2, st2, zt2, gs, 4)
        out, _ = fused_add_rms_norm_ref(d, res, w_norm, 1e-6)
        return out

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    # GEMV vs GEMM differ only in bf16 rounding of the intermediates (~1e-3 here); a stage
    # that read its input before the predecessor finished would be off by O(1).
    assert rel_err(chain(True), chain(False)) < 2e-2
    graph = torch.cuda.CUDAGraph()
    chain(True)  # warm-up outside capture (workspaces)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = chain(True)
    for seed in range(3):
        static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert rel_err(captured, chain(False)) < 2e-2
