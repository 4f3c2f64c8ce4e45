"""pagoda serves the checkpoints AutoAWQ 0.2.9 itself wrote (tests/fixtures/autoawq-tiny):
logits against transformers on the weights dequantized by an independent reading of the layout
(float32, tight) and against AutoAWQ's own float16 logits; the seed document's script runs."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from safetensors.torch import load_file

from pagoda.engine.args import EngineArgs
from pagoda.models.loader import load_model
from pagoda.models.registry import SUPPORTED_ARCHITECTURES
from tests.quant.test_awq_fixtures import AWQ_FIXTURES, LOGIT_ATOL, _dequantized, _hf_model

ARCHS = [
    "llama",
    "qwen2",
    pytest.param(
        "mistral",
        marks=pytest.mark.skipif(
            "MistralForCausalLM" not in SUPPORTED_ARCHITECTURES, reason="no Mistral class yet"
        ),
    ),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_pagoda_on_autoawq_fixture(arch: str) -> None:
    model_dir = AWQ_FIXTURES / arch
    args = EngineArgs(model=str(model_dir), dtype="float32", device="cpu", quantization="awq")
    _, config, *_ = args.create_configs()
    model = load_model(config, "cpu")
    assert model.model.layers[0].mlp.gate_up_proj.zeros is not None  # AWQ zero points kept
    hf = _hf_model(model_dir, _dequantized(model_dir, (0, 2, 4, 6, 1, 3, 5, 7)))
    reference = load_file(model_dir / "reference" / "logits.safetensors")
    for i in range(5):  # prompt 4 is longer than Mistral's window
        ids = reference[f"prompt{i}.input_ids"]
        with torch.no_grad():
            ours = model.compute_logits(model(ids, torch.arange(len(ids))))
            theirs = hf(ids[None]).logits[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours, reference[f"prompt{i}.logits"], rtol=0, atol=LOGIT_ATOL)


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


def test_seed_script_runs_on_autoawq_llama() -> None:
    """The second seed document's script with `from vllm` -> `from pagoda` (the model path is
    the fixture instead of the Hub name): four prompts, four generations."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(SEED_SCRIPT, {"MODEL": str(AWQ_FIXTURES / "llama")})  # noqa: S102
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: '")
    assert all(len(line) > len("Prompt: '', Generated text: ''") + 10 for line in lines)


def test_cli_quantization_flag(capsys) -> None:
    from pagoda.entrypoints.cli import main

    model = str(AWQ_FIXTURES / "llama")
    argv = ["generate", "--model", model, "--device", "cpu", "--max-tokens", "3", "Hello"]
    assert main([*argv, "--quantization", "AWQ"]) == 0
    assert main([*argv, "--quantization", "gptq"]) == 2
    err = capsys.readouterr().err
    assert "error: quantization='gptq' was requested but the checkpoint is 'awq'" in err
    assert "Traceback" not in err
