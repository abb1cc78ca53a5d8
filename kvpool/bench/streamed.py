"""One streamed `/v1/completions` request as its client sees it: when the first chunk came,
the gaps between later ones, the usage the last one reports. The serving benchmarks
(`serve`, `disagg`) time their requests with it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StreamTimes:
    """Seconds from the send to the first chunk (`ttft`) and to the end (`latency`), the gaps
    between later chunks (`itls`), and the tokens the usage chunk reports. A failed request
    has `error` and whatever was timed before it failed."""

    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def stream_completion(http: Any, model: str, prompt: list[int],
                            max_tokens: int) -> StreamTimes:
    """Send `prompt` greedily (EOS ignored) on `http` (an httpx.AsyncClient at the server's
    base URL) and time its chunks; never raises for the request's own failure."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times = StreamTimes()
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:200]
                times.error = f"HTTP {response.status_code}: {text!r}"
                return times
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = _read_chunk(times, json.loads(line[6:]), start, last)
    except Exception as error:  # a failed request is reported, not fatal to the run
        times.error = f"{type(error).__name__}: {error}"
    times.latency = time.perf_counter() - start
    return times


def _read_chunk(times: StreamTimes, chunk: dict[str, Any], start: float, last: float) -> float:
    """Record one chunk; returns the time of the latest chunk with choices."""
    now = time.perf_counter()
    if usage := chunk.get("usage"):
        times.output_tokens = usage["completion_tokens"]
        times.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens") or 0
        return last
    if chunk.get("choices"):
        if times.ttft == 0.0:
            times.ttft = now - start
        else:
            times.itls.append(now - last)
        return now
    return last
