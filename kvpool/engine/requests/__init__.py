"""Requests: from `add_request` to the `RequestOutput`s a caller reads.

    intake.py            `RequestIntake`: tokenize, validate once, salt, generators, matchers,
                         prefix hashes — everything `LLMEngine.add_request` derives up front
    derived.py           the per-request state intake derives (salt key, generators, grammar
                         matchers, bad words as token sequences)
    outputs.py           `RequestOutput`, `CompletionOutput`, `Logprob`, `RequestMetrics`
    output_processor.py  scheduler results → detokenized, stop-checked outputs (deltas)
    prompt_logprobs.py   the prompt logprob positions each chunk computes, and their values
    stream.py            the async engine's per-request output stream

Nothing here is imported by `__init__` (the scheduler and the sampler import `outputs` and
`prompt_logprobs` alone, so importing one module never pulls the rest in).
"""
