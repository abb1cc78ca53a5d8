"""`kvpool bench <name>`: the user-facing benchmark commands and their flags.

This module owns only the parsers. `BENCHES` is the one table of commands: each row names the
command, its help, the function that adds its own flags, and its module
`kvpool.bench.<module>`, whose `run(args)` (or `run(args, engine_config)` for a benchmark
that runs an engine) prints a table, or one JSON object with `--json`. `register` walks the
table once; every command gets `--json` unless its row says otherwise, and every engine
benchmark gets the engine flags (`add_engine_args`). Benchmark modules are imported when a
benchmark runs, never when the parser is built.

Development benchmarks (the GPU check, kernel sweeps, the vLLM and transformers baselines)
are not commands: they live in the repository's top-level `benchmarks/` package, run as
`python -m benchmarks.<name>` from a checkout, and are not shipped in the wheel.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.attention.selector import ATTENTION_BACKENDS
from kvpool.bench import scale_out  # light at import: httpx and the standard library

# Constants only: kvpool.bench.multi_turn imports nothing heavy at module level.
from kvpool.bench.multi_turn import DEFAULT_KV_CACHE_MEMORY, DEFAULT_SWAP_SPACE_GIB, TIERS
from kvpool.cli.args import add_engine_args, engine_config_from_args, parse_size
from kvpool.engine.config import PREEMPTION_MODES
from kvpool.memory.kv_layout import KV_CACHE_DTYPES
from kvpool.model.dtype import DTYPE_CHOICES
from kvpool.model.quantization import QUANTIZATION_CHOICES

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig

DEFAULT_VOCAB_SIZE = 512  # --vocab-size: every preset's vocabulary is at least this large
# `bench tp` without --model: dummy weights of a preset two ranks split (SmolLM2's 9 query
# heads do not split in two).
DEFAULT_TP_MODEL = "qwen2-0.5b"

Parser = argparse.ArgumentParser
EngineConfigFn = Callable[[argparse.Namespace], "EngineConfig | None"]


@dataclass(frozen=True)
class Bench:
    """One `kvpool bench` command. `engine_config` is None for a benchmark that runs no
    engine from the engine flags (its `run(args)` takes the namespace alone); otherwise the
    engine flags are added and `run(args, engine_config(args))` is called. `defaults`
    overrides flag defaults for this command only."""

    name: str
    help: str
    add_args: Callable[[Parser], None]
    module: str
    engine_config: EngineConfigFn | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    json_flag: bool = True
    flag_modules: Mapping[str, str] = field(default_factory=dict)  # a set flag runs another

    def module_for(self, args: argparse.Namespace) -> str:
        """The module to run: that of the first of `flag_modules`' flags set, else `module`."""
        return next((module for flag, module in self.flag_modules.items()
                     if getattr(args, flag, False)), self.module)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: a readable table, or one JSON object with --json"
    )
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for bench in BENCHES:
        bench_parser = bench_subparsers.add_parser(bench.name, help=bench.help)
        bench.add_args(bench_parser)
        if bench.json_flag:
            bench_parser.add_argument("--json", action="store_true",
                                      help="print one JSON object")
        if bench.engine_config is not None:
            add_engine_args(bench_parser)
        bench_parser.set_defaults(func=functools.partial(run_bench, bench), **bench.defaults)


def run_bench(bench: Bench, args: argparse.Namespace) -> int:
    """Import the benchmark's module and run it on `args` (and its engine config)."""
    module = importlib.import_module(f"kvpool.bench.{bench.module_for(args)}")
    if bench.engine_config is None:
        return module.run(args)
    return module.run(args, bench.engine_config(args))


def _add_length_args(
    parser: Parser, input_len: tuple[int, int], output_len: tuple[int, int]
) -> None:
    """`--input-len MIN MAX` and `--output-len MIN MAX`: each request's length is uniform in
    the range."""
    parser.add_argument("--input-len", type=int, nargs=2, default=input_len, metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=output_len, metavar=("MIN", "MAX")
    )


