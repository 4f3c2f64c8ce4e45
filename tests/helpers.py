"""Test helpers: tiny random Hugging Face models saved to disk, and transformers baselines."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_config(arch: str, **overrides):
    """A small config of a real architecture (fast on 2 CPU cores)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, **common)
    raise ValueError(arch)


def save_tiny_model(arch: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Build a random HF model of `arch`, save it (safetensors) to `path`, return `path`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises with std 0.02: logits are then nearly flat and greedy picks hinge on
    # rounding. A larger spread gives decisive (but still random) predictions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int):
    """Greedy continuations and per-step log-softmax from transformers, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tokens, logprobs = [], []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens.append(out.sequences[0, len(ids) :].tolist())
        logprobs.append([torch.log_softmax(s[0].float(), -1) for s in out.logits])
    return tokens, logprobs
