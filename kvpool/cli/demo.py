"""`kvpool demo`: the project's main job, run by `make demo`.

It answers a batch of chat questions that share a system prompt on the default model, then
prints a memory report: peak blocks, prefix-cache hits, preemptions, and the KV memory a
contiguous max-length reservation per request would have needed for the same batch.
`--experiments` instead runs the seed's four memory experiments (`kvpool.experiments`).
"""

from __future__ import annotations

import argparse
from importlib import import_module
from typing import TYPE_CHECKING

from kvpool.experiments import SEED_EXPERIMENTS
from kvpool.memory.kv_layout import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from kvpool.engine.llm import LLM
    from kvpool.engine.requests.outputs import RequestOutput
    from kvpool.memory import BlockPool, BlockPoolStats
    from kvpool.memory.kv_layout import KVLayout

DEMO_SYSTEM_PROMPT = (
    "You are a concise assistant for a lighthouse museum. Answer in one or two sentences, "
    "mention the museum when it fits, and never invent opening hours."
)
DEMO_QUESTIONS = (
    "What does a lighthouse keeper do?",
    "Why are lighthouses painted with stripes?",
    "How far can a lighthouse beam be seen?",
    "What is a Fresnel lens?",
    "Are there still lighthouse keepers today?",
    "Write a two-line poem about a lighthouse.",
    "What powers a modern lighthouse?",
    "Name a famous lighthouse.",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="generate a batch of chat replies on the default model, with a memory report"
    )
    parser.add_argument(
        "--experiments", action="store_true", help="run the seed's four memory experiments instead"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                        help="KV cache storage (auto: the model's dtype; int8 / fp8 quantized)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.experiments:
        return run_seed_experiments()
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling_params import SamplingParams

    llm = LLM(max_model_len=2048, kv_cache_dtype=args.kv_cache_dtype)
    conversations = [
        [{"role": "system", "content": DEMO_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        for question in DEMO_QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # The first conversation computes the shared system prompt; the batch after it reuses those
    # cached blocks (requests admitted in the same step cannot: nothing is computed yet).
    outputs = llm.chat(conversations[:1], params) + llm.chat(conversations[1:], params)
    for question, output in zip(DEMO_QUESTIONS, outputs, strict=True):
        print(f"\n> {question}\n{output.outputs[0].text.strip()}")
    print("\n== memory report")
    print(format_engine_report(llm, outputs, args.max_tokens))
    return 0


def format_engine_report(llm: LLM, outputs: list[RequestOutput], max_tokens: int) -> str:
    """Peak KV use of the batch against a contiguous max-length reservation per request."""
    engine = llm.engine
    stats, pool, layout = engine.stats(), engine.memory_stats(), engine.kv_memory.layout
    peak_bytes = stats.peak_used_blocks * layout.bytes_per_block
    contiguous_bytes = len(outputs) * engine.max_model_len * layout.bytes_per_token
    hit_rate = pool.prefix_cache_hits_tokens / max(pool.prefix_cache_queries_tokens, 1)
    cached = sum(output.num_cached_tokens for output in outputs)
    lines = [
        f"requests                        {len(outputs)} (max_tokens {max_tokens})",
        f"KV block                        {pool.block_size} tokens, {pool.kv_cache_dtype}, "
        f"{layout.bytes_per_block / 2**10:.0f} KiB{_scale_note(layout)}",
        f"peak blocks used                {stats.peak_used_blocks} of {pool.num_blocks} "
        f"({peak_bytes / 2**20:.1f} MiB)",
        f"maximum concurrency             {pool.max_concurrency:.2f}x requests of "
        f"{pool.max_model_len} tokens",
        f"prefix-cache hit rate           {hit_rate:.1%} ({cached} prompt tokens reused)",
        f"preemptions                     {stats.num_preemptions}",
        f"contiguous max-length KV        {contiguous_bytes / 2**20:.1f} MiB "
        f"({len(outputs)} x {engine.max_model_len} tokens)",
        f"paged peak / contiguous         {peak_bytes / contiguous_bytes:.1%}",
    ]
    return "\n".join(lines)


def _scale_note(layout: KVLayout) -> str:
    if not layout.is_quantized:
        return ""
    return f" (scales {layout.scale_bytes_per_block / 2**10:.1f} KiB of it)"


def run_seed_experiments() -> int:
    """Run every seed experiment, then report the memory of each experiment's pool."""
    reports: list[tuple[str, BlockPoolStats]] = []
    for index, name in enumerate(SEED_EXPERIMENTS, start=1):
        module = import_module(f"kvpool.experiments.{name}")
        title = (module.__doc__ or name).strip().splitlines()[0].rstrip(".")
        print(f"\n== {title}  [{module.__name__}]")
        pool: BlockPool = module.main()
        reports.append((f"{index}. {name}", pool.stats()))
    print("\n== memory report (BlockPool.stats() at the end of each experiment)")
    print(format_memory_report(reports))
    return 0


_REPORT_COLUMNS = (
    ("blocks", "num_blocks"),
    ("used", "num_used_blocks"),
    ("free", "num_free_blocks"),
    ("cached", "num_cached_blocks"),
    ("allocs", "num_allocations"),
    ("frees", "num_frees"),
    ("hit blocks", "prefix_cache_hits_blocks"),
    ("evictions", "num_evictions"),
)


def format_memory_report(reports: list[tuple[str, BlockPoolStats]]) -> str:
    """A plain-text table, one row per named `BlockPoolStats` snapshot."""
    name_width = max([len("pool"), *(len(name) for name, _ in reports)])
    widths = {label: max(len(label), 6) for label, _ in _REPORT_COLUMNS}
    header = f"{'pool':<{name_width}}" + "".join(
        f"  {label:>{widths[label]}}" for label, _ in _REPORT_COLUMNS
    )
    rows = [
        f"{name:<{name_width}}"
        + "".join(f"  {getattr(stats, field):>{widths[label]}}" for label, field in _REPORT_COLUMNS)
        for name, stats in reports
    ]
    return "\n".join([header, "-" * len(header), *rows])
