"""`kvpool bench blocks | throughput | multi-turn | serve | precision | kv-capacity |
kv-granularity | structured | kv-trace | snapshot | tp`: the benchmark commands' flags.

This module owns only the parsers. Each benchmark's logic lives in its own module,
`kvpool.bench.blocks`, `kvpool.bench.throughput`, `kvpool.bench.multi_turn`,
`kvpool.bench.serve`, `kvpool.bench.precision`, `kvpool.bench.kv_capacity`,
`kvpool.bench.kv_granularity`, `kvpool.bench.structured`, `kvpool.bench.kv_trace`,
`kvpool.bench.snapshot` and `kvpool.bench.tensor_parallel`, whose
`run(args, ...)` prints a table, or one JSON object with `--json`. Those modules are imported
when a benchmark runs, never when the parser is built.
"""

from __future__ import annotations

import argparse
import math

from kvpool.attention.selector import ATTENTION_BACKENDS
from kvpool.bench import scale_out  # light at import: httpx and the standard library

# Constants only: kvpool.bench.multi_turn imports nothing heavy at module level.
from kvpool.bench.multi_turn import DEFAULT_KV_CACHE_MEMORY, DEFAULT_SWAP_SPACE_GIB, TIERS
from kvpool.cli.args import (
    DTYPE_CHOICES,
    add_engine_args,
    engine_config_from_args,
    parse_size,
)
from kvpool.engine.config import PREEMPTION_MODES
from kvpool.memory.kv_layout import KV_CACHE_DTYPES

DEFAULT_VOCAB_SIZE = 512  # --vocab-size: every preset's vocabulary is at least this large
# `bench tp` without --model: dummy weights of a preset two ranks split (SmolLM2's 9 query
# heads do not split in two).
DEFAULT_TP_MODEL = "qwen2-0.5b"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: a readable table, or one JSON object with --json"
    )
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for register_bench in (
        _register_blocks, _register_throughput, _register_multi_turn, _register_serve,
        _register_precision, _register_kv_capacity, _register_kv_granularity,
        _register_structured, _register_kv_trace, _register_snapshot, _register_tp,
        scale_out.register,  # a bench that registers itself (its flags live beside it)
    ):
        register_bench(bench_subparsers)


def _register_blocks(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "blocks", help="allocate/free, append and prefix-lookup speed of the block pool"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="few iterations (for tests)")
    parser.add_argument("--repeats", type=int, help="repeats per measurement")
    parser.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    parser.set_defaults(func=run_blocks)


def _register_throughput(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "throughput",
        help="offline throughput on a seeded workload, optionally vs vLLM and transformers",
    )
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64], metavar="N",
                        help="one run per N: the workload's first N prompts (default 64)")
    _add_length_args(parser, input_len=(32, 512), output_len=(64, 256))
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt shares")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, metavar="DTYPE",
                        help="repeat every run per dtype (overrides --dtype)")
    parser.add_argument("--baseline", action="extend", nargs="+", choices=("vllm", "hf"),
                        default=[], help="also run vLLM (its venv: `make vllm-venv`) and/or "
                        "transformers generate on the same requests")
    parser.add_argument("--baseline-batch-size", type=int, default=16,
                        help="transformers' static batch size")
    parser.add_argument("--vllm-python", default=None, help="the interpreter of vLLM's venv "
                        "(default $KVPOOL_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=None,
                        choices=tuple(KV_CACHE_DTYPES), metavar="KV_DTYPE",
                        help="repeat the benchmark per KV storage dtype, e.g. auto int8 fp8")
    parser.add_argument("--preemption-modes", nargs="+", default=None, choices=PREEMPTION_MODES,
                        metavar="MODE", help="repeat every kvpool run per preemption mode "
                        "(overrides --preemption-mode; swap needs --swap-space), e.g. "
                        "recompute swap auto; the baselines run once, with the first")
    parser.add_argument("--latency-tokens", type=int, default=128,
                        help="tokens of the single-request decode-latency measurement")
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="also write the JSON object to PATH")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)
    parser.set_defaults(func=run_throughput)


