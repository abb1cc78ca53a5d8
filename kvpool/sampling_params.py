"""vLLM's import path for sampling parameters (`from vllm.sampling_params import ...`), so a
vLLM script switches by changing the package name. The classes live in `kvpool.engine`."""

from kvpool.engine.beams import BeamSearchParams
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpool.engine.structured_outputs import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
