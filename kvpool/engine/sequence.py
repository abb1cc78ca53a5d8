"""A request and the sequences (one per sampled completion) it owns.

A sequence's tokens are its prompt followed by its outputs. `num_computed_tokens` of them have
KV in the cache; the rest are computed by coming steps:

    tokens:      [ prompt ........................ | out0 out1 out2 ]
    computed:    [ cached prefix | earlier chunks  ....... | ]          <- one token left: decode
    block_table: slots for exactly the computed tokens (between steps)
    block_hashes [ h0 | h1 | h2 | ...                  ]                 <- every full block

Prefill, chunked prefill, decode and recomputation after preemption are one rule: each step
computes some of `tokens[num_computed_tokens:]`, and when it reaches the end the step's logits
sample the next output token.

A sequence keeps the chained hashes of its full blocks (`block_hashes`): the prompt's are
computed once, when the request is made, and one more is added each time an output token fills
a block. Prefix lookups, admission and publishing to the prefix cache all read them; nothing
hashes a prompt again, not even after a preemption. The sequence is the one owner of its tokens
and their hash chain: its block table keeps counts only and is handed both when it publishes
(`BlockTable.mark_computed(n, seq.token_ids, seq.block_hashes)`).

Invariants: `0 <= num_computed_tokens <= num_tokens`; between steps
`block_table.num_tokens == num_computed_tokens`; `block_hashes` are the hashes of the first
`num_tokens // block_size` blocks; a finished sequence holds no blocks. What a caller sees of a
sequence (its text, logprobs, what was already sent) is the output processor's, not here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.engine.sampling.token_rules import NO_TOKEN_RULES, TokenRules
from kvpool.engine.sampling_params import SamplingParams
from kvpool.memory.block_table import BlockTable
from kvpool.memory.prefix_cache import BlockHash, SaltKey

if TYPE_CHECKING:
    import torch

    from kvpool.engine.beams import BeamGroup
    from kvpool.engine.kv_connector.params import RemoteDecode, RemotePrefill
    from kvpool.engine.sampling.matcher import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted (its KV dropped) and waiting again
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, max_model_len, or the whole KV pool
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False, slots=True)
class Sequence:
    """One completion of a request: its tokens, block hashes, block table and progress."""

    seq_id: int
    request: Request
    index: int  # which of the request's n completions
    block_table: BlockTable
    block_hashes: list[BlockHash]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        """This completion's private random stream (None: the sampler's shared one)."""
        return self.request.generator(self.index)

    @property
    def matcher(self) -> Matcher | None:
        """This completion's grammar state (None: its output is not constrained)."""
        return self.request.matchers[self.index] if self.request.matchers else None

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.request.priority, self.request.arrival_time, self.seq_id)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens start..end-1 of prompt + outputs, without building the whole list."""
        prompt = self.request.prompt_token_ids
        end = self.num_tokens if end is None else end
        if end <= len(prompt):
            return prompt[start:end]
        outputs = self.output_token_ids[max(start - len(prompt), 0) : end - len(prompt)]
        return prompt[start:] + outputs if start < len(prompt) else outputs


@dataclass(eq=False)
class Request:
    """What a caller asked for: one prompt, its sampling rules, and its n sequences.

    `salt` is the hashing form of `cache_salt` (`kvpool.memory.prefix_cache.salt_key`),
    derived once at intake and the only form anything hashes with; `cache_salt` stays only as
    the tenant's label (snapshots are scoped by it);
    `generators[i]` is completion i's random stream, made on the model's device when the
    request is made, so a completion not yet forked can already be sampled; likewise
    `matchers[i]`, completion i's grammar matcher (empty without structured outputs), which
    advances with each of its output tokens. `token_rules` is its logit bias, allowed ids and
    bad words as tensors on the model's device, built once at intake for the sampler to index.
    `params` is the engine's own validated snapshot (`SamplingParams.validated_copy`): the
    caller's later changes to its object never reach it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    salt: SaltKey
    generators: tuple[torch.Generator | None, ...]
    priority: int = 0
    cache_salt: str | None = None
    matchers: tuple[Matcher, ...] = ()  # structured outputs: completion i's grammar
    token_rules: TokenRules = NO_TOKEN_RULES  # logit bias, allowed ids, bad words, as tensors
    sequences: list[Sequence] = field(default_factory=list)
    beams: BeamGroup | None = None  # a beam search's beams (its sequences fork per round)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served, set at admission
    num_prompt_logprob_positions: int = 0  # prompt positions whose logits gave prompt logprobs
    first_scheduled_time: float | None = None  # first admission to a batch (not re-admissions)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)  # not yet handed out
    # Disaggregated serving (`kvpool.engine.kv_connector`): what its kv_transfer_params ask
    # (RemoteDecode / RemotePrefill, read by the connector at intake), what its output hands
    # on (a producer's handover), and why it failed (a load under policy "fail").
    kv_transfer: RemoteDecode | RemotePrefill | None = None
    kv_transfer_params: dict | None = None
    error: str | None = None

    def record_new_tokens(self, now: float) -> None:
        """A step that ended at `now` gave this request new tokens: the first such step sets
        `first_token_time`, each later one adds its gap since the previous one (vLLM's
        inter-token interval, per request and step, preemptions included)."""
        if self.last_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now

    @property
    def needs_fork(self) -> bool:
        """True until the prompt's prefill has produced all n sequences (a beam search
        forks round by round instead: `kvpool.engine.beams`)."""
        return self.beams is None and len(self.sequences) < self.params.n

    def num_seats(self, seq: Sequence) -> int:
        """Batch seats `seq` stands for: the n sequences of a prompt not yet forked, or the
        width of a beam search not yet expanded; else one."""
        if self.needs_fork:
            return self.params.n
        if self.beams is not None and not self.beams.has_expanded:
            return self.beams.width
        return 1

    def generator(self, index: int) -> torch.Generator | None:
        """Completion `index`'s random stream; a beam's fork (index beyond n) is greedy and
        draws none."""
        return self.generators[index] if index < len(self.generators) else None

    @property
    def is_finished(self) -> bool:
        # A request aborted before its prompt finished never forks: its one sequence decides.
        return all(seq.is_finished for seq in self.sequences)
