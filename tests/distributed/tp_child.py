"""Runs one tensor-parallel scenario in its own process, for tests/distributed (which bound it
with a timeout, so a hang fails the test instead of stalling the suite). Prints one JSON line.

usage: python tp_child.py compare MODEL SIZES...   greedy tokens + top logprobs per size
       python tp_child.py vl MODEL SIZES...        the same, chat with an image (Qwen2.5-VL)
       python tp_child.py kill MODEL SIZE          kill rank 1 between two generate calls
"""

from __future__ import annotations

import json
import sys
import time

from pagoda import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9]}, {"prompt_token_ids": [5, 6, 7, 8, 100, 200, 11]}]


def _llm(model: str | None, tp: int, **kwargs) -> LLM:
    options = dict(
        kv_cache_memory=32 << 20,
        max_model_len=256,
        print_memory_report=False,
        skip_tokenizer_init=True,
    )
    options.update(kwargs)
    return LLM(model, tensor_parallel_size=tp, **options)


def compare(model: str | None, sizes: list[int], lora: str | None) -> dict:
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    out: dict = {}
    for tp in sizes:
        kwargs = {"enable_lora": True, "max_lora_rank": 8} if lora else {}
        with _llm(model, tp, **kwargs) as llm:
            lora_request = None
            if lora:
                from pagoda.lora.request import LoRARequest

                lora_request = LoRARequest("adapter", 1, lora)
            res = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=lora_request)
        out[str(tp)] = [
            {
                "tokens": list(r.outputs[0].token_ids),
                "logprobs": [
                    {str(k): v.logprob for k, v in lp.items()} for lp in r.outputs[0].logprobs
                ],
            }
            for r in res
        ]
    return out


def vision_language(model: str, sizes: list[int]) -> dict:
    """Chat with an image (the vision tower replicated, the decoder split) and without."""
    from tests.models.test_qwen2_5_vl import _conversation

    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    out: dict = {}
    for tp in sizes:
        with _llm(
            model, tp, limit_mm_per_prompt={"image": 2}, block_size=8, skip_tokenizer_init=False
        ) as llm:
            res = llm.chat([_conversation(["a"]), _conversation([])], sp, use_tqdm=False)
        out[str(tp)] = [
            {
                "tokens": list(r.outputs[0].token_ids),
                "logprobs": [
                    {str(k): v.logprob for k, v in lp.items()} for lp in r.outputs[0].logprobs
                ],
            }
            for r in res
        ]
    return out


def kill(model: str | None, tp: int) -> dict:
    sp = SamplingParams(max_tokens=4, temperature=0)
    llm = _llm(model, tp)
    first = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    executor = llm.llm_engine.core.runner
    victim = executor._ranks[0].process
    victim.kill()
    victim.wait(10)
    t0 = time.monotonic()
    try:
        llm.generate(PROMPTS[:1], sp, use_tqdm=False)
        error = None
    except Exception as e:  # the test checks the type and message
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    llm.shutdown()
    alive = [r.alive() for r in executor._ranks]
    return {"first": list(first), "error": error, "seconds": seconds, "alive": alive}


if __name__ == "__main__":
    mode, model = sys.argv[1], sys.argv[2]
    model = None if model == "default" else model
    if mode == "vl":
        result = vision_language(model, [int(a) for a in sys.argv[3:]])
    elif mode == "compare":
        sizes = [int(a) for a in sys.argv[3:] if not a.startswith("--lora=")]
        lora = next((a[7:] for a in sys.argv[3:] if a.startswith("--lora=")), None)
        result = compare(model, sizes, lora)
    else:
        result = kill(model, int(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
