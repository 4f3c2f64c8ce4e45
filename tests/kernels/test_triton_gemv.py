"""The dense split-K GEMV (M = 1) against the fp32 torch reference: interpreter on CPU, the
Qwen2.5 decode shapes on the GPU, and the dispatch in `UnquantizedLinearMethod`."""

from __future__ import annotations

import pytest
import torch


def _case(n, k, dtype, bias, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _check(out, x, w, b):
    from pagoda.kernels.dense.triton_gemv import gemv_ref

    ref = gemv_ref(x, w, b)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # Both accumulate in fp32 and round once: at most one ulp of the output dtype apart.
    ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=1e-3)


@pytest.mark.parametrize(
    "n,k,dtype,bias,cfg",
    [
        (64, 1024, torch.bfloat16, False, (16, 256, 1)),  # one split
        (64, 1024, torch.bfloat16, True, (16, 256, 4)),  # serial split-K + bias
        (50, 700, torch.float16, True, (16, 256, 3)),  # N and K tails
        (96, 512, torch.bfloat16, True, (32, 128, 2)),
        (40, 300, torch.float16, False, (8, 128, 0)),  # default split
    ],
)
def test_gemv_interpreter(n, k, dtype, bias, cfg) -> None:
    from pagoda.kernels.dense.triton_gemv import DenseGemvConfig, gemv_bf16

    x, w, b = _case(n, k, dtype, bias, seed=n + k)
    config = DenseGemvConfig(cfg[0], cfg[1], cfg[2], num_warps=2)
    for _ in range(2):  # the workspace and counters are clean for the next call
        _check(gemv_bf16(x, w, b, config), x, w, b)


@pytest.mark.parametrize("split", [1, 3])
def test_gemv_float32_output_is_rounded_to_the_model_dtype(split) -> None:
    """out_dtype=float32 (the LM head's logits) stores x's-dtype-rounded values widened to
    fp32, like `F.linear(...).float()`: no extra precision that could change greedy picks."""
    from pagoda.kernels.dense.triton_gemv import DenseGemvConfig, gemv_bf16

    x, w, _ = _case(48, 768, torch.bfloat16, False, seed=split)
    out = gemv_bf16(x, w, None, DenseGemvConfig(8, 256, split, 2), out_dtype=torch.float32)
    narrow = gemv_bf16(x, w, None, DenseGemvConfig(8, 256, split, 2))
    assert out.dtype == torch.float32
    assert torch.equal(out, out.to(torch.bfloat16).float())
    assert torch.equal(out, narrow.float())
    _check(out.to(torch.bfloat16), x, w, None)


def test_gemv_errors() -> None:
    from pagoda.kernels.dense.triton_gemv import gemv_bf16

    x, w, b = _case(16, 64, torch.bfloat16, True, 0)
    with pytest.raises(ValueError, match="M == 1"):
        gemv_bf16(torch.cat([x, x]), w, b)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv_bf16(x.float(), w.float(), None)
    with pytest.raises(ValueError, match="unit stride"):
        gemv_bf16(x[:, :32], w.t().contiguous().t()[:, :32], None)
    with pytest.raises(ValueError, match="bias must be"):
        gemv_bf16(x, w, torch.zeros(17, dtype=torch.bfloat16))


QWEN = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (2560, 2048), (2048, 11008)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_qwen_shapes_gpu(n, k, bias) -> None:
    from pagoda.kernels.dense.triton_gemv import gemv_bf16

    x, w, b = _case(n, k, torch.bfloat16, bias, seed=n, device="cuda")
    _check(gemv_bf16(x, w, b), x, w, b)


@pytest.mark.gpu
def test_lm_head_uses_the_gemv_at_batch_one_gpu() -> None:
    """The dense LM head at M = 1 gives exactly `F.linear(...).float()` up to the summation
    order (one bf16 ulp), stored as float32 without extra precision."""
    from pagoda.layers.embedding import LMHead

    head = LMHead(152064, 3584, dtype=torch.bfloat16).cuda()
    torch.nn.init.normal_(head.weight, std=0.02)
    for seed in range(4):
        h = torch.randn(1, 3584, generator=torch.Generator().manual_seed(seed))
        h = h.to("cuda", torch.bfloat16)
        logits = head(h)
        ref = torch.nn.functional.linear(h, head.weight).float()
        assert logits.dtype == torch.float32 and logits.shape == ref.shape
        torch.testing.assert_close(logits, ref, rtol=2.0**-7, atol=1e-3)
        assert torch.equal(logits, logits.to(torch.bfloat16).float())


@pytest.mark.gpu
def test_linear_dispatch_and_cuda_graph_gpu(monkeypatch) -> None:
    """M = 1 on CUDA sm_90+ takes the GEMV, M = 2 cuBLAS; the GEMV replays inside a CUDA
    graph."""
    from pagoda.kernels.dense import triton_gemv
    from pagoda.layers.linear import UnquantizedLinearMethod, dense_gemv_kernel

    calls = []
    real = triton_gemv.gemv_bf16
    monkeypatch.setattr(triton_gemv, "gemv_bf16", lambda *a, **kw: calls.append(1) or real(*a))
    layer = torch.nn.Module()
    x, w, b = _case(3584, 3584, torch.bfloat16, True, 1, device="cuda")
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    method = UnquantizedLinearMethod()
    out = method.apply(layer, x, b)
    assert calls == [1] if dense_gemv_kernel(x.device) is not None else calls == []
    _check(out, x, w, b)
    method.apply(layer, torch.cat([x, x]), b)  # M = 2: cuBLAS
    assert len(calls) <= 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_gemv.gemv_bf16(x, w, b)
    for seed in range(2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        _check(captured, x, w, b)


def test_dense_gemv_rule(monkeypatch) -> None:
    """Never on the CPU; on CUDA from sm_90 on (where it was measured) unless disabled."""
    from pagoda import platform
    from pagoda.layers import linear

    def kernel(cap, disabled=""):
        linear._dense_gemv_for.cache_clear()
        monkeypatch.setattr(platform, "capability", lambda index: cap)
        monkeypatch.setenv("PAGODA_DISABLED_KERNELS", disabled)
        return linear._dense_gemv_for(0)

    try:
        assert linear.dense_gemv_kernel(torch.device("cpu")) is None
        assert kernel((9, 0)) is not None and kernel((10, 0)) is not None
        assert kernel((8, 9)) is None  # RTX 40xx: not measured
        assert kernel((9, 0), "dense_gemv") is None
        with pytest.raises(ValueError, match="unknown kernel"):
            kernel((9, 0), "dense_gemv_all")
    finally:
        linear._dense_gemv_for.cache_clear()
