"""`kvpool simulate`: replay a request trace through every allocation strategy.

This module owns the command: its flags, building the trace they describe, and printing the
results. The simulator itself is `kvpool.sim`. Registration only builds the parser; the
simulator (and torch, for the arena's meta buffer) loads when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kvpool.cli.args import parse_size
from kvpool.sim.model_shape import KV_SHAPES

if TYPE_CHECKING:
    from kvpool.sim.trace import Request


def parse_int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_range(text: str) -> tuple[int, int]:
    values = parse_int_list(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {text!r}")
    return values[0], values[1]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="compare KV allocation strategies on a request trace (no model run)",
        description="Replay a request trace through contiguous and paged KV allocation "
        "strategies on the same memory budget and report where the memory goes.")
    trace = parser.add_argument_group("trace")
    trace.add_argument("--trace", choices=("sharegpt", "uniform", "jsonl"), default="sharegpt")
    trace.add_argument("--trace-file", help="JSONL trace for --trace jsonl")
    trace.add_argument("--num-requests", type=int, default=1000)
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--arrival-rate", type=float, default=0.0,
                       help="Poisson arrivals per step (0: all at step 0)")
    trace.add_argument("--prompt-range", type=parse_range, default=(16, 512),
                       help="uniform trace prompt lengths LOW,HIGH")
    trace.add_argument("--output-range", type=parse_range, default=(16, 512),
                       help="uniform trace output lengths LOW,HIGH")
    trace.add_argument("--prefix-groups", type=int, default=0,
                       help="give every prompt one of this many shared system prompts")
    trace.add_argument("--prefix-len", type=int, default=256,
                       help="shared system prompt length (tokens)")
    trace.add_argument("--num-samples", type=int, default=1, help="parallel samples (n)")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--budget", type=parse_size, default=parse_size("512MiB"),
                        help="KV memory budget (default 512MiB)")
    memory.add_argument("--model", default="smollm2-135m", choices=sorted(KV_SHAPES),
                        help="KV shape: bytes per token (default smollm2-135m)")
    memory.add_argument("--max-seq-len", type=int, default=2048,
                        help="longest sequence; what contiguous-max reserves (default 2048)")
    memory.add_argument("--block-sizes", type=parse_int_list, default=(1, 8, 16, 32, 64, 128),
                        help="paged block sizes, comma-separated (default 1,8,16,32,64,128)")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print a JSON list instead")
    output.add_argument("--plot-dir", help="write PNG plots here")
    output.add_argument("--save-trace", help="also write the trace as JSONL here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError) as error:
        print(f"kvpool simulate: error: {error}", file=sys.stderr)
        return 2


def _build_trace(args: argparse.Namespace) -> list[Request]:
    from kvpool.sim import trace as traces

    rate = args.arrival_rate or None
    if args.trace == "jsonl":
        if not args.trace_file:
            raise ValueError("--trace jsonl needs --trace-file")
        return traces.load_jsonl(args.trace_file, default_prefix_len=args.prefix_len)
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.trace == "uniform":
        requests = traces.uniform_trace(args.num_requests, args.prompt_range, args.output_range,
                                        seed=args.seed, arrival_rate=rate)
    else:
        requests = traces.sharegpt_trace(args.num_requests, seed=args.seed, arrival_rate=rate,
                                         max_seq_len=args.max_seq_len)
    if args.prefix_groups:
        requests = traces.add_shared_prefix(requests, args.prefix_groups, args.prefix_len,
                                            seed=args.seed, max_seq_len=args.max_seq_len)
    return requests


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvpool.sim import report
    from kvpool.sim.model_shape import kv_shape
    from kvpool.sim.simulate import simulate
    from kvpool.sim.strategies import SimConfig, build_strategies
    from kvpool.sim.trace import describe, save_jsonl

    requests = _build_trace(args)
    if args.save_trace:
        save_jsonl(requests, args.save_trace)
    shape = kv_shape(args.model)
    config = SimConfig(args.budget, shape, args.max_seq_len, args.num_samples)
    strategies = build_strategies(config, requests, args.block_sizes)
    results = []
    for strategy in tqdm(strategies, desc="simulate", unit="strategy", file=sys.stderr):
        results.append(simulate(requests, strategy, config))
    info = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps(report.to_json(results), indent=2))
    else:
        print(f"trace: {args.trace}, {describe(requests)}, {args.num_samples} sample(s) each")
        print(f"budget: {args.budget} B = {config.budget_tokens} tokens of {shape.name} "
              f"({shape.bytes_per_token} B/token), max_seq_len {args.max_seq_len}\n")
        print(report.format_table(results))
    if args.plot_dir:
        for path in report.write_plots(results, args.plot_dir):
            print(f"wrote {path}", file=info)
    return 0
