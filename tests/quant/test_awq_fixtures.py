"""AutoAWQ's own checkpoints (tests/fixtures/autoawq-tiny) served by pagoda (issue 17, acc. 1).

Oracles: transformers in float32 on the weights dequantized here by an independent reading of
the AutoAWQ GEMM layout (a wrong nibble order must fail it), and the logits AutoAWQ's own
quantized model produced (`reference/logits.safetensors`). The seed document's vLLM script
runs unchanged but for `from vllm` -> `from pagoda` and the model path.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


def _pagoda_model(model_dir: Path, quantization: str | None):
    from pagoda.engine.args import EngineArgs
    from pagoda.models.loader import load_model

    args = EngineArgs(
        model=str(model_dir), dtype="float32", device="cpu", quantization=quantization
    )
    _, config, *_ = args.create_configs()
    return load_model(config, "cpu")


@pytest.mark.parametrize("arch", ARCHS)
def test_pagoda_serves_autoawq_checkpoint(arch: str) -> None:
    from pagoda.models.registry import SUPPORTED_ARCHITECTURES

    model_dir = AWQ_FIXTURES / arch
    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        pytest.skip(f"{architecture} is not a pagoda architecture in this tree")
    reference = load_file(model_dir / "reference" / "logits.safetensors")
    hf = _hf_model(model_dir, _dequantized(model_dir, (0, 2, 4, 6, 1, 3, 5, 7)))
    for quantization in ("AWQ", None):  # as the seed script asks, and auto-detected
        model = _pagoda_model(model_dir, quantization)
        for i in range(5):
            ids = reference[f"prompt{i}.input_ids"]
            with torch.no_grad():
                ours = model.compute_logits(model(ids, torch.arange(len(ids))))
                torch.testing.assert_close(ours, hf(ids[None]).logits[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(
                ours, reference[f"prompt{i}.logits"], atol=LOGIT_ATOL, rtol=0
            )


SEED_SCRIPT = """
from pagoda import LLM, SamplingParams
# Sample prompts.
prompts = [
"Hello, my name is",
"The president of the United States is",
"The capital of France is",
"The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
# Create an LLM.
llm = LLM(model=MODEL, quantization="AWQ")
# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


def test_seed_script_runs_on_autoawq_llama(tmp_path) -> None:
    """The second seed document's script (its indentation restored), on AutoAWQ's Llama."""
    script = tmp_path / "seed.py"
    model = AWQ_FIXTURES / "llama"
    script.write_text(f"MODEL = {str(model)!r}\n" + SEED_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 4
    for line, prompt in zip(lines, SEED_PROMPTS):
        head = f"Prompt: {prompt!r}, Generated text: "
        assert line.startswith(head)
        assert ast.literal_eval(line[len(head) :])  # a non-empty generated string
