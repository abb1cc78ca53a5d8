"""Speculative decoding behind the OpenAI server: a stream delivers the same text as without
speculation, several tokens in one delta where drafts were accepted, and /metrics counts the
drafts under kvpool's and vLLM's names."""

from __future__ import annotations

from kvpool.engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL, offline_generate, scrape, serve

PASSAGE = ("The block pool cuts one reservation into fixed-size blocks. Each block holds the "
           "keys and values of sixteen tokens, and a free list hands them out in constant time.")
PROMPT = f"Repeat this text exactly.\n\nText: {PASSAGE}\n\nRepeated text: The block pool"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}


def test_stream_carries_accepted_drafts_as_one_delta(smollm2) -> None:
    expected = offline_generate(smollm2, PROMPT, SamplingParams(temperature=0, max_tokens=32))
    with serve(smollm2, num_gpu_blocks=64, speculative_config=NGRAM) as server:
        stream = server.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stream=True, logprobs=1)
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        text = "".join(choice.text for choice in chunks)
        tokens_per_delta = [len(choice.logprobs.tokens) for choice in chunks if choice.logprobs]
        server.wait_until_idle()
        samples = scrape(server)
    assert text == expected.outputs[0].text
    assert max(tokens_per_delta) > 1 and sum(tokens_per_delta) == 32
    accepted = samples["kvpool:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= samples["kvpool:spec_decode_num_draft_tokens_total"]
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == accepted
    assert samples["vllm:spec_decode_num_drafts_total"] > 0
    assert samples["kvpool:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
