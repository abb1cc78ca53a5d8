"""vLLM's import path for output records (`from vllm.outputs import RequestOutput, ...`). The
classes live in `kvpool.engine.requests.outputs` and `kvpool.engine.beams`."""

from kvpool.engine.beams import BeamSearchOutput, BeamSearchSequence
from kvpool.engine.requests.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)

__all__ = ["BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "Logprob",
           "RequestMetrics", "RequestOutput"]
