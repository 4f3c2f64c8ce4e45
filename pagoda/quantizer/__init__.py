"""pagoda.quantizer: GPTQ / AWQ / RTN weight quantization to compressed-tensors (or AutoAWQ)
checkpoints — a tool above the models, as llmcompressor is beside vLLM.

`quantize(model, out_dir, ...)` is the entry point (also `pagoda quantize`); the algorithms
(`gptq`, `awq`, `rtn`: pure functions on weights, Hessians and activation statistics), the
calibration data, the sequential pipeline and the checkpoint writer are separate modules.
"""

from __future__ import annotations

from typing import Any


def quantize(*args: Any, **kwargs: Any) -> Any:
    """See `pagoda.quantizer.api.quantize` (imported on first use: it pulls in the model code)."""
    from pagoda.quantizer.api import quantize as _quantize

    return _quantize(*args, **kwargs)


__all__ = ["quantize"]
