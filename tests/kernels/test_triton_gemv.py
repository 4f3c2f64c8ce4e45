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
    from pagoda.kernels.triton_gemv import gemv_ref

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
    from pagoda.kernels.triton_gemv import DenseGemvConfig, gemv_bf16

    x, w, b = _case(n, k, dtype, bias, seed=n + k)
    config = DenseGemvConfig(cfg[0], cfg[1], cfg[2], num_warps=2)
    for _ in range(2):  # the workspace and counters are clean for the next call
        _check(gemv_bf16(x, w, b, config), x, w, b)


@pytest.mark.parametrize("split", [1, 3])
def test_gemv_float32_output_is_rounded_to_the_model_dtype(split) -> None:
    """out_dtype=float32 (the LM head's logits) stores x's-dtype-rounded values widened to
    fp32, like `F.linear(...).float()`: no extra precision that could change greedy picks."""
    from pagoda.kernels.triton_gemv import DenseGemvConfig, gemv_bf16

    x, w, _ = _case(48, 768, torch.bfloat16, False, seed=split)
    out = gemv_bf16(x, w, None, DenseGemvConfig(8, 256, split, 2), out_dtype=torch.float32)
    narrow = gemv_bf16(x, w, None, DenseGemvConfig(8, 256, split, 2))
    assert out.dtype == torch.float32
    assert torch.equal(out, out.to(torch.bfloat16).float())
    assert torch.equal(out, narrow.float())
    _check(out.to(torch.bfloat16), x, w, None)


def test_gemv_errors() -> None:
    from pagoda.kernels.triton_gemv import gemv_bf16

    x, w, b = _case(16, 64, torch.bfloat16, True, 0)
    with pytest.raises(ValueError, match="M == 1"):
        gemv_bf16(torch.cat([x, x]), w, b)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv_bf16(x.float(), w.float(), None)
    with pytest.raises(ValueError, match="unit stride"):
        gemv_bf16(x[:, :32], w.t().contiguous().t()[:, :32], None)
    with pytest.raises(ValueError, match="bias must be"):
        gemv_bf16(x, w, torch.zeros(17, dtype=torch.bfloat16))


# ---- the norm and activation prologues ---------------------------------------------------------


def _norm_case(n, k, dtype, residual, bias, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, w, b = _case(n, k, dtype, bias, seed, device)
    r = torch.randn(1, k, generator=g).to(dtype).to(device) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(device)
    return x, r, nw, w, b


def _unfused_norm_gemv(x, r, nw, w, b, config, workspace):
    """The two kernels the prologue replaces: the RMSNorm kernel, then the plain GEMV."""
    from pagoda.kernels.triton_fused_ops import fused_add_rms_norm_triton, rms_norm_triton
    from pagoda.kernels.triton_gemv import gemv_bf16

    normed, h = fused_add_rms_norm_triton(x, r, nw, 1e-6) if r is not None else (
        rms_norm_triton(x, nw, 1e-6), x)  # fmt: skip
    return gemv_bf16(normed, w, b, config, workspace=workspace), h


@pytest.mark.parametrize(
    "n,k,dtype,residual,bias,cfg",
    [
        (64, 1024, torch.bfloat16, True, False, (16, 256, 1)),
        (50, 700, torch.float16, True, True, (16, 256, 3)),  # N and K tails, serial split-K
        (40, 300, torch.bfloat16, False, True, (8, 128, 1)),  # the first layer: no residual
        (96, 512, torch.bfloat16, True, True, (32, 128, 2)),
    ],
)
def test_gemv_add_rms_norm_interpreter(n, k, dtype, residual, bias, cfg) -> None:
    """The RMSNorm prologue gives exactly what the norm kernel + the GEMV give (same roundings),
    stores x + residual bit for bit, and is within one output ulp of the torch reference."""
    from pagoda.kernels.triton_gemv import DenseGemvConfig, gemv_add_rms_norm, gemv_add_rms_norm_ref
    from pagoda.kernels.workspace import SplitKWorkspace

    x, r, nw, w, b = _norm_case(n, k, dtype, residual, bias, seed=n + k)
    config = DenseGemvConfig(cfg[0], cfg[1], cfg[2], num_warps=2)
    ws = SplitKWorkspace()
    x_before = x.clone()
    for _ in range(2):  # split-K: the workspace is clean for the next call
        out, h = gemv_add_rms_norm(x, r, nw, 1e-6, w, b, config, workspace=ws)
        want, want_h = _unfused_norm_gemv(x, r, nw, w, b, config, ws)
        assert torch.equal(out, want) and torch.equal(h, want_h)
    ref, ref_h = gemv_add_rms_norm_ref(x, r, nw, 1e-6, w, b)
    assert torch.equal(h, ref_h) and torch.equal(x, x_before)
    assert (h is x) == (r is None)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=1e-3)


