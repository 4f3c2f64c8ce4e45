"""Acceptance: Mistral's sliding window through the whole engine equals transformers.

Tiny random `MistralForCausalLM` models with windows of 8, 20 and 32 tokens (below, not a
multiple of, and a multiple of the 16-token block), prompts up to 5x longer than the window,
greedy continuations long enough to slide further. Variants: prefix caching on / off (two prompts
share a 40-token prefix, so a hit starts past the window and skips blocks out of it), chunked
prefill, preemption (a tiny KV pool), async scheduling. `sliding_window: null` is full attention.
The GPU test runs the same on CUDA with the Triton kernels and CUDA graphs.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.helpers import hf_greedy

MAX_NEW = 24
VOCAB = 384


def save_tiny_mistral(path: Path, sliding_window: int | None, seed: int = 0) -> Path:
    """A random HF Mistral saved to `path`; spread-out weights as in tests.helpers."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = MistralForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 47, 80)]
    prompts.append(shared + [rng.randrange(3, VOCAB) for _ in range(9)])
    prompts.append(shared + [rng.randrange(3, VOCAB) for _ in range(13)])
    return prompts


@pytest.fixture(scope="module", params=[8, 20, 32], ids=lambda w: f"window{w}")
def mistral(request, tmp_path_factory):
    window = request.param
    path = save_tiny_mistral(tmp_path_factory.mktemp(f"mistral{window}"), window, seed=window)
    prompts = _prompts(window)
    tokens, _ = hf_greedy(path, prompts, MAX_NEW)
    return window, path, prompts, tokens


ENGINE_VARIANTS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    # 8 usable blocks of 16 tokens: six sequences of 29-104 tokens cannot all stay resident
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128),
    "async": dict(async_scheduling=True),
    "async-chunked-preemption": dict(
        async_scheduling=True,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=9,
        max_model_len=128,
    ),  # fmt: skip
}


