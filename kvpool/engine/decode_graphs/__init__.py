"""CUDA graphs for decode: a decode-only step padded to a captured batch size and replayed.

- `padded_decode`: the static input buffers, the padding and its invariant, the plan of sizes;
- `runner`: `DecodeGraphRunner`, which sends qualifying steps there (captured on CUDA, or called
  eagerly on any device) and every other step to the eager `ModelRunner` path; which engines
  capture (`decode_plan`) and at which sizes (`capture_sizes`, vLLM's options).
"""

from kvpool.engine.decode_graphs.padded_decode import DecodePlan, PaddedDecode
from kvpool.engine.decode_graphs.runner import DecodeGraphRunner, capture_sizes, decode_plan

__all__ = ["DecodeGraphRunner", "DecodePlan", "PaddedDecode", "capture_sizes", "decode_plan"]
