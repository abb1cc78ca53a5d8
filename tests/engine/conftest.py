"""Engine fixtures: engines of any configuration over the one shared SmolLM2 model."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

# Sixteen prompts of mixed lengths (a few tokens to a few hundred), some sharing prefixes.
_STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him, and lit the great lamp that warned the fishing boats away "
    "from the rocks. "
)
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "List three uses for a paperclip:",
    "Once upon a time",
    _STORY * 6 + "What did the keeper count?",
    "def fibonacci(n):",
    "Translate to French: good morning, my friend.",
    _STORY * 2 + "Continue the story:",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    _STORY * 12 + "Summarize this in one sentence:",
    "In 1969, astronauts",
    "A recipe for pancakes needs",
    _STORY + "Why did he light the lamp?",
    "The quick brown fox",
]


@pytest.fixture
def make_engine(smollm2) -> Iterator[Callable[..., LLMEngine]]:
    """Build engines over the shared model; after the test, every engine's pool, host tier
    and disk tier must be back to blocks free or cached (no leaks), their invariants holding."""
    yield from _engines_over(smollm2)


@pytest.fixture
def make_fast_engine(fast_model) -> Iterator[Callable[..., LLMEngine]]:
    """`make_engine` over the two-layer random model (`fast_model`): steps in milliseconds,
    for tests about KV bookkeeping rather than the model's text."""
    yield from _engines_over(fast_model)


def _engines_over(model) -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def factory(**options) -> LLMEngine:
        config = EngineConfig(**options)
        engine = LLMEngine(config, build_engine_parts(config, model))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        stats = engine.memory_stats()
        assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} blocks leaked"
        host = engine.kv_tier_stats().host
        assert host is None or host.num_used_blocks == 0, "host blocks leaked"
        engine.check_invariants()
        engine.close()
    # Closed engines still hold their 2 GiB pools until their reference cycles are collected;
    # without this a file of engine tests grew one worker past 18 GB.
    engines.clear()
    gc.collect()


def run_all(engine: LLMEngine, prompts, params=GREEDY) -> list[RequestOutput]:
    """Add every prompt, step to completion, return the final outputs in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [
        engine.add_request(prompt, prompt_params).request_id
        for prompt, prompt_params in zip(prompts, params_list, strict=True)
    ]
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[request_id] for request_id in ids]


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def fail_once(owner: object, name: str, message: str) -> None:
    """Make `owner.name` raise RuntimeError(`message`) on its next call only (an injected
    fault: the call after it runs the real one)."""
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        setattr(owner, name, real)
        raise RuntimeError(message)

    setattr(owner, name, failing)
