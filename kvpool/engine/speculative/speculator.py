"""The scheduler's speculative-decoding partner: which sequences draft how many tokens this
step, and what each verification taught.

A decode chunk (one new token, sampled once) may carry drafts: the proposer's guesses at the
tokens after it. The scheduler gives them tentative slots
(`BlockTable.append_tentative_slots`), the model computes logits at every drafted position in
the same pass, the sampler chooses a token at each as if the earlier
drafts were already the sequence's, and the longest prefix of drafts the sampler agreed with
is accepted, plus the sampler's token after it (`accepted_length`). So greedy output is the
same token for token, and sampled output follows the same distribution: each token is drawn
from the target distribution given the tokens before it, and a draft is kept exactly when the
draw equals it (speculative rejection sampling with a point-mass proposal).

A seeded request draws one uniform per row; a verification draws k + 1 but only a + 1 of them
are kept (a accepted drafts): `verified` rewinds the request's generator to where it stood and
draws a + 1 again, so a seeded request's tokens are the same with speculation or without.

A request with a grammar (structured outputs) drafts too: its drafts are cut to the longest
prefix the grammar accepts before they are sized (`grammar_draft_prefix`, which leaves the
matcher where it stood), and the sampler masks each verification row with the grammar after
the drafts before it (`kvpool.engine.sampling.constraints`).

Left out of drafting (they decode one token at a time): prompt chunks (a request's first
token comes from its prefill), a request's chunk before its n > 1 siblings are forked, and
tokens past `max_tokens` or the model's length.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import torch

from kvpool.engine.config.speculative import SpeculativeConfig
from kvpool.engine.sampling.constraints import grammar_draft_prefix
from kvpool.engine.speculative.adaptive import Acceptance, StepCostModel, choose_draft_lengths
from kvpool.engine.speculative.proposers import make_proposer
from kvpool.engine.speculative.stats import SpecDecodeCounters, SpecDecodeStats

if TYPE_CHECKING:
    from kvpool.engine.scheduler_output import ScheduledChunk
    from kvpool.engine.sequence import Sequence


def accepted_length(drafts: SequenceOf[int], sampled: SequenceOf[int]) -> int:
    """How many leading drafts the sampler agreed with (`sampled[i]` was chosen where
    `drafts[i]` was guessed; `sampled` has one more row, the token after the last draft)."""
    num_accepted = 0
    for draft, token_id in zip(drafts, sampled, strict=False):
        if draft != token_id:
            break
        num_accepted += 1
    return num_accepted


class NoSpeculation:
    """Speculation off: no drafts, nothing learnt (the scheduler never branches on it)."""

    def propose(self, chunks: SequenceOf[ScheduledChunk], token_budget: int,
                num_running: int) -> dict[int, list[int]]:
        return {}

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        raise AssertionError("no drafts were proposed")

    def observe_step(self, chunks: SequenceOf[ScheduledChunk], seconds: float) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats()

    def reset_counters(self) -> None:
        pass


class Speculator(NoSpeculation):
    """Prompt-lookup drafts, sized per sequence by `kvpool.engine.speculative.adaptive`."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config)
        self.cost = StepCostModel()
        self.counters = SpecDecodeCounters()
        self._acceptance: dict[int, Acceptance] = {}  # seq_id -> its record
        self._rewind: dict[int, torch.Tensor] = {}  # seq_id -> generator state before drafts

    def propose(self, chunks: SequenceOf[ScheduledChunk], token_budget: int,
                num_running: int) -> dict[int, list[int]]:
        """Drafts for some of the step's chunks: {index in `chunks`: draft tokens}."""
        limit = self.config.disable_by_batch_size
        if token_budget <= 0 or (limit is not None and num_running >= limit):
            return {}
        guesses: dict[int, list[int]] = {}
        for index, chunk in enumerate(chunks):
            room = min(self._room(chunk), token_budget)
            if room > 0:
                seq = chunk.seq
                drafts = self.proposer.propose(seq, room)
                if drafts and seq.matcher is not None:
                    drafts = grammar_draft_prefix(seq.matcher, len(seq.output_token_ids), drafts)
                if drafts:
                    guesses[index] = drafts
        for index, chunk in enumerate(chunks):  # only sequences that drafted have a record
            record = self._acceptance.get(chunk.seq.seq_id)
            if record is not None and index not in guesses:
                record.fade()
        return self._sized(chunks, guesses, token_budget)

    def _room(self, chunk: ScheduledChunk) -> int:
        """How many drafts the chunk may carry (0: none)."""
        seq = chunk.seq
        request = seq.request
        # Decodes only: a prompt's last chunk runs the prefill kernels, and a draft verified
        # there would be computed otherwise than the decode that would have produced it. A
        # one-token last chunk of a prompt has one new token too: it has no outputs yet.
        if (chunk.num_new_tokens != 1 or chunk.num_samples != 1 or request.needs_fork
                or not seq.output_token_ids):
            return 0
        params = request.params
        room = self.config.num_speculative_tokens
        if params.max_tokens is not None:  # the verification's token is the last one kept
            room = min(room, params.max_tokens - len(seq.output_token_ids) - 1)
        return min(room, self.max_model_len - seq.num_tokens - 1)

    def _sized(self, chunks: SequenceOf[ScheduledChunk], guesses: dict[int, list[int]],
               token_budget: int) -> dict[int, list[int]]:
        """Each guess cut to the length the step's cost model says pays, within the budget."""
        indexes = list(guesses)
        rates = [self._record(chunks[index].seq).rate for index in indexes]
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        num_yielded = sum(chunk.num_samples for chunk in chunks)
        lengths = choose_draft_lengths(rates, [len(guesses[index]) for index in indexes],
                                       num_tokens, num_yielded, self.cost.coefficients())
        sized: dict[int, list[int]] = {}
        for index, length in zip(indexes, lengths, strict=True):
            length = min(length, token_budget)
            if length:
                sized[index] = guesses[index][:length]
                token_budget -= length
                self._save_generator(chunks[index].seq)
        return sized

    def _save_generator(self, seq: Sequence) -> None:
        """Remember a seeded random row's stream before its verification draws from it."""
        generator = seq.generator
        if generator is not None and not seq.request.params.is_greedy:
            self._rewind[seq.seq_id] = generator.get_state()

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Count the verification, learn from it, and rewind a seeded stream to the draws of
        the tokens kept."""
        self.counters.record(num_drafts, num_accepted)
        self._record(seq).record(num_drafts, num_accepted)
        state = self._rewind.pop(seq.seq_id, None)
        if state is not None:
            generator = seq.generator
            generator.set_state(state)
            for _ in range(num_accepted + 1):  # one uniform per token, as the sampler draws
                torch.rand(1, generator=generator, device=generator.device)

    def observe_step(self, chunks: SequenceOf[ScheduledChunk], seconds: float) -> None:
        """A step's wall time, for the cost model, if it computed no prompt."""
        if chunks and all(chunk.num_new_tokens - chunk.num_draft_tokens == 1
                          and chunk.num_samples == 1 for chunk in chunks):
            self.cost.observe(sum(chunk.num_new_tokens for chunk in chunks), seconds)

    def _record(self, seq: Sequence) -> Acceptance:
        record = self._acceptance.get(seq.seq_id)
        if record is None:
            record = self._acceptance[seq.seq_id] = Acceptance()
        return record

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq)
        self._acceptance.pop(seq.seq_id, None)
        self._rewind.pop(seq.seq_id, None)

    def stats(self) -> SpecDecodeStats:
        return self.counters.snapshot()

    def reset_counters(self) -> None:
        self.counters = SpecDecodeCounters()


def make_speculator(config: SpeculativeConfig | None,
                    max_model_len: int) -> NoSpeculation:
    return NoSpeculation() if config is None else Speculator(config, max_model_len)
