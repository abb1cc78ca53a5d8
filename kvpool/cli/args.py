"""The flags every engine-running command shares, defined once: engine flags with vLLM's
names (`add_engine_args` -> `engine_config_from_args`), sampling flags (`add_sampling_args` ->
`sampling_params_from_args`) and `parse_size` for byte sizes such as `512MiB`.

vLLM's flags that kvpool has no counterpart for (`--enforce-eager`, `--trust-remote-code`,
...) are accepted in their own group, from the one table of them
(`kvpool.engine.vllm_compat`): at a neutral value with one warning, otherwise refused.

Light on purpose (no torch): commands register these flags when `kvpool --help` builds its
parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any

from kvpool.attention.selector import ATTENTION_BACKENDS
from kvpool.engine.config import DEFAULT_KV_DISK_CACHE_SIZE, PREEMPTION_MODES, EngineConfig
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.vllm_compat import VLLM_ARGS, VLLMArg, ignore_vllm_args
from kvpool.memory.elastic_pool import ElasticPoolConfig
from kvpool.memory.kv_layout import KV_CACHE_DTYPES
from kvpool.memory.kv_pool import KV_POOL_MODES
from kvpool.model.dtype import DTYPE_CHOICES

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """`512MiB`, `1.5GB`, `65536` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 1GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_json_object(text: str) -> dict[str, Any]:
    """`{"temperature": 0.5}` -> a dict (vLLM's JSON-valued flags)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine flags; the model is `--model`, or a positional MODEL (as `vllm serve`)."""
    group = parser.add_argument_group("engine")
    model_help = ("GGUF file, HF directory, Hugging Face Hub id in the local cache (org/name) "
                  "or dummy preset (default: SmolLM2)")
    if model_positional:
        group.add_argument("model", nargs="?", default=None, help=model_help)
    else:
        group.add_argument("--model", default=None, help=model_help)
    group.add_argument(
        "--load-format", default="auto", choices=("auto", "gguf", "safetensors", "dummy")
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="auto: bfloat16 where the device runs it natively (CUDA sm80+, a CPU with "
        "AVX-512 BF16 or AMX), else float32",
    )
    group.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=None,
                       help="KV blocks (over memory)")
    group.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        type=parse_size,
        default=None,
        help="KV cache size, e.g. 512MiB (CPU default 2GiB)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=tuple(KV_CACHE_DTYPES),
        help="KV cache storage: auto (the model's dtype), a float dtype, or int8 / fp8 "
        "(= fp8_e4m3) / fp8_e5m2 with a float32 scale per token and KV head",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA; on the CPU the C++ decode kernel (cpu) when it builds, "
        "else the PyTorch reference (torch)",
    )
    group.add_argument(
        "--enable-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a dummy batch at start-up so the first request pays no first-use costs",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,DIR}",
        help="requests' sampling defaults: auto (the model's generation_config.json), vllm "
        "(none), or a directory holding a generation_config.json",
    )
    group.add_argument(
        "--override-generation-config",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help='merged over those defaults, e.g. \'{"temperature": 0.5}\'',
    )
    group.add_argument(
        "--kv-trace",
        default=None,
        metavar="FILE",
        help="write every KV block allocation, free, hit, eviction, preemption and resize to "
        "FILE, one JSON line each (kvpool.formats.kv_trace)",
    )
    _add_kv_pool_args(parser)
    _add_kv_tier_args(parser)
    _add_parallel_args(parser)
    _add_vllm_compat_args(parser)


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensor parallelism (kvpool.engine.parallel)")
    group.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many ranks (spawned worker processes, or torchrun's "
        "ranks: torchrun --nproc-per-node 2 -m kvpool serve -tp 2)",
    )
    group.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=60.0,
        help="how long a collective waits for a peer before the step fails (a hung worker "
        "becomes an error)",
    )
    group.add_argument(
        "--tensor-parallel-overlap-chunks",
        type=int,
        default=1,
        help="all-reduce each row-parallel layer's output in this many pieces, each in flight "
        "while the next is computed (1: one all-reduce, no overlap)",
    )


