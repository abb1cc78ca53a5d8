"""`kvpool bench kv-capacity --hybrid`: how many long requests one KV budget holds at once with
the hybrid KV manager on (sliding-window layers keep their window) and off (every layer keeps
every block), measured by allocation, not computed.

For each context length L, requests are built one after another in the pool as the engine
builds them: the prompt's KV in chunks of `--chunk` tokens (a chunk's blocks are all held while
it is computed, then the window drops what its layers no longer read), then one decode step.
Requests are added until the next one cannot be built; the count is the measured maximum
concurrency, beside the formula's (`kv_groups.max_concurrency`, vLLM's "Maximum concurrency").
Tokens differ per request, so no prefix is shared. Both sides hold the same bytes and run the
engine's bookkeeping (the hybrid pool's arena over a meta-device buffer: offsets and pages, no
bytes touched; the plain pool, blocks of every layer).

A second table shows what padding would cost where groups' pages differ in size (Gemma 4's
sliding layers have smaller heads than its global ones): pages carved at their own sizes
against every page padded to the largest, in the same budget.
"""

from __future__ import annotations

import dataclasses
import json

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.hybrid_memory import HybridKVMemory
from kvpool.memory.kv_groups import KVGroup, bytes_for_tokens, kv_groups, max_concurrency
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.sequence_blocks import SequenceBlocks

DEFAULT_LENGTHS = (4096, 8192, 32768)


def fill(pool, length: int, chunk: int, vocab: int = 1 << 30) -> int:
    """Requests of `length` tokens built in `pool` until one does not fit (module docstring)."""
    held = []
    while True:
        seq = SequenceBlocks(pool)
        first = len(held) * length
        try:
            for start in range(0, length - 1, chunk):
                end = min(start + chunk, length - 1)
                seq.append_tokens([(first + p) % vocab for p in range(start, end)])
            seq.append_tokens([(first + length - 1) % vocab])  # the decode step
        except OutOfBlocksError:
            seq.free()
            return len(held)
        held.append(seq)


