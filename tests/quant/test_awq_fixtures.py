"""The AutoAWQ fixtures (tests/fixtures/autoawq-tiny) are what they claim to be.

Each checkpoint, dequantized here by an independent reading of the AutoAWQ GEMM layout and run
by transformers in float32, must give the logits AutoAWQ's own quantized model produced
(`reference/logits.safetensors`); a wrong nibble order must not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

AWQ_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "autoawq-tiny"
ARCHS = ("llama", "qwen2", "mistral")
SEED_PROMPTS = (
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
)
# AutoAWQ computes in float16: its logits (|x| <= 8) carry a few float16 ulps (2^-8 there) of
# rounding from the dequantized weights and each matmul; 0.06 is about 15 ulps.
LOGIT_ATOL = 0.06


def _unpack(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, n] int32 -> [rows, 8n]: nibble i of each word is column order[i] of its 8."""
    nibbles = (words.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF  # [rows, n, nibble]
    columns = torch.empty_like(nibbles)
    columns[..., list(order)] = nibbles
    return columns.reshape(words.shape[0], -1)


def _dequantized(model_dir: Path, order: tuple[int, ...]) -> dict[str, torch.Tensor]:
    group = json.loads((model_dir / "config.json").read_text())["quantization_config"]["group_size"]
    packed = load_file(model_dir / "model.safetensors")
    state = {}
    for name, t in packed.items():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            codes = _unpack(t, order).float()  # [in, out]
            zeros = _unpack(packed[prefix + ".qzeros"], order).float()  # [in / G, out]
            scales = packed[prefix + ".scales"].float()  # [in / G, out]
            w = (codes - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)
            state[prefix + ".weight"] = w.t().contiguous()  # [out, in]
        elif not name.endswith((".qzeros", ".scales")):
            state[name] = t.float()
    return state


def _hf_model(model_dir: Path, state: dict[str, torch.Tensor]):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_autoawq_fixture_matches_autoawq_logits(arch: str) -> None:
    model_dir = AWQ_FIXTURES / arch
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "bits": 4,
        "group_size": 128,
        "modules_to_not_convert": None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }
    reference = load_file(model_dir / "reference" / "logits.safetensors")
    good = _hf_model(model_dir, _dequantized(model_dir, (0, 2, 4, 6, 1, 3, 5, 7)))
    naive = _hf_model(model_dir, _dequantized(model_dir, tuple(range(8))))
    for i in range(5):
        ids = reference[f"prompt{i}.input_ids"]
        expected = reference[f"prompt{i}.logits"]
        with torch.no_grad():
            torch.testing.assert_close(good(ids[None]).logits[0], expected, atol=LOGIT_ATOL, rtol=0)
            assert (naive(ids[None]).logits[0] - expected).abs().max() > 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_autoawq_fixture_tokenizer_and_window(arch: str) -> None:
    from transformers import AutoTokenizer

    model_dir = AWQ_FIXTURES / arch
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = load_file(model_dir / "reference" / "logits.safetensors")
    for i, prompt in enumerate(SEED_PROMPTS):
        assert tokenizer.encode(prompt) == reference[f"prompt{i}.input_ids"].tolist()
    if arch == "mistral":  # the long prompt reaches past the window, which AutoAWQ honoured
        window = json.loads((model_dir / "config.json").read_text())["sliding_window"]
        assert window == 16 and len(reference["prompt4.input_ids"]) > 4 * window
