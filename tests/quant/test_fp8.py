"""FP8 W8A8 checkpoints: llmcompressor's float-quantized fixtures, pagoda quantize's output,
quantization at load, and the config errors.

Oracle: transformers + compressed-tensors on the same directory, which runs FP8 as
quantize-dequantize (per-token or static activation rounding, e4m3 weights times scales) in
float32. pagoda's W8A8 reference (`Fp8W8A8Reference`: the same e4m3 values, fp32 accumulation)
must match it up to float32 summation order: 1e-4 on logits of magnitude ~5 (fp32's 2^-24
relative step times sums over <= 128 products per layer, two layers, is ~1e-5). The CPU's
default kernel (W8A16: activations not rounded) must equal the dense model with the
dequantized weights to the same tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda.engine.args import EngineArgs
from pagoda.layers.fp8_linear import Fp8LinearMethod, Fp8W8A16, choose_fp8_kernels
from pagoda.layers.linear import LinearBase
from pagoda.models.loader import load_model
from pagoda.models.registry import get_model_class
from pagoda.quant.fp8 import Fp8Args, dequantize_weight_fp8
from pagoda.quant.scheme import parse_quantization_config
from pagoda.quantizer import quantize
from tests.quant.test_formats import _hf_logits, _logits

FP8_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmcompressor-tiny-fp8"
TOL = dict(rtol=1e-4, atol=1e-4)


def _load(model_dir: Path, **kwargs):
    _, config, *_ = EngineArgs(
        model=str(model_dir), dtype="float32", device="cpu", **kwargs
    ).create_configs()
    return load_model(config, "cpu"), config


def _fp8_layers(model) -> list[LinearBase]:
    return [
        m
        for m in model.modules()
        if isinstance(m, LinearBase) and isinstance(m.linear_method, Fp8LinearMethod)
    ]


def _use_reference(model) -> None:
    for layer in _fp8_layers(model):
        layer.linear_method.use_w8a8_reference(layer)


def _dequantized_state(model_dir: Path) -> dict[str, torch.Tensor]:
    raw = load_file(str(model_dir / "model.safetensors"))
    state = {}
    for name, t in raw.items():
        if name.endswith((".weight_scale", ".input_scale", ".k_scale", ".v_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = raw[name.removesuffix("weight") + "weight_scale"]
            t = dequantize_weight_fp8(t, scale)
        state[name] = t.float()
    return state


@pytest.mark.parametrize("name", ["dynamic", "static"])
def test_llmcompressor_fp8_checkpoint_matches_transformers(name: str) -> None:
    model_dir = FP8_FIXTURES / name
    model, config = _load(model_dir)
    layers = _fp8_layers(model)
    assert len(layers) == 8  # qkv, o, gate_up, down x 2 layers
    assert all(layer.fp8_backend == "dense" for layer in layers)  # the CPU runs W8A16
    # W8A16 on the CPU: the dense model with the dequantized weights
    dense = get_model_class(["Qwen2ForCausalLM"])(config.hf_config).eval()
    dense.load_weights(_dequantized_state(model_dir).items())
    torch.testing.assert_close(_logits(model), _logits(dense), **TOL)
    # W8A8 (what FP8 tensor cores compute): transformers' quantize-dequantize forward
    _use_reference(model)
    torch.testing.assert_close(_logits(model), _hf_logits(model_dir), **TOL)


def test_static_fixture_fused_scales_are_per_shard() -> None:
    model, _ = _load(FP8_FIXTURES / "static")
    raw = load_file(str(FP8_FIXTURES / "static" / "model.safetensors"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    want = torch.cat(
        [
            raw[f"model.layers.0.self_attn.{p}_proj.weight_scale"].float().expand(size)
            for p, size in zip("qkv", qkv.out_features_per_shard)
        ]
    )
    torch.testing.assert_close(qkv.fp8_scale, want, rtol=0, atol=0)
    inputs = [raw[f"model.layers.0.self_attn.{p}_proj.input_scale"].float() for p in "qkv"]
    assert qkv.input_scale.item() == max(s.item() for s in inputs)


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8"])
def test_pagoda_fp8_checkpoint_loads_in_transformers(tiny_llama, calib_text, tmp_path, scheme):
    out = tmp_path / scheme
    dataset = calib_text if scheme == "FP8" else None
    report = quantize(
        str(tiny_llama), out, scheme=scheme, dataset=dataset, max_seq_len=64, progress=False
    )
    assert report.method == "rtn" and report.scheme == scheme
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["type"] == "float"
    assert group["input_activations"]["dynamic"] is (scheme == "FP8_DYNAMIC")
    raw = load_file(str(out / "model.safetensors"))
    assert raw["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert ("model.layers.0.mlp.down_proj.input_scale" in raw) is (scheme == "FP8")
    model, _ = _load(out)
    _use_reference(model)
    torch.testing.assert_close(_logits(model), _hf_logits(out), **TOL)


def test_fp8_quantize_errors(tiny_llama, tmp_path) -> None:
    with pytest.raises(ValueError, match="static activation scales"):
        quantize(str(tiny_llama), tmp_path / "a", scheme="FP8", progress=False)
    with pytest.raises(ValueError, match="min-max"):
        quantize(str(tiny_llama), tmp_path / "b", scheme="FP8_DYNAMIC", method="gptq")


def test_quantization_fp8_quantizes_a_dense_checkpoint_at_load(tiny_llama) -> None:
    model, config = _load(tiny_llama, quantization="fp8")
    assert config.quantization["quant_method"] == "fp8"
    layers = _fp8_layers(model)
    assert len(layers) == 8 and model.lm_head.quantized is False
    dense, _ = _load(tiny_llama)
    for layer in layers:
        want = dense.get_submodule(layer.prefix).weight
        # per channel: |error| <= half an e4m3 step, 2^-4 of the value, + a subnormal step
        err = (layer.weight - want).abs()
        assert torch.all(err <= want.abs() * 2**-4 + layer.fp8_scale[:, None] * 2**-9)
        torch.testing.assert_close(
            layer.weight, dequantize_weight_fp8(layer.fp8_codes, layer.fp8_scale), **TOL
        )


def test_dummy_fp8_config(tmp_path) -> None:
    from tests.helpers import tiny_config

    path = tmp_path / "c.json"
    path.write_text(tiny_config("qwen2").to_json_string())
    model, config = _load(f"config:{path}:fp8")
    assert parse_quantization_config(config.quantization).groups[0][2] == "float-quantized"
    hidden = model(torch.tensor([1, 2, 3]), torch.arange(3))
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize(
    "group, match",
    [
        (
            {"weights": {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}},
            "strategy 'group'",
        ),
        (
            {
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                "input_activations": {"type": "float", "dynamic": True, "strategy": "tensor"},
            },
            "dynamic activations by 'tensor'",
        ),
        (
            {
                "format": "naive-quantized",
                "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
                "input_activations": {"type": "int", "dynamic": True, "strategy": "token"},
            },
            "int weights",
        ),
    ],
)
def test_unsupported_fp8_configs_name_the_problem(group, match) -> None:
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], **group}},
    }
    with pytest.raises(NotImplementedError, match=match):
        parse_quantization_config(qc)


def test_registry_picks_by_capability() -> None:
    pytest.importorskip("triton")  # the FP8 kernels need Triton; without it every table is dense
    from pagoda.layers.fp8_linear import (
        Fp8DequantMM,
        Fp8Gemm,
        Fp8GemmA8,
        Fp8Gemv,
        Fp8KernelConfig,
        Fp8ScaledMM,
    )

    def cfg(device, cap, acts="dynamic", n=4096, k=4096):
        return Fp8KernelConfig(device, cap, n, k, torch.bfloat16, acts)

    hopper = choose_fp8_kernels(cfg("cuda", (9, 0)))
    assert hopper.layout == "fp8" and hopper.pick(1) is Fp8Gemv
    # FP8 weights x bf16 rows while the weight bytes bound the layer, FP8 tensor cores beyond
    assert hopper.pick(2) is Fp8Gemm and hopper.pick(32) is Fp8Gemm
    # quantized activations through our FP8 x FP8 dot to 64 rows (128 on long layers),
    # cuBLASLt above
    assert hopper.pick(33) is Fp8GemmA8 and hopper.pick(64) is Fp8GemmA8
    assert hopper.pick(65) is Fp8ScaledMM
    wide = choose_fp8_kernels(cfg("cuda", (9, 0), n=22016))  # a gate_up: W8A8 from 17 rows
    assert wide.pick(16) is Fp8Gemm and wide.pick(17) is Fp8GemmA8
    assert wide.pick(64) is Fp8GemmA8 and wide.pick(65) is Fp8ScaledMM
    long = choose_fp8_kernels(cfg("cuda", (9, 0), n=2048, k=11008))  # a down_proj
    assert long.pick(128) is Fp8GemmA8 and long.pick(129) is Fp8ScaledMM
    ada = choose_fp8_kernels(cfg("cuda", (8, 9)))  # the RTX 4070: Triton converts e4m3 there
    assert ada.names == ("fp8_gemv", "fp8_gemm", "fp8_gemm_a8", "fp8_scaled_mm")
    assert ada.pick(1) is Fp8Gemv
    # No FP8 GEMM (Ampere / Orin: no FP8 tensor cores; a weight-only checkpoint): W8A16 with
    # the weight kept in FP8, decoded in the kernels to 128 rows, dequantized per call above
    for table in (
        choose_fp8_kernels(cfg("cuda", (8, 7))),
        choose_fp8_kernels(cfg("cuda", (8, 0))),
        choose_fp8_kernels(cfg("cuda", (9, 0), acts=None)),
    ):
        assert table.layout == "fp8"
        assert table.names == ("fp8_gemv", "fp8_gemm", "fp8_dequant_mm")
        assert table.pick(128) is Fp8Gemm and table.pick(129) is Fp8DequantMM
    assert any("no FP8 tensor cores" in r for r in choose_fp8_kernels(cfg("cuda", (8, 0))).reasons)
    for table in (
        choose_fp8_kernels(cfg("cpu", (0, 0))),
        choose_fp8_kernels(cfg("cuda", (7, 5))),  # Turing: the Triton kernels need sm_80
        choose_fp8_kernels(cfg("cuda", (9, 0), n=4100)),  # not a multiple of 16
    ):
        assert table.layout == "dense" and table.pick(64) is Fp8W8A16
    with pytest.raises(ValueError, match="FP8_DYNAMIC"):
        Fp8LinearMethod(Fp8Args("tensor", "static"), quantize_at_load=True)