@pytest.mark.parametrize(
    "n,k,dtype,bias,cfg",
    [
        (64, 1024, torch.bfloat16, False, (16, 256, 1)),
        (50, 700, torch.float16, True, (16, 256, 3)),
        (40, 300, torch.bfloat16, True, (8, 128, 1)),
    ],
)
def test_gemv_silu_and_mul_interpreter(n, k, dtype, bias, cfg) -> None:
    """The SiLU-and-mul prologue gives exactly the activation kernel + the GEMV."""
    from pagoda.kernels.triton_fused_ops import silu_and_mul_triton
    from pagoda.kernels.triton_gemv import (
        DenseGemvConfig,
        gemv_bf16,
        gemv_silu_and_mul,
        gemv_silu_and_mul_ref,
    )
    from pagoda.kernels.workspace import SplitKWorkspace

    g = torch.Generator().manual_seed(k)
    _, w, b = _case(n, k, dtype, bias, seed=n)
    gate_up = (2 * torch.randn(1, 2 * k, generator=g)).to(dtype)
    config = DenseGemvConfig(cfg[0], cfg[1], cfg[2], num_warps=2)
    ws = SplitKWorkspace()
    for _ in range(2):
        out = gemv_silu_and_mul(gate_up, w, b, config, workspace=ws)
        assert torch.equal(out, gemv_bf16(silu_and_mul_triton(gate_up), w, b, config, workspace=ws))
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    ref = gemv_silu_and_mul_ref(gate_up, w, b)
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=1e-3)


def test_gemv_prologue_errors() -> None:
    from pagoda.kernels.triton_gemv import gemv_add_rms_norm, gemv_silu_and_mul

    x, r, nw, w, b = _norm_case(16, 64, torch.bfloat16, True, True, 0)
    with pytest.raises(ValueError, match="M == 1"):
        gemv_add_rms_norm(torch.cat([x, x]), r, nw, 1e-6, w, b)
    with pytest.raises(ValueError, match=r"residual must be a \[1, 64\] torch.bfloat16 tensor"):
        gemv_add_rms_norm(x, r[:, :32], nw, 1e-6, w, b)
    with pytest.raises(ValueError, match="got \\[1, 64\\] torch.float16"):
        gemv_add_rms_norm(x, r.half(), nw, 1e-6, w, b)
    with pytest.raises(ValueError, match=r"norm_weight must be a \[64\] torch.bfloat16"):
        gemv_add_rms_norm(x, r, nw.float(), 1e-6, w, b)
    with pytest.raises(ValueError, match=r"x \(gate \| up\) must be \[1, 128\]"):
        gemv_silu_and_mul(x, w, b)


QWEN = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (2560, 2048), (2048, 11008)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_qwen_shapes_gpu(n, k, bias) -> None:
    from pagoda.kernels.triton_gemv import gemv_bf16

    x, w, b = _case(n, k, torch.bfloat16, bias, seed=n, device="cuda")
    _check(gemv_bf16(x, w, b), x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (37888, 3584), (2560, 2048), (22016, 2048)])
@pytest.mark.parametrize("residual", [False, True])
def test_gemv_add_rms_norm_qwen_shapes_gpu(n, k, residual) -> None:
    """The norm prologue on the QKV / gate_up shapes of Qwen2.5-7B and -3B: x + residual bit
    for bit, the output within one bf16 ulp of the two separate kernels and of torch."""
    from pagoda.kernels.triton_gemv import gemv_add_rms_norm, gemv_add_rms_norm_ref

    x, r, nw, w, b = _norm_case(n, k, torch.bfloat16, residual, n < 8192, seed=n, device="cuda")
    out, h = gemv_add_rms_norm(x, r, nw, 1e-6, w, b)
    want, want_h = _unfused_norm_gemv(x, r, nw, w, b, None, None)
    ref, ref_h = gemv_add_rms_norm_ref(x, r, nw, 1e-6, w, b)
    assert torch.equal(h, want_h) and torch.equal(h, ref_h)
    for other in (want, ref):
        torch.testing.assert_close(out.float(), other.float(), rtol=2.0**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3584, 18944), (2048, 11008)])
def test_gemv_silu_and_mul_qwen_shapes_gpu(n, k) -> None:
    from pagoda.kernels.triton_fused_ops import silu_and_mul_triton
    from pagoda.kernels.triton_gemv import gemv_bf16, gemv_silu_and_mul, gemv_silu_and_mul_ref

    _, w, _ = _case(n, k, torch.bfloat16, False, seed=k, device="cuda")
    gate_up = torch.randn(1, 2 * k, generator=torch.Generator().manual_seed(n))
    gate_up = (2 * gate_up).to("cuda", torch.bfloat16)
    out = gemv_silu_and_mul(gate_up, w)
    for other in (gemv_bf16(silu_and_mul_triton(gate_up), w), gemv_silu_and_mul_ref(gate_up, w)):
        torch.testing.assert_close(out.float(), other.float(), rtol=2.0**-7, atol=1e-3)


