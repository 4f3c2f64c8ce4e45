"""PyTorch's int4 matmul layout (`TorchInt4pack`): the conversion from compressed-tensors'
signed codes and zero points (and AutoAWQ's unsigned ones) to its (u - 8) * scale + zero form,
checked through the CPU build of the same kernel against `wna16_linear_ref`; the codes read
back exactly; on the GPU, the layer the registry builds without Triton."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.kernels.wna16.reference import wna16_linear_ref
from pagoda.layers import wna16_kernels as wk
from pagoda.quant.formats.autoawq import pack_awq_gemm, unpack_awq_gemm
from pagoda.quant.weights import UnpackedWeight

needs_cpu_int4 = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
    reason="this torch has no CPU int4 matmul",
)


def _layer(n: int, k: int, group: int) -> nn.Module:
    layer = nn.Module()
    layer.out_features, layer.in_features = n, k
    layer.wna16_group_size, layer.wna16_bits, layer.params_dtype = group, 4, torch.bfloat16
    layer.input_perm = None
    return layer


def _weights(n, k, group, zp, seed):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group >= k else k // group
    q = torch.randint(-8, 8, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).bfloat16()
    z = torch.randint(-8, 8, (n, groups), generator=g).to(torch.int16) if zp else None
    return q, scale, z


def test_conversion_math_is_the_checkpoints_formula() -> None:
    """The scales-and-zeros `int4pack_weight` makes turn the kernel's (u - 8) * scale + zero,
    u = q + 8, into the checkpoint's (q - zp) * scale: to within scale / 32 (zero = -zp * scale
    rounded once to bf16, |zp| <= 8), exactly when symmetric; per channel, the scale repeats."""
    n, k, group = 16, 128, 32
    u_minus_8 = torch.arange(-8, 8).repeat(n, k // 16)  # [N, K]: every code
    for zp in (True, False):
        q, scale, z = _weights(n, k, group, zp, seed=0)
        q = u_minus_8.to(torch.int8)
        _, sz = wk.int4pack_weight(q, scale, z, group, torch.bfloat16)
        assert sz.shape == (k // group, n, 2) and sz.dtype == torch.bfloat16
        s = sz[..., 0].t().float().repeat_interleave(group, 1)  # [N, K]
        zero = sz[..., 1].t().float().repeat_interleave(group, 1)
        got = u_minus_8.float() * s + zero
        zpk = 0 if z is None else z.float().repeat_interleave(group, 1)
        want = (q.float() - zpk) * scale.float().repeat_interleave(group, 1)
        assert torch.equal(s, scale.float().repeat_interleave(group, 1))
        if zp:
            assert ((got - want).abs() <= s / 32).all() and not torch.equal(zero, 0 * zero)
        else:
            assert torch.equal(got, want)
    q, scale, z = _weights(n, k, k, True, seed=1)  # per channel: [N, 1] scale
    _, sz = wk.int4pack_weight(q, scale, z, 128, torch.bfloat16)
    assert torch.equal(sz[0, :, 0], scale[:, 0])
    assert torch.equal(sz[0, :, 1], (-z[:, 0].float() * scale[:, 0].float()).bfloat16())


@needs_cpu_int4
@pytest.mark.parametrize(
    ("n", "k", "group", "zp"),
    [
        (64, 256, 32, False),
        (64, 256, 64, True),
        (32, 384, 128, True),  # K = 3 tiles of 128: 8 inner K tiles
        (32, 512, 256, False),
        (48, 512, 512, True),  # per channel: the scale repeated over groups of 256
        (32, 96, 32, True),  # K % 64 != 0: 2 inner K tiles
    ],
)
def test_cpu_kernel_matches_the_reference(n, k, group, zp) -> None:
    q, scale, z = _weights(n, k, group, zp, seed=n + k + group)
    layer = _layer(n, k, group)
    wk.TorchInt4pack.prepare(layer, UnpackedWeight(q, scale, z, None))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = wna16_linear_ref(x.float(), q, scale.float(), z, group)
    y, bias_added = wk.TorchInt4pack.apply(layer, x, None)
    assert y.dtype == torch.bfloat16 and not bias_added
    # bf16 output rounding (2^-8 relative) plus the zero's rounding (scale / 32 a weight)
    tol = 2.0**-7 * ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol
    # the codes, scales and zero points read back exactly
    q2, s2, z2 = wk.TorchInt4pack.dequantize(layer)
    assert torch.equal(q2, q) and torch.equal(s2, scale.float())
    assert (z2 is None) if z is None else torch.equal(z2, z.float())
    w = wk.dense_weight(_with_table(layer), torch.float32)
    expect = q.float().view(n, -1, min(group, k)) - (0 if z is None else z.float()[..., None])
    expect = (expect * scale.float()[..., None]).view(n, k)
    torch.testing.assert_close(w, expect, rtol=0, atol=0)


def _with_table(layer: nn.Module) -> nn.Module:
    layer.wna16_kernels = wk.KernelTable("int4pack", ((None, wk.TorchInt4pack),))
    return layer


@needs_cpu_int4
def test_autoawq_checkpoint_through_int4pack() -> None:
    """AutoAWQ's unsigned codes u and zeros z (w = (u - z) * s), packed in its own order and
    unpacked as the loader does, give (u - z) * s through the int4 matmul."""
    n, k, group = 64, 256, 128
    g = torch.Generator().manual_seed(5)
    u = torch.randint(0, 16, (n, k), generator=g)
    zu = torch.randint(0, 16, (n, k // group), generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half()
    qweight, qzeros, scales = pack_awq_gemm((u - 8).to(torch.int8), s, (zu - 8).to(torch.int16))
    codes, scale, zeros = unpack_awq_gemm(qweight, qzeros, scales)
    layer = _layer(n, k, group)
    wk.TorchInt4pack.prepare(layer, UnpackedWeight(codes, scale.bfloat16(), zeros, None))
    x = torch.randn(3, k, generator=g).bfloat16()
    w = ((u - zu.repeat_interleave(group, 1)).float() * s.bfloat16().float().repeat_interleave(
        group, 1
    ))  # fmt: skip
    ref = x.float() @ w.t()
    y, _ = wk.TorchInt4pack.apply(layer, x, None)
    assert (y.float() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("zp", [False, True])
def test_registry_layer_without_triton_gpu(monkeypatch, zp) -> None:
    """On CUDA with Triton hidden the registry gives a W4A16 layer PyTorch's int4 matmul, which
    gives the reference at every M (decode to prefill)."""
    from pagoda import platform
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantized_linear import WNA16LinearMethod
    from pagoda.quant.packing import pack_to_int32
    from pagoda.quant.weights import WeightQuantArgs

    monkeypatch.setattr(platform, "triton_available", lambda: False)
    inp, out, group = 2048, 2560, 128
    q, scale, z = _weights(out, inp, group, zp, seed=7)
    method = WNA16LinearMethod(WeightQuantArgs(4, True, group))
    with torch.device("cuda"):
        layer = ReplicatedLinear(inp, out, linear_method=method, dtype=torch.bfloat16)
    if zp:  # compressed-tensors' asymmetric params are another test's business: repack directly
        wk.TorchInt4pack.prepare(layer, UnpackedWeight(q.cuda(), scale.cuda(), z.cuda(), None))
        cfg = wk.kernel_config(layer, 4, True, torch.device("cuda"))
        layer.wna16_kernels = wk.choose_kernels(cfg, frozenset())
    else:  # the loader's path: checkpoint params, then process_weights_after_loading
        layer.weight_packed.data.copy_(pack_to_int32(q, 4, 1))
        layer.weight_scale.data.copy_(scale)
        method.process_weights_after_loading(layer)
        assert layer.wna16_backend == "int4pack"
    assert layer.wna16_kernels.describe() == "torch_int4mm M=1.."
    x = torch.randn(600, inp, generator=torch.Generator().manual_seed(2))
    ref = wna16_linear_ref(x, q, scale.float(), z, group)
    for m in (1, 4, 16, 64, 600):
        y = layer(x[:m].cuda().bfloat16()).float().cpu()
        assert (y - ref[:m]).abs().max().item() <= 2.0**-7 * ref[:m].abs().max().item(), m
