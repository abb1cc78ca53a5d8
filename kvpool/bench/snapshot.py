"""`kvpool bench snapshot`: the cost of `LLMEngine.kv_snapshot()` on a large, busy pool.

The engine is real, with a tiny random model (the `tiny` preset, dummy weights) so that a
100,000-block pool fits in memory: the snapshot's work depends on blocks and sequences, not on
the model. The pool is first left with cached prefixes (a batch of short requests that finish),
then filled by long-running requests (a third share a system prompt, every tenth has n=2) until
`fill` of it is used. Then `kv_snapshot()`, `to_json()` and `json.dumps` are each timed
`repeats` times; best and median are reported. The target is a snapshot under 50 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

TARGET_SNAPSHOT_MS = 50.0


@dataclass(frozen=True, slots=True)
class SnapshotBenchConfig:
    num_blocks: int = 100_000
    fill: float = 0.6  # fraction of the pool the long requests hold when measured
    num_repeats: int = 7
    seed: int = 0


def _timed(call: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """Milliseconds of each call, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - start) * 1e3)
    return times, result


def _busy_engine(config: SnapshotBenchConfig):
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model="tiny", load_format="dummy", num_gpu_blocks=config.num_blocks, max_num_seqs=1024,
        max_num_batched_tokens=65536, enable_warmup=False, seed=config.seed))
    rng = random.Random(config.seed)
    vocab = engine.model_config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(320)]

    def prompt(index: int) -> list[int]:
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(100, 1700))]
        return system + body if index % 3 == 0 else body

    for index in range(max(4, config.num_blocks // 330)):  # finish at once: blocks stay cached
        engine.add_request(prompt(index), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    target = config.fill * config.num_blocks
    index = 0
    while engine.memory_stats().num_used_blocks < target:
        for _ in range(32):
            engine.add_request(prompt(index), SamplingParams(
                max_tokens=100_000, ignore_eos=True, n=2 if index % 10 == 0 else 1, seed=index))
            index += 1
        engine.step()
    return engine


def measure(config: SnapshotBenchConfig) -> dict[str, Any]:
    engine = _busy_engine(config)
    snapshot_ms, snapshot = _timed(engine.kv_snapshot, config.num_repeats)
    to_json_ms, doc = _timed(snapshot.to_json, config.num_repeats)
    dumps_ms, text = _timed(lambda: json.dumps(doc), config.num_repeats)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    device = snapshot.device
    return {
        "config": asdict(config),
        "num_sequences": len(snapshot.sequences),
        "blocks": {state: device.count(state) for state in ("used", "cached", "free")},
        "num_runs": len(device.runs),
        "json_bytes": len(text),
        "snapshot_ms": {"best": min(snapshot_ms), "median": statistics.median(snapshot_ms)},
        "to_json_ms": {"best": min(to_json_ms), "median": statistics.median(to_json_ms)},
        "json_dumps_ms": {"best": min(dumps_ms), "median": statistics.median(dumps_ms)},
        "target_snapshot_ms": TARGET_SNAPSHOT_MS,
    }


def run(args: argparse.Namespace) -> int:
    config = SnapshotBenchConfig(num_blocks=args.num_blocks, fill=args.fill,
                                 num_repeats=args.repeats)
    result = measure(config)
    if args.json:
        print(json.dumps(result))
        return 0
    blocks = result["blocks"]
    print(f"pool: {config.num_blocks:,} blocks ({blocks['used']:,} used, {blocks['cached']:,} "
          f"cached, {blocks['free']:,} free), {result['num_sequences']} sequences, "
          f"{result['num_runs']:,} runs, JSON {result['json_bytes'] / 1e6:.2f} MB")
    for name in ("snapshot_ms", "to_json_ms", "json_dumps_ms"):
        figures = result[name]
        print(f"  {name[:-3]:<12} best {figures['best']:7.1f} ms   "
              f"median {figures['median']:7.1f} ms")
    verdict = "meets" if result["snapshot_ms"]["best"] < TARGET_SNAPSHOT_MS else "misses"
    print(f"kv_snapshot() {verdict} the {TARGET_SNAPSHOT_MS:.0f} ms target")
    return 0
