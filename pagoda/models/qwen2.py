"""Qwen2 / Qwen2.5 causal LM: the Llama skeleton with bias on q/k/v (not on o_proj).

Everything else (fused projections, tied embeddings for the small sizes, weight loading) is
inherited from `pagoda.models.llama`.
"""

from __future__ import annotations

from typing import Any

from pagoda.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 always has q/k/v bias; HF's Qwen2 config has no attention_bias switch."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_proj_bias=False, mlp_bias=False)