def _add_output_json(parser: Parser) -> None:
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="also write the JSON object to PATH")


def add_blocks_args(parser: Parser) -> None:
    parser.add_argument("--quick", action="store_true", help="few iterations (for tests)")
    parser.add_argument("--repeats", type=int, help="repeats per measurement")
    parser.add_argument("--block-size", type=int, help="tokens per block (default 16)")


def add_throughput_args(parser: Parser) -> None:
    """`kvpool bench throughput`'s own flags (also `benchmarks.throughput_baselines`', which
    adds the baselines' flags to them)."""
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64], metavar="N",
                        help="one run per N: the workload's first N prompts (default 64)")
    _add_length_args(parser, input_len=(32, 512), output_len=(64, 256))
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt shares")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, metavar="DTYPE",
                        help="repeat every run per dtype (overrides --dtype)")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=None,
                        choices=tuple(KV_CACHE_DTYPES), metavar="KV_DTYPE",
                        help="repeat the benchmark per KV storage dtype, e.g. auto int8 fp8")
    parser.add_argument("--preemption-modes", nargs="+", default=None, choices=PREEMPTION_MODES,
                        metavar="MODE", help="repeat every run per preemption mode "
                        "(overrides --preemption-mode; swap needs --swap-space), e.g. "
                        "recompute swap auto")
    parser.add_argument("--latency-tokens", type=int, default=128,
                        help="tokens of the single-request decode-latency measurement")
    _add_output_json(parser)


def add_speculative_args(parser: Parser) -> None:
    """`kvpool bench speculative`'s own flags (also `benchmarks.speculative_baselines`')."""
    parser.add_argument("--workloads", nargs="+", choices=("grounded", "open", "chat"),
                        default=["grounded", "open"], metavar="WORKLOAD",
                        help="grounded (answers copy the prompt), open (random-token prompts), "
                        "chat (open-ended chat, nothing to copy) (default grounded open)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32], metavar="N",
                        help="requests in flight, one run per N (default 1 4 32)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per run (default 8 x concurrency up to 64, at least "
                        "2 x concurrency)")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3, 5, 8],
                        metavar="K", help="one n-gram setting per K, beside off (default 3 5 8)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4,
                        help="longest n-gram looked up (default 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2,
                        help="shortest n-gram looked up (default 2)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="max_tokens of every request (default 128)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512),
                        metavar=("MIN", "MAX"), help="the open workload's prompt lengths")
    parser.add_argument("--max-passage-chars", type=int, default=1200,
                        help="the grounded workload's longest passage (default 1200)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, metavar="DTYPE",
                        help="repeat everything per dtype (overrides --dtype), e.g. float32 "
                        "bfloat16")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of one run per setting, alternating order (default 3)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="two short requests through every engine, untimed, first "
                        "(default on)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw tokens/s by concurrency and setting to PNG")
    _add_output_json(parser)


def add_multi_turn_args(parser: Parser) -> None:
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
    _add_output_json(parser)


def add_serve_args(parser: Parser) -> None:
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
    parser.add_argument("--noisy-neighbour", action="store_true",
                        help="two tenants: measure this workload alone, then beside a tenant "
                        "sending the heaviest valid inputs (kvpool.bench.serve_noisy)")
    parser.add_argument("--noisy-concurrency", type=int, default=8,
                        help="with --noisy-neighbour: its requests in flight (default 8)")


def add_precision_args(parser: Parser) -> None:
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
    parser.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                        help="the weights measured: gguf (a GGUF's blocks as stored), int8 or "
                        "int4 (quantized at load), none (default: dequantized into --dtype)")
    parser.add_argument("--reference-quantization", default="none",
                        choices=QUANTIZATION_CHOICES, help="the reference's weights (none)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per prompt (default 128; 16 with --quick)")
    parser.add_argument("--quick", action="store_true", help="4 prompts, short text (for tests)")