@pytest.mark.gpu
def test_gemv_prologues_chained_in_a_cuda_graph_gpu() -> None:
    """norm-prologue GEMV -> SiLU-prologue GEMV -> norm-prologue GEMV (a Qwen2.5-3B MLP and the
    next layer's QKV), PDL-chained inside one CUDA graph and replayed on new inputs, gives
    exactly what the same kernels give launched one by one."""
    from pagoda.kernels.triton_gemv import gemv_add_rms_norm, gemv_silu_and_mul

    hidden, inter = 2048, 11008
    x, r, nw, w_gu, _ = _norm_case(2 * inter, hidden, torch.bfloat16, True, False, 3, "cuda")
    _, w_down, _ = _case(hidden, inter, torch.bfloat16, False, seed=4, device="cuda")
    _, w_qkv, b_qkv = _case(2560, hidden, torch.bfloat16, True, seed=5, device="cuda")

    def chain():
        gate_up, h = gemv_add_rms_norm(x, r, nw, 1e-6, w_gu)
        down = gemv_silu_and_mul(gate_up, w_down)
        return gemv_add_rms_norm(down, h, nw, 1e-6, w_qkv, b_qkv)

    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv, h2 = chain()
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(x.shape, generator=g))
        r.copy_(torch.randn(r.shape, generator=g))
        graph.replay()
        want_qkv, want_h2 = chain()
        assert torch.equal(qkv, want_qkv) and torch.equal(h2, want_h2)


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
    from pagoda.kernels import triton_gemv
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


# ---- the decoder's wiring: the prologues at M = 1 -------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_decoder_takes_the_prologues_at_one_token(monkeypatch, arch) -> None:
    """A decode token through a bf16 model with the prologue GEMVs forced on the CPU
    (interpreter): each layer's QKV and gate_up take the norm prologue and down the SiLU
    prologue, the o_proj and the final norm stay as they were, and the hidden states match
    the unfused path. Two tokens (prefill) never take them."""
    from pagoda.config import ModelConfig
    from pagoda.kernels import triton_gemv
    from pagoda.layers.linear import UnquantizedLinearMethod
    from pagoda.models.loader import load_model
    from tests.helpers import tiny_config

    config = tiny_config(arch, architectures=[f"{arch.capitalize()}ForCausalLM"])
    model_config = ModelConfig(
        model="", hf_config=config, dtype="bfloat16", max_model_len=64, load_format="dummy"
    )
    model = load_model(model_config, "cpu")
    layers = config.num_hidden_layers
    tokens, positions = torch.tensor([7]), torch.tensor([0])
    with torch.no_grad():
        want = model(tokens, positions, None)
        want2 = model(torch.tensor([7, 9]), torch.tensor([0, 1]), None)

    calls = {"norm": 0, "silu": 0}
    norm_gemv, silu_gemv = triton_gemv.gemv_add_rms_norm, triton_gemv.gemv_silu_and_mul

    def count(name, fn):
        return lambda *a, **kw: calls.__setitem__(name, calls[name] + 1) or fn(*a, **kw)

    monkeypatch.setattr(triton_gemv, "gemv_add_rms_norm", count("norm", norm_gemv))
    monkeypatch.setattr(triton_gemv, "gemv_silu_and_mul", count("silu", silu_gemv))
    monkeypatch.setattr(
        UnquantizedLinearMethod,
        "_prologue_gemv",
        staticmethod(lambda layer, x: triton_gemv if x.shape[0] == 1 else None),
    )
    with torch.no_grad():
        got = model(tokens, positions, None)
        assert calls == {"norm": 2 * layers, "silu": layers}
        got2 = model(torch.tensor([7, 9]), torch.tensor([0, 1]), None)
        assert calls == {"norm": 2 * layers, "silu": layers}
    assert torch.equal(got2, want2)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_prologue_rule(monkeypatch) -> None:
    """On the CPU there is no prologue GEMV; on a GPU none either since session 18's
    measurement (slower)."""
    from pagoda.layers import linear
    from pagoda.layers.norm import RMSNorm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.bfloat16), False)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    method = linear.UnquantizedLinearMethod()
    norm = RMSNorm(16, dtype=torch.bfloat16)
    assert method.apply_rms_norm_first(layer, x, None, norm, None) is None
    assert method.apply_silu_and_mul_first(layer, torch.cat([x, x], 1), None) is None
    # measured slower on the H200 (session 18): off whatever the environment says
    try:
        monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "gemv_prologue")
        linear.prologue_enabled.cache_clear()
        assert not linear.prologue_enabled()
        monkeypatch.delenv("PAGODA_DISABLED_KERNELS")
        linear.prologue_enabled.cache_clear()
        assert not linear.prologue_enabled()
    finally:
        linear.prologue_enabled.cache_clear()
