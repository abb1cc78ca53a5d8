"""The allocation simulator: replay request traces through KV allocation strategies.

No model runs: a strategy only decides where each token's KV would live, so contiguous
reservations (on the engine's `Arena`, or on `SizeClassArena`, which adds size classes and
compaction) and paged blocks (on the real `BlockPool`) can be compared on the same budget and
trace: `kvpool.sim.simulate.simulate(trace, strategy, config)`.
`requests_from_kv_trace` turns a recorded KV trace (`--kv-trace`) into such a trace.
`kvpool simulate` is the command line (kvpool/cli/simulate.py).
"""

from kvpool.sim.kv_trace_replay import KVTraceRequests, requests_from_kv_trace
from kvpool.sim.model_shape import KV_SHAPES, KVShape, kv_shape
from kvpool.sim.roster import build_strategies
from kvpool.sim.simulate import SimResult
from kvpool.sim.strategies import MemorySnapshot, SimConfig, Strategy
from kvpool.sim.trace import (
    Request,
    add_shared_prefix,
    load_jsonl,
    save_jsonl,
    sharegpt_trace,
    uniform_trace,
)

__all__ = [
    "KV_SHAPES",
    "KVShape",
    "KVTraceRequests",
    "MemorySnapshot",
    "Request",
    "SimConfig",
    "SimResult",
    "Strategy",
    "add_shared_prefix",
    "build_strategies",
    "kv_shape",
    "load_jsonl",
    "requests_from_kv_trace",
    "save_jsonl",
    "sharegpt_trace",
    "uniform_trace",
]