def add_kv_capacity_args(parser: Parser) -> None:
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF "
                        "(with --hybrid: the gemma-3-1b preset)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=2**30,
                        help="the budget, e.g. 1GiB (default)")
    parser.add_argument("--hybrid", action="store_true",
                        help="requests of each --max-model-len held at once, hybrid KV manager "
                        "on and off")
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 8192, 32768],
                        help="with --hybrid: the request lengths (default 4096 8192 32768)")
    parser.add_argument("--chunk", type=int, default=2048,
                        help="with --hybrid: prompt tokens computed per step (default 2048)")
    parser.add_argument("--long-context", action="store_true",
                        help="with --hybrid: run long prompts through engines with it on and "
                        "off instead (throughput, preemptions)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--output-len", type=int, default=32)


def add_kv_granularity_args(parser: Parser) -> None:
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--text-tokens", type=int, default=None,
                        help="score only the first N tokens of the text (default: all)")


def add_structured_args(parser: Parser) -> None:
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


def add_kv_trace_args(parser: Parser) -> None:
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


def add_snapshot_args(parser: Parser) -> None:
    parser.add_argument("--num-blocks", type=int, default=100_000,
                        help="blocks in the pool (default 100,000)")
    parser.add_argument("--fill", type=float, default=0.6,
                        help="fraction of the pool running requests hold (default 0.6)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls (default 7)")


def add_tp_args(parser: Parser) -> None:
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
    _add_output_json(parser)


def add_disagg_args(parser: Parser) -> None:
    """`kvpool bench disagg`'s flags: the processes, the mixed workload and the projection."""
    parser.add_argument("--model", default=None, help="what the servers serve (default: the "
                        "bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default=None,
                        help="the servers' --load-format (dummy: random weights of a preset)")
    parser.add_argument("--serve-args", default=None, metavar="FLAGS",
                        help="more flags for every `kvpool serve`, one string: write "
                        "--serve-args='--num-gpu-blocks 512 --no-enable-warmup'")
    parser.add_argument("--configs", nargs="+", choices=("colocated", "disagg"),
                        default=["colocated", "disagg"], metavar="CONFIG",
                        help="colocated, disagg (default both, in that order)")
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads in all: the colocated server's, split between the "
                        "disaggregated workers (default 2)")
    parser.add_argument("--prefill-threads", type=int, default=None,
                        help="of --threads, the prefill worker's (default half); the decode "
                        "worker gets the rest")
    parser.add_argument("--num-chats", type=int, default=4,
                        help="chats decoding back to back for the whole run (default 4)")
    parser.add_argument("--chat-len", type=int, nargs=2, default=(64, 128),
                        metavar=("MIN", "MAX"), help="a chat prompt's tokens (default 64 128)")
    parser.add_argument("--chat-output-len", type=int, default=64,
                        help="tokens each chat request generates (default 64)")
    parser.add_argument("--num-long", type=int, default=4, help="long prompts (default 4)")
    parser.add_argument("--long-len", type=int, default=1024,
                        help="a long prompt's tokens (default 1024)")
    parser.add_argument("--long-output-len", type=int, default=8,
                        help="tokens each long prompt generates (default 8)")
    parser.add_argument("--long-interval", type=float, default=6.0,
                        help="seconds between long prompts' arrivals (default 6)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="for a model without a tokenizer: prompt ids are drawn below this")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--probe-repeats", type=int, default=2,
                        help="after the disagg run, handovers of each size timed one at a "
                        "time (default 2; 0: none, and no projection)")
    parser.add_argument("--rdma-gbps", type=float, default=100.0,
                        help="the projection's RDMA link, Gb/s (default 100)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw the chats' inter-token latency CDFs to PNG")
    _add_output_json(parser)


