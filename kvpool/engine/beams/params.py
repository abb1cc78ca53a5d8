"""vLLM's beam search records: `BeamSearchParams` (what `LLM.beam_search` takes) and
`BeamSearchOutput` / `BeamSearchSequence` (what it returns), with vLLM's names and meanings.

A beam request runs in the engine as `SamplingParams(use_beam_search=True, best_of=width,
length_penalty=...)` (vLLM's earlier spelling, which /v1/completions still speaks):
`BeamSearchParams.sampling_params` is that translation, the one place it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.engine.requests.outputs import Logprob
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters. Beams are ranked by the model's raw log probabilities,
    so only `temperature=0` (vLLM's default) is accepted."""

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

    def sampling_params(self) -> SamplingParams:
        """The engine request that runs this search and returns all `beam_width` beams."""
        return SamplingParams(n=self.beam_width, best_of=self.beam_width, use_beam_search=True,
                              length_penalty=self.length_penalty, temperature=0.0,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              logprobs=2 * self.beam_width,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones (a final EOS included);
    `text` is the generated text (without a final EOS); `logprobs` has one entry per
    generated token, and `cum_logprob` is the sum of the chosen tokens' log probabilities."""

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
