"""Mistral causal LM: the Llama skeleton with sliding-window attention in every layer.

`config.sliding_window` W (4096 for Mistral-7B-v0.1) limits query i to keys i - W < j <= i, as
transformers' `MistralForCausalLM` does; null (or absent) means full causal attention. The window
goes to each layer's `Attention`, so every path (torch reference, Triton prefill / decode, the
fused decode kernel, CUDA graphs) applies it; the KV cache manager frees blocks that leave it.
"""

from __future__ import annotations

from typing import Any

from pagoda.models.llama import DecoderOptions, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """No biases; the window comes from `config.sliding_window`."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        window = getattr(config, "sliding_window", None)
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(f"config.sliding_window must be null or an int >= 1, got {window!r}")
        return DecoderOptions(
            qkv_bias=False, o_proj_bias=False, mlp_bias=False, sliding_window=window
        )
