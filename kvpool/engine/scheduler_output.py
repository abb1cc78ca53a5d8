"""What `Scheduler.schedule()` hands the rest of the step: the batch's chunks, its block
copies, and who was preempted or capped on the way.

A chunk is one sequence's share of the step; it also says which logits rows the step must
return for it (`num_samples` rows of its last token, plus the rows of `prompt_logprob_positions`
for a request that asked for prompt logprobs). Everything in a chunk is fixed when it is
scheduled: the sequence grows once the step is done.

A chunk may end with drafts (speculative decoding: `draft_token_ids`, the last tokens of
`token_ids`, in tentative slots); it then asks for a sampling row at each drafted position
and at the token before them, which the verification compares with the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.engine.sequence import Sequence
from kvpool.memory.block_table import BlockCopy


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`token_ids`, the next tokens of `seq` after its first `num_computed_tokens`.

    `num_samples`: the logits rows the step computes for this chunk's last token: 0 while a
    prompt's prefill is unfinished, 1 when the chunk reaches the sequence's last token, n when
    that completes the prompt of a request still to fork (one row per future sibling).
    `prompt_logprob_positions`: the chunk's positions whose logits give prompt logprobs (see
    `kvpool.engine.requests.prompt_logprobs`); empty for most chunks.
    `draft_token_ids`: drafted tokens ending `token_ids` (then `num_samples` is 1 and the
    step samples `1 + len(draft_token_ids)` rows, one per position from the last real token on).
    """

    seq: Sequence
    num_computed_tokens: int
    token_ids: list[int]
    num_samples: int
    prompt_logprob_positions: range = range(0)
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_sampling_rows(self) -> int:
        return self.num_samples + self.num_draft_tokens

    def with_drafts(self, draft_token_ids: list[int]) -> ScheduledChunk:
        """This chunk followed by drafts in tentative slots (already reserved)."""
        assert self.num_samples == 1 and not self.draft_token_ids
        return ScheduledChunk(self.seq, self.num_computed_tokens,
                              self.token_ids + draft_token_ids, 1,
                              self.prompt_logprob_positions, tuple(draft_token_ids))

    @property
    def num_prompt_logprob_rows(self) -> int:
        return len(self.prompt_logprob_positions)

    @property
    def completes_sequence(self) -> bool:
        return self.num_samples > 0

    @property
    def block_ids(self) -> list[int]:
        return self.seq.block_table.block_ids

    @property
    def group_block_ids(self) -> tuple[list[int], ...]:
        """Each KV cache group's blocks (`kvpool.memory.kv_groups`)."""
        return self.seq.block_table.group_block_ids


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    length_capped: list[Sequence] = field(default_factory=list)  # outgrew the whole pool

    def written_block_ids(self) -> set[int]:
        """The device blocks the step writes: its new tokens' slots' blocks and its block
        copies' destinations (asked by the KV tiers on CUDA, to order their copies)."""
        written = {copy.dst_block_id for copy in self.block_copies}
        for chunk in self.chunks:
            size = chunk.seq.block_table.block_size
            first = chunk.num_computed_tokens // size
            last = (chunk.num_computed_tokens + chunk.num_new_tokens - 1) // size
            written.update(chunk.block_ids[first : last + 1])
        return written

    def sampled_sequences(self) -> list[tuple[Sequence, int, tuple[int, ...]]]:
        """(chunk's sequence, completion index, drafts before the row) per sampling logits
        row, in row order; an index not yet among the request's sequences is a sibling
        `update` forks. A chunk with k drafts has k + 1 rows, the i-th after i drafts."""
        rows = []
        for chunk in self.chunks:
            seq, drafts = chunk.seq, chunk.draft_token_ids
            if drafts:
                rows.extend((seq, seq.index, drafts[:row]) for row in range(len(drafts) + 1))
            else:
                rows.extend((seq, seq.index + sample, ()) for sample in range(chunk.num_samples))
        return rows
