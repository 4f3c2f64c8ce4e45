"""The quantized-linear kernel registry: which kernels a layer gets for which M, the A/B
switch (PAGODA_DISABLED_KERNELS), and the layouts' kernels against the torch reference (the
Triton ones under the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pagoda import envs
from pagoda.kernels.wna16.reference import wna16_linear_ref
from pagoda.layers import wna16_kernels as wk
from pagoda.quant.dequant import dequantize_weight
from pagoda.quant.weights import UnpackedWeight

MMA = frozenset({"mma_wgmma_tma", "mma_wgmma", "mma_gemv", "mma_gemm", "mma_dequant"})


def _cfg(n=4608, k=3584, bits=4, zp=False, group=128, dtype=torch.bfloat16, cuda=True, **kw):
    return wk.KernelConfig(
        device_type="cuda" if cuda else "cpu",
        device_index=0,
        capability=kw.pop("capability", (9, 0)) if cuda else (0, 0),
        num_sms=132 if cuda else 0,
        device_name="some GPU" if cuda else "",
        n=n,
        k=k,
        bits=bits,
        has_zero_point=zp,
        group_size=group,
        act_dtype=dtype,
        **kw,
    )


@pytest.fixture
def mma_passes(monkeypatch):
    """The MMA self-test needs a GPU: pretend it passed (the shape rules stay real)."""
    pytest.importorskip("triton")  # the dispatch with Triton installed (CI's second venv skips)
    from pagoda.kernels.wna16 import triton_w4a16_mma as mm

    monkeypatch.setattr(mm, "mma_self_test", lambda index: True)


def test_cpu_layers_dequantize_per_call() -> None:
    table = wk.choose_kernels(_cfg(cuda=False, dtype=torch.float32), frozenset())
    assert table.layout == "dequant" and table.describe() == "torch_dequant M=1.."


def test_hopper_bf16_symmetric_takes_the_tensor_core_kernels(mma_passes) -> None:
    # sm_90: the GEMV to 8 rows, then the wgmma GEMM, the TMA GEMM in its band, dequant +
    # cuBLAS: qkv / o of 3B and 7B o no TMA GEMM; 7B qkv 33-64; gate_up 17-512; down 33-512 at
    # N = 3584 (7B), 65-256 at 2048 (3B)
    pytest.importorskip("triton.experimental.gluon")
    for n in (2560, 2048):
        assert wk.choose_kernels(_cfg(n=n, k=2048), frozenset()).describe() == (
            "mma_gemv M=1..8, mma_wgmma M=9..64, mma_dequant M=65.."
        )
    assert wk.choose_kernels(_cfg(n=4608, k=3584), frozenset()).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..32, mma_wgmma_tma M=33..64, mma_dequant M=65.."
    )
    assert wk.choose_kernels(_cfg(n=37888, k=3584), frozenset()).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..16, mma_wgmma_tma M=17..512, mma_dequant M=513.."
    )
    assert wk.choose_kernels(_cfg(n=22016, k=2048), frozenset()).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..16, mma_wgmma_tma M=17..512, mma_dequant M=513.."
    )
    assert wk.choose_kernels(_cfg(n=3584, k=18944), frozenset()).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..32, mma_wgmma_tma M=33..512, mma_dequant M=513.."
    )
    assert wk.choose_kernels(_cfg(n=2048, k=11008), frozenset()).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..64, mma_wgmma_tma M=65..256, mma_dequant M=257.."
    )
    # zero points (AWQ, asymmetric GPTQ) take the same kernels
    assert wk.choose_kernels(_cfg(n=37888, zp=True), frozenset()).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..16, mma_wgmma_tma M=17..512, mma_dequant M=513.."
    )
    # without the TMA GEMM the cp.async wgmma GEMM keeps gate_up / down to 128 rows
    no_tma = frozenset({"mma_wgmma_tma"})
    assert wk.choose_kernels(_cfg(n=37888), no_tma).describe() == (
        "mma_gemv M=1..8, mma_wgmma M=9..128, mma_dequant M=129.."
    )
    # without either wgmma GEMM (or before sm_90): the GEMV to 32 rows, the MMA GEMM to 64 on
    # layers of >= 12 Mi weights (qkv), to 128 on >= 64 Mi (gate_up); small layers no GEMM
    no_wg = frozenset({"mma_wgmma", "mma_wgmma_tma"})
    for cfg, disabled in ((_cfg(), no_wg), (_cfg(capability=(8, 9)), frozenset())):
        assert wk.choose_kernels(cfg, disabled).describe() == (
            "mma_gemv M=1..32, mma_gemm M=33..64, mma_dequant M=65.."
        )
    assert wk.choose_kernels(_cfg(n=37888, capability=(8, 9)), frozenset()).describe() == (
        "mma_gemv M=1..32, mma_gemm M=33..128, mma_dequant M=129.."
    )
    assert wk.choose_kernels(_cfg(n=1024), no_wg).describe() == (
        "mma_gemv M=1..32, mma_dequant M=33.."
    )


def test_wgmma_needs_hopper_and_whole_tiles(mma_passes) -> None:
    pytest.importorskip("triton.experimental.gluon")
    assert wk.MmaWgmma.can_implement(_cfg(capability=(8, 9))) == (False, "needs sm_90 (wgmma)")
    assert wk.MmaWgmmaTma.can_implement(_cfg(capability=(8, 9)))[0] is False
    ok, why = wk.MmaWgmma.can_implement(_cfg(n=4608 + 16))  # N % 64 != 0: the GEMV still runs
    assert not ok and "N % 64" in why
    # the TMA GEMM takes any N % 16 (a partial last CTA), so it covers gate_up-sized N here
    assert wk.MmaWgmmaTma.can_implement(_cfg(n=37888 + 16))[0]
    # (a 7B-qkv-sized N % 64 != 0: the TMA GEMM keeps its band, the GEMV runs to 32 rows)
    assert wk.choose_kernels(_cfg(n=4608 + 16), frozenset()).describe() == (
        "mma_gemv M=1..32, mma_wgmma_tma M=33..64, mma_dequant M=65.."
    )
    ok, why = wk.MmaWgmmaTma.can_implement(_cfg(group=32))
    assert not ok


def test_packed_layout_follows_the_large_m_rule(mma_passes) -> None:
    # gate_up fills the GPU: the Triton GEMM up to M = 139; qkv (35 column tiles of 64 on
    # 132 SMs) runs dequant + cuBLAS from the first M past the GEMV.
    big = wk.choose_kernels(_cfg(n=37888), MMA)
    assert big.layout == "triton"
    assert big.describe() == "triton_gemv M=1..16, triton_gemm M=17..139, triton_dequant M=140.."
    assert wk.choose_kernels(_cfg(), MMA).describe() == "triton_gemv M=1..16, triton_dequant M=17.."
    # without dequant + cuBLAS the GEMM takes every M past the GEMV; without the GEMV the GEMM
    # starts at M = 1
    no_dq = MMA | {"triton_dequant"}
    assert wk.choose_kernels(_cfg(), no_dq).describe() == "triton_gemv M=1..16, triton_gemm M=17.."
    no_gemv = MMA | {"triton_gemv"}
    assert wk.choose_kernels(_cfg(n=37888), no_gemv).describe() == (
        "triton_gemm M=1..139, triton_dequant M=140.."
    )
    # the MMA GEMV alone still covers what it can; the rest falls to the next layout
    only_gemv = frozenset({"mma_wgmma_tma", "mma_wgmma", "mma_gemm", "mma_dequant"})
    assert wk.choose_kernels(_cfg(), only_gemv).layout == "triton"


@pytest.mark.parametrize(
    ("cfg", "layout"),
    [
        (_cfg(zp=True), "mma"),  # zero points in the MMA GEMV and dequant
        (_cfg(bits=8), "triton"),
        (_cfg(dtype=torch.float16), "triton"),  # the MMA kernels are bf16 only
        (_cfg(capability=(7, 5)), "triton"),  # no mma.sync bf16 before sm_80
        (_cfg(group=32), "triton"),  # MMA groups are multiples of 64
        (_cfg(group=8), "dequant"),  # tl.dot needs 16 columns per group
    ],
)
def test_layout_by_capability_dtype_bits_zero_point_group(mma_passes, cfg, layout) -> None:
    assert wk.choose_kernels(cfg, frozenset()).layout == layout


def test_can_implement_says_why() -> None:
    ok, why = wk.TritonGemv.can_implement(_cfg(cuda=False).rows(1, 1))
    assert not ok and why == "needs a CUDA device"
    ok, why = wk.TritonGemv.can_implement(_cfg().rows(1, 17))
    assert not ok and why == "M up to 16 only"
    pytest.importorskip("triton")  # the MMA kernels' own reasons come after Triton's
    ok, why = wk.MmaGemv.can_implement(_cfg(capability=(8, 9), dtype=torch.float16).rows(1, 1))
    assert not ok and "bf16" in why


def test_triton_optional(monkeypatch) -> None:
    from pagoda import platform

    monkeypatch.setattr(platform, "triton_available", lambda: False)
    assert wk.TritonGemm.can_implement(_cfg()) == (False, "triton not installed")
    assert wk.MmaGemv.can_implement(_cfg().rows(1, 1)) == (False, "triton not installed")
    # PyTorch's int4 matmul where it can (4-bit, bf16, sm_80+), else dequant per call
    assert wk.choose_kernels(_cfg(), frozenset()).describe() == "torch_int4mm M=1.."
    assert wk.choose_kernels(_cfg(capability=(8, 7), zp=True), frozenset()).layout == "int4pack"
    for cfg in (_cfg(bits=8), _cfg(dtype=torch.float16), _cfg(capability=(7, 5)), _cfg(group=16)):
        assert wk.choose_kernels(cfg, frozenset()).layout == "dequant"


def test_disabled_kernels_env(monkeypatch) -> None:
    assert set(wk.KERNEL_NAMES) <= set(envs.KERNEL_NAMES)
    monkeypatch.setenv("PAGODA_DISABLED_KERNELS", " mma_gemv , triton_gemm,")
    assert envs.disabled_kernels() == {"mma_gemv", "triton_gemm"}
    assert not envs.kernel_enabled("mma_gemv") and envs.kernel_enabled("dense_gemv")
    monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "mma_gemv,tinygemm")
    known = "known: mma_wgmma_tma, mma_gemv"
    with pytest.raises(ValueError, match=f"unknown kernel.* tinygemm; {known}"):
        envs.disabled_kernels()
    monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "torch_dequant")
    with pytest.raises(ValueError, match="no quantized-linear kernel can run N=48 K=64"):
        wk.choose_kernels(_cfg(n=48, k=64, cuda=False))


def _weights(n, k, group, zp, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g).to(torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    z = torch.randint(-8, 8, scale.shape, generator=g).to(torch.int16) if zp else None
    return q, scale, z


def _layer(n, k, group, dtype, bits=4):
    from torch import nn

    layer = nn.Module()
    layer.out_features, layer.in_features = n, k
    layer.wna16_group_size, layer.wna16_bits, layer.params_dtype = group, bits, dtype
    layer.input_perm = None
    return layer


def test_packed_layout_kernels_interpreter(monkeypatch) -> None:
    """Each Triton kernel of the packed layout (fp32: the interpreter's bf16 tl.dot is broken)
    gives the reference on its rows, with zero points and a fused bias."""
    pytest.importorskip("triton")
    from pagoda.layers.quantized_linear import WNA16LinearMethod
    from pagoda.quant.weights import WeightQuantArgs

    n, k, group = 64, 256, 64
    q, scale, zp = _weights(n, k, group, True, seed=3)
    layer = _layer(n, k, group, torch.float32)
    wk.TritonGemv.prepare(layer, UnpackedWeight(q, scale, zp, None))
    bias = torch.randn(n)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(1))
    ref = wna16_linear_ref(x, q, scale, zp, group, bias=bias)
    method = WNA16LinearMethod(WeightQuantArgs(4, False, group))
    for entries, m in (
        (((16, wk.TritonGemv), (None, wk.TritonDequantCublas)), 16),
        (((16, wk.TritonGemv), (None, wk.TritonDequantCublas)), 17),
        (((None, wk.TritonGemm),), 20),
    ):
        layer.wna16_kernels = wk.KernelTable("triton", entries)
        y = method.apply(layer, x[:m], bias)
        torch.testing.assert_close(y, ref[:m], rtol=1e-4, atol=1e-4)
    w = wk.dense_weight(layer, torch.float32)
    torch.testing.assert_close(w, dequantize_weight(q, scale, zp, group), rtol=0, atol=0)


@pytest.mark.parametrize("zp", [False, True])
def test_mma_layout_kernels_interpreter(zp) -> None:
    """The tensor-core layout's GEMV (1 and 2 blocks of 8 rows), GEMM and
    dequant + matmul, run by the interpreter through a hand-made table (the registry picks
    them on CUDA only), with and without zero points."""
    pytest.importorskip("triton")
    from pagoda.layers.quantized_linear import WNA16LinearMethod
    from pagoda.quant.weights import WeightQuantArgs

    n, k, group = 32, 256, 64
    q, scale, z = _weights(n, k, group, zp, seed=2)
    scale = scale.bfloat16()
    layer = _layer(n, k, group, torch.bfloat16)
    wk.MmaGemv.prepare(layer, UnpackedWeight(q, scale, z, None))
    middle = ((18, wk.MmaGemm),)
    layer.wna16_kernels = wk.KernelTable(
        "mma", ((16, wk.MmaGemv), *middle, (None, wk.MmaDequantCublas))
    )
    expect = dequantize_weight(q, scale, z, group, None, torch.bfloat16)
    assert torch.equal(wk.dense_weight(layer, torch.bfloat16), expect)
    bias = torch.randn(n).bfloat16()
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = wna16_linear_ref(x.float(), q, scale.float(), z, group, bias=bias.float())
    tol = 2.0**-6 * ref.abs().max().item()
    method = WNA16LinearMethod(WeightQuantArgs(4, True, group))
    for m in (1, 9, 16, 17, 20):
        assert (method.apply(layer, x[:m], bias).float() - ref[:m]).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("inp,out", [(1024, 512), (1024, 16384)])
def test_every_cuda_path_of_a_layer_gpu(monkeypatch, inp, out) -> None:
    """On the GPU: the default table (on an H200 with both wgmma GEMMs; 16384 output columns
    take the TMA GEMM at 17-512 rows), the sm_80-89 dispatch (the wgmma GEMMs disabled) and the
    packed layout (MMA disabled) give the reference at every M band of their tables."""
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantized_linear import WNA16LinearMethod
    from pagoda.quant.packing import pack_to_int32
    from pagoda.quant.weights import WeightQuantArgs

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (out, inp), generator=g).to(torch.int8)
    scale = torch.rand(out, inp // 128, generator=g) * 0.02 + 0.001
    x = torch.randn(600, inp, generator=g)
    ref = wna16_linear_ref(x, q, scale.bfloat16().float(), None, 128)
    for disabled, layout in (
        ("", "mma"),
        ("mma_wgmma_tma,mma_wgmma", "mma"),
        ("mma_wgmma_tma,mma_wgmma,mma_gemv,mma_gemm,mma_dequant", "triton"),
    ):
        monkeypatch.setenv("PAGODA_DISABLED_KERNELS", disabled)
        method = WNA16LinearMethod(WeightQuantArgs(4, True, 128))
        with torch.device("cuda"):
            layer = ReplicatedLinear(inp, out, linear_method=method, dtype=torch.bfloat16)
        layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
        layer.weight_scale.data.copy_(scale)
        method.process_weights_after_loading(layer)
        table = layer.wna16_kernels.describe()
        assert layer.wna16_backend == layout, table
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert ("mma_wgmma_tma M=17..512" in table) == (hopper and not disabled and out > 8192)
        for m in (1, 7, 16, 17, 32, 33, 64, 65, 100, 300, 512, 513, 600):
            y = layer(x[:m].cuda().bfloat16())
            where = f"{table} M={m}"
            torch.testing.assert_close(
                y.float().cpu(), ref[:m], rtol=2e-2, atol=3e-2, msg=lambda e, w=where: f"{w}: {e}"
            )
