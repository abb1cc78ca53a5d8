"""`kvpool bench serve`: an online benchmark client for the OpenAI-compatible server.

Requests arrive as a Poisson process at `--request-rate` per second (inf: all at once), and at
most `--max-concurrency` run at a time when that is given. Each is a streamed /v1/completions
call with a prompt of random token ids (length uniform in `--input-len`) that generates exactly
its output length (uniform in `--output-len`; EOS ignored, greedy). Without `--base-url` the
benchmark starts its own server in-process on a loopback port, with the engine flags given.

Per request it measures, on the client side:
    TTFT  time to first token: request sent -> first streamed chunk
    ITL   inter-token latency: the gaps between successive chunks
    TPOT  time per output token: (latency - TTFT) / (output tokens - 1)
and over the run: request and token throughput. Reported as mean, p50 and p99, in a table or,
with `--json`, one JSON object (`ttft_ms_p50`, `ttft_ms_p99`, `tpot_ms_p50`, `itl_ms_p99`,
`output_tokens_per_s`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvpool.bench.streamed import stream_completion

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig

SERVED_NAME = "bench"
MIN_TOKEN_ID = 10  # the lowest ids are special tokens in common vocabularies
PERCENTILES = (50, 99)


@dataclass(frozen=True, slots=True)
class ServeWorkload:
    num_prompts: int = 64
    input_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (32, 128)
    request_rate: float = math.inf  # requests per second (Poisson); inf: all at t=0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_prompts, *self.input_len, *self.output_len) < 1:
            raise ValueError("--num-prompts and the lengths must be at least 1")
        if self.request_rate <= 0 or (self.max_concurrency or 1) < 1:
            raise ValueError("--request-rate and --max-concurrency must be positive")

    def requests(self, vocab_size: int) -> list[tuple[float, list[int], int]]:
        """(arrival offset in seconds, prompt token ids, output length) per request."""
        rng = random.Random(self.seed)
        arrival, requests = 0.0, []
        for _ in range(self.num_prompts):
            prompt = [rng.randrange(MIN_TOKEN_ID, vocab_size)
                      for _ in range(rng.randint(*self.input_len))]
            requests.append((arrival, prompt, rng.randint(*self.output_len)))
            if math.isfinite(self.request_rate):
                arrival += rng.expovariate(self.request_rate)
        return requests


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None


async def _send(http, model: str, prompt: list[int], output_len: int) -> RequestResult:
    """One streamed completion, timed from the client's side."""
    times = await stream_completion(http, model, prompt, output_len)
    return RequestResult(len(prompt), times.output_tokens, times.ttft, times.latency,
                         times.itls, times.error)


async def run_workload(
    base_url: str, workload: ServeWorkload, vocab_size: int, model: str, api_key: str | None,
    show_progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send the workload; returns every request's result and the run's duration."""
    import httpx
    from tqdm.auto import tqdm

    requests = workload.requests(vocab_size)
    limit = asyncio.Semaphore(workload.max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr,
                    disable=not show_progress)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None,
                                 limits=limits) as http:
        start = time.perf_counter()

        async def one(arrival: float, prompt: list[int], output_len: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            async with limit:
                result = await _send(http, model, prompt, output_len)
            progress.update(1)
            return result

        results = await asyncio.gather(*(one(*request) for request in requests))
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float) -> dict[str, float | int]:
    """Latency statistics (milliseconds) and throughput of the successful requests."""
    import numpy as np

    done = [result for result in results if result.error is None]
    num_output = sum(result.output_len for result in done)
    summary: dict[str, float | int] = {
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": num_output / duration,
        "total_tokens_per_s": (num_output + sum(r.prompt_len for r in done)) / duration,
    }
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [itl for r in done for itl in r.itls],
        "e2e": [r.latency for r in done],
    }
    for name, values in samples.items():
        values_ms = np.asarray(values or [math.nan]) * 1e3
        summary[f"{name}_ms_mean"] = float(values_ms.mean())
        for q in PERCENTILES:
            summary[f"{name}_ms_p{q}"] = float(np.percentile(values_ms, q))
    return summary


def format_table(summary: dict[str, object]) -> str:
    lines = [
        f"requests: {summary['num_completed']} completed, {summary['num_failed']} failed "
        f"in {summary['duration_s']:.2f} s",
        f"throughput: {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_tokens_per_s']:.1f} output tok/s, "
        f"{summary['total_tokens_per_s']:.1f} total tok/s",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = [summary[f"{name}_ms_{stat}"] for stat in ("mean", "p50", "p99")]
        lines.append(f"{name.upper():<14}" + "".join(f"{value:>10.1f}" for value in values))
    return "\n".join(lines)


@contextmanager
def _in_process_server(engine_config: EngineConfig) -> Iterator[tuple[str, int]]:
    """(base url, vocabulary size) of a server started here on the engine configured."""
    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.cpu_threads import reserve_front_end_core
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.model_loading import resolve_device
    from kvpool.server.app import build_app
    from kvpool.server.background import BackgroundServer
    from kvpool.server.config import ServerConfig

    reserve_front_end_core(engine_config.load.cpu_threads,
                           resolve_device(engine_config.load.device))
    engine = AsyncLLMEngine(LLMEngine(engine_config))
    app = build_app(engine, ServerConfig(served_model_names=(SERVED_NAME,),
                                         max_concurrent_requests=None))
    with BackgroundServer(app) as server:
        yield server.base_url, engine.engine.model_config.vocab_size


def run(args: argparse.Namespace, engine_config: EngineConfig | None) -> int:
    """The benchmark of `kvpool bench serve` (flags: kvpool.cli.bench): against
    `args.base_url`, or else a server started here on `engine_config`. Returns 1 if a request
    failed."""
    try:
        workload = ServeWorkload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                                 args.request_rate, args.max_concurrency, args.workload_seed)
    except ValueError as error:
        raise SystemExit(f"kvpool bench serve: {error}") from error
    with _server(args, engine_config) as (base_url, vocab_size):
        model = args.served_model_name or (SERVED_NAME if args.base_url is None else None)
        results, duration = asyncio.run(
            run_workload(base_url, workload, vocab_size, model, args.api_key)
        )
    summary = {**summarize(results, duration), "workload": asdict(workload),
               "base_url": args.base_url}
    print(json.dumps(_json_safe(summary)) if args.json else format_table(summary))
    return 0 if summary["num_failed"] == 0 else 1


def _json_safe(value: object) -> object:
    """inf and NaN (an unlimited rate, a statistic with no sample) become null in JSON."""
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@contextmanager
def _server(
    args: argparse.Namespace, engine_config: EngineConfig | None
) -> Iterator[tuple[str, int]]:
    if args.base_url is not None:
        yield args.base_url.rstrip("/"), args.vocab_size
        return
    assert engine_config is not None, "an in-process server needs an engine config"
    with _in_process_server(engine_config) as server:
        yield server