def _register_multi_turn(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "multi-turn", help="chat conversations resending their history: TTFT and throughput "
        "with the KV tiers off, host, disk, host+disk, and disk again after a restart"
    )
    parser.add_argument("--num-conversations", type=int, default=8, help="run at once")
    parser.add_argument("--num-turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--system-prompt-len", type=int, default=2048,
                        help="tokens of the system prompt every conversation shares")
    parser.add_argument("--user-len", type=int, default=64, help="new user tokens per turn")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per turn")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS),
                        metavar="TIER", help="configurations to run, one after another: "
                        f"{', '.join(TIERS)} (default all); host tiers get --swap-space GiB "
                        f"(here default {DEFAULT_SWAP_SPACE_GIB:g})")
    parser.add_argument("--warmup-pass", action=argparse.BooleanOptionalAction, default=True,
                        help="first run the whole workload once, untimed, so that first-use "
                        "costs do not land on the first configuration (default on)")
    parser.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                        help="where the disk tiers live: DIR/disk, DIR/host-disk (and "
                        "DIR/warm-up), each EMPTIED before its configuration runs (default: a "
                        "temporary directory, deleted afterwards)")
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="also write the JSON object to PATH")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)
    parser.set_defaults(func=run_multi_turn, kv_cache_memory=DEFAULT_KV_CACHE_MEMORY,
                        swap_space=DEFAULT_SWAP_SPACE_GIB)


def _register_serve(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "serve", help="online latency/throughput over HTTP (own server, or --base-url)"
    )
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument("--served-model-name", default=None, help="`model` to send")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="with --base-url: prompt token ids are drawn below this")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    _add_length_args(parser, input_len=(64, 256), output_len=(32, 128))
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)
    parser.set_defaults(func=run_serve)


