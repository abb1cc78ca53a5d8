"""`kvpool bench serve --noisy-neighbour`: does one tenant's heavy input slow another tenant?

Two tenants (two API keys) on one in-process server. The quiet tenant sends the usual
`kvpool bench serve` workload (streamed completions, token-id prompts), measured twice: alone,
then beside a noisy tenant that keeps `--noisy-concurrency` of the heaviest valid requests in
flight for the whole run, in turn:

    prompt    text just under the server's character cap (`PromptLimits.max_chars`): it is
              tokenized in full before its (token-count) 400
    schema    a JSON schema just under `--max-grammar-chars`, compiled (or refused at the
              compile timeout)
    regex     `.{0,100000}`: compiles for seconds, refused at the compile timeout
    bias      a short prompt with a 300-key `logit_bias` (OpenAI's cap), run for 64 tokens

Reported: the quiet tenant's TTFT and ITL p50/p99 alone and beside the noisy tenant, their
ratios (noisy / alone; issue 28 asks for p99 within 1.5×), and what the noisy tenant's
requests got (status counts). JSON with `--json`, else a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvpool.bench.serve import SERVED_NAME, ServeWorkload, _json_safe, run_workload, summarize

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig

QUIET_KEY, NOISY_KEY = "quiet-tenant-key", "noisy-tenant-key"
NOISY_KINDS = ("prompt", "schema", "regex", "bias")
NUM_BIAS_KEYS = 300
RATIO_KEYS = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")


def noisy_body(kind: str, max_prompt_chars: int | None, max_grammar_chars: int,
               vocab_size: int, rng: random.Random) -> dict[str, Any]:
    """The heaviest valid request of `kind` (module docstring)."""
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": "Tell me a story.",
                            "max_tokens": 16, "temperature": 0}
    if kind == "prompt" and max_prompt_chars is not None:
        words = " ".join(rng.choice(("lorem", "ipsum", "dolor", "sit", "amet"))
                         for _ in range(max_prompt_chars // 4 + 1))  # words of 3+ letters
        body["prompt"] = words[:max_prompt_chars]
    elif kind == "schema":
        body["structured_outputs"] = {"json": _large_schema(max_grammar_chars)}
    elif kind == "regex":
        body["structured_outputs"] = {"regex": ".{0,100000}"}
    elif kind == "bias":
        ids = rng.sample(range(10, vocab_size), min(NUM_BIAS_KEYS, vocab_size - 10))
        body.update(logit_bias={str(token_id): -1.0 for token_id in ids}, max_tokens=64)
    return body


def _large_schema(max_chars: int) -> dict[str, Any]:
    """An object schema with as many string properties as fit in `max_chars` (compact)."""
    properties: dict[str, Any] = {}
    schema = {"type": "object", "properties": properties}
    size = len(json.dumps(schema, separators=(",", ":")))
    index = 0
    while True:
        name = f"field_{index:06d}"
        entry_chars = len(json.dumps({name: {"type": "string"}}, separators=(",", ":"))) - 1
        if size + entry_chars > max_chars:
            return schema
        properties[name] = {"type": "string"}
        size += entry_chars
        index += 1


async def _noisy_loop(base_url: str, bodies: list[dict[str, Any]], concurrency: int,
                      stop: asyncio.Event) -> Counter[str]:
    """Keep `concurrency` noisy requests in flight, cycling through `bodies`, until `stop`."""
    import httpx

    statuses: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {NOISY_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None) as http:

        async def sender(turn: int) -> None:
            while not stop.is_set():
                kind = turn % len(bodies)
                turn += 1
                try:
                    response = await http.post("/v1/completions", json=bodies[kind])
                    statuses[f"{NOISY_KINDS[kind]}:{response.status_code}"] += 1
                except httpx.HTTPError as error:
                    statuses[type(error).__name__] += 1

        await asyncio.gather(*(sender(index) for index in range(concurrency)))
    return statuses


async def _measure(base_url: str, workload: ServeWorkload, vocab_size: int,
                   noisy_bodies: list[dict[str, Any]] | None, concurrency: int
                   ) -> tuple[dict[str, Any], Counter[str]]:
    """The quiet tenant's summary (and the noisy tenant's status counts, if it runs)."""
    stop = asyncio.Event()
    noisy = None
    if noisy_bodies is not None:
        noisy = asyncio.ensure_future(_noisy_loop(base_url, noisy_bodies, concurrency, stop))
        await asyncio.sleep(0.5)  # its first requests are in flight before the quiet ones
    try:
        results, duration = await run_workload(base_url, workload, vocab_size, SERVED_NAME,
                                               QUIET_KEY, show_progress=False)
    finally:
        stop.set()
    statuses = await noisy if noisy is not None else Counter()
    return summarize(results, duration), statuses


@contextmanager
def _two_tenant_server(engine_config: EngineConfig) -> Iterator[tuple[str, Any, Any]]:
    """(base url, async engine, server config) of a server with the quiet and the noisy
    tenant's keys."""
    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.engine import LLMEngine
    from kvpool.openai.auth import ApiKeyTable
    from kvpool.server.app import build_app
    from kvpool.server.background import BackgroundServer
    from kvpool.server.config import ServerConfig

    engine = AsyncLLMEngine(LLMEngine(engine_config))
    keys = ApiKeyTable.from_keys([("quiet", QUIET_KEY), ("noisy", NOISY_KEY)])
    config = ServerConfig(served_model_names=(SERVED_NAME,), api_keys=keys,
                          max_concurrent_requests=None)
    app = build_app(engine, config)
    with BackgroundServer(app) as server:
        yield server.base_url, engine, config


