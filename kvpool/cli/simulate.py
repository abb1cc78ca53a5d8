"""`kvpool simulate`: replay a request trace through every allocation strategy.

This module owns the command: its flags, building the trace they describe, and printing the
results. The simulator itself is `kvpool.sim`. Registration only builds the parser; the
simulator (and torch, for the arena's meta buffer) loads when the command runs.

`--trace kv --trace-file FILE` replays the requests of a KV trace recorded with `--kv-trace
FILE` (`kvpool.sim.kv_trace_replay` says what is taken from it). There, unless given,
`--budget` is the recorded pool (its online blocks at start x block size tokens, at `--model`'s
bytes per token) and `--num-samples` is the n the requests asked for. A KV trace is never
guessed from `--trace jsonl`: that names the simulator's own request format, and is refused
with a pointer to `--trace kv` when handed a KV trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kvpool.cli.args import parse_size
from kvpool.sim.model_shape import KV_SHAPES

if TYPE_CHECKING:
    from kvpool.sim.kv_trace_replay import KVTraceRequests
    from kvpool.sim.model_shape import KVShape
    from kvpool.sim.trace import Request

DEFAULT_BUDGET = "512MiB"


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
    trace.add_argument("--trace", choices=("sharegpt", "uniform", "jsonl", "kv"),
                       default="sharegpt",
                       help="kv: the requests of a KV trace recorded with --kv-trace")
    trace.add_argument("--trace-file",
                       help="request JSONL for --trace jsonl, or a KV trace for --trace kv")
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
    trace.add_argument("--num-samples", type=int,
                       help="parallel samples (n) per request (default 1; --trace kv: the "
                       "recorded n when all requests share one)")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--budget", type=parse_size,
                        help=f"KV memory budget (default {DEFAULT_BUDGET}; --trace kv: the "
                        "recorded pool's tokens at --model's bytes per token)")
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


def _build_trace(args: argparse.Namespace) -> tuple[list[Request], KVTraceRequests | None]:
    """The requests to replay, and what a KV trace said about them (None for other traces)."""
    from kvpool.sim import trace as traces

    if args.trace in ("jsonl", "kv"):
        return _load_trace_file(args)
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    rate = args.arrival_rate or None
    if args.trace == "uniform":
        requests = traces.uniform_trace(args.num_requests, args.prompt_range, args.output_range,
                                        seed=args.seed, arrival_rate=rate)
    else:
        requests = traces.sharegpt_trace(args.num_requests, seed=args.seed, arrival_rate=rate,
                                         max_seq_len=args.max_seq_len)
    if args.prefix_groups:
        requests = traces.add_shared_prefix(requests, args.prefix_groups, args.prefix_len,
                                            seed=args.seed, max_seq_len=args.max_seq_len)
    return requests, None


def _load_trace_file(args: argparse.Namespace) -> tuple[list[Request], KVTraceRequests | None]:
    from kvpool.formats.kv_trace import is_kv_trace, read_kv_trace
    from kvpool.sim.kv_trace_replay import requests_from_kv_trace
    from kvpool.sim.trace import load_jsonl

    if not args.trace_file:
        raise ValueError(f"--trace {args.trace} needs --trace-file")
    if args.trace == "jsonl":
        if is_kv_trace(args.trace_file):
            raise ValueError(f"{args.trace_file} is a kvpool KV trace: replay it with --trace kv")
        return load_jsonl(args.trace_file, default_prefix_len=args.prefix_len), None
    replay = requests_from_kv_trace(read_kv_trace(args.trace_file))
    if not replay.requests:
        raise ValueError(f"{args.trace_file}: {replay.describe()}, nothing to simulate")
    return replay.requests, replay


def _num_samples(args: argparse.Namespace, replay: KVTraceRequests | None) -> int:
    if args.num_samples is not None:
        return args.num_samples
    if replay is None or replay.num_samples is None:
        return 1
    return replay.num_samples


def _budget(args: argparse.Namespace, replay: KVTraceRequests | None, shape: KVShape) -> int:
    """--budget, else the recorded pool's tokens at `shape` (rounded up to the arena's
    alignment), else the default."""
    from kvpool.sim.strategies import ALIGNMENT

    if args.budget is not None:
        return args.budget
    if replay is None:
        return parse_size(DEFAULT_BUDGET)
    num_bytes = replay.header.num_blocks * replay.header.block_size * shape.bytes_per_token
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


def _replay_lines(replay: KVTraceRequests, num_samples: int) -> list[str]:
    header = replay.header
    lines = [replay.describe(),
             f"recorded pool: {header.num_blocks} blocks of {header.block_size} tokens; shared "
             f"prefixes are exact at block size {header.block_size}, a lower bound at others"]
    if replay.num_samples is None and len(replay.sample_counts) > 1:
        lines.append(f"note: requests asked for n in {sorted(replay.sample_counts)}; "
                     f"replaying {num_samples} sample(s) each (set --num-samples)")
    return lines


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvpool.sim import report
    from kvpool.sim.model_shape import kv_shape
    from kvpool.sim.roster import build_strategies
    from kvpool.sim.simulate import simulate
    from kvpool.sim.strategies import SimConfig
    from kvpool.sim.trace import describe, save_jsonl

    requests, replay = _build_trace(args)
    if args.save_trace:
        save_jsonl(requests, args.save_trace)
    shape = kv_shape(args.model)
    num_samples = _num_samples(args, replay)
    config = SimConfig(_budget(args, replay, shape), shape, args.max_seq_len, num_samples)
    info = sys.stderr if args.json else sys.stdout
    for line in _replay_lines(replay, num_samples) if replay else []:
        print(line, file=info)
    strategies = build_strategies(config, requests, args.block_sizes)
    results = []
    for strategy in tqdm(strategies, desc="simulate", unit="strategy", file=sys.stderr):
        results.append(simulate(requests, strategy, config))
    if args.json:
        print(json.dumps(report.to_json(results), indent=2))
    else:
        print(f"trace: {args.trace}, {describe(requests)}, {num_samples} sample(s) each")
        print(f"budget: {config.budget_bytes} B = {config.budget_tokens} tokens of {shape.name} "
              f"({shape.bytes_per_token} B/token), max_seq_len {args.max_seq_len}\n")
        print(report.format_table(results))
    if args.plot_dir:
        for path in report.write_plots(results, args.plot_dir):
            print(f"wrote {path}", file=info)
    return 0