def _register_precision(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "precision", help="bf16 vs fp32, or quantized vs float KV: where greedy decoding "
        "diverges, and the perplexity"
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES,
                        help="the dtype measured (default bfloat16)")
    parser.add_argument("--reference-dtype", default="float32", choices=DTYPE_CHOICES,
                        help="the dtype it is measured against (default float32)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                        help="the KV storage measured, e.g. int8 or fp8 (default auto: the "
                        "model's dtype); with --dtype equal to --reference-dtype this measures "
                        "KV quantization alone")
    parser.add_argument("--reference-kv-cache-dtype", default="auto",
                        choices=tuple(KV_CACHE_DTYPES), help="the reference's KV storage")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per prompt (default 128; 16 with --quick)")
    parser.add_argument("--quick", action="store_true", help="4 prompts, short text (for tests)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_precision)


def _register_kv_capacity(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "kv-capacity", help="KV blocks and tokens one budget holds, per kv_cache_dtype"
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=2**30,
                        help="the budget, e.g. 1GiB (default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_kv_capacity)


def _register_kv_granularity(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "kv-granularity", help="quantized KV: perplexity with per-token vs per-block scales"
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--text-tokens", type=int, default=None,
                        help="score only the first N tokens of the text (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_kv_granularity)


def _register_structured(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "structured", help="output tokens/s with 0%%, 50%% and 100%% of a batch constrained by "
        "a JSON schema (structured outputs' per-step cost)"
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="the batch (default 32)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="tokens every request generates (default 128)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0],
                        metavar="F", help="shares of the batch constrained, one run each per "
                        "round (default 0 0.5 1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of runs, alternating direction (default 3)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="run the batch once, untimed, first (default on)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)
    parser.set_defaults(func=run_structured)


def _register_kv_trace(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "kv-trace", help="output tokens/s of one greedy batch with and without --kv-trace "
        "(what recording the KV allocation trace costs)"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="the batch (default 64)")
    parser.add_argument("--input-len", type=int, default=128,
                        help="random prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens every request generates (default 128)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of one run per mode, alternating order (default 3)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="run the batch once, untimed, first (default on)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)  # --kv-trace FILE: where the traced runs write (default: a temp)
    parser.set_defaults(func=run_kv_trace)


def _add_length_args(
    parser: argparse.ArgumentParser, input_len: tuple[int, int], output_len: tuple[int, int]
) -> None:
    """`--input-len MIN MAX` and `--output-len MIN MAX`: each request's length is uniform in
    the range."""
    parser.add_argument("--input-len", type=int, nargs=2, default=input_len, metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=output_len, metavar=("MIN", "MAX")
    )


def run_blocks(args: argparse.Namespace) -> int:
    from kvpool.bench import blocks

    return blocks.run(args)


def run_throughput(args: argparse.Namespace) -> int:
    from kvpool.bench import throughput

    return throughput.run(args, engine_config_from_args(args))


def run_multi_turn(args: argparse.Namespace) -> int:
    from kvpool.bench import multi_turn

    return multi_turn.run(args, engine_config_from_args(args))


def run_serve(args: argparse.Namespace) -> int:
    from kvpool.bench import serve

    # Against a running server (--base-url) the engine flags describe nothing: no config.
    engine_config = engine_config_from_args(args) if args.base_url is None else None
    return serve.run(args, engine_config)


def run_kv_capacity(args: argparse.Namespace) -> int:
    from kvpool.bench import kv_capacity

    return kv_capacity.run(args)


def run_kv_granularity(args: argparse.Namespace) -> int:
    from kvpool.bench import kv_granularity

    return kv_granularity.run(args)


def run_precision(args: argparse.Namespace) -> int:
    from kvpool.bench import precision

    return precision.run(args)


def run_structured(args: argparse.Namespace) -> int:
    from kvpool.bench import structured

    return structured.run(args, engine_config_from_args(args))


def _register_snapshot(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "snapshot", help="how long LLMEngine.kv_snapshot() and its JSON take on a large, busy "
        "pool (tiny random model)")
    parser.add_argument("--num-blocks", type=int, default=100_000,
                        help="blocks in the pool (default 100,000)")
    parser.add_argument("--fill", type=float, default=0.6,
                        help="fraction of the pool running requests hold (default 0.6)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls (default 7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_snapshot)


def run_snapshot(args: argparse.Namespace) -> int:
    from kvpool.bench import snapshot

    return snapshot.run(args)


def run_kv_trace(args: argparse.Namespace) -> int:
    from kvpool.bench import kv_trace

    return kv_trace.run(args, engine_config_from_args(args))


def _register_tp(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "tp", help="tensor parallelism: collective calls, bytes and time per step of a greedy "
        "batch at -tp N (default 2) vs 1, and a paper estimate for tp 2/4/8 on H200s")
    parser.add_argument("--estimate-only", action="store_true",
                        help="print only the paper estimate (starts no engine)")
    parser.add_argument("--num-prompts", type=int, default=8, help="the batch (default 8)")
    parser.add_argument("--input-len", type=int, default=64,
                        help="random prompt tokens per request (default 64)")
    parser.add_argument("--output-len", type=int, default=32,
                        help="tokens every request generates (default 32)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed runs per tp size, after one warm-up (default 3)")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4, 8], metavar="N",
                        help="the estimate's tp sizes (default 1 2 4 8)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64], metavar="B",
                        help="the estimate's decode batches (default 1 64)")
    parser.add_argument("--context", type=int, default=2048,
                        help="the estimate's tokens of context per sequence (default 2048)")
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="also write the JSON object to PATH")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)  # -tp N: the measured size (default here 2); --dtype default fp32
    parser.set_defaults(func=run_tp, dtype="float32")


def run_tp(args: argparse.Namespace) -> int:
    from kvpool.bench import tensor_parallel

    if args.model is None:
        args.model, args.load_format = DEFAULT_TP_MODEL, "dummy"
    engine_config = None if args.estimate_only else engine_config_from_args(args)
    return tensor_parallel.run(args, engine_config)
