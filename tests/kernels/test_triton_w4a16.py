"""Triton W4A16 / W8A16 GEMM and GEMV against the torch reference (interpreter on CPU, GPU when
present)."""

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
    # fp32 reference from the same (dtype-rounded) activations and scales
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


# ---------------------------------------------------------------- split-K GEMV (M <= 16)
#
# Tolerances. The kernel forms exactly the products of the reference (codes minus zero are
# exact small integers in fp32 and in bf16 / fp16 for the tensor-core path; x and the scales
# are the same rounded values) and sums them in fp32 in another order: with K <= 512 and
# |terms| <= ~0.5 the reordering error is < 1e-5, so an fp32 output must match to 1e-5. An
# output in x's dtype adds one rounding: half an ulp on the GPU (round to nearest), less than
# one ulp in the interpreter (its fp32 -> bf16 cast truncates), so rtol = one ulp (2^-7 for
# bf16's 8 significant bits, 2^-10 for fp16's 11) plus atol for the fp32 error near zero.
_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}


def _check(out, ref, dtype) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, rtol=_RTOL[dtype], atol=1e-5)


def _gemv_cases():
    from pagoda.kernels.triton_w4a16 import GemvConfig as C

    # (m, n, k, group, bits, asym, dtype, config); the interpreter's bf16 tl.dot is broken
    # (raw bits multiplied), so the tensor-core path runs fp16 / fp32 here, bf16 on the GPU.
    return [
        (1, 256, 512, 128, 4, False, torch.bfloat16, C(256, 64, 4, 1)),  # serial split-K
        (1, 256, 512, 128, 4, False, torch.bfloat16, C(256, 64, 1, 1)),  # one split
        (1, 512, 256, 64, 4, True, torch.bfloat16, C(512, 64, 2, 2, reduce="atomic")),
        (3, 128, 256, 32, 4, True, torch.float16, C(128, 32, 3, 1)),  # FMA path, 3 rows
        (16, 64, 256, 64, 4, False, torch.bfloat16, C(64, 64, 2, 1)),  # FMA path, 16 rows
        (2, 96, 100, -1, 4, True, torch.bfloat16, C(64, 32, 2, 1)),  # per channel, N and K tails
        (1, 128, 256, 128, 8, False, torch.bfloat16, C(128, 32, 3, 1)),  # 8-bit
        (2, 64, 256, 64, 8, True, torch.float16, C(64, 32, 2, 1)),  # 8-bit asym
        (3, 64, 256, 64, 4, False, torch.float32, C(64, 64, 2, 1)),  # fp32 activations
        (16, 128, 512, 128, 4, False, torch.float16, C(64, 128, 4, 4, use_dot=True)),
        (5, 64, 256, 128, 4, True, torch.float16, C(64, 128, 1, 4, use_dot=True)),
        (3, 64, 512, 64, 8, True, torch.float16, C(64, 64, 2, 4, use_dot=True)),
        (4, 96, 200, -1, 4, True, torch.float16, C(64, 128, 2, 4, use_dot=True)),  # tails
        (2, 64, 256, 128, 4, True, torch.float32, C(64, 128, 2, 4, use_dot=True)),
    ]


@pytest.mark.parametrize("case", range(14))
def test_wna16_gemv_interpreter(case) -> None:
    from pagoda.kernels.triton_w4a16 import wna16_gemv

    m, n, k, group, bits, asym, dtype, cfg = _gemv_cases()[case]
    x, qt, st, zt, gs, ref = _case(m, n, k, group, bits, asym, dtype=dtype, seed=case)
    out = wna16_gemv(x, qt, st, zt, gs, bits, cfg, out_dtype=torch.float32)
    _check(out, ref, torch.float32)
    if dtype != torch.float32 and case % 3 == 0:  # the cast to x's dtype, on a few cases
        _check(wna16_gemv(x, qt, st, zt, gs, bits, cfg), ref, dtype)


