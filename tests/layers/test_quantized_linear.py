"""WNA16LinearMethod: every checkpoint layout and backend against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.wna16.reference import wna16_linear_ref
from pagoda.layers.linear import QKVLinear, ReplicatedLinear, UnquantizedLinearMethod
from pagoda.layers.quantized_linear import (
    WeightQuantArgs,
    WNA16LinearMethod,
    make_linear_method_factory,
)
from pagoda.quant.packing import pack_to_int32


def _codes(out: int, inp: int, bits: int, groups: int, asym: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (out, inp), generator=g).to(torch.int8)
    scale = torch.rand(out, groups, generator=g) * 0.02 + 0.001
    zp = torch.randint(lo, hi, (out, groups), generator=g).to(torch.int8) if asym else None
    return q, scale, zp


@pytest.mark.parametrize(
    "bits,group,asym,backend",
    [
        (4, 32, False, "dequant"),
        (4, 64, True, "dequant"),
        (4, -1, False, "dequant"),
        (8, 32, True, "dequant"),
        (8, -1, False, "dequant"),
    ],
)
def test_pack_quantized_layer_matches_reference(bits, group, asym, backend) -> None:
    inp, out = 128, 48
    gs = inp if group == -1 else group
    q, scale, zp = _codes(out, inp, bits, inp // gs, asym)
    method = WNA16LinearMethod(WeightQuantArgs(bits, not asym, group), "pack-quantized")
    layer = ReplicatedLinear(inp, out, bias=True, linear_method=method, prefix="l")
    layer.weight_loader(layer.weight_packed, pack_to_int32(q, bits, 1))
    layer.weight_loader(layer.weight_scale, scale)
    if asym:
        layer.weight_loader(layer.weight_zero_point, pack_to_int32(zp, bits, 0))
    layer.bias.data.normal_()
    method.process_weights_after_loading(layer)
    assert layer.wna16_backend == backend
    x = torch.randn(5, inp)
    ref = wna16_linear_ref(x, q, scale, zp, gs, bias=layer.bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)
    w_ref = wna16_linear_ref(torch.eye(inp), q, scale, zp, gs).t()
    torch.testing.assert_close(method.dequantized_weight(layer), w_ref, rtol=1e-5, atol=1e-5)


def test_fused_qkv_loads_shards_and_group_act_order() -> None:
    # Three HF modules land in one fused layer; a g_idx (act-order "group") is honoured.
    inp, group = 64, 16
    args = WeightQuantArgs(4, False, group, "group")
    layer = QKVLinear(inp, 16, 2, 1, linear_method=WNA16LinearMethod(args), prefix="qkv")
    g_idx = torch.randperm(inp, generator=torch.Generator().manual_seed(3)) // group
    refs, x = [], torch.randn(3, inp)
    for i, shard in enumerate("qkv"):
        out = 32 if shard == "q" else 16
        q, scale, zp = _codes(out, inp, 4, inp // group, True, seed=i)
        layer.weight_loader(layer.weight_packed, pack_to_int32(q, 4, 1), shard)
        layer.weight_loader(layer.weight_scale, scale, shard)
        layer.weight_loader(layer.weight_zero_point, pack_to_int32(zp, 4, 0), shard)
        layer.weight_loader(layer.weight_shape, torch.tensor([out, inp]), shard)
        layer.weight_loader(layer.weight_g_idx, g_idx.to(torch.int32), shard)
        refs.append(wna16_linear_ref(x, q, scale, zp, group, g_idx))
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.input_perm is not None
    torch.testing.assert_close(layer(x), torch.cat(refs, dim=1), rtol=1e-4, atol=1e-4)


def test_factory_ignores_lm_head_and_patterns() -> None:
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                },
            }
        },
        "ignore": ["lm_head", "re:.*mlp\\.down_proj$"],
    }
    factory = make_linear_method_factory(qc, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert isinstance(factory("model.layers.0.self_attn.qkv_proj"), WNA16LinearMethod)
    assert isinstance(factory("model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
    qc["ignore"] = ["model.layers.0.self_attn.k_proj"]
    with pytest.raises(ValueError, match="quantized differently"):
        make_linear_method_factory(qc, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})(
            "model.layers.0.self_attn.qkv_proj"
        )
    with pytest.raises(NotImplementedError, match="supported: pack-quantized, naive-quantized"):
        make_linear_method_factory({**qc, "format": "marlin-24"}, {})("x")
