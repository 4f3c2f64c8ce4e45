"""pagoda: an LLM inference engine (paged KV cache, continuous batching) and weight quantizer.

`from pagoda import LLM, SamplingParams` is a drop-in for vLLM's offline API. The names are
imported lazily so that torch-free parts (scheduler, KV cache manager) stay torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagoda.entrypoints.llm",
    "SamplingParams": "pagoda.sampling_params",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "LoRARequest": "pagoda.lora.request",
}

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM
    from pagoda.lora.request import LoRARequest
    from pagoda.outputs import CompletionOutput, RequestOutput
    from pagoda.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