def _generate(path: Path, prompts, device: str = "cpu", **kwargs):
    llm = LLM(
        str(path),
        dtype="float32",
        device=device,
        skip_tokenizer_init=True,
        print_memory_report=False,
        **{"max_model_len": 256, **kwargs},
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(mistral, variant):
    window, path, prompts, ref_tokens = mistral
    llm, outs = _generate(path, prompts, **ENGINE_VARIANTS[variant])
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref_tokens[i], f"window {window}/{variant} prompt {i}"
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.sliding_window == window
    assert kv.num_free_blocks == kv.num_blocks - 1, "blocks leaked"
    if "preemption" in variant:
        assert llm.memory_report().num_blocks == 8
        assert llm.llm_engine.core.num_preemptions > 0
    if variant in ("default", "async"):
        # The second prompt sharing 40 tokens hit its first two full blocks (32 tokens); with
        # a window of 8 or 20 the first of them lies before its first query's window.
        assert max(o.num_cached_tokens for o in outs[4:]) == 32


def test_window_frees_blocks_during_decode(mistral):
    """A long decode holds only the blocks its window needs: 80 + 24 tokens over 16-token
    blocks is 7 blocks without a window, at most ceil((W - 1) / 16) + 1 (+1 while a step
    crosses a block edge) with it."""
    window, path, prompts, ref_tokens = mistral
    llm = LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True,
              print_memory_report=False, max_model_len=256)  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompts[3]}, params)
    kv = engine.core.kv_cache_manager
    held = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if "r" in kv._req_blocks:
            held.append(sum(1 for b in kv.get_block_ids("r") if b))
    assert tokens == ref_tokens[3]
    assert max(held[1:]) <= -(-(window - 1) // 16) + 2 < 7


def test_null_window_is_full_attention(tmp_path):
    """`sliding_window: null` equals transformers' full-attention Mistral; the same weights with
    a window give other tokens (the prompts are long enough for it to matter)."""
    path = save_tiny_mistral(tmp_path / "none", None, seed=8)
    prompts = _prompts(3)
    ref, _ = hf_greedy(path, prompts, MAX_NEW)
    llm, outs = _generate(path, prompts, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.llm_engine.core.kv_cache_manager.sliding_window is None
    windowed = save_tiny_mistral(tmp_path / "w8", 8, seed=8)
    _, outs8 = _generate(windowed, prompts)
    assert [o.outputs[0].token_ids for o in outs8] != ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("variant", ["default", "chunked-prefill", "preemption", "async"])
def test_gpu_greedy_matches_transformers(mistral, variant, enforce_eager):
    """The Triton kernels (paged attention for prefill / mixed steps, the fused decode kernel
    inside the captured graphs) with the window, float32 so greedy ties are not a question."""
    window, path, prompts, ref_tokens = mistral
    kwargs = dict(ENGINE_VARIANTS[variant])
    if variant == "async":
        kwargs.pop("async_scheduling")  # on by default with CUDA
    # max_num_seqs 8 (>= the 6 prompts): a few graph sizes to capture, not the default 15
    llm, outs = _generate(
        path, prompts, device="cuda", enforce_eager=enforce_eager, max_num_seqs=8, **kwargs
    )
    try:
        if not enforce_eager:
            assert llm.llm_engine.core.runner.graph_runner is not None
        for i, out in enumerate(outs):
            assert out.outputs[0].token_ids == ref_tokens[i], f"window {window}/{variant} {i}"
    finally:
        llm.shutdown()  # the next case's engine sizes its KV cache from what is free


def test_bad_window_in_config_is_one_clear_error(tmp_path, capsys):
    import json
    import shutil

    from pagoda.cli import main

    path = save_tiny_mistral(tmp_path, 8)
    # a tokenizer, so that the CLI gets as far as building the model
    tokenizer = Path(__file__).parents[1] / "fixtures" / "qwen2.5-tokenizer"
    for f in tokenizer.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.sliding_window must be null or an int >= 1"):
        LLM(str(path), device="cpu", skip_tokenizer_init=True, print_memory_report=False)
    assert main(["generate", "hi", "--model", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "config.sliding_window must be null or an int >= 1" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_mistral_7b_shapes_bf16(tmp_path, eager):
    """Mistral-7B's real heads / head size / vocabulary (benchmarks/configs/mistral-7b.json) with
    3 layers and a window of 64, bf16 on CUDA: prompts up to 300 tokens, prefix sharing and
    chunked prefill. Sequences may only part where the two logits tie up to bf16 rounding."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = Path(__file__).parents[2] / "benchmarks" / "configs" / "mistral-7b.json"
    data = json.loads(config_file.read_text())
    data.update(num_hidden_layers=3, sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    hf.save_pretrained(tmp_path)
    hf.eval()
    rng = random.Random(0)
    shared = [rng.randrange(3, 32000) for _ in range(100)]
    prompts = [[rng.randrange(3, 32000) for _ in range(n)] for n in (7, 100, 300, 65)]
    prompts += [shared + [5, 6, 7], shared + [8, 9]]
    ref, ref_logits = [], []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p], device="cuda"), max_new_tokens=80, do_sample=False,
                pad_token_id=0, eos_token_id=None, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        ref.append(out.sequences[0, len(p) :].tolist())
        ref_logits.append([s[0].float() for s in out.logits])
    del hf
    torch.cuda.empty_cache()
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
              enforce_eager=eager, skip_tokenizer_init=True, max_num_batched_tokens=128,
              max_num_seqs=8, print_memory_report=False)  # fmt: skip
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), use_tqdm=False
    )
    assert llm.llm_engine.core.kv_cache_manager.sliding_window == 64
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        g = o.outputs[0].token_ids
        if g == r:
            continue
        k = next(j for j in range(len(r)) if g[j] != r[j])
        logits = ref_logits[i][k]
        gap = (logits[r[k]] - logits[g[k]]).item()
        # Both sides round their logits to bf16 (pagoda's LM head too, layers/embedding.py):
        # each rounded value is within ulp / 2 of its exact value T, ulp(x) <= 2**-7 * |x|
        # (8 significant bits). With the same T on both sides, transformers' rounded gap is at
        # most (T_r - T_g) + ulp, and pagoda picking g means its rounded L_g >= L_r, so
        # T_r - T_g <= ulp: rounding alone allows a gap of 2 ulp <= 2**-6 * |L| (|L| in
        # [16, 32): ulp 0.125, gap 0.25). The 1e-3 is float32 noise in the comparison.
        top = max(abs(logits[r[k]].item()), abs(logits[g[k]].item()))
        assert gap <= 2**-6 * top + 1e-3, (i, k, gap, g, r)
