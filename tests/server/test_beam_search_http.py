"""/v1/completions with vLLM's `use_beam_search` / `best_of` / `length_penalty`, over real HTTP
with the official openai client: the n best of best_of beams (`kvpool.engine.beams`), best
first by vLLM's length-penalised score; a stream ends with the same choices; width one is the
greedy completion."""

from __future__ import annotations

from tests.server.conftest import MODEL

PROMPT = "The best way to learn a language is"
BEAMS = {"use_beam_search": True, "length_penalty": 0.7}


def test_beam_search_returns_the_n_best_beams_best_first(server):
    client = server.client()
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2,
                                           best_of=4, logprobs=1, extra_body=BEAMS)
    choices = completion.choices
    assert [choice.index for choice in choices] == [0, 1]
    assert len({choice.text for choice in choices}) == 2
    prompt_len = completion.usage.prompt_tokens

    def score(choice) -> float:
        logprobs = choice.logprobs.token_logprobs
        return sum(logprobs) / (prompt_len + len(logprobs)) ** 0.7

    assert score(choices[0]) >= score(choices[1])
    assert completion.usage.completion_tokens == sum(
        len(choice.logprobs.token_logprobs) for choice in choices)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2,
                                         best_of=4, stream=True, extra_body=BEAMS)
    pieces = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == [choice.text for choice in choices]
    assert server.wait_until_idle()["num_used_blocks"] == 0


def test_width_one_is_the_greedy_completion(server):
    client = server.client()
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    beam = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                     extra_body={"use_beam_search": True})
    assert beam.choices[0].text == greedy.choices[0].text