def test_wna16_gemv_serial_reduction_interpreter() -> None:
    """The last program of each column tile writes the sum and leaves workspace and counters
    zero, so repeated calls (different shapes, same buffers) stay correct."""
    from pagoda.kernels.triton_w4a16 import GemvConfig, _workspaces, wna16_gemv

    for seed, (m, n, split) in enumerate(((1, 256, 4), (2, 128, 3), (1, 256, 2))):
        x, qt, st, zt, gs, ref = _case(m, n, 512, 64, 4, True, dtype=torch.bfloat16, seed=seed)
        for _ in range(2):
            out = wna16_gemv(x, qt, st, zt, gs, 4, GemvConfig(128, 64, split, 1), torch.float32)
            _check(out, ref, torch.float32)
        ws, cnt = _workspaces[("cpu", 0)][-2:]
        assert int(ws.count_nonzero()) == 0 and int(cnt.count_nonzero()) == 0


def test_wna16_gemv_default_config_interpreter() -> None:
    from pagoda.kernels.triton_w4a16 import default_gemv_config, wna16_gemv

    for m, dtype in ((1, torch.bfloat16), (6, torch.float16)):
        x, qt, st, zt, gs, ref = _case(m, 256, 1024, 128, 4, False, dtype=dtype, seed=m)
        cfg = default_gemv_config(m, 256, 1024, 128, 4, num_sms=8)
        assert cfg.use_dot == (m > 2) and cfg.split_k > 1
        _check(wna16_gemv(x, qt, st, zt, gs, 4, out_dtype=torch.float32), ref, torch.float32)


