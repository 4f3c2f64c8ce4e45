"""pagoda.quant: GPTQ / RTN weight quantization to compressed-tensors checkpoints.

`quantize(model, out_dir, ...)` is the entry point (also `pagoda quantize`); the algorithms
(`gptq`, `rtn`), calibration data, pipeline and formats are separate modules.
"""

from __future__ import annotations

from typing import Any


def quantize(*args: Any, **kwargs: Any) -> Any:
    """See `pagoda.quant.api.quantize` (imported lazily: it pulls in the model code)."""
    from pagoda.quant.api import quantize as _quantize

    return _quantize(*args, **kwargs)


__all__ = ["quantize"]
