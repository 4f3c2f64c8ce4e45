"""Speculative decoding with a Qwen2.5-VL target: greedy output equals plain output.

The tiny random Qwen2.5-VL of test_qwen2_5_vl.py, prompts with no, one and two images: drafts
(n-gram, or a text-only draft model on 1-D positions over the token ids) are verified on text
positions (M-RoPE position + the prompt's delta) while the prompt keeps its image embeddings and
3-D positions.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pagoda import SamplingParams
from tests.models.test_qwen2_5_vl import (  # noqa: F401
    CASES,
    TEXT_CONFIG,
    _conversation,
    _llm,
    tiny_vl,
)

# adaptive off: these tests check speculation itself on every step (the governor may skip it)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}


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


@pytest.mark.gpu
def test_gpu_speculative_greedy_equals_plain_with_images(tiny_vl):  # noqa: F811
    """On the GPU: decode and verify steps replay CUDA graphs (the fused verify attention
    rotates the drafts' keys at their M-RoPE text positions). float32: in bf16 a verify
    step's dense layers (cuBLAS, 1 + k rows) round differently from a decode step's GEMV (one
    row), so near-ties of this random model may break the other way (BENCHMARKS.md)."""
    dtype = "float32"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, _ = tiny_vl
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    convs = [_conversation(keys) for keys in CASES.values()]
    opts = dict(limit_mm_per_prompt={"image": 2}, device="cuda", dtype=dtype)
    opts.update(gpu_memory_utilization=0.2, enable_prefix_caching=False)
    plain_llm = _llm(path, **opts)
    plain = plain_llm.chat(convs, params, use_tqdm=False)
    plain_llm.shutdown()
    llm = _llm(path, speculative_config=NGRAM, **opts)
    assert llm.llm_engine.core.runner.verify_graph_runner is not None
    # the target's own greedy continuation as the drafts: every draft checks one more token
    reference = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain}

    class Replay:
        def propose(self, token_ids, k=None, state=None):
            for prompt, cont in reference.items():
                if tuple(token_ids[: len(prompt)]) == prompt:
                    done = len(token_ids) - len(prompt)
                    return cont[done : done + 4]
            return []

    llm.llm_engine.core.proposer = Replay()
    spec = llm.chat(convs, params, use_tqdm=False)
    for name, a, b in zip(CASES, plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in spec)
    assert accepted > 0.8 * sum(o.metrics.spec_num_draft_tokens for o in spec)
    llm.shutdown()


def _text_draft(vl_model, path) -> str:
    """The VL model's own language model saved as a text-only Qwen2: a draft that reads image
    placeholder ids as text with 1-D positions (so it is right on text, guesses after images)."""
    from transformers import Qwen2Config

    text = vl_model.config.text_config
    config = Qwen2Config(
        **{k: v for k, v in TEXT_CONFIG.items() if k != "rope_parameters"},
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        architectures=["Qwen2ForCausalLM"],
    )
    config.save_pretrained(path)
    prefix = "model.language_model."
    weights = {
        "model." + k.removeprefix(prefix): v.contiguous()
        for k, v in vl_model.state_dict().items()
        if k.startswith(prefix)
    }
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def test_text_draft_greedy_equals_plain_with_images(tiny_vl, tmp_path):  # noqa: F811
    path, vl_model = tiny_vl
    draft = _text_draft(vl_model, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    convs = [_conversation(keys) for keys in CASES.values()]
    plain = _llm(path, limit_mm_per_prompt={"image": 2}).chat(convs, params, use_tqdm=False)
    spec_config = {"model": draft, "num_speculative_tokens": 3, "adaptive": False}
    llm = _llm(path, limit_mm_per_prompt={"image": 2}, speculative_config=spec_config)
    spec = llm.chat(convs, params, use_tqdm=False)
    for name, a, b in zip(CASES, plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
    drafted = sum(o.metrics.spec_num_draft_tokens for o in spec)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in spec)
    assert 0 < accepted <= drafted
    runner = llm.llm_engine.core.runner.encoder_runner
    assert not runner.cache and not runner.users and not runner.held  # nothing leaks
