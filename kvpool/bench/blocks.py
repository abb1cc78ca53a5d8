"""`kvpool bench blocks`: throughput and latency of the pure-Python memory core.

Three measurements, each repeated; the best repeat is the headline figure (the least disturbed
by other processes on a shared machine) and the median is reported next to it:

- alloc_free_pairs_per_s: `pool.free(pool.allocate(1))` pairs per second, one block per call.
- append_tokens_per_s: `SequenceBlocks.append_tokens([token_id])` one token at a time, as decode
  appends, including taking a block when the last is full and hashing/publishing full blocks.
- prefix_lookup_4096_ms: one prefix lookup for a 4,096-token prompt on a warm cache that holds
  all its blocks: chained hashing of every full block plus `BlockPool.match_prefix`.

Timed loops run with the garbage collector paused, as `timeit` does, so a collection triggered
by unrelated objects does not land inside one repeat.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from kvpool.memory import BlockPool, SequenceBlocks
from kvpool.memory.kv_layout import KVLayout, cdiv

PREFIX_LOOKUP_TOKENS = 4096  # fixed: the JSON key names it
TARGET_ALLOC_FREE_PAIRS_PER_S = 2_000_000
TARGET_PREFIX_LOOKUP_MS = 1.0


@dataclass(frozen=True, slots=True)
class BlocksBenchConfig:
    block_size: int = 16
    num_repeats: int = 7
    num_alloc_free_pairs: int = 200_000  # per repeat
    batch_num_blocks: int = 16  # blocks per call in the batched allocate/free figure
    num_append_tokens: int = 32_768  # per repeat
    num_lookups: int = 50  # per repeat

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


QUICK_CONFIG = BlocksBenchConfig(
    num_repeats=2, num_alloc_free_pairs=5_000, num_append_tokens=1_024, num_lookups=3
)


@dataclass(frozen=True, slots=True)
class Measurement:
    key: str  # the JSON key of the best figure; the median is `<key>_median`
    label: str
    samples: tuple[float, ...]  # one per repeat (or per lookup)
    higher_is_better: bool
    target: float | None = None

    @property
    def best(self) -> float:
        return max(self.samples) if self.higher_is_better else min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def is_target_met(self) -> bool | None:
        if self.target is None:
            return None
        return self.best >= self.target if self.higher_is_better else self.best < self.target


@contextmanager
def _gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _rates(run_once: Callable[[], int], num_repeats: int) -> tuple[float, ...]:
    """Operations per second of each repeat; `run_once` returns how many it performed."""
    rates = []
    for _ in range(num_repeats):
        with _gc_paused():
            start = time.perf_counter()
            num_ops = run_once()
            elapsed = time.perf_counter() - start
        rates.append(num_ops / elapsed)
    return tuple(rates)


def measure_alloc_free(config: BlocksBenchConfig) -> Measurement:
    """Single-block allocate + free pairs per second."""
    pool = BlockPool(1024, KVLayout(config.block_size))
    allocate, free, num_pairs = pool.allocate, pool.free, config.num_alloc_free_pairs

    def run_once() -> int:
        for _ in range(num_pairs):
            free(allocate(1))
        return num_pairs

    samples = _rates(run_once, config.num_repeats)
    assert pool.num_free_blocks == pool.num_blocks
    return Measurement("alloc_free_pairs_per_s", "alloc+free pairs / s (1 block per call)",
                       samples, True, TARGET_ALLOC_FREE_PAIRS_PER_S)


def measure_alloc_free_batched(config: BlocksBenchConfig) -> Measurement:
    """Blocks per second through `allocate(n)` + `free(ids)` with n blocks per call."""
    pool = BlockPool(1024, KVLayout(config.block_size))
    allocate, free, batch = pool.allocate, pool.free, config.batch_num_blocks
    num_calls = max(1, config.num_alloc_free_pairs // batch)

    def run_once() -> int:
        for _ in range(num_calls):
            free(allocate(batch))
        return num_calls * batch

    samples = _rates(run_once, config.num_repeats)
    return Measurement("alloc_free_batched_blocks_per_s",
                       f"alloc+free blocks / s ({batch} blocks per call)", samples, True)


def measure_append(config: BlocksBenchConfig) -> Measurement:
    """Tokens per second appended one at a time through a SequenceBlocks."""
    num_tokens, size = config.num_append_tokens, config.block_size
    single_token_lists = [[token_id % 49_152] for token_id in range(num_tokens)]
    tables: list[SequenceBlocks] = []

    def run_once() -> int:
        # A fresh pool per repeat, so every repeat hashes and publishes new blocks.
        table = SequenceBlocks(BlockPool(cdiv(num_tokens, size), KVLayout(size)))
        tables.append(table)
        append = table.append_tokens
        for token_list in single_token_lists:
            append(token_list)
        return num_tokens

    samples = _rates(run_once, config.num_repeats)
    assert all(table.num_tokens == num_tokens for table in tables)
    return Measurement("append_tokens_per_s", "append tokens / s (1 token per call)",
                       samples, True)


def measure_prefix_lookup(config: BlocksBenchConfig) -> Measurement:
    """Milliseconds per prefix lookup (hashing included) of a cached 4,096-token prompt."""
    size = config.block_size
    token_ids = [(7 * index) % 49_152 for index in range(PREFIX_LOOKUP_TOKENS)]
    pool = BlockPool(PREFIX_LOOKUP_TOKENS // size + 1, KVLayout(size))
    writer = SequenceBlocks(pool)
    writer.append_tokens(token_ids)
    writer.free()  # its full blocks stay cached: the warm cache this lookup hits
    reader = SequenceBlocks(pool)
    num_full_blocks = PREFIX_LOOKUP_TOKENS // size
    samples = []
    for _ in range(config.num_repeats * config.num_lookups):
        with _gc_paused():
            start = time.perf_counter()
            match = pool.match_prefix(reader.prefix_hashes(token_ids), token_ids)
            elapsed = time.perf_counter() - start
        assert len(match.block_ids) == num_full_blocks, "the warm cache must hold the whole prompt"
        samples.append(elapsed * 1e3)
    label = f"prefix lookup, {PREFIX_LOOKUP_TOKENS} tokens (ms)"
    return Measurement("prefix_lookup_4096_ms", label, tuple(samples), False,
                       TARGET_PREFIX_LOOKUP_MS)


def run_benchmarks(config: BlocksBenchConfig) -> list[Measurement]:
    return [
        measure_alloc_free(config),
        measure_alloc_free_batched(config),
        measure_append(config),
        measure_prefix_lookup(config),
    ]


def to_json_dict(config: BlocksBenchConfig, measurements: list[Measurement]) -> dict[str, object]:
    result: dict[str, object] = {}
    for measurement in measurements:
        result[measurement.key] = measurement.best
        result[f"{measurement.key}_median"] = measurement.median
    result["targets"] = {m.key: m.target for m in measurements if m.target is not None}
    result["targets_met"] = {m.key: m.is_target_met for m in measurements if m.target is not None}
    result["config"] = asdict(config)
    return result


def format_table(config: BlocksBenchConfig, measurements: list[Measurement]) -> str:
    lines = [
        f"kvpool bench blocks: block_size {config.block_size}, {config.num_repeats} repeats "
        "(best and median)",
        f"{'measurement':<42} {'best':>12} {'median':>12} {'target':>13}  met",
    ]
    for m in measurements:
        target = ""
        if m.target is not None:
            target = (">= " if m.higher_is_better else "< ") + _fmt(m.target)
        met = {None: "", True: "yes", False: "NO"}[m.is_target_met]
        lines.append(f"{m.label:<42} {_fmt(m.best):>12} {_fmt(m.median):>12} {target:>13}  {met}")
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    """The benchmark of `kvpool bench blocks` (flags: kvpool.cli.bench); prints a table, or one
    JSON object with `args.json`."""
    config = QUICK_CONFIG if args.quick else BlocksBenchConfig()
    if args.repeats is not None:
        config = replace(config, num_repeats=args.repeats)
    if args.block_size is not None:
        config = replace(config, block_size=args.block_size)
    measurements = run_benchmarks(config)
    if args.json:
        print(json.dumps(to_json_dict(config, measurements)))
    else:
        print(format_table(config, measurements))
    return 0
