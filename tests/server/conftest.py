"""Server fixtures: real uvicorn servers on free loopback ports, over models loaded once.

Two models (session fixtures of tests/conftest.py): the real SmolLM2 (`smollm2`) where the
text matters, and `fast_model`, SmolLM2's tokenizer over a tiny random-weight Llama with the same
vocabulary, where only the server and the block pool are under test (auth, limits, disconnects,
soak, fuzz): it steps in milliseconds, so those tests can send hundreds of requests.

Every server is checked at teardown: after the graceful stop no block may still be in use and
the pool's invariants must hold.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.setup import build_engine_parts
from kvpool.model.loaders.base import LoadedModel
from kvpool.server.app import build_app
from kvpool.server.background import BackgroundServer
from kvpool.server.config import ServerConfig

MODEL = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class RunningServer:
    base_url: str
    engine: AsyncLLMEngine

    def client(self, api_key: str = "unused", **options: Any) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                      timeout=120, **options)

    def async_client(self, api_key: str = "unused", **options: Any) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                           timeout=120, **options)

    def http(self, **options: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120, **options)

    def kv_stats(self, **headers: str) -> dict[str, Any]:
        response = httpx.get(f"{self.base_url}/v1/kv/stats", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def wait_until_idle(self, timeout: float = 20.0, **headers: str) -> dict[str, Any]:
        """Poll /v1/kv/stats until no request runs or waits and no block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.kv_stats(**headers)
            idle = stats["num_requests_running"] == stats["num_requests_waiting"] == 0
            if (idle and stats["num_used_blocks"] == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


@contextmanager
def serve(
    loaded: LoadedModel, server_config: ServerConfig | None = None, **engine_options: Any
) -> Iterator[RunningServer]:
    """A real server over `loaded` (engine built per call, model shared)."""
    config = EngineConfig(**{"enable_warmup": False, **engine_options})
    engine = AsyncLLMEngine(LLMEngine(config, build_engine_parts(config, loaded)))
    app = build_app(engine, server_config or ServerConfig(served_model_names=(MODEL,)))
    with BackgroundServer(app) as background:
        yield RunningServer(background.base_url, engine)
    num_used = engine.engine.memory_stats().num_used_blocks
    assert num_used == 0, f"{num_used} blocks leaked"
    engine.engine.check_invariants()


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[RunningServer]:
    """A real-SmolLM2 server per module (128 blocks); a module needing other options defines
    its own `server`."""
    with serve(smollm2, num_gpu_blocks=128) as running:
        yield running


@pytest.fixture(scope="module")
def fast_server(fast_model: LoadedModel) -> Iterator[RunningServer]:
    """A `fast_model` server per module (64 blocks)."""
    with serve(fast_model, num_gpu_blocks=64) as running:
        yield running


@pytest.fixture
def make_server(fast_model: LoadedModel) -> Iterator[Callable[..., RunningServer]]:
    """Start servers over the fast model: `make_server(server_config, **engine_options)`;
    each is stopped and leak-checked when the test ends."""
    with ExitStack() as stack:

        def start(server_config: ServerConfig | None = None, **options: Any) -> RunningServer:
            options = {"num_gpu_blocks": 128, **options}
            return stack.enter_context(serve(fast_model, server_config, **options))

        yield start


def offline_generate(loaded: LoadedModel, prompt: str | list[int], params: Any) -> Any:
    """The same prompt through a plain `LLMEngine` (no server): the reference output."""
    config = EngineConfig(num_gpu_blocks=64, enable_warmup=False)
    engine = LLMEngine(config, build_engine_parts(config, loaded))
    engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    return final


def thinks_then_answers(tokenizer: Any, answer: str = "", opens: bool = True) -> dict[str, Any]:
    """Sampling fields (`logit_bias`, `bad_words`) that drive `fast_model` (greedy) to think
    `think`, close the thinking and then write `answer` wherever a grammar lets it choose.

    `logit_bias` ranks `think` (50) over `</` (40), `>` (30), `<` (26, qwen3's opener; with
    `opens` false the output does not open with it) and `answer`'s tokens and EOS (10 up,
    later ones higher, so a finished part never repeats); `bad_words` ban `think` after
    itself and `</` after `</think`. Unconstrained, the highest allowed token is therefore
    `think`, `</`, `think`, `>` in turn; a qwen3 output whose grammar refuses `<` opens with
    `<think>` (after `<` the tag's own tokens are all that is allowed)."""
    def token(text: str) -> int:
        (token_id,) = tokenizer.encode(text, False)
        return token_id

    bias = {token("think"): 50, token("</"): 40, token(">"): 30}
    if opens:
        bias[token("<")] = 26
    if answer:
        answer_ids = [*tokenizer.encode(answer, False), min(tokenizer.eos_token_ids)]
        for rank, token_id in enumerate(answer_ids):
            bias.setdefault(token_id, 10 + rank)
    return {"logit_bias": {str(token_id): value for token_id, value in bias.items()},
            "bad_words": ["thinkthink", "</think</"]}


def slow_steps(server: RunningServer, seconds: float) -> None:
    """Make each engine step of `server` last at least `seconds` (the fast model steps in
    milliseconds), so that a long request stays in flight while a test looks at the pool."""
    engine = server.engine.engine
    step = engine.step

    def slow_step() -> Any:
        time.sleep(seconds)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]


def scrape(server: RunningServer) -> dict[str, float]:
    """/metrics as sample name (with any label but model_name) -> value."""
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            suffix = "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            samples[sample.name + suffix] = sample.value
    return samples
