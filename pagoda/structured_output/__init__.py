"""Structured outputs: grammars that constrain which tokens a request may sample.

`StructuredOutputManager` turns a request's `StructuredOutputsParams` into a compiled grammar
(xgrammar, imported only when a request asks for one) on a thread pool, caches it by the
constraint's key, and fills the token bitmasks that the sampler applies on the device.
"""

from pagoda.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