def measure(layout: KVLayout, windows: list[int | None], budget: int, length: int,
            chunk: int) -> dict:
    """Measured and formula concurrency at `length`, hybrid on and off, in `budget` bytes."""
    row = {"max_model_len": length}
    for hybrid in (True, False):
        groups = kv_groups(layout, windows, hybrid, max_model_len=length)
        name = "on" if hybrid else "off"
        if hybrid:
            memory = HybridKVMemory(layout, groups, budget, "meta")
            pool, usable = memory.hybrid, memory.num_usable_bytes
        else:
            pool = BlockPool(budget // layout.bytes_per_block, layout)
            usable = pool.num_blocks * layout.bytes_per_block
        row[f"{name}_measured"] = fill(pool, length, chunk)
        row[f"{name}_formula"] = max_concurrency(groups, usable, length)
    row["ratio_measured"] = row["on_measured"] / max(row["off_measured"], 1)
    row["ratio_formula"] = row["on_formula"] / row["off_formula"]
    return row


def gemma4_like(block_size: int, padded: bool) -> tuple[KVGroup, KVGroup]:
    """25 sliding layers (window 1024) and 5 global ones, one KV head each, of 256 and 512
    dimensions, bf16: a global layer's page is twice a sliding one's. `padded`: every page
    the largest, as one page size for all groups makes it."""
    sliding = KVLayout(block_size, 25, 1, 256, "bfloat16")
    full = KVLayout(block_size, 5, 1, 512, "bfloat16")
    if padded:
        sliding = dataclasses.replace(sliding, head_dim=512)
    return (KVGroup(tuple(range(25, 30)), None, full),
            KVGroup(tuple(range(25)), 1024, sliding))


def mixed_page_sizes(budget: int, block_size: int, length: int, chunk: int) -> dict:
    """Requests of `length` tokens held with pages at their own sizes and padded to the
    largest, measured in the same budget, and the bytes one such request holds."""
    rows = {}
    for name, padded in (("own_sizes", False), ("padded", True)):
        groups = gemma4_like(block_size, padded)
        memory = HybridKVMemory(groups[0].layout, groups, budget, "meta")
        rows[name] = {"page_bytes": list(memory.hybrid.page_bytes),
                      "bytes_per_request": bytes_for_tokens(groups, length),
                      "measured": fill(memory.hybrid, length, chunk)}
    rows["bytes_saved"] = 1 - (rows["own_sizes"]["bytes_per_request"]
                               / rows["padded"]["bytes_per_request"])
    return rows


def run_hybrid_capacity(model: str, block_size: int, budget: int, lengths: tuple[int, ...],
                        chunk: int) -> dict:
    from kvpool.model.loaders.auto import _dummy_config

    config = _dummy_config(model)
    layout = KVLayout(block_size, config.num_layers, config.num_kv_heads, config.head_dim,
                      "bfloat16")
    windows = [spec.sliding_window for spec in config.layer_specs]
    return {"model": model, "block_size": block_size, "budget_bytes": budget, "chunk": chunk,
            "rows": [measure(layout, windows, budget, length, chunk) for length in lengths],
            "mixed_page_sizes": mixed_page_sizes(budget, block_size, 8192, chunk)}


def format_hybrid(result: dict) -> str:
    lines = [f"Maximum concurrency of {result['budget_bytes'] / 2**30:g} GiB for "
             f"{result['model']} (bf16, blocks of {result['block_size']}, prompts in chunks "
             f"of {result['chunk']}; requests really allocated)",
             f"  {'max_model_len':>13} {'hybrid on':>10} {'(formula)':>10} {'off':>6} "
             f"{'(formula)':>10} {'on / off':>9}"]
    for row in result["rows"]:
        lines.append(f"  {row['max_model_len']:>13,} {row['on_measured']:>10} "
                     f"{row['on_formula']:>10.2f} {row['off_measured']:>6} "
                     f"{row['off_formula']:>10.2f} {row['ratio_measured']:>8.2f}×")
    mixed = result["mixed_page_sizes"]
    lines.append(f"  pages of two sizes (Gemma-4-like, 8k tokens): at their own sizes "
                 f"{mixed['own_sizes']['measured']} requests, padded to the largest "
                 f"{mixed['padded']['measured']}; {mixed['bytes_saved']:.0%} of a request's "
                 "bytes saved")
    return "\n".join(lines)


def run(args) -> int:
    if args.long_context:
        result = run_long_context(args.kv_cache_memory, args.num_requests, args.prompt_len,
                                  args.output_len)
        print(json.dumps(result) if args.json else format_long_context(result))
        return 0
    result = run_hybrid_capacity(args.model or "gemma-3-1b", args.block_size,
                                 args.kv_cache_memory, tuple(args.max_model_len), args.chunk)
    print(json.dumps(result) if args.json else format_hybrid(result))
    return 0


def long_context_model(hidden_size: int = 256):
    """Gemma 3 1B's attention (26 layers, every sixth full, window 512, one KV head of 256)
    around a narrower residual stream and MLP, so that a long-context run on a CPU takes a
    minute, not an hour; the KV per token is the real model's."""
    from kvpool.model.presets import preset

    return preset("gemma-3-1b").replace(hidden_size=hidden_size,
                                        intermediate_size=2 * hidden_size)


def run_long_context(budget: int, num_requests: int, prompt_len: int, output_len: int,
                     seed: int = 0) -> dict:
    """`num_requests` requests of `prompt_len` random tokens, all submitted at once, through
    one engine with the hybrid manager on and one with it off, in `budget` bytes of KV: wall
    time, output tokens per second and preemptions of each (alternating, one run each)."""
    import time

    import torch

    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling_params import SamplingParams
    from kvpool.engine.setup import build_engine_parts
    from kvpool.model.loaders import load_model

    loaded = load_model(long_context_model(), load_format="dummy", dtype="bfloat16", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 32000, (prompt_len,), generator=generator).tolist()
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rows, outputs = {}, {}
    for hybrid in (True, False):
        config = EngineConfig(dtype="bfloat16", kv_cache_memory=budget, enable_warmup=False,
                              max_num_seqs=num_requests,
                              disable_hybrid_kv_cache_manager=not hybrid)
        engine = LLMEngine(config, build_engine_parts(config, loaded))
        start = time.perf_counter()
        for prompt in prompts:
            engine.add_request(prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        seconds = time.perf_counter() - start
        stats = engine.stats()
        name = "on" if hybrid else "off"
        outputs[name] = sorted(list(o.outputs[0].token_ids) for o in finished.values())
        rows[name] = {"seconds": seconds,
                      "output_tokens_per_s": num_requests * output_len / seconds,
                      "num_preemptions": stats.num_preemptions,
                      "num_recomputed_tokens": stats.num_recomputed_tokens,
                      "max_concurrency": engine.memory_stats().max_concurrency}
        engine.close()
    return {"budget_bytes": budget, "num_requests": num_requests, "prompt_len": prompt_len,
            "output_len": output_len, "rows": rows,
            "speedup": rows["off"]["seconds"] / rows["on"]["seconds"],
            "same_tokens": outputs["on"] == outputs["off"]}


def format_long_context(result: dict) -> str:
    lines = [f"{result['num_requests']} requests of {result['prompt_len']:,} prompt tokens and "
             f"{result['output_len']} output tokens at once, "
             f"{result['budget_bytes'] / 2**20:g} MiB of KV (Gemma 3 1B's attention, a narrow "
             "MLP, bf16)",
             f"  {'hybrid':<7} {'seconds':>8} {'out tok/s':>10} {'preemptions':>12} "
             f"{'recomputed':>11} {'max conc.':>10}"]
    for name, row in result["rows"].items():
        lines.append(f"  {name:<7} {row['seconds']:>8.1f} {row['output_tokens_per_s']:>10.1f} "
                     f"{row['num_preemptions']:>12} {row['num_recomputed_tokens']:>11,} "
                     f"{row['max_concurrency']:>9.2f}×")
    lines.append(f"  on / off: {result['speedup']:.2f}× the speed; same tokens: "
                 f"{result['same_tokens']}")
    return "\n".join(lines)
