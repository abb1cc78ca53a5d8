"""Sampling: from a step's logits to each sequence's next token.

    matcher.py      what the engine needs of a grammar matcher (`TokenMask`, `Matcher`)
    token_rules.py  a request's logit bias, allowed ids and bad words as index tensors, built
                    once at admission (`TokenRules`, by a `TokenRuleBuilder`)
    rows.py         what the sampler is told per logits row (`SamplingRow`, built from a
                    scheduled batch by `sampling_rows`)
    constraints.py  what a row may not generate (grammar bitmask, allowed ids, bad words),
                    its logit bias, and the grammars' advance by the chosen tokens
    sampler.py      the `Sampler`: penalties, greedy or random choice, logprobs
    grammar.py      structured outputs' grammars: the compiler, and the matchers it makes
    after_thinking.py  a matcher whose grammar starts after a reasoning model's thinking

Imports run one way, matcher → token_rules → rows → constraints → sampler, and constraints →
after_thinking → grammar: the sampler meets matchers only through `matcher.TokenMask`, and
nothing here imports the engine, the scheduler or the output processor. A new constraint on
what a row may generate is a function in `constraints.py`, called from
`sampler.choose_token_ids`, reading a field of `SamplingRow`; what it needs of a request's
lists is built once, at admission, never walked per step.
"""

from kvpool.engine.sampling.matcher import TokenMask
from kvpool.engine.sampling.rows import SamplingRow, sampling_rows
from kvpool.engine.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "TokenMask", "sampling_rows"]
