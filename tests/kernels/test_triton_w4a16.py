"""Triton W4A16 / W8A16 GEMM against the torch reference (interpreter on CPU, GPU when present)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.wna16 import pack_to_int32, wna16_linear_ref


def _case(m, n, k, group, bits, asym, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    gs = k if group == -1 else group
    q = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, -(-k // gs), generator=g) * 0.02 + 0.001).to(dtype)
    zp = torch.randint(lo, hi, scale.shape, generator=g).to(torch.int8) if asym else None
    x = torch.randn(m, k, generator=g).to(dtype)
    qt = pack_to_int32(q, bits, 1).t().contiguous()
    zt = None if zp is None else (zp.float() + (1 << (bits - 1))).t().contiguous().to(dtype)
    ref = wna16_linear_ref(x.float(), q, scale.float(), zp, gs)
    return (
        x.to(device),
        qt.to(device),
        scale.t().contiguous().to(device),
        None if zt is None else zt.to(device),
        gs,
        ref,
    )


@pytest.mark.parametrize(
    "m,n,k,group,bits,asym,split",
    [
        (1, 64, 128, 32, 4, False, 2),
        (17, 48, 192, 64, 4, True, 1),
        (3, 32, 100, -1, 4, True, 1),
        (5, 64, 128, 32, 8, True, 3),
    ],
)
def test_wna16_gemm_interpreter(m, n, k, group, bits, asym, split) -> None:
    from pagoda.kernels.triton_w4a16 import GemmConfig, wna16_gemm

    x, qt, st, zt, gs, ref = _case(m, n, k, group, bits, asym)
    out = wna16_gemm(x, qt, st, zt, gs, bits, GemmConfig(16, 32, 32, split_k=split))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 33, 128, 512])
@pytest.mark.parametrize("bits,asym,group", [(4, False, 128), (4, True, 64), (8, False, 128)])
def test_wna16_gemm_gpu(m, bits, asym, group) -> None:
    from pagoda.kernels.triton_w4a16 import wna16_gemm

    x, qt, st, zt, gs, ref = _case(m, 3584, 3584, group, bits, asym, "cuda", torch.bfloat16)
    out = wna16_gemm(x, qt, st, zt, gs, bits)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_quantized_layer_cuda_backends(monkeypatch) -> None:
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantized_linear import WeightQuantArgs, WNA16LinearMethod

    inp, out = 1024, 512
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (out, inp), generator=g).to(torch.int8)
    scale = torch.rand(out, inp // 128, generator=g) * 0.02 + 0.001
    x = torch.randn(4, inp, generator=g)
    ref = wna16_linear_ref(x, q, scale, None, 128)
    for small_m in ("triton", "tinygemm"):
        monkeypatch.setenv("PAGODA_WNA16_SMALL_M", small_m)
        method = WNA16LinearMethod(WeightQuantArgs(4, True, 128))
        with torch.device("cuda"):
            layer = ReplicatedLinear(inp, out, linear_method=method, dtype=torch.bfloat16)
        layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
        layer.weight_scale.data.copy_(scale)
        method.process_weights_after_loading(layer)
        assert layer.wna16_backend == "triton"
        assert hasattr(layer, "int4pack") == (small_m == "tinygemm")
        for m in (1, 4, 64):
            y = (
                layer(x[:1].repeat(m, 1).cuda().bfloat16())
                if m != 4
                else layer(x.cuda().bfloat16())
            )
            expect = ref[:1].repeat(m, 1) if m != 4 else ref
            torch.testing.assert_close(y.float().cpu(), expect, rtol=2e-2, atol=3e-2)
