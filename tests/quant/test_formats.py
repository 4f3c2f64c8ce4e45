"""Checkpoint formats end to end: llmcompressor's fixture, pagoda's output, legacy GPTQ, naive.

Oracles: the same model served unquantized with independently dequantized weights, and
transformers + compressed-tensors on the same directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.engine.args import EngineArgs
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import load_model
from pagoda.quantizer.api import quantize
from pagoda.quantizer.checkpoint import dequantized_state_dict
from tests.quant.conftest import FIXTURES

IDS = torch.tensor([5, 17, 99, 3, 250, 42, 7, 301, 11, 64, 128, 2, 77, 190, 33, 8])
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pagoda(model_dir: Path):
    _, config, *_ = EngineArgs(model=str(model_dir), dtype="float32", device="cpu").create_configs()
    return load_model(config, "cpu"), config


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def _dense_logits(config, state: dict[str, torch.Tensor]) -> torch.Tensor:
    dense = LlamaForCausalLM(config.hf_config).eval()
    dense.load_weights(state.items())
    return _logits(dense)


def _hf_logits(model_dir: Path) -> torch.Tensor:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(IDS[None]).logits[0].float()


@pytest.mark.parametrize("name", ["sym", "asym"])
def test_llmcompressor_checkpoint_matches_its_dequantized_weights(name: str) -> None:
    model_dir = FIXTURES / name
    model, config = _pagoda(model_dir)
    qc = config.quantization
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    ours = _logits(model)
    torch.testing.assert_close(
        ours, _dense_logits(config, dequantized_state_dict(model_dir)), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(ours, _hf_logits(model_dir), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scheme="W4A16", method="gptq", group_size=32),
        dict(scheme="W4A16_ASYM", method="rtn", group_size=64, dtype="bfloat16"),
        dict(scheme="W8A16", method="rtn", group_size=-1),
    ],
    ids=["w4a16-gptq-g32", "w4a16-asym-rtn-g64-bf16", "w8a16-rtn-channel"],
)
def test_pagoda_checkpoint_loads_in_transformers(tiny_llama, calib_text, tmp_path, kwargs):
    out = tmp_path / "q"
    dataset = calib_text if kwargs["method"] == "gptq" else None
    quantize(
        str(tiny_llama),
        out,
        dataset=dataset,
        num_samples=8,
        max_seq_len=48,
        progress=False,
        **kwargs,
    )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["num_bits"] in (4, 8)
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    assert tensors["model.layers.0.self_attn.q_proj.weight_shape"].tolist() == [64, 64]
    assert "lm_head.weight" in tensors and "model.layers.0.self_attn.q_proj.weight" not in tensors
    model, _ = _pagoda(out)
    ours = _logits(model)
    torch.testing.assert_close(ours, _hf_logits(out), rtol=2e-4, atol=2e-4)


def _write_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qc: dict) -> None:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit [R, C] -> int32 [R / 8, C], written out bit by bit (independent oracle)."""
    rows, cols = values.shape
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for i in range(rows):
        words[i // 8] |= values[i].to(torch.int64) << (4 * (i % 8))
    return (words - ((words >> 31) << 32)).to(torch.int32)


@pytest.mark.parametrize("desc_act", [False, True])
def test_legacy_gptq_v1_zero_point_off_by_one(tiny_llama, tmp_path, desc_act: bool) -> None:
    g = torch.Generator().manual_seed(0)
    state = load_file(tiny_llama / "model.safetensors")
    dense = dict(state)
    group = 32
    orders: dict[tuple, torch.Tensor] = {}
    for name in list(state):
        if not name.endswith(tuple(f"{p}.weight" for p in PROJ)):
            continue
        out, inp = state[name].shape
        ngroups = inp // group
        codes = torch.randint(0, 16, (inp, out), generator=g)  # unsigned, [in, out]
        stored_zero = torch.randint(0, 15, (ngroups, out), generator=g)
        scales = torch.rand(ngroups, out, generator=g) * 0.02 + 0.005
        if desc_act:  # act-order: each group's columns are scattered
            # q/k/v (and gate/up) read one input, so GPTQ gives them one order and one g_idx.
            key = (inp, "mlp" in name and "down_proj" not in name, "o_proj" in name)
            if key not in orders:
                orders[key] = torch.randperm(inp, generator=g).argsort() // group
            g_idx = orders[key].to(torch.int32)
        else:
            g_idx = (torch.arange(inp) // group).to(torch.int32)
        module = name.removesuffix(".weight")
        del state[name]
        state[f"{module}.qweight"] = _pack_rows(codes)
        state[f"{module}.qzeros"] = _pack_rows(stored_zero.t()).t().contiguous()
        state[f"{module}.scales"] = scales.to(torch.float16)
        state[f"{module}.g_idx"] = g_idx
        gi = g_idx.long()
        # AutoGPTQ v1: w = s * (u - (stored_zero + 1)).
        w = scales.half().float()[gi] * (codes - (stored_zero[gi] + 1))  # [in, out]
        dense[name] = w.t().contiguous()
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": desc_act,
        "sym": False,
        "checkpoint_format": "gptq",
    }
    _write_checkpoint(tiny_llama, tmp_path / "gptq", state, qc)
    model, config = _pagoda(tmp_path / "gptq")
    torch.testing.assert_close(_logits(model), _dense_logits(config, dense), rtol=1e-4, atol=1e-4)


def test_naive_quantized_int8(tiny_llama, tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    state = load_file(tiny_llama / "model.safetensors")
    dense = dict(state)
    for name in list(state):
        if name.endswith(tuple(f"{p}.weight" for p in PROJ)):
            out, _ = state[name].shape
            q = torch.randint(-128, 128, state[name].shape, generator=g).to(torch.int8)
            scale = torch.rand(out, 1, generator=g) * 1e-3 + 1e-4
            state[name] = q
            state[name.replace(".weight", ".weight_scale")] = scale
            dense[name] = q.float() * scale
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "naive-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    _write_checkpoint(tiny_llama, tmp_path / "naive", state, qc)
    model, config = _pagoda(tmp_path / "naive")
    torch.testing.assert_close(_logits(model), _dense_logits(config, dense), rtol=1e-4, atol=1e-4)
