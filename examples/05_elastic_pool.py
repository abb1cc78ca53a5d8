"""Experiment 5: an elastic KV pool grows under a burst and gives memory back when idle.

The engine (the real SmolLM2 on the CPU) gets a 32 MiB KV budget (45 blocks of 16 tokens),
taken online in segments of 4 blocks, starting with one. A burst of six requests makes the
pool grow instead of preempting; while the burst drains, segments that stay free for
`IDLE_SECONDS` are given back, the live blocks in them migrated elsewhere; after the burst
the pool shrinks to its initial segment, one segment per idle period. A second, smaller burst
grows it again.

Run: python examples/05_elastic_pool.py [--plot docs/img/elastic_pool.png]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams

IDLE_SECONDS = 0.2
INITIAL_BLOCKS = 4
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
    "steps as his father had taught him, and lit the great lamp. "
)
BURSTS = [  # (prompt, max_tokens): long and short prompts, long and short answers
    [
        (STORY * (1 + index % 3) + f"Question {index}: what did he count?", 4 + 4 * (index % 3))
        for index in range(6)
    ],
    [(STORY * 2 + "Tell the story again.", 24), ("Hello, my name is", 6)],
]


def run_burst(engine: LLMEngine, burst, start: float, trace: list[tuple[float, int, int]]):
    """Submit every request, then step until all are done, recording the pool after each."""
    for prompt, max_tokens in burst:
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
        trace.append(
            (
                time.monotonic() - start,
                engine.kv_pool_stats().num_online_blocks,
                engine.memory_stats().num_used_blocks,
            )
        )


def idle(engine: LLMEngine, start: float, trace: list[tuple[float, int, int]]) -> float:
    """What a server loop does with no work: let the pool resize now and then, here until it
    is back to its initial segment; returns the seconds that took."""
    idle_start = time.monotonic()
    while engine.kv_pool_stats().num_online_blocks > INITIAL_BLOCKS:
        assert time.monotonic() - idle_start < 100 * IDLE_SECONDS, "the pool did not shrink"
        time.sleep(IDLE_SECONDS / 5)
        engine.resize_kv_pool()
        trace.append((time.monotonic() - start, engine.kv_pool_stats().num_online_blocks, 0))
    time.sleep(IDLE_SECONDS)
    trace.append((time.monotonic() - start, engine.kv_pool_stats().num_online_blocks, 0))
    return time.monotonic() - idle_start - IDLE_SECONDS


def plot(trace: list[tuple[float, int, int]], block_nbytes: int, path: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.5), layout="constrained")
    axes = figure.subplots()
    times = [t for t, _, _ in trace]
    to_mib = block_nbytes / 2**20
    axes.step(
        times, [online * to_mib for _, online, _ in trace], where="post", label="online (segments)"
    )
    axes.step(times, [used * to_mib for _, _, used in trace], where="post", label="used blocks")
    axes.set_xlabel("seconds")
    axes.set_ylabel("KV memory (MiB)")
    axes.set_title("Elastic KV pool: two bursts with idle time after each")
    axes.legend(loc="upper right")
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", default=None, help="write the timeline as a PNG here")
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",  # docs/memory.md's transcript counts fp32 blocks (720 KiB each)
            kv_cache_memory=32 * 2**20,
            kv_pool="elastic",
            kv_pool_segment_blocks=4,
            kv_pool_initial_blocks=INITIAL_BLOCKS,
            kv_pool_idle_seconds=IDLE_SECONDS,
        )
    )
    start, trace = time.monotonic(), [(0.0, engine.kv_pool_stats().num_online_blocks, 0)]
    for burst in BURSTS:
        first_entry = len(trace)
        run_burst(engine, burst, start, trace)
        peak = max(online for _, online, _ in trace[first_entry:])
        print(
            f"after a burst of {len(burst)}: peak {peak} blocks online, "
            f"{trace[-1][1]} now, {engine.stats().num_preemptions} preemptions"
        )
        seconds = idle(engine, start, trace)
        print(f"idle: back to {trace[-1][1]} blocks online after {seconds:.1f} s")
    stats = engine.kv_pool_stats()
    print(
        f"grows {stats.num_grows}, shrinks {stats.num_shrinks}, migrated blocks "
        f"{stats.num_migrated_blocks}, evicted cached blocks {stats.num_evicted_blocks}; "
        f"{stats.max_num_blocks} blocks of {stats.bytes_per_block} B in the budget"
    )
    assert engine.memory_stats().num_used_blocks == 0 and stats.num_online_blocks == INITIAL_BLOCKS
    assert stats.num_grows > 0 and stats.num_shrinks == stats.num_grows
    print("the pool grew under load and gave every grown segment back when idle")
    if args.plot:
        plot(trace, stats.bytes_per_block, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
