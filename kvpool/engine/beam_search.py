"""Beam search over the engine, as vLLM's `LLM.beam_search` does it: vLLM's names and meanings.

Each round asks the engine for one greedy token of every live beam with `logprobs=2 *
beam_width` (the raw distribution's most likely tokens), expands every beam by those tokens
and keeps, per prompt, the `beam_width` candidates with the highest cumulative log
probability. A kept candidate ending in EOS is finished (unless `ignore_eos`); the others go on.
The beams share their prompt and earlier tokens, so each round's prefill is served by the
prefix cache. After `max_tokens` rounds the finished and live beams are ranked by
`cum_logprob / len(tokens) ** length_penalty` (vLLM's score: tokens include the prompt, a final
EOS does not count) and the best `beam_width` come back, best first.

Invariants: every beam's `logprobs` has one entry per generated token, and `cum_logprob` is
the sum of the chosen tokens' log probabilities there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.engine.requests.outputs import Logprob, RequestOutput
from kvpool.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters. kvpool's log probabilities are the model's raw ones, so
    only `temperature=0` (vLLM's default) is accepted."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError("beam search ranks beams by the model's raw log probabilities: "
                             "temperature must be 0")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones; `text` is the generated
    text (without a final EOS)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


# Runs one greedy token for every prompt (token ids) with these params; outputs in order.
StepFn = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]
DecodeFn = Callable[[list[int]], str]


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    run_step: StepFn,
    decode: DecodeFn,
    eos_token_ids: frozenset[int],
) -> list[BeamSearchOutput]:
    """The best `params.beam_width` beams of each prompt (token ids)."""
    step_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                 logprobs=2 * params.beam_width)
    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for prompt_beams in live for beam in prompt_beams]
        if not beams:
            break
        outputs = iter(run_step([beam.tokens for beam in beams], step_params))
        for index, prompt_beams in enumerate(live):
            candidates = [child for beam in prompt_beams
                          for child in _expand(beam, next(outputs))]
            candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
            live[index] = []
            for beam in candidates[:params.beam_width]:
                is_eos = beam.tokens[-1] in eos_token_ids and not params.ignore_eos
                (done[index] if is_eos else live[index]).append(beam)
    return [_best(finished + still_live, len(prompt), params, decode, eos_token_ids)
            for prompt, finished, still_live in zip(prompts, done, live, strict=True)]


def _expand(beam: BeamSearchSequence, output: RequestOutput) -> list[BeamSearchSequence]:
    """The beam extended by each of the step's top tokens."""
    [top] = output.outputs[0].logprobs
    return [BeamSearchSequence([*beam.tokens, token_id], [*beam.logprobs, top],
                               beam.cum_logprob + logprob.logprob)
            for token_id, logprob in top.items()]


def _best(
    beams: list[BeamSearchSequence],
    prompt_len: int,
    params: BeamSearchParams,
    decode: DecodeFn,
    eos_token_ids: frozenset[int],
) -> BeamSearchOutput:
    def ends_in_eos(beam: BeamSearchSequence) -> bool:
        return beam.tokens[-1] in eos_token_ids and not params.ignore_eos

    def score(beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - ends_in_eos(beam)
        return beam.cum_logprob / length ** params.length_penalty

    best = sorted(beams, key=score, reverse=True)[:params.beam_width]
    for beam in best:
        is_eos = ends_in_eos(beam)
        generated = beam.tokens[prompt_len:len(beam.tokens) - is_eos]
        beam.text = decode(generated)
        beam.finish_reason = "stop" if is_eos else "length"
        beam.stop_reason = beam.tokens[-1] if is_eos else None
    return BeamSearchOutput(best)
