"""Speculative decoding (n-gram) with a Qwen2.5-VL target: greedy output equals plain output.

The tiny random Qwen2.5-VL of test_qwen2_5_vl.py, prompts with no, one and two images: drafts
are verified on text positions (M-RoPE position + the prompt's delta) while the prompt keeps its
image embeddings and 3-D positions.
"""

from __future__ import annotations

from pagoda import SamplingParams
from tests.models.test_qwen2_5_vl import CASES, _conversation, _llm, tiny_vl  # noqa: F401

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_speculative_greedy_equals_plain_with_images(tiny_vl):  # noqa: F811
    path, _ = tiny_vl
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    convs = [_conversation(keys) for keys in CASES.values()]
    plain = _llm(path, limit_mm_per_prompt={"image": 2}).chat(convs, params, use_tqdm=False)
    llm = _llm(path, limit_mm_per_prompt={"image": 2}, speculative_config=NGRAM)
    spec = llm.chat(convs, params, use_tqdm=False)
    for name, a, b in zip(CASES, plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for t in la:
                assert abs(lb[t].logprob - la[t].logprob) < 1e-3, name
    # Drafts were verified on text positions after the images (this random model accepts
    # few or none: the rejected ones test the rows' M-RoPE positions as much).
    assert sum(o.metrics.spec_num_draft_tokens for o in spec) > 0, "no draft was verified"
    runner = llm.llm_engine.core.runner.encoder_runner
    assert not runner.cache and not runner.users and not runner.held  # nothing leaks
