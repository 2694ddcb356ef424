"""raypaged: PagedAttention and continuous batching LLM serving."""

from raypaged.core.beam_search import BeamSearchParams
from raypaged.entrypoints.llm import LLM
from raypaged.outputs import CompletionOutput, RequestOutput
from raypaged.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
