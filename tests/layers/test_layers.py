"""Shared layers against their Hugging Face counterparts and their own contracts.

RMSNorm and RoPE (default, linear, llama3) are compared with transformers' Llama modules;
fused linears are checked against separate projections; the Attention layer's paged path is
checked against its no-cache path, including padding rows (CUDA-graph style batches).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import Attention, AttentionMetadata
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.linear import (
    LinearMethod,
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    UnquantizedLinearMethod,
)
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, get_rope


def test_rmsnorm_matches_hf_with_and_without_residual() -> None:
    torch.manual_seed(0)
    ours, theirs = RMSNorm(32, eps=1e-5), LlamaRMSNorm(32, eps=1e-5)
    weight = 1 + 0.1 * torch.randn(32)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    torch.testing.assert_close(ours(x), theirs(x))
    out, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, theirs(x + residual))


def test_rmsnorm_bfloat16_normalises_in_float32() -> None:
    torch.manual_seed(0)
    ours, theirs = RMSNorm(64).to(torch.bfloat16), LlamaRMSNorm(64).to(torch.bfloat16)
    x = (100 * torch.randn(3, 64)).to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_matches_hf(case: str) -> None:
    heads, kv_heads, head_dim = 4, 2, 32
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rope_parameters=dict(ROPE_CASES[case]),
    )
    rope = get_rope(config, head_dim)
    assert rope.rope_type == case
    hf_rope = LlamaRotaryEmbedding(config)

    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 7, 63, 100, 511])
    q = torch.randn(len(positions), heads * head_dim)
    k = torch.randn(len(positions), kv_heads * head_dim)
    q_out, k_out = rope(positions, q, k)

    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    q_hf = q.view(1, -1, heads, head_dim).transpose(1, 2)  # [1, H, T, D]
    k_hf = k.view(1, -1, kv_heads, head_dim).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape_as(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape_as(k), atol=1e-5, rtol=1e-5)


def test_rotary_unsupported_type_raises() -> None:
    with pytest.raises(NotImplementedError, match="dynamic"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_qkv_linear_loads_shards_like_separate_projections() -> None:
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads = 16, 4, 4, 2
    layer = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True, prefix="p.qkv_proj")
    separate = {
        name: torch.nn.Linear(hidden, n * head_dim)
        for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
    }
    for shard_id, linear in separate.items():
        layer.weight.weight_loader(layer.weight, linear.weight.data, shard_id)
        layer.bias.weight_loader(layer.bias, linear.bias.data, shard_id)
    x = torch.randn(3, hidden)
    expected = torch.cat([separate[s](x) for s in "qkv"], dim=-1)
    torch.testing.assert_close(layer(x), expected)

    with pytest.raises(ValueError, match="does not fit"):
        layer.weight.weight_loader(layer.weight, torch.zeros(5, hidden), "k")
    with pytest.raises(ValueError, match="shard id"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, hidden), "x")


def test_merged_column_linear_and_silu_and_mul() -> None:
    torch.manual_seed(0)
    gate, up = torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(8, 12, bias=False)
    layer = MergedColumnLinear(8, [12, 12])
    layer.weight.weight_loader(layer.weight, gate.weight.data, 0)
    layer.weight.weight_loader(layer.weight, up.weight.data, 1)
    x = torch.randn(5, 8)
    out = SiluAndMul()(layer(x))
    torch.testing.assert_close(out, torch.nn.functional.silu(gate(x)) * up(x))


def test_linear_method_is_pluggable() -> None:
    class ScaledMethod(UnquantizedLinearMethod):
        def apply(self, layer, x, bias):  # type: ignore[no-untyped-def]
            return 2 * super().apply(layer, x, bias)

    layer = ReplicatedLinear(4, 3, linear_method=ScaledMethod())
    layer.weight.data.copy_(torch.ones(3, 4))
    assert isinstance(layer.linear_method, LinearMethod)
    torch.testing.assert_close(layer(torch.ones(1, 4)), torch.full((1, 3), 8.0))


def test_lm_head_ties_to_embedding() -> None:
    embed = VocabEmbedding(10, 4)
    embed.weight.data.normal_()
    head = LMHead(10, 4, tie_to=embed)
    assert head.weight is embed.weight
    hidden = torch.randn(2, 4)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ embed.weight.T)


def _single_sequence_metadata(
    num_tokens: int, num_padding: int, block_table: list[int], block_size: int
) -> AttentionMetadata:
    slots = [block_table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
    )


def test_attention_paged_matches_no_cache_and_zeroes_padding() -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    attn = Attention(heads, head_dim, head_dim**-0.5, kv_heads)
    num_tokens, num_padding = 7, 3
    q = torch.randn(num_tokens + num_padding, heads * head_dim)
    k = torch.randn(num_tokens + num_padding, kv_heads * head_dim)
    v = torch.randn(num_tokens + num_padding, kv_heads * head_dim)
    expected = attn(q[:num_tokens], k[:num_tokens], v[:num_tokens], None)

    with pytest.raises(RuntimeError, match="kv_cache"):
        attn(q, k, v, _single_sequence_metadata(num_tokens, num_padding, [2, 5], block_size))
    attn.kv_cache = torch.zeros(2, 8, block_size, kv_heads, head_dim)
    metadata = _single_sequence_metadata(num_tokens, num_padding, [2, 5], block_size)
    out = attn(q, k, v, metadata)
    assert out.shape == q.shape
    torch.testing.assert_close(out[:num_tokens], expected, atol=1e-5, rtol=1e-5)
    assert torch.all(out[num_tokens:] == 0)
    # Only blocks 2 and 5 were written (7 slots); padding tokens left no trace.
    written = attn.kv_cache.abs().sum(dim=(0, 3, 4)) != 0  # [num_blocks, block_size]
    assert written.sum() == num_tokens
    assert written[2].all() and written[5, :3].all()
