"""`SamplingParams` is mutable, as in vLLM (whose chat example does
`sp = llm.get_default_sampling_params(); sp.max_tokens = N`), and checked when it is used: a
field set out of range fails at `generate` with an error naming it, and what the caller changes
after submitting a request never reaches the request (the engine keeps a validated copy)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kvpool import LLM, SamplingParams
from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.errors import InvalidRequestError
from tests.model.test_loaders import save_tiny_hf_model

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(directory)
    return directory


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory=4 << 20, enable_warmup=False)


def test_vllms_chat_example_sets_max_tokens_on_the_default_params(llm):
    sp = llm.get_default_sampling_params()
    sp.max_tokens = 3
    sp.temperature = 0
    sp.ignore_eos = True
    sp.stop = "never"  # set after construction: normalised when used, as at construction
    outputs = llm.generate(PROMPT, sp, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    assert sp.max_tokens == 3 and sp.stop == "never"  # the caller's object is left as it is


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", 5.0, r"temperature must be in \[0, 2\]"),
    ("max_tokens", 0, "max_tokens must be at least 1"),
    ("logit_bias", {token_id: 1.0 for token_id in range(301)}, "at most 300 entries"),
])
@pytest.mark.parametrize("output_kind", ["default", "final_only"])
def test_a_field_set_out_of_range_fails_at_generate_naming_it(llm, field, value, message,
                                                             output_kind):
    sp = SamplingParams(max_tokens=4)
    if output_kind == "final_only":  # LLM passes such params on as they are
        sp.output_kind = type(sp.output_kind).FINAL_ONLY
    setattr(sp, field, value)  # no error yet: checked when used, as in vLLM
    with pytest.raises(ValueError, match=message) as raised:
        llm.generate(PROMPT, sp, use_tqdm=False)
    error = raised.value  # LLM may say which prompt, over the engine's own error
    engine_error = error if isinstance(error, InvalidRequestError) else error.__cause__
    assert isinstance(engine_error, InvalidRequestError) and engine_error.param == field
    assert not llm.engine.has_unfinished_requests()


def test_changes_after_submitting_never_reach_the_running_request(llm):
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[])
    request = engine.add_request(PROMPT, sp)
    sp.max_tokens = 1
    sp.stop_token_ids.extend(range(256))  # in place, on the caller's list
    sp.temperature = 99.0  # out of range, but never used
    assert request.params.max_tokens == 6 and request.params.stop_token_ids == []
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.finished]
    assert len(outputs[0].outputs[0].token_ids) == 6
    assert outputs[0].outputs[0].finish_reason == "length"


class SlowTokenizer:
    """Tokenizes by code point, slowly: the caller changes its params meanwhile."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(0.2)
        return [ord(char) for char in text]


def test_the_async_engine_keeps_the_params_as_they_were_when_added(tiny_dir):
    engine = AsyncLLMEngine(LLM(str(tiny_dir), dtype="float32", kv_cache_memory=4 << 20,
                                enable_warmup=False).engine)
    engine.engine.intake.token_rules.tokenizer = SlowTokenizer()  # bad words need one
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, bad_words=["zz"])

    async def main() -> list[int]:
        adding = asyncio.create_task(engine.add_request(PROMPT, sp))
        await asyncio.sleep(0.05)  # the bad words are being tokenized in a worker thread
        assert not adding.done()
        sp.max_tokens = 1
        sp.bad_words.append("")  # would be refused, were it checked again
        stream = await adding
        async with stream:
            outputs = [output async for output in stream]
        return list(outputs[-1].outputs[0].token_ids)

    try:
        token_ids = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(token_ids) == 5


def test_params_compare_equal_and_replace_still_works():
    sp = SamplingParams(temperature=0.5, stop=["x"])
    assert sp == SamplingParams(temperature=0.5, stop="x")
    changed = dataclasses.replace(sp, n=2)
    assert changed.n == 2 and sp.n == 1
    copy = sp.validated_copy()
    copy.stop.append("y")
    assert copy != sp and sp.stop == ["x"]
