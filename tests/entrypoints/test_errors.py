"""Bad input gets a clear error naming the problem, at the offline API's edge."""

from __future__ import annotations

import json

import pytest

from pagoda import LLM, SamplingParams
from tests.helpers import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), skip_tokenizer_init=True, max_model_len=64, print_memory_report=False)


def test_prompt_longer_than_context_names_both_lengths(llm):
    with pytest.raises(ValueError, match=r"100 tokens.*64"):
        llm.generate([list(range(3, 103))], use_tqdm=False)


def test_max_tokens_beyond_the_context_is_an_error_not_a_silent_clamp(llm):
    # as the server's 400: the numbers, and what to change
    message = (
        r"^max_tokens=1000000000 does not fit: the prompt has 3 tokens and the context "
        r"\(max_model_len\) is 64, so at most 61 can be generated; lower max_tokens, pass "
        r"max_tokens=None \(up to the limit\), or raise max_model_len$"
    )
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10**9), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # exactly the room left is fine, and None runs up to the limit
    for max_tokens, n in ((61, 61), (None, 61)):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n


def test_bad_sampling_values_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], use_tqdm=False)
    with pytest.raises(TypeError, match="token ids must be integers"):
        llm.generate([[5, "x"]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[5, 6]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    # the engine is still usable afterwards
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_unknown_argument_and_architecture(tiny, tmp_path):
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(str(tiny), max_num_sequences=4)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    bad = tmp_path / "foo"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    for f in tiny.glob("*.safetensors"):
        (bad / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(bad), skip_tokenizer_init=True, print_memory_report=False)


def test_missing_and_corrupt_files(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(broken), skip_tokenizer_init=True, print_memory_report=False)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(broken), skip_tokenizer_init=True, print_memory_report=False)


def test_context_too_large_for_cache_is_explained(tiny):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(
            str(tiny),
            skip_tokenizer_init=True,
            max_model_len=512,
            num_gpu_blocks_override=4,
            print_memory_report=False,
        )


def test_bad_stop_ids_and_seed_rejected_and_engine_survives(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10**6], min_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
