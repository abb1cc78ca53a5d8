"""`/v1/completions` on the real SmolLM2 through the official openai client: the same text as
the offline engine, streamed or not, with n, seeds, stop strings, logprobs, usage and cached
tokens."""

from __future__ import annotations

import uuid

from kvpool.engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL, offline_generate

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


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


# ------------------------------------------------------------ vLLM's request fields
def test_echo_returns_the_prompt_with_its_logprobs_first(server, smollm2) -> None:
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1. The prompt's tokens
    come first, the very first with null logprobs; the rest are the prompt logprobs."""
    client = server.client()
    num_prompt = len(smollm2.tokenizer.encode(PROMPT))
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                           logprobs=1, echo=True, **GREEDY)
    choice = completion.choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, **GREEDY)
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 1
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i]))
                                    for i in range(num_prompt + 1)]
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    ids = smollm2.tokenizer.encode(PROMPT)
    assert [None] + [prompt_logprobs[i][str(ids[i])]["logprob"] for i in range(1, num_prompt)
                     ] == logprobs.token_logprobs[:num_prompt]
    only_prompt = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0,
                                            logprobs=1, echo=True, **GREEDY).choices[0]
    assert only_prompt.text == PROMPT
    assert only_prompt.logprobs.token_logprobs == logprobs.token_logprobs[:num_prompt]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, stream=True, **GREEDY))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True,
                                      **GREEDY)
    assert streamed == whole.choices[0].text
    assert whole.choices[0].text.startswith(PROMPT)


def test_prompt_logprobs_have_vllms_shape(server, smollm2) -> None:
    """Per prompt token: null for the first, else token id -> {logprob, rank, decoded_token},
    holding the prompt's own token and the top k."""
    ids = smollm2.tokenizer.encode(PROMPT)
    choice = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True}).choices[0]
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for token_id, position in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in position
        assert 2 <= len(position) <= 3
        assert {1, 2} <= {entry["rank"] for entry in position.values()}
        assert all(set(entry) == {"logprob", "rank", "decoded_token"}
                   for entry in position.values())
    assert choice.logprobs is None


def test_stop_token_ids_stop_and_name_the_stop_reason(server, smollm2) -> None:
    reference = offline_generate(
        smollm2, PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ).outputs[0]
    stop_id = reference.token_ids[3]
    first = reference.token_ids.index(stop_id)
    choice = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY | {"extra_body": {
            "ignore_eos": True, "stop_token_ids": [stop_id]}}).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    assert choice.text == smollm2.tokenizer.decode(reference.token_ids[:first])


def test_include_stop_str_in_output_keeps_the_stop(server) -> None:
    client = server.client()
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                     **GREEDY).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    kept = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop],
        **GREEDY | {"extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
    ).choices[0]
    assert kept.text == text[: text.find(stop)] + stop
    assert kept.finish_reason == "stop"


def test_logit_bias_and_bad_words_change_the_greedy_text(server, smollm2) -> None:
    client = server.client()
    reference = offline_generate(
        smollm2, PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ).outputs[0]
    first_id = reference.token_ids[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **GREEDY,
                                       logit_bias={str(first_id): -100})
    assert not banned.choices[0].text.startswith(smollm2.tokenizer.decode([first_id]))
    forced_id = smollm2.tokenizer.encode(" Lyon")[0]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, **GREEDY,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == smollm2.tokenizer.decode([forced_id])
    word = reference.text.split()[0]
    without = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **GREEDY |
                                        {"extra_body": {"ignore_eos": True,
                                                        "bad_words": [word]}})
    assert word not in without.choices[0].text


def test_priority_is_accepted_and_changes_no_text(server) -> None:
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY)
    urgent = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY |
                                       {"extra_body": {"ignore_eos": True, "priority": -10}})
    assert urgent.choices[0].text == plain.choices[0].text


def test_a_priority_under_fcfs_is_a_400_naming_it(make_server) -> None:
    server = make_server(scheduling_policy="fcfs")
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                      "max_tokens": 2, "priority": 3})
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["param"] == "priority" and "scheduling_policy" in error["message"]
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                "max_tokens": 2, "priority": 0})
        assert ok.status_code == 200


def test_allowed_token_ids_and_skip_special_tokens(server, smollm2) -> None:
    """Only <|im_start|> may be sampled: skipped from the text by default, shown with
    skip_special_tokens false."""
    special_id = smollm2.tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"ignore_eos": True, "allowed_token_ids": [special_id]}
    client = server.client()
    skipped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                        **GREEDY | {"extra_body": body})
    shown = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2,
        **GREEDY | {"extra_body": {**body, "skip_special_tokens": False}})
    assert skipped.choices[0].text == ""
    assert shown.choices[0].text == "<|im_start|><|im_start|>"
    assert skipped.usage.completion_tokens == shown.usage.completion_tokens == 2
