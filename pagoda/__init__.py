"""pagoda: an LLM inference engine (paged KV cache, continuous batching) and weight quantizer.

`from pagoda import LLM, SamplingParams` is a drop-in for vLLM's offline API.
"""

from pagoda.entrypoints.llm import LLM
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
