"""Maps `config.architectures` names to pagoda model classes.

Classes are imported lazily so that asking for one architecture does not import the others.
Unknown architectures raise ValueError listing what is supported.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture name -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagoda.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagoda.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("pagoda.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagoda.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": (
        "pagoda.models.qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
    ),
    "Qwen2VLForConditionalGeneration": (
        "pagoda.models.qwen2_5_vl",
        "Qwen2VLForConditionalGeneration",
    ),
    "Qwen3VLForConditionalGeneration": (
        "pagoda.models.qwen3_vl",
        "Qwen3VLForConditionalGeneration",
    ),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

# Configs read from GGUF files carry `model_type` but no `architectures`.
_ARCHITECTURE_OF_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def architectures_of(hf_config: Any) -> list[str]:
    """`hf_config.architectures`, or the causal-LM class implied by `model_type` when absent."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        model_type = getattr(hf_config, "model_type", None)
        if model_type in _ARCHITECTURE_OF_MODEL_TYPE:
            architectures = [_ARCHITECTURE_OF_MODEL_TYPE[model_type]]
    return architectures


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class of the first supported name in `architectures` (an HF config field)."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"model architectures {list(architectures or [])} are not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
