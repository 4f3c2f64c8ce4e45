"""Prompt log-probs against transformers' log_softmax of the same prompt (tiny random model).

Chunked prefill splits the prompt over several steps (each chunk computes its slice), a second
identical prompt would hit the prefix cache (a request with prompt_logprobs skips it), and
async scheduling and n > 1 give the same numbers.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.helpers import save_tiny_model

PROMPT = [5 + (i * 37) % 370 for i in range(37)]


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model("qwen2", tmp_path_factory.mktemp("plp"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]  # [L, V]
    return path, logits.float().log_softmax(-1)  # row p predicts token p + 1


def _check(prompt_logprobs, ref: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT)
    assert prompt_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        entry = prompt_logprobs[pos]
        row = ref[pos - 1]
        token = PROMPT[pos]
        # The prompt token itself, with its rank in the distribution.
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        # The top-k alternatives, ranks 1..k.
        top = row.topk(k)
        ranked = {lp.rank: (tid, lp.logprob) for tid, lp in entry.items() if tid != token}
        for r in range(1, k + 1):
            tid = top.indices[r - 1].item()
            if tid == token:
                assert entry[token].rank == r
                continue
            assert ranked[r][0] == tid
            assert ranked[r][1] == pytest.approx(top.values[r - 1].item(), abs=1e-4)
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize(
    "variant",
    [
        dict(max_num_batched_tokens=8),  # the prompt in 5 chunks
        dict(max_num_batched_tokens=8, async_scheduling=True),
        dict(max_num_batched_tokens=64, enable_prefix_caching=True),
    ],
    ids=["chunked", "chunked-async", "prefix-cache"],
)
def test_prompt_logprobs_match_transformers(model_and_reference, variant):
    path, ref = model_and_reference
    llm = LLM(
        str(path),
        device="cpu",
        skip_tokenizer_init=True,
        max_model_len=128,
        print_memory_report=False,
        **variant,
    )
    # A first request fills the prefix cache with the prompt's blocks.
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    _check(out.prompt_logprobs, ref, 3)
    assert out.num_cached_tokens == 0  # the cached prefix was recomputed for its logits
    # Greedy generation is unaffected.
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    if variant.get("enable_prefix_caching"):
        assert plain[0].num_cached_tokens == 32  # without prompt_logprobs it hits the cache
    # n > 1 and prompt_logprobs=0 (only the prompt token itself).
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=2, prompt_logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    _check(out.prompt_logprobs, ref, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert len(out.outputs) == 2


def test_prompt_logprobs_delta_stream_carries_them_once(model_and_reference):
    path, ref = model_and_reference
    llm = LLM(
        str(path),
        device="cpu",
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=16,
        print_memory_report=False,
    )
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    outs = list(llm.stream(PROMPT, params))
    with_lp = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_lp) == 1 and with_lp[0] is outs[0]
    _check(with_lp[0].prompt_logprobs, ref, 1)