def _serve_engine_config(args: argparse.Namespace) -> EngineConfig | None:
    # Against a running server (--base-url) the engine flags describe nothing: no config.
    return engine_config_from_args(args) if args.base_url is None else None


def _tp_engine_config(args: argparse.Namespace) -> EngineConfig | None:
    if args.model is None:
        args.model, args.load_format = DEFAULT_TP_MODEL, "dummy"
    return None if args.estimate_only else engine_config_from_args(args)


BENCHES: tuple[Bench, ...] = (
    Bench("blocks", "allocate/free, append and prefix-lookup speed of the block pool",
          add_blocks_args, "blocks"),
    Bench("throughput", "offline throughput on a seeded workload (vs vLLM and transformers: "
          "`python -m benchmarks.throughput_baselines` in a checkout)",
          add_throughput_args, "throughput", engine_config_from_args),
    Bench("speculative", "speculative decoding off vs n-gram (k = 3, 5, 8): output tokens/s, "
          "acceptance and ratio on grounded and open workloads at 1, 4, 32 requests in "
          "flight (vs vLLM: `python -m benchmarks.speculative_baselines` in a checkout)",
          add_speculative_args, "speculative", engine_config_from_args),
    Bench("multi-turn", "chat conversations resending their history: TTFT and throughput "
          "with the KV tiers off, host, disk, host+disk, and disk again after a restart",
          add_multi_turn_args, "multi_turn", engine_config_from_args,
          defaults={"kv_cache_memory": DEFAULT_KV_CACHE_MEMORY,
                    "swap_space": DEFAULT_SWAP_SPACE_GIB}),
    Bench("serve", "online latency/throughput over HTTP (own server, or --base-url)",
          add_serve_args, "serve", _serve_engine_config,
          flag_modules={"noisy_neighbour": "serve_noisy"}),
    Bench("precision", "bf16 vs fp32, or quantized vs float KV: where greedy decoding "
          "diverges, and the perplexity", add_precision_args, "precision"),
    Bench("kv-capacity", "KV blocks and tokens one budget holds, per kv_cache_dtype",
          add_kv_capacity_args, "kv_capacity"),
    Bench("kv-granularity", "quantized KV: perplexity with per-token vs per-block scales",
          add_kv_granularity_args, "kv_granularity"),
    Bench("structured", "output tokens/s with 0%%, 50%% and 100%% of a batch constrained by "
          "a JSON schema (structured outputs' per-step cost)",
          add_structured_args, "structured", engine_config_from_args),
    # The engine flags' --kv-trace FILE: where the traced runs write (default: a temp file).
    Bench("kv-trace", "output tokens/s of one greedy batch with and without --kv-trace "
          "(what recording the KV allocation trace costs)",
          add_kv_trace_args, "kv_trace", engine_config_from_args),
    Bench("snapshot", "how long LLMEngine.kv_snapshot() and its JSON take on a large, busy "
          "pool (tiny random model)", add_snapshot_args, "snapshot"),
    # The engine flags' -tp N is the measured size (default here 2); --dtype defaults to fp32.
    Bench("tp", "tensor parallelism: collective calls, bytes and time per step of a greedy "
          "batch at -tp N (default 2) vs 1, and a paper estimate for tp 2/4/8 on H200s",
          add_tp_args, "tensor_parallel", _tp_engine_config, defaults={"dtype": "float32"}),
    # Its flags live beside it; it prints JSON always.
    Bench("scale-out", "multi-turn chat over replicas behind `kvpool router`: round-robin "
          "vs prefix-aware routing vs prefix-aware with a shared Redis KV tier",
          scale_out.add_args, "scale_out", json_flag=False),
    Bench("disagg", "short chats beside long prompts, colocated vs disaggregated prefill/"
          "decode: the chats' inter-token latency, TTFTs, the KV handover's cost, and a "
          "paper projection to RDMA", add_disagg_args, "disagg"),
)