def run(args: argparse.Namespace, engine_config: EngineConfig | None) -> int:
    """The noisy-neighbour benchmark (module docstring); 1 if a quiet request failed."""
    if args.base_url is not None or engine_config is None:
        raise SystemExit("kvpool bench serve --noisy-neighbour: starts its own server "
                         "(two tenants); --base-url is not supported")
    try:
        workload = ServeWorkload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                                 args.request_rate, args.max_concurrency, args.workload_seed)
    except ValueError as error:
        raise SystemExit(f"kvpool bench serve: {error}") from error
    with _two_tenant_server(engine_config) as (base_url, engine, config):
        vocab_size = engine.engine.model_config.vocab_size
        rng = random.Random(args.workload_seed)
        bodies = [noisy_body(kind, engine.prompt_limits.max_chars, config.max_grammar_chars,
                             vocab_size, rng) for kind in NOISY_KINDS]
        alone, _ = asyncio.run(_measure(base_url, workload, vocab_size, None, 0))
        beside, statuses = asyncio.run(_measure(base_url, workload, vocab_size, bodies,
                                                args.noisy_concurrency))
    result = {
        "alone": alone, "noisy": beside,
        "ratios": {key: _ratio(beside[key], alone[key]) for key in RATIO_KEYS},
        "noisy_requests": dict(sorted(statuses.items())),
        "noisy_concurrency": args.noisy_concurrency,
        "noisy_prompt_chars": len(bodies[0]["prompt"]),
        "workload": asdict(workload),
    }
    print(json.dumps(_json_safe(result)) if args.json else format_table(result))
    return 0 if alone["num_failed"] == beside["num_failed"] == 0 else 1


def _ratio(value: float, base: float) -> float | None:
    return value / base if base else None


def format_table(result: dict[str, Any]) -> str:
    alone, beside, ratios = result["alone"], result["noisy"], result["ratios"]
    lines = [f"quiet tenant: {alone['num_completed']} requests alone, "
             f"{beside['num_completed']} beside the noisy tenant "
             f"({result['noisy_concurrency']} heavy requests in flight)",
             f"{'quiet tenant (ms)':<20}{'alone':>10}{'noisy':>10}{'ratio':>8}"]
    for key in RATIO_KEYS:
        ratio = ratios[key]
        lines.append(f"{key.replace('_ms_', ' '):<20}{alone[key]:>10.1f}{beside[key]:>10.1f}"
                     + (f"{ratio:>8.2f}" if ratio is not None else f"{'-':>8}"))
    noisy = ", ".join(f"{key} x{count}" for key, count in result["noisy_requests"].items())
    lines.append(f"noisy tenant's requests: {noisy or 'none'}")
    return "\n".join(lines)
