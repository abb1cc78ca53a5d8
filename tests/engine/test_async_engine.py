"""`AsyncLLMEngine`: the engine in its own thread serving asyncio callers. Concurrent callers
get the tokens the synchronous engine gives; aborts and failing steps free every block; the
loop survives a failing step; shutdown honours its grace period."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvpool.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineError
from kvpool.engine.engine import LLMEngine
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import PROMPTS, fail_once, run_all, token_ids

SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)


@pytest.fixture
def make_async(make_engine) -> Iterator[Callable[..., AsyncLLMEngine]]:
    engines: list[AsyncLLMEngine] = []

    def factory(**options) -> AsyncLLMEngine:
        options = {"num_gpu_blocks": 64, "enable_warmup": False, **options}
        engines.append(AsyncLLMEngine(make_engine(**options)))
        return engines[-1]

    yield factory
    for engine in engines:
        engine.shutdown()


async def final_output(engine: AsyncLLMEngine, prompt, params=SHORT) -> RequestOutput:
    stream = await engine.add_request(prompt, params)
    async with stream:
        outputs = [output async for output in stream]
    assert outputs[-1].finished and not any(output.finished for output in outputs[:-1])
    return outputs[-1]


def wait_for_no_used_blocks(engine: AsyncLLMEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.snapshot().memory.num_used_blocks or engine.snapshot().num_requests_running:
        assert time.monotonic() < deadline, "blocks stayed in use"
        time.sleep(0.01)


def test_concurrent_callers_get_the_synchronous_engines_tokens(make_engine, make_async) -> None:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[14]]
    expected = token_ids(run_all(make_engine(enable_warmup=False), prompts, SHORT))
    engine = make_async()

    async def main() -> list[RequestOutput]:
        return await asyncio.gather(*(final_output(engine, prompt) for prompt in prompts))

    assert token_ids(asyncio.run(main())) == expected
    assert engine.snapshot().stats.num_steps < 3 * 4  # batched across callers, not one by one


def test_a_bad_request_raises_and_the_engine_goes_on(make_async) -> None:
    engine = make_async(max_model_len=32)

    async def main() -> RequestOutput:
        with pytest.raises(ValueError, match="max_model_len is 32"):
            await engine.add_request(list(range(1, 40)), SHORT)
        with pytest.raises(ValueError, match="the prompt is empty"):
            await engine.add_request([], SHORT)
        return await final_output(engine, "Hello")

    assert len(asyncio.run(main()).outputs[0].token_ids) == 3


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(make_async) -> None:
    engine = make_async()

    async def main() -> None:
        stream = await engine.add_request("Tell me a long story.", LONG)
        async with stream:
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 2:
                    break

    asyncio.run(main())
    wait_for_no_used_blocks(engine)
    assert engine.snapshot().stats.num_generated_tokens < LONG.max_tokens


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(make_async) -> None:
    engine = make_async()
    fail_once(engine.engine.runner, "execute", "injected")

    async def main() -> RequestOutput:
        with pytest.raises(EngineError, match="engine step failed: RuntimeError"):
            await final_output(engine, "Hello")
        return await final_output(engine, "Hello")

    assert len(asyncio.run(main()).outputs[0].token_ids) == 3
    assert engine.snapshot().num_failed_steps == 1
    assert engine.is_healthy


def _shutdown_soon(engine: AsyncLLMEngine, grace_seconds: float) -> threading.Thread:
    thread = threading.Thread(target=engine.shutdown, args=(grace_seconds,))
    thread.start()
    return thread


def test_shutdown_lets_requests_in_flight_finish_within_the_grace(make_async) -> None:
    engine = make_async()

    async def main() -> RequestOutput:
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=6, ignore_eos=True))
        stopper = _shutdown_soon(engine, grace_seconds=60)
        outputs = [output async for output in stream]
        await asyncio.to_thread(stopper.join)
        with pytest.raises(EngineClosedError):
            await engine.add_request("Hello", SHORT)
        return outputs[-1]

    final = asyncio.run(main())
    assert final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == 6
    assert not engine.is_accepting


def test_shutdown_aborts_what_outlasts_the_grace(make_async) -> None:
    engine = make_async()

    async def main() -> None:
        stream = await engine.add_request("Tell me a long story.", LONG)
        await anext(stream)
        stopper = _shutdown_soon(engine, grace_seconds=0)
        with pytest.raises(EngineClosedError, match="shutting down"):
            async for _ in stream:
                pass
        await asyncio.to_thread(stopper.join)

    asyncio.run(main())
    assert engine.engine.memory_stats().num_used_blocks == 0
    assert not engine.engine.has_unfinished_requests()


def test_engine_is_the_same_object_the_caller_gave(make_engine) -> None:
    inner: LLMEngine = make_engine(num_gpu_blocks=8, enable_warmup=False)
    engine = AsyncLLMEngine(inner)
    try:
        assert engine.engine is inner
        assert engine.max_model_len == inner.max_model_len
        assert engine.snapshot().memory.num_blocks == 8
    finally:
        engine.shutdown()


def test_an_idle_engine_lets_an_elastic_pool_shrink(make_engine) -> None:
    inner = make_engine(enable_warmup=False, kv_cache_memory=12 * 2**20, kv_pool="elastic",
                        kv_pool_segment_blocks=4, kv_pool_initial_blocks=4,
                        kv_pool_idle_seconds=0.1)
    engine = AsyncLLMEngine(inner, idle_tick_seconds=0.02)
    try:
        final = asyncio.run(final_output(engine, PROMPTS[8], SamplingParams(max_tokens=1)))
        assert len(final.prompt_token_ids) > 4 * 16  # more than the initial segment holds
        assert engine.snapshot().kv_pool.num_grows >= 1
        deadline = time.monotonic() + 10
        while engine.snapshot().kv_pool.num_online_blocks > 4:  # no step runs: idle ticks do it
            assert time.monotonic() < deadline, "the idle pool never shrank"
            time.sleep(0.02)
        assert engine.snapshot().kv_pool.num_shrinks >= 1
        assert engine.snapshot().memory.num_used_blocks == 0
    finally:
        engine.shutdown()
