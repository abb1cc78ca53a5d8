"""A bounded soak: hundreds of concurrent requests of mixed shapes through a pool small enough
to force preemption, some clients leaving mid-stream or mid-wait, some sending garbage.

Afterwards: no 5xx, every well-formed request either completed (finish reason stop/length) or
was abandoned by its own client, the preemption counter moved, no engine step failed, and the
pool is back to no block in use (the fixture then checks the pool's invariants)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

import httpx

from tests.server.conftest import MODEL, scrape

NUM_REQUESTS = 300
SOAK_TIMEOUT_SECONDS = 120
WORDS = ("harbour", "lamp", "keeper", "stair", "night", "ship", "rock", "wave", "light", "bell",
         "rope", "tide")
MALFORMED = [
    b'{"prompt": "unterminated',
    b'{"prompt": "hi", "max_tokens": "many"}',
    b'{"prompt": "hi", "n": 99}',
    b'{"prompt": "hi", "temperature": -2}',
    b'{"messages": [{"role": "robot"}]}',
    json.dumps({"prompt": "lamp " * 400}).encode(),  # beyond max_model_len
]


@dataclass
class Outcome:
    kind: str
    status: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)
    left_early: bool = False
    saw_done: bool = False


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 90)))


async def _completion(http: httpx.AsyncClient, rng: random.Random) -> Outcome:
    body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": rng.randint(1, 24),
            "n": rng.choice([1, 1, 1, 2]), "temperature": rng.choice([0.0, 1.0])}
    if rng.random() < 0.15:  # a client that gives up waiting
        try:
            await http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
        except httpx.ReadTimeout:
            return Outcome("completion", left_early=True)
    response = await http.post("/v1/completions", json=body)
    reasons = [c["finish_reason"] for c in response.json().get("choices", [])]
    return Outcome("completion", response.status_code, reasons)


async def _stream(http: httpx.AsyncClient, rng: random.Random) -> Outcome:
    is_chat = rng.random() < 0.4
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": rng.randint(2, 24), "stream": True}
    body |= ({"messages": [{"role": "user", "content": _prompt(rng)}]} if is_chat
             else {"prompt": _prompt(rng)})
    leave_after = rng.choice([None, None, 1, 2])
    outcome = Outcome("chat-stream" if is_chat else "stream")
    async with http.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        num_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.saw_done = True
                break
            num_events += 1
            choices = json.loads(line[6:]).get("choices", [])
            outcome.finish_reasons += [c["finish_reason"] for c in choices if c["finish_reason"]]
            if leave_after is not None and num_events >= leave_after:
                outcome.left_early = True
                break  # leaving the block closes the connection mid-stream
    return outcome


async def _malformed(http: httpx.AsyncClient, rng: random.Random) -> Outcome:
    body = rng.choice(MALFORMED)
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = await http.post(path, content=body, headers={"content-type": "application/json"})
    return Outcome("malformed", response.status_code)


async def _soak(base_url: str) -> list[Outcome]:
    rng = random.Random(0)
    kinds = rng.choices([_completion, _stream, _malformed], weights=[5, 4, 1], k=NUM_REQUESTS)
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=base_url, timeout=SOAK_TIMEOUT_SECONDS,
                                 limits=limits) as http:
        tasks = [kind(http, random.Random(rng.random())) for kind in kinds]
        return await asyncio.wait_for(asyncio.gather(*tasks), SOAK_TIMEOUT_SECONDS)


def test_soak_under_preemption_disconnects_and_garbage(make_server) -> None:
    server = make_server(num_gpu_blocks=24, max_num_seqs=48, max_model_len=256)
    outcomes = asyncio.run(_soak(server.base_url))

    assert not [o for o in outcomes if o.status >= 500]
    assert {o.status for o in outcomes if o.kind == "malformed"} == {400}
    finished = [o for o in outcomes if o.kind != "malformed" and not o.left_early]
    assert all(o.status == 200 for o in finished)
    assert all(o.finish_reasons and set(o.finish_reasons) <= {"stop", "length"} for o in finished)
    assert all(o.saw_done for o in finished if "stream" in o.kind)
    assert sum(o.left_early for o in outcomes) >= 20  # the disconnect paths were exercised

    stats = server.wait_until_idle(timeout=30)
    assert stats["num_used_blocks"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    samples = scrape(server)
    assert samples["kvpool:num_preemptions_total"] > 0
    assert samples["kvpool:engine_step_failures_total"] == 0
