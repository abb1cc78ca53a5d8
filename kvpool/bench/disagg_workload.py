"""The workload of `kvpool bench disagg` and its client: chats decoding back to back while long
prompts arrive, streamed through `/v1/completions` and timed chunk by chunk (TTFT, ITLs).

Prompts are token ids, cut as windows from one source (`prompt_source`): the held-out prose
in the model's tokenizer, or seeded random ids for a model without one. Every window starts at
its own seeded offset (wrapping round the source's end), so long prompts share no prefix.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.bench.streamed import stream_completion

MIN_TOKEN_ID = 10  # the lowest ids are special tokens in common vocabularies


@dataclass(frozen=True, slots=True)
class MixedWorkload:
    """`num_chats` chats, each sending prompts of `chat_len` tokens (uniform in the range) one
    after another, `chat_output_len` tokens each, until the long prompts are done; long
    prompt i (from 0) of `long_len` tokens arrives at (i + 1) x `long_interval` seconds, so
    the chats first decode alone, and generates `long_output_len` tokens."""

    num_chats: int = 4
    chat_len: tuple[int, int] = (64, 128)
    chat_output_len: int = 64
    num_long: int = 4
    long_len: int = 1024
    long_output_len: int = 8
    long_interval: float = 6.0  # seconds between long prompts' arrivals
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_chats, *self.chat_len, self.chat_output_len, self.num_long,
               self.long_len, self.long_output_len) < 1:
            raise ValueError("the bench's counts and lengths must be at least 1")
        if self.chat_len[0] > self.chat_len[1] or self.long_interval < 0:
            raise ValueError("--chat-len is MIN MAX; --long-interval is not negative")

    def long_prompts(self, source: list[int]) -> list[list[int]]:
        """`num_long` windows of `long_len` tokens, each at its own start."""
        return [_window(source, start, self.long_len) for start in self._long_starts(source)]

    def chat_prompts(self, source: list[int], chat: int) -> Iterator[list[int]]:
        """Chat `chat`'s prompts, endless: windows of `chat_len` tokens at seeded starts, none
        at a long prompt's (which would give that prompt a cached prefix)."""
        rng, taken = random.Random(f"{self.seed}:chat:{chat}"), self._long_starts(source)
        while True:
            length = rng.randint(*self.chat_len)
            yield _window(source, _fresh_start(rng, len(source), taken), length)

    def probe_prompts(self, source: list[int], repeats: int) -> dict[str, list[list[int]]]:
        """`repeats` prompts of the longest chat length and of `long_len`, none starting where
        a long prompt does (so none finds its blocks cached)."""
        rng, taken = random.Random(f"{self.seed}:probe"), self._long_starts(source)
        lengths = {"chat": self.chat_len[1], "long": self.long_len}
        return {kind: [_window(source, _fresh_start(rng, len(source), taken), length)
                       for _ in range(repeats)] for kind, length in lengths.items()}

    def _long_starts(self, source: list[int]) -> list[int]:
        return random.Random(f"{self.seed}:long").sample(range(len(source)), self.num_long)


def _fresh_start(rng: random.Random, size: int, taken: list[int]) -> int:
    """A start in [0, size) that is not in `taken`."""
    while (start := rng.randrange(size)) in taken:
        pass
    return start


def _window(source: list[int], start: int, length: int) -> list[int]:
    """`length` tokens of `source` from `start`, wrapping round its end."""
    return [source[(start + offset) % len(source)] for offset in range(length)]


def prompt_source(model: str | None, vocab_size: int, seed: int = 0) -> list[int]:
    """The token ids prompts are cut from: the held-out prose in the model's tokenizer, or
    seeded random ids below `vocab_size` for a model without a tokenizer."""
    from kvpool.router.prompt_tokens import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is not None:
        from kvpool.bench.heldout_text import TEXT

        return tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(f"{seed}:ids")
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(4096)]


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (a failed one has `error` and no timings)."""

    kind: str  # "chat" or "long"
    prompt_tokens: int
    ttft: float = 0.0  # seconds, request sent -> first streamed chunk
    itls: list[float] = field(default_factory=list)  # gaps between later chunks
    output_tokens: int = 0
    cached_tokens: int = 0  # on disagg: what the decode worker loaded (or had)
    error: str | None = None


@dataclass(slots=True)
class ConfigResult:
    """One configuration's run: every request, and on disagg the decode worker's transfer
    figures (None without its counters) and the probe's (blocks, seconds) points by kind."""

    config: str
    wall_s: float
    requests: list[RequestResult]
    block_size: int
    transfer: dict[str, Any] | None = None
    probe: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


# ---------------------------------------------------------------- the client
async def _stream(http: httpx.AsyncClient, result: RequestResult, prompt: list[int],
                  max_tokens: int) -> RequestResult:
    """One streamed completion, its chunks' arrival times read as TTFT and ITLs."""
    times = await stream_completion(http, "bench", prompt, max_tokens)
    result.ttft, result.itls, result.error = times.ttft, times.itls, times.error
    result.output_tokens, result.cached_tokens = times.output_tokens, times.cached_tokens
    return result


async def _chat(http: httpx.AsyncClient, prompts: Iterator[list[int]], output_len: int,
                done: asyncio.Event) -> list[RequestResult]:
    """One chat: a request, then the next, until `done` (at least one request)."""
    results = []
    while not (results and done.is_set()):
        prompt = next(prompts)
        results.append(await _stream(http, RequestResult("chat", len(prompt)), prompt,
                                     output_len))
    return results


async def _long(http: httpx.AsyncClient, prompt: list[int], arrival: float,
                workload: MixedWorkload) -> RequestResult:
    await asyncio.sleep(arrival)
    return await _stream(http, RequestResult("long", len(prompt)), prompt,
                         workload.long_output_len)


async def run_workload(base_url: str, workload: MixedWorkload, source: list[int]
                       ) -> tuple[list[RequestResult], float]:
    """Every request's result (chats', then long prompts') and the run's wall time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as http:
        done = asyncio.Event()
        start = time.perf_counter()
        chats = [asyncio.create_task(_chat(http, workload.chat_prompts(source, chat),
                                           workload.chat_output_len, done))
                 for chat in range(workload.num_chats)]
        longs = await asyncio.gather(*(
            _long(http, prompt, (index + 1) * workload.long_interval, workload)
            for index, prompt in enumerate(workload.long_prompts(source))))
        done.set()
        per_chat = await asyncio.gather(*chats)
    wall = time.perf_counter() - start
    return [result for results in per_chat for result in results] + list(longs), wall
