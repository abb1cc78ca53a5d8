"""`/v1/completions` on the real SmolLM2 through the official openai client: the same text as
the offline engine, streamed or not, with n, seeds, stop strings, logprobs, usage and cached
tokens."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvpool.engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL, RunningServer, offline_generate, serve

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(smollm2) -> Iterator[RunningServer]:
    with serve(smollm2, num_gpu_blocks=128) as running:
        yield running


def test_greedy_completion_matches_the_offline_engine(server, smollm2) -> None:
    completion = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY
    )
    reference = offline_generate(
        smollm2, PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    choice = completion.choices[0]
    assert choice.text == reference.outputs[0].text
    assert choice.finish_reason == "length"
    num_prompt_tokens = len(smollm2.tokenizer.encode(PROMPT))
    assert completion.usage.prompt_tokens == num_prompt_tokens
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == num_prompt_tokens + 8
    assert completion.model == MODEL
    assert completion.object == "text_completion"


def test_stream_concatenates_to_the_whole_text(server) -> None:
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    ))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_token_id_prompts_and_batches_match_single_text_prompts(server, smollm2) -> None:
    client = server.client()
    other = "Water boils at"
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY).choices[0].text
        for p in (PROMPT, other)
    ]
    ids = smollm2.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == single[0]
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert [choice.text for choice in batch.choices] == single
    assert batch.usage.completion_tokens == 8


def test_n_with_a_seed_is_reproducible_streamed_or_not(server) -> None:
    client = server.client()
    options = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 6, "n": 3,
               "temperature": 1.0, "seed": 1234, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**options)
    again = client.completions.create(**options)
    texts = {choice.index: choice.text for choice in first.choices}
    assert sorted(texts) == [0, 1, 2]
    assert texts == {choice.index: choice.text for choice in again.choices}
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    assert len(set(texts.values())) > 1  # sampled, not three copies of one completion
    assert first.usage.completion_tokens == 3 * 6


def test_stop_string_cuts_the_text_streamed_or_not(server) -> None:
    client = server.client()
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    expected = text[: text.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                               stop=stop, stream=True, **GREEDY)
    )
    assert streamed == expected


def test_logprobs_name_the_greedy_choice_as_the_most_likely(server) -> None:
    completion = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY
    )
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == choice.text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):
        assert len(top) == 3
        assert logprob <= 0
        assert top[token] == logprob == max(top.values())
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert offsets == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


def test_usage_reports_cached_prompt_tokens_on_a_repeat(server, smollm2) -> None:
    prompt = f"Request {uuid.uuid4().hex}: " + "tell me about the sea and the ships. " * 6
    num_tokens = len(smollm2.tokenizer.encode(prompt))
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block_size = server.kv_stats()["block_size"]
    expected = (num_tokens - 1) // block_size * block_size
    assert expected > 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected


def test_streamed_logprobs_match_the_whole_response(server) -> None:
    """The deltas' logprobs concatenate to the whole response's, offsets running on across
    chunks."""
    client = server.client()
    options = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "logprobs": 2, **GREEDY}
    whole = client.completions.create(**options).choices[0].logprobs
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for chunk in client.completions.create(stream=True, **options):
        logprobs = chunk.choices[0].logprobs
        if logprobs is not None:
            tokens += logprobs.tokens
            token_logprobs += logprobs.token_logprobs
            top_logprobs += logprobs.top_logprobs
            offsets += logprobs.text_offset
    assert tokens == whole.tokens
    assert token_logprobs == whole.token_logprobs
    assert top_logprobs == whole.top_logprobs
    assert offsets == whole.text_offset


def test_stream_chunks_carry_only_news_and_each_finish_reason_once(server) -> None:
    """n sampled choices that stop at different steps: each chunk carries new tokens or a
    finish reason, never a copy of earlier ones; each finish reason goes out once; usage is
    summed over the deltas."""
    client = server.client()
    options = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 12, "n": 3,
               "temperature": 1.0, "seed": 99, "stop": ["e"], "logprobs": 1}
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **options))
    streamed = {index: "" for index in range(3)}
    tokens: dict[int, list[str]] = {index: [] for index in range(3)}
    finish_reasons: dict[int, list[str]] = {index: [] for index in range(3)}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.logprobs.tokens or choice.finish_reason
        streamed[choice.index] += choice.text
        tokens[choice.index] += choice.logprobs.tokens
        if choice.finish_reason is not None:
            finish_reasons[choice.index].append(choice.finish_reason)
    assert streamed == {choice.index: choice.text for choice in whole.choices}
    assert tokens == {choice.index: choice.logprobs.tokens for choice in whole.choices}
    assert finish_reasons == {choice.index: [choice.finish_reason] for choice in whole.choices}
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
