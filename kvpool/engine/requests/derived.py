"""What `LLMEngine.add_request` derives once from a request and carries on its `Request`, so
that no step has to derive it again: the hashing form of its cache salt, each completion's
random generator and grammar matcher. (Its token rules, the bad words among them, are built by
`kvpool.engine.sampling.token_rules`.)

Per completion: a request with `n > 1` gets n generators and n matchers up front, one per
completion index, so a completion that is not forked yet can already be sampled and each fork
advances its own grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import SamplingParams
from kvpool.memory.prefix_cache import SaltKey, salt_key

if TYPE_CHECKING:
    from kvpool.engine.sampling.grammar import GrammarCompiler
    from kvpool.engine.sampling.matcher import Matcher


def cache_salt_key(cache_salt: str | None) -> SaltKey:
    """`cache_salt` as the prefix cache hashes it; InvalidRequestError if it cannot be."""
    try:
        return salt_key(cache_salt)
    except UnicodeEncodeError:  # a lone surrogate: not text that can be hashed
        raise InvalidRequestError("cache_salt must be valid Unicode text", "cache_salt") from None


def sequence_generators(
    seed: int | None, n: int, device: torch.device
) -> tuple[torch.Generator | None, ...]:
    """A private random stream per completion of a seeded request, on the model's device:
    completion `index` of seed s is the same whatever else runs in the batch."""
    if seed is None:
        return (None,) * n
    generators = []
    for index in range(n):
        generator = torch.Generator(device=device)
        generator.manual_seed((seed * 0x9E3779B97F4A7C15 + index) % 2**63)
        generators.append(generator)
    return tuple(generators)


def grammar_matchers(
    params: SamplingParams, compiler: GrammarCompiler | None
) -> tuple[Matcher, ...]:
    """One fresh matcher per completion of a structured request (none otherwise); a spec with
    `thinking` gets matchers whose grammar starts after the thinking. The compile normally
    hits the compiler's cache: callers that can compile ahead do."""
    spec = params.structured_outputs
    if spec is None:
        return ()
    if compiler is None:
        raise InvalidRequestError(
            "this model has no tokenizer: structured outputs need one", "structured_outputs")
    return tuple(compiler.new_matcher(spec) for _ in range(params.n))

