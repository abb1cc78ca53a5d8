"""`kvpool bench scale-out`: multi-turn chat over replicas behind `kvpool router`.

Workload (seeded): `--num-sessions` chat sessions of `--num-turns` turns, starting
`--session-interval` seconds apart, each sending its next turn `--think-time` seconds after the
last reply: chats about a document. The first turn pastes `--first-words` words of prose
(`heldout_text`), each later turn adds `--user-words` more (both ±50%, so sessions drift out
of lockstep); every turn resends the whole conversation (`/v1/chat/completions`, streamed,
greedy: every earlier user message and the assistant's replies) and generates exactly
`--output-len` tokens. Sessions open with different windows of the text, so they share no
prefix beyond the chat template's first tokens.

Configurations, each on fresh processes (`--replicas` `kvpool serve` replicas with KV events
on, `--threads-per-replica` threads each, and a `kvpool router` in front), one at a time:
  round-robin     the router's `--policy round-robin`; no shared tier
  prefix          `--policy prefix` (the longest cached prefix, load-capped)
  prefix+shared   `--policy prefix`, replicas share a KV tier in a private redis-server
  round-robin+shared  (not run by default) round-robin over replicas sharing that tier
What it reports per configuration, from the client's side: output tok/s, TTFT p50/p99 of turns
after the first (`later_ttft_ms_*`) and of first turns, the cache hit rate of later turns
(`usage.prompt_tokens_details.cached_tokens` / prompt tokens), and the router's decisions by
reason; `ttft_p50_speedup` is round-robin's later-turn TTFT p50 over each configuration's.

`projection` is a paper model (`project`), not a measurement: TTFT = t0 + uncached tokens /
prefill rate, both fitted by least squares over the prefix run's turns, and the uncached
tokens each policy leaves at N replicas if sessions were assigned as it assigns them
(round-robin: a turn lands on a replica that served the conversation's latest earlier turn
with probability 1/N; prefix: always). It ignores queueing and eviction (which only widen the
gap: round-robin asks every replica to cache every conversation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpool.bench.processes import ManagedProcess, free_port, start_kvpool, start_redis

CONFIGS = ("round-robin", "prefix", "prefix+shared", "round-robin+shared")
DEFAULT_CONFIGS = CONFIGS[:3]
PROJECTED_REPLICAS = (2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class ChatSessions:
    """Chats about a document: the first turn pastes `first_words` words, each later turn asks
    about `user_words` more (both ±50%, seeded, so sessions drift out of lockstep)."""

    num_sessions: int = 8
    num_turns: int = 4
    first_words: int = 400
    user_words: int = 40
    output_len: int = 32
    seed: int = 0
    session_interval: float = 2.0  # seconds between session starts
    think_time: float = 2.0  # seconds a user takes between a reply and the next turn

    def user_messages(self) -> list[list[str]]:
        """Each session's user message per turn: windows of the held-out prose."""
        from kvpool.bench.heldout_text import TEXT

        words, rng = TEXT.split(), random.Random(self.seed)

        def window(mean: int) -> str:
            size = min(len(words) - 1, rng.randint((mean + 1) // 2, mean * 3 // 2))
            start = rng.randrange(len(words) - size)
            return " ".join(words[start:start + size])

        return [[window(self.first_words if turn == 0 else self.user_words)
                 for turn in range(self.num_turns)] for _ in range(self.num_sessions)]


@dataclass(slots=True)
class Turn:
    session: int
    turn: int
    ttft: float = 0.0  # seconds, request sent -> first content
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


@dataclass(slots=True)
class ConfigResult:
    config: str
    wall_s: float
    output_tokens_per_s: float
    later_ttft_ms_p50: float
    later_ttft_ms_p99: float
    first_ttft_ms_p50: float
    later_hit_rate: float
    routing: dict[str, float] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)


# ---------------------------------------------------------------- the client
async def _chat(http: httpx.AsyncClient, messages: list[dict[str, str]], output_len: int,
                result: Turn) -> None:
    body = {"model": "bench", "messages": messages, "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    pieces: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if not pieces:
                        result.ttft = time.perf_counter() - start
                    pieces.append(content)
            if usage := chunk.get("usage"):
                result.prompt_tokens = usage["prompt_tokens"]
                result.output_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens") or 0
    result.latency = time.perf_counter() - start
    result.text = "".join(pieces)


async def _session(http: httpx.AsyncClient, index: int, messages_by_turn: list[str],
                   sessions: ChatSessions) -> list[Turn]:
    conversation: list[dict[str, str]] = []
    turns = []
    await asyncio.sleep(index * sessions.session_interval)
    for turn, user in enumerate(messages_by_turn):
        if turn:
            await asyncio.sleep(sessions.think_time)
        conversation.append({"role": "user", "content": user})
        result = Turn(index, turn)
        await _chat(http, conversation, sessions.output_len, result)
        conversation.append({"role": "assistant", "content": result.text})
        turns.append(result)
    return turns


async def run_sessions(base_url: str, sessions: ChatSessions) -> tuple[list[Turn], float]:
    """Every session's turns (closed loop, all sessions at once) and the wall time."""
    messages = sessions.user_messages()
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as http:
        start = time.perf_counter()
        per_session = await asyncio.gather(*(
            _session(http, index, turns, sessions)
            for index, turns in enumerate(messages)))
    return [turn for turns in per_session for turn in turns], time.perf_counter() - start


# ---------------------------------------------------------------- processes
def _replica_args(args: argparse.Namespace, redis_url: str | None) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:*"}
    replica = ["--served-model-name", "bench", "--kv-cache-memory", str(args.kv_cache_memory),
               "--kv-events-config", json.dumps(events)]
    if args.model:
        replica.insert(0, args.model)
    return replica + (["--kv-shared-redis", redis_url] if redis_url else [])


def run_config(config: str, args: argparse.Namespace, sessions: ChatSessions,
               redis_url: str | None) -> ConfigResult:
    """Fresh replicas and router for one configuration, the workload, then everything stops."""
    env = {"OMP_NUM_THREADS": str(args.threads_per_replica)}
    started: list[ManagedProcess] = []
    try:
        urls = []
        for index in range(args.replicas):
            port = free_port()
            started.append(start_kvpool(f"replica{index}", "serve", _replica_args(
                args, redis_url if config.endswith("+shared") else None), port, env))
            urls.append(f"http://127.0.0.1:{port}")
        router_port = free_port()
        policy = "round-robin" if config.startswith("round-robin") else "prefix"
        router_args = [f"--replica={url}" for url in urls] + ["--policy", policy]
        if args.model:
            router_args += ["--model", args.model]
        started.append(start_kvpool("router", "router", router_args, router_port))
        base_url = f"http://127.0.0.1:{router_port}"
        turns, wall = asyncio.run(run_sessions(base_url, sessions))
        routing = _router_decisions(base_url)
    finally:
        for process in reversed(started):
            process.stop()
    return summarize(config, turns, wall, routing)


def _router_decisions(base_url: str) -> dict[str, float]:
    """The router's kvpool_router_* counters from its /metrics, summed by their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvpool_router_") and sample.name.endswith("_total"):
                label = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items())
                                 if key != "replica")
                key = f"{sample.name}{{{label}}}" if label else sample.name
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


# ---------------------------------------------------------------- the report
def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(config: str, turns: list[Turn], wall: float, routing: dict[str, float]
              ) -> ConfigResult:
    later = [turn for turn in turns if turn.turn > 0]
    first = [turn for turn in turns if turn.turn == 0]
    prompt = sum(turn.prompt_tokens for turn in later)
    return ConfigResult(
        config=config, wall_s=wall,
        output_tokens_per_s=sum(turn.output_tokens for turn in turns) / wall,
        later_ttft_ms_p50=1e3 * _percentile([turn.ttft for turn in later], 50),
        later_ttft_ms_p99=1e3 * _percentile([turn.ttft for turn in later], 99),
        first_ttft_ms_p50=1e3 * _percentile([turn.ttft for turn in first], 50),
        later_hit_rate=sum(turn.cached_tokens for turn in later) / max(1, prompt),
        routing=routing, turns=turns)


def project(results: dict[str, ConfigResult], replicas: tuple[int, ...] = PROJECTED_REPLICAS
            ) -> dict[str, Any]:
    """Paper TTFT of later turns at N replicas (module docstring): needs the prefix run."""
    prefix = results.get("prefix") or results.get("prefix+shared")
    if prefix is None:
        return {}
    # TTFT = t0 + uncached / rate, fitted (least squares) over every turn of the prefix run.
    uncached = [turn.prompt_tokens - turn.cached_tokens for turn in prefix.turns]
    slope, t0 = statistics.linear_regression(uncached, [turn.ttft for turn in prefix.turns])
    rate, t0 = 1 / max(slope, 1e-9), max(0.0, t0)
    later = [turn for turn in prefix.turns if turn.turn > 0]
    by_turn = {(turn.session, turn.turn): turn for turn in prefix.turns}
    out: dict[str, Any] = {"prefill_tokens_per_s": rate, "t0_ms": 1e3 * t0}
    for count in replicas:
        miss = 1 - 1 / count
        rr, pa = [], []
        for turn in later:
            uncached_rr = 0.0  # expectation over which earlier turn this replica served last
            for back in range(1, turn.turn + 1):
                held = by_turn[(turn.session, turn.turn - back)]
                cached = held.prompt_tokens + held.output_tokens
                uncached_rr += (miss ** (back - 1)) * (1 / count) * (turn.prompt_tokens - cached)
            uncached_rr += (miss ** turn.turn) * turn.prompt_tokens
            rr.append(t0 + uncached_rr / rate)
            pa.append(t0 + (turn.prompt_tokens - turn.cached_tokens) / rate)
        out[f"{count}_replicas"] = {
            "round_robin_ttft_ms_p50": 1e3 * statistics.median(rr),
            "prefix_ttft_ms_p50": 1e3 * statistics.median(pa),
            "speedup": statistics.median(rr) / statistics.median(pa)}
    return out


def report(results: dict[str, ConfigResult]) -> dict[str, Any]:
    base = results.get("round-robin")
    table = {}
    for name, result in results.items():
        row = {key: value for key, value in asdict(result).items() if key != "turns"}
        if base is not None:
            row["ttft_p50_speedup"] = base.later_ttft_ms_p50 / result.later_ttft_ms_p50
        table[name] = row
    return {"configs": table, "projection": project(results)}


def run(args: argparse.Namespace) -> int:
    sessions = ChatSessions(args.num_sessions, args.num_turns, args.first_words,
                            args.user_words, args.output_len, args.workload_seed,
                            args.session_interval, args.think_time)
    results: dict[str, ConfigResult] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-scale-out-") as scratch:
        redis, redis_url = (start_redis(Path(scratch), args.redis_maxmemory)
                            if any(name.endswith("+shared") for name in args.configs)
                            else (None, None))
        try:
            for config in args.configs:
                results[config] = run_config(config, args, sessions, redis_url)
                print(f"{config}: later-turn TTFT p50 {results[config].later_ttft_ms_p50:.0f} "
                      f"ms, hit rate {results[config].later_hit_rate:.2f}", flush=True)
        finally:
            if redis is not None:
                redis.stop()
    body = report(results)
    text = json.dumps(body, indent=2)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    print(text)
    return 0


def add_args(parser: argparse.ArgumentParser) -> None:
    """`kvpool bench scale-out`'s flags (registered by `kvpool.cli.bench`)."""
    parser.add_argument("--model", default=None, help="what the replicas serve (default: "
                        "the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--kv-cache-memory", type=int, default=200 * 2**20,
                        help="bytes of device KV per replica (the default holds about half "
                        "the sessions' conversations in fp32 SmolLM2: what prefix routing "
                        "gives each replica, while round-robin asks each for all of them)")
    parser.add_argument("--num-sessions", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--first-words", type=int, default=400,
                        help="words of the document a session's first turn pastes (±50%%)")
    parser.add_argument("--user-words", type=int, default=40,
                        help="new words per later user turn (±50%%)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--session-interval", type=float, default=2.0,
                        help="seconds between session starts")
    parser.add_argument("--think-time", type=float, default=2.0,
                        help="seconds between a reply and the session's next turn")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(DEFAULT_CONFIGS))
    parser.add_argument("--redis-maxmemory", default="1gb")
    parser.add_argument("--output-json", default=None, metavar="PATH")
