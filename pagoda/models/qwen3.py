"""Qwen3 causal LM: the Llama skeleton with per-head RMSNorm on q and k before RoPE.

Qwen3 configs give `head_dim` explicitly (it need not equal hidden_size / num_heads) and have no
q/k/v bias unless `attention_bias` is set (then o_proj has one too, as in HF).
"""

from __future__ import annotations

from typing import Any

from pagoda.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """q_norm / k_norm over head_dim; bias follows `config.attention_bias`."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias, o_proj_bias=attention_bias, mlp_bias=False, qk_norm=True
        )