def test_gemv_configs_and_errors() -> None:
    from pagoda.kernels.triton_w4a16 import (
        default_gemv_config,
        gemv_candidate_configs,
        gemv_dot_ok,
        wna16_gemv,
    )

    # Qwen2.5-7B decode shapes on an H200: the tiles and splits that won run 3's sweep
    # (w4a16_gemv_h200.json) -- down_proj's best split was 74, the rule gives 75.
    expected = {
        (4608, 3584): (128, 1, 28),
        (3584, 3584): (128, 1, 28),
        (37888, 3584): (1024, 4, 7),
        (3584, 18944): (256, 1, 75),
    }
    for (n, k), (block_n, warps, split) in expected.items():
        cfg = default_gemv_config(1, n, k, 128, 4, num_sms=132)
        assert not cfg.use_dot and cfg.block_k == 64
        assert (cfg.block_n, cfg.num_warps, cfg.split_k) == (block_n, warps, split)
        warps_total = -(-n // cfg.block_n) * cfg.split_k * cfg.num_warps
        assert 4 * 132 <= warps_total <= 9 * 132 and k // cfg.block_k // cfg.split_k >= 2
        assert default_gemv_config(16, n, k, 128, 4, num_sms=132).use_dot
    assert gemv_dot_ok(4096, 128, 4) and not gemv_dot_ok(4096, 64, 4) and gemv_dot_ok(4096, 64, 8)
    assert not default_gemv_config(16, 4096, 4096, 32, 4).use_dot  # K-tile < 16 words
    assert any(c.use_dot for c in gemv_candidate_configs(8, 3584, 128))
    assert not any(c.use_dot for c in gemv_candidate_configs(1, 3584, 128))
    x, qt, st, _, _, _ = _case(17, 64, 128, 32, 4, False)
    with pytest.raises(ValueError, match="M <= 16"):
        wna16_gemv(x, qt, st, None, 32, 4)


# ---------------------------------------------------------------- GPU

QWEN7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]  # qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 33, 128, 512])
@pytest.mark.parametrize("bits,asym,group", [(4, False, 128), (4, True, 64), (8, False, 128)])
def test_wna16_gemm_gpu(m, bits, asym, group) -> None:
    from pagoda.kernels.triton_w4a16 import wna16_gemm

    x, qt, st, zt, gs, ref = _case(m, 3584, 3584, group, bits, asym, "cuda", torch.bfloat16)
    out = wna16_gemm(x, qt, st, zt, gs, bits)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def _case_gpu(n, k, group, bits, asym, seed=0):
    """_case's weights built on the GPU (the gate/up shape has 136M weights)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    gs = k if group == -1 else group
    q = torch.randint(lo, hi, (n, k), generator=g, device="cuda").to(torch.int8)
    scale = (torch.rand(n, -(-k // gs), generator=g, device="cuda") * 0.02 + 0.001).bfloat16()
    zp = None
    if asym:
        zp = torch.randint(lo, hi, scale.shape, generator=g, device="cuda").to(torch.int8)
    qt = pack_to_int32(q, bits, 1).t().contiguous()
    zt = None if zp is None else (zp.float() + (1 << (bits - 1))).t().contiguous().bfloat16()
    return q, scale, zp, qt, scale.t().contiguous(), zt, gs


def _check_gpu(x, q, scale, zp, gs, out, out32=None) -> None:
    """fp32 output: 1e-4 of the output scale (up to 18944 fp32 terms summed in another order);
    bf16 output: one bf16 ulp more (round to nearest on the GPU)."""
    ref = wna16_linear_ref(x.float(), q, scale.float(), zp, gs)
    atol = 1e-4 * float(ref.abs().max())
    if out32 is not None:
        torch.testing.assert_close(out32, ref, rtol=1e-4, atol=atol)
    torch.testing.assert_close(out.float(), ref, rtol=2.0**-7, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN7B)
def test_wna16_gemv_qwen7b_gpu(n, k) -> None:
    """Default configs on the real decode shapes (bf16 activations, W4A16 group 128)."""
    from pagoda.kernels.triton_w4a16 import wna16_gemv

    q, scale, zp, qt, st, zt, gs = _case_gpu(n, k, 128, 4, False)
    for m in (1, 2, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out32 = wna16_gemv(x, qt, st, zt, gs, 4, out_dtype=torch.float32)
        _check_gpu(x, q, scale, zp, gs, wna16_gemv(x, qt, st, zt, gs, 4), out32)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,asym,group", [(4, True, 128), (8, False, 128), (4, True, -1)])
def test_wna16_gemv_quant_types_gpu(bits, asym, group) -> None:
    from pagoda.kernels.triton_w4a16 import wna16_gemv

    q, scale, zp, qt, st, zt, gs = _case_gpu(4608, 3584, group, bits, asym, seed=1)
    for m in (1, 5):  # FMA path, tensor-core path
        x = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16)
        _check_gpu(x, q, scale, zp, gs, wna16_gemv(x, qt, st, zt, gs, bits))


@pytest.mark.gpu
def test_wna16_gemv_candidates_gpu() -> None:
    """Every config the benchmark sweeps is correct, with both reductions and one split, and
    the serial reduction leaves its workspace zero after repeated calls."""
    from dataclasses import replace

    from pagoda.kernels.triton_w4a16 import _workspaces, gemv_candidate_configs, wna16_gemv

    q, scale, zp, qt, st, zt, gs = _case_gpu(4608, 3584, 128, 4, False, seed=2)
    for m in (1, 8):
        x = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16)
        cands = gemv_candidate_configs(m, 3584, 128, 4)
        configs = [*cands, replace(cands[0], split_k=1), replace(cands[0], reduce="atomic")]
        for cfg in configs:
            for _ in range(3):
                out = wna16_gemv(x, qt, st, zt, gs, 4, cfg)
                _check_gpu(x, q, scale, zp, gs, out)
    torch.cuda.synchronize()
    for bufs in _workspaces.values():
        assert all(int(b.count_nonzero()) == 0 for b in bufs)


@pytest.mark.gpu
def test_wna16_gemv_cuda_graph_gpu() -> None:
    """Captured once, replayed with new inputs: the serial split-K reduction needs no sync
    (atomics make the fp32 sum order vary, so compare with the reference, not bit-exactly)."""
    from pagoda.kernels.triton_w4a16 import wna16_gemv

    q, scale, zp, qt, st, zt, gs = _case_gpu(37888, 3584, 128, 4, False, seed=3)
    static_x = torch.randn(1, 3584, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles, allocates the workspace
        wna16_gemv(static_x, qt, st, zt, gs, 4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wna16_gemv(static_x, qt, st, zt, gs, 4)
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        _check_gpu(static_x, q, scale, zp, gs, static_out)


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
    for small_m in ("gemv", "gemm", "tinygemm"):
        monkeypatch.setattr(WNA16LinearMethod, "small_m_kernel", small_m)
        method = WNA16LinearMethod(WeightQuantArgs(4, True, 128))
        with torch.device("cuda"):
            layer = ReplicatedLinear(inp, out, linear_method=method, dtype=torch.bfloat16)
        layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
        layer.weight_scale.data.copy_(scale)
        method.process_weights_after_loading(layer)
        assert layer.wna16_backend == "triton"
        for m in (1, 4, 64):
            y = (
                layer(x[:1].repeat(m, 1).cuda().bfloat16())
                if m != 4
                else layer(x.cuda().bfloat16())
            )
            expect = ref[:1].repeat(m, 1) if m != 4 else ref
            torch.testing.assert_close(y.float().cpu(), expect, rtol=2e-2, atol=3e-2)
        # tinygemm's int4 copy is made on the first small-M call, only when selected
        assert hasattr(layer, "int4pack") == (small_m == "tinygemm")


def test_tuned_gemv_configs_cover_the_measured_shapes_and_only_their_gpu():
    """The H200 table gives the measured best config; other GPUs / shapes get None."""
    import json

    from pagoda.kernels.triton_w4a16 import _TUNED_PATH, GemvConfig, tuned_gemv_config

    data = json.loads(_TUNED_PATH.read_text())
    gpu = data["gpu"]
    for e in data["entries"]:
        cfg = tuned_gemv_config(gpu, e["m"], e["n"], e["k"], e["group_size"], e["bits"])
        assert cfg == GemvConfig(**e["config"])
        assert e["us"] <= e["default_us"]  # the sweep includes the default
    e = data["entries"][0]
    assert tuned_gemv_config("some other GPU", e["m"], e["n"], e["k"], 128, 4) is None
    assert tuned_gemv_config(gpu, 1, 123, 456, 128, 4) is None
    # M = 3 takes the M = 4 entry (tensor-core path), never an FMA entry tuned at M <= 2
    cfg = tuned_gemv_config(gpu, 3, 4608, 3584, 128, 4)
    assert cfg is not None and cfg.use_dot


def test_gemv_with_a_tuned_config_matches_the_reference():
    """A tuned config (small split, 1 warp) computes the same result under the interpreter."""
    from pagoda.kernels.triton_w4a16 import GemvConfig, wna16_gemv
    from pagoda.kernels.wna16 import pack_to_int32, wna16_linear_ref

    torch.manual_seed(0)
    n, k, g = 256, 512, 128
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // g) * 0.02 + 0.01
    x = torch.randn(1, k)
    packed_t = pack_to_int32(q.t().contiguous(), 4, packed_dim=0)  # [K/8, N]
    cfg = GemvConfig(block_n=128, block_k=64, split_k=4, num_warps=1, num_stages=3)
    got = wna16_gemv(x, packed_t, scale.t().contiguous(), None, g, 4, config=cfg)
    want = wna16_linear_ref(x, q, scale, None, g)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_tuned_gemm_configs_cover_the_measured_shapes_and_stop_at_the_largest_m():
    import json

    from pagoda.kernels.triton_w4a16 import _TUNED_PATH, GemmConfig, tuned_gemm_config

    data = json.loads(_TUNED_PATH.with_name("w4a16_gemm.json").read_text())
    gpu = data["gpu"]
    for e in data["entries"]:
        cfg = tuned_gemm_config(gpu, e["m"], e["n"], e["k"], e["group_size"], e["bits"])
        assert cfg == GemmConfig(**e["config"])
        assert e["us"] < e["default_us"]  # only entries that beat the heuristic are kept
    e = data["entries"][0]
    assert tuned_gemm_config("another GPU", e["m"], e["n"], e["k"], 128, 4) is None
    largest = max(x["m"] for x in data["entries"] if (x["n"], x["k"]) == (e["n"], e["k"]))
    assert tuned_gemm_config(gpu, largest + 1, e["n"], e["k"], 128, 4) is None  # prefill


def test_gemm_with_a_tuned_config_matches_the_reference():
    from pagoda.kernels.triton_w4a16 import GemmConfig, wna16_gemm
    from pagoda.kernels.wna16 import wna16_linear_ref

    torch.manual_seed(0)
    n, k, g, m = 128, 256, 128, 33
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // g) * 0.02 + 0.01
    x = torch.randn(m, k)
    qt = pack_to_int32(q, 4, 1).t().contiguous()  # [K/8, N]
    cfg = GemmConfig(block_m=32, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3)
    got = wna16_gemm(x, qt, scale.t().contiguous(), None, g, 4, cfg)
    want = wna16_linear_ref(x, q, scale, None, g)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