def _add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "accepted for vLLM compatibility",
        "vLLM flags kvpool has no counterpart for: ignored, with a warning, at values that "
        "change nothing here; refused otherwise",
    )
    for arg in VLLM_ARGS:
        if arg.flag is None:
            continue
        if arg.flag is bool:
            group.add_argument(arg.flag_name, *arg.aliases, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=_compat_help(arg))
        else:
            group.add_argument(arg.flag_name, *arg.aliases, type=arg.flag, metavar="VALUE",
                               default=argparse.SUPPRESS, help=_compat_help(arg))


def _compat_help(arg: VLLMArg) -> str:
    """What a compatibility flag accepts, in the terms of a command line (no None)."""
    if arg.neutral is None:
        return f"ignored: {arg.reason}"
    values = [_spelling(arg, value) for value in arg.neutral if value is not None]
    values += ["the model"] if arg.names_model else []
    if not values:
        return f"refused: {arg.supported}"
    return f"{', '.join(values)} accepted, and ignored: {arg.reason}"


def _spelling(arg: VLLMArg, value: object) -> str:
    """A value as a command line gives it: a bool as its flag (--x / --no-x), else as text."""
    if arg.flag is bool:
        return arg.flag_name if value else "--no-" + arg.flag_name.removeprefix("--")
    return str(value)


def _add_kv_tier_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV tiers below the device pool")
    group.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of host memory (pinned on CUDA) for swapped-out sequences and prefix blocks "
        "the device pool evicts (0: no host tier)",
    )
    group.add_argument(
        "--preemption-mode",
        default="auto",
        choices=PREEMPTION_MODES,
        help="what a preempted sequence's KV becomes: recompute (dropped), swap (to the host "
        "tier and back), auto (the cheaper of the two per victim, by measured copy and "
        "prefill rates)",
    )
    group.add_argument(
        "--kv-disk-cache",
        default=None,
        metavar="DIR",
        help="keep full prefix blocks in DIR (salted-hash keyed files, LRU within "
        "--kv-disk-cache-size); a restarted engine finds them",
    )
    group.add_argument(
        "--kv-disk-cache-size",
        type=parse_size,
        default=DEFAULT_KV_DISK_CACHE_SIZE,
        help=f"bytes the disk tier may hold (default {DEFAULT_KV_DISK_CACHE_SIZE >> 30}GiB)",
    )
    group.add_argument(
        "--kv-shared-redis",
        default=None,
        metavar="URL",
        help="share full prefix blocks with every replica naming the same Redis "
        "(redis://host:port/db), below the host and disk tiers; its capacity is Redis's "
        "maxmemory with maxmemory-policy allkeys-lru",
    )
    group.add_argument(
        "--kv-shared-redis-timeout",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="a Redis call slower than this counts as Redis down: the engine goes on without "
        "the shared tier until Redis answers again",
    )
    group.add_argument(
        "--kv-events-config",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help='publish KV events, as vLLM does: \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
    )


def _add_kv_pool_args(parser: argparse.ArgumentParser) -> None:
    defaults = ElasticPoolConfig()
    group = parser.add_argument_group("KV pool (elastic options are rejected with static)")
    group.add_argument(
        "--kv-pool",
        default="static",
        choices=KV_POOL_MODES,
        help="static: the whole KV budget online at start; elastic: grow by segments under "
        "pressure, give idle segments back",
    )
    group.add_argument(
        "--kv-pool-initial-blocks",
        type=int,
        default=None,
        help="elastic: blocks online at start and never given back, in whole segments "
        "(0: lazy, everything given back when idle; default: one segment)",
    )
    group.add_argument(
        "--kv-pool-segment-blocks",
        type=int,
        default=None,
        help=f"elastic: blocks per segment (default {defaults.segment_blocks})",
    )
    group.add_argument(
        "--kv-pool-idle-seconds",
        type=float,
        default=None,
        help="elastic: how long a segment's worth of blocks must stay free before it is "
        f"given back (default {defaults.idle_seconds:g})",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An EngineConfig from the parsed flags (ValueError, with the field named, if invalid;
    also for a vLLM compatibility flag at a value kvpool cannot honour)."""
    ignore_vllm_args(getattr(args, "model", None), {
        arg.name: getattr(args, arg.name) for arg in VLLM_ARGS
        if arg.flag is not None and hasattr(args, arg.name)})
    names = {field.name for field in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("-n", type=int, default=1, help="completions per prompt")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--sampling-seed", type=int, default=None)
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
