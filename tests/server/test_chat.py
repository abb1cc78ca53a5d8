"""`/v1/chat/completions` on the real SmolLM2 through the official openai client: the chat
template applied as the offline engine applies it, streaming with a role chunk first,
logprobs with top alternatives, n, and content given as parts."""

from __future__ import annotations

from kvpool.engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL, offline_generate

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a primary colour."},
]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_greedy_chat_matches_the_offline_engine(server, smollm2) -> None:
    response = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=8, **GREEDY
    )
    prompt_ids = smollm2.tokenizer.apply_chat_template(MESSAGES)
    reference = offline_generate(
        smollm2, prompt_ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 8
    assert response.object == "chat.completion"


def test_stream_starts_with_the_role_and_concatenates_to_the_whole_reply(server) -> None:
    client = server.client()
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks, usage_chunk = chunks[1:-1], chunks[-1]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks)
    assert text == whole.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 8


def test_logprobs_list_top_alternatives_with_their_bytes(server) -> None:
    response = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob


def test_n_choices_and_content_parts(server) -> None:
    client = server.client()
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "Name a primary "},
                                     {"type": "text", "text": "colour."}]},
    ]
    as_parts = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=3, n=2,
                                              temperature=1.0, seed=7)
    as_text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2,
                                             temperature=1.0, seed=7)
    assert [choice.index for choice in as_parts.choices] == [0, 1]
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert [c.message.content for c in as_parts.choices] == [
        c.message.content for c in as_text.choices
    ]


def test_prompt_logprobs_come_on_the_response_and_logit_bias_forces_a_token(
    server, smollm2
) -> None:
    """vLLM puts chat prompt_logprobs on the response itself; OpenAI's logit_bias (string
    keys, from the official client) at 100 all but forces its token."""
    prompt_ids = smollm2.tokenizer.apply_chat_template(MESSAGES)
    forced_id = smollm2.tokenizer.encode(" Blue")[0]
    response = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=1, temperature=0,
        logit_bias={str(forced_id): 100}, extra_body={"prompt_logprobs": 0})
    assert response.choices[0].message.content == smollm2.tokenizer.decode([forced_id])
    prompt_logprobs = response.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    assert [list(position) for position in prompt_logprobs[1:]] == [
        [str(token_id)] for token_id in prompt_ids[1:]]


def test_continue_final_message_continues_the_assistant(server, smollm2) -> None:
    partial = [*MESSAGES, {"role": "assistant", "content": "A primary colour is"}]
    response = server.client().chat.completions.create(
        model=MODEL, messages=partial, max_completion_tokens=3, **GREEDY | {"extra_body": {
            "ignore_eos": True, "continue_final_message": True,
            "add_generation_prompt": False}})
    text = smollm2.tokenizer.apply_chat_template(partial, add_generation_prompt=False,
                                                 continue_final_message=True, tokenize=False)
    assert text.endswith("A primary colour is")
    assert response.usage.prompt_tokens == len(smollm2.tokenizer.encode(
        text, add_special_tokens=False))
