"""Test helpers: PEFT LoRA adapters with random (non-zero) weights for tiny HF models."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def randomize_adapter(peft_model, seed: int, std: float = 0.1) -> None:
    """PEFT initialises lora_B to zero (a no-op adapter); give every trained tensor values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def make_adapter(base: Path, out: Path, seed: int = 0, **lora_kwargs):
    """Build a PEFT LoRA adapter for the HF model at `base`, save it to `out`.

    Returns the in-memory PeftModel (float32) so tests can compare against it.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    lora_kwargs.setdefault("target_modules", ALL_TARGETS)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out)
    return peft_model.eval()
