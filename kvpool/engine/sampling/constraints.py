"""The sampler's steps 2 and 3 (see `kvpool.engine.sampling.sampler`): what each row may not
generate, and its logit bias; and, once tokens are chosen, the grammars' advance.

Each function works in place on float32 logits [num_rows, vocab] and skips itself when no row
needs it. Forbidden tokens become -inf: a grammar's (structured outputs), those outside
`allowed_token_ids`, bad words' and the stop tokens of rows below `min_tokens`
(`apply_token_bans`). Everything runs on the logits' device but the grammar bitmask, which
xgrammar fills in host memory and which is copied over once per step.

Allowed ids, bias and bad words come as each request's `TokenRules`, tensors built at
admission (`kvpool.engine.sampling.token_rules`): a step concatenates the rows' tensors and
never walks a request's dict or lists in Python, so their sizes cost the step next to nothing.

Grammar matchers advance here, on the sampling side, by the token chosen for their row
(`advance_grammars`), so a matcher is always at its row's next token when the stop rules read
it (`kvpool.engine.requests.output_processor`: a rejected token or a terminated grammar stops the
sequence). A step rolled back after the sampler ran leaves its matchers ahead (by the tokens it
would have kept); the next fill rewinds them to the tokens their sequence really has.

Speculative drafts meet the grammar three times, each leaving the matcher invariant intact
(between steps it has accepted exactly its sequence's outputs):
- at proposal, `grammar_draft_prefix` cuts the drafts to the longest prefix the grammar
  accepts (ending at a draft that ends the grammar), walking the matcher and rewinding it;
- at verification, row i of a drafted chunk is masked by the grammar after the outputs and
  drafts[:i] (`fill_grammar_rows` accepts one draft between rows, then rewinds);
- after sampling, `advance_grammars` accepts exactly the tokens the sequence keeps: the drafts
  the sampler agreed with and its token after them (none past a grammar's end), so the stop
  rules read each kept token's state as it joins the sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf

import torch

from kvpool.engine.sampling.matcher import TokenMask
from kvpool.engine.sampling.rows import SamplingRow

_BITS_PER_WORD = 32  # the grammar bitmask is int32: bit t % 32 of word t // 32 is token t


def apply_grammar_bitmask(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> None:
    """Forbid (-inf, in place) every token a constrained row's grammar does not allow next.

    One int32 bitmask [num_constrained_rows, ceil(vocab / 32)] for the batch, filled by the
    rows' matchers in host memory (where xgrammar writes), copied to the logits' device once,
    turned into 0 / -inf and added to all constrained rows by one op. Unconstrained rows are
    never touched; a batch without constrained rows returns at once.
    """
    constrained = [index for index, row in enumerate(rows) if row.matcher is not None]
    if not constrained:
        return
    num_rows, vocab_size = logits.shape
    num_words = -(-vocab_size // _BITS_PER_WORD)
    bitmask = torch.full((len(constrained), num_words), -1, dtype=torch.int32)  # all allowed
    if not any(fill_grammar_rows(bitmask, [rows[index] for index in constrained])):
        return
    penalty = bitmask_penalty(bitmask.to(logits.device), vocab_size)
    if len(constrained) == num_rows:
        logits.add_(penalty)
    else:
        row_ids = torch.tensor(constrained, device=logits.device)
        logits.index_add_(0, row_ids, penalty)


def fill_grammar_rows(bitmask: torch.Tensor, rows: SequenceOf[SamplingRow]) -> list[bool]:
    """Fill `bitmask[i]` with the tokens the i-th row's grammar allows next (every row has a
    matcher); per row, whether it forbids anything.

    A row's matcher stands after the sequence's outputs, and for a verification row after the
    drafts before it too. A drafted chunk's rows come one after another with 0, 1, ..., k
    drafts, so its matcher accepts one draft between two rows; afterwards every matcher is
    rewound to its sequence's outputs (the invariant the sampler's advance starts from).
    """
    needs_apply = []
    for position, row in enumerate(rows):
        drafts = row.draft_token_ids
        if drafts:  # the chunk's previous row was filled after drafts[:-1]
            is_accepted = row.matcher.accept(drafts[-1])
            assert is_accepted, "a draft the grammar rejects was not cut at proposal"
        else:  # also undoes a step rolled back after its sampling
            row.matcher.rewind_to(len(row.output_token_ids))
        needs_apply.append(row.matcher.fill(bitmask, position))
    for row in rows:
        if not row.draft_token_ids:  # every drafted chunk has one such row, its first
            row.matcher.rewind_to(len(row.output_token_ids))
    return needs_apply


def advance_grammars(rows: SequenceOf[SamplingRow], token_ids: SequenceOf[int]) -> None:
    """Advance each constrained row's matcher by the token its sequence keeps. A token the
    grammar rejects (possible only when it had masked every token) leaves the matcher marked,
    and the stop rules end the sequence.

    A verification row's token is kept while the chunk's earlier rows chose its drafts (the
    rule of `kvpool.engine.speculative.accepted_length`): row i's, when row i - 1's token was
    kept and equals the draft before row i. A grammar that ended with an accepted draft takes
    no token after it: its sequence stops at that draft.
    """
    is_kept, previous = False, None
    for row, token_id in zip(rows, token_ids, strict=True):
        drafts = row.draft_token_ids
        is_kept = not drafts or (is_kept and previous == drafts[-1])
        previous = token_id
        if is_kept and row.matcher is not None and not row.matcher.is_terminated:
            row.matcher.accept(token_id)


def grammar_draft_prefix(matcher: TokenMask, num_outputs: int,
                         drafts: SequenceOf[int]) -> list[int]:
    """The longest prefix of `drafts` the grammar accepts after the sequence's `num_outputs`
    outputs, ending at a draft that ends the grammar (nothing can follow it). The matcher
    walks through the drafts and is rolled back: it ends at the sequence's outputs, where it
    stands between steps."""
    matcher.rewind_to(num_outputs)  # a no-op but after a step rolled back past its sampling
    num_allowed = 0
    for draft in drafts:
        if matcher.is_terminated or not matcher.accept(draft):
            break
        num_allowed += 1
    matcher.rewind_to(num_outputs)
    return list(drafts[:num_allowed])


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token `token_id`'s bit in `bitmask[row]` (host int32 words, as xgrammar fills)."""
    word, bit = divmod(token_id, _BITS_PER_WORD)
    value = (int(bitmask[row, word]) | 1 << bit) & 0xFFFFFFFF
    bitmask[row, word] = value - (1 << 32) if value >> 31 else value  # int32's sign bit


def bitmask_penalty(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, num_words] int32 -> [num_rows, vocab_size] float32: 0 where a token's bit is
    set, -inf where it is not.

    By bytes rather than bits: each byte of the mask looks up its 8 values in a [256, 8]
    table (an embedding lookup), a few times faster than unpacking 32 bits per word and
    masking. Bytes are taken by shifts, low byte first, so the result is endianness-free.
    """
    device = bitmask.device
    byte_shifts = torch.arange(0, _BITS_PER_WORD, 8, dtype=torch.int32, device=device)
    mask_bytes = (bitmask[:, :, None] >> byte_shifts) & 0xFF  # [num_rows, num_words, 4]
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    table = torch.zeros(256, 8, device=device).masked_fill_(bits == 0, float("-inf"))
    values = torch.nn.functional.embedding(mask_bytes, table)  # [num_rows, num_words, 4, 8]
    return values.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_allowed_token_ids(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> None:
    """Forbid (-inf, in place) every token outside a row's `allowed_token_ids`."""
    limited = [(index, row.rules.allowed_token_ids) for index, row in enumerate(rows)
               if row.rules.allowed_token_ids is not None]
    if not limited:
        return
    row_ids, token_ids = _concat_rows(limited, logits.device)
    is_limited = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    is_limited[row_ids] = True
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[row_ids, token_ids] = True
    logits.masked_fill_(is_limited[:, None] & ~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> None:
    """Add each row's `logit_bias` to its tokens' logits, in place."""
    biased = [(index, row.rules) for index, row in enumerate(rows)
              if row.rules.bias_token_ids is not None]
    if not biased:
        return
    row_ids, token_ids = _concat_rows([(index, rules.bias_token_ids)
                                       for index, rules in biased], logits.device)
    biases = torch.cat([rules.bias_values for _, rules in biased])
    logits.index_put_((row_ids, token_ids), biases, accumulate=True)


def apply_token_bans(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> None:
    """-inf, in place, for the stop tokens of rows below `min_tokens` and for bad words: the
    one-token words' (tensors made at admission) and the longer words' whose other tokens end
    the output (`TokenRules.bad_word_bans`)."""
    device = logits.device
    pairs = [(index, token_id) for index, row in enumerate(rows)
             for token_id in itertools.chain(row.banned_token_ids,
                                             row.rules.bad_word_bans(row.output_token_ids))]
    always = [(index, row.rules.banned_token_ids) for index, row in enumerate(rows)
              if row.rules.banned_token_ids is not None]
    parts = [torch.tensor(pairs, device=device).unbind(dim=1)] if pairs else []
    if always:
        parts.append(_concat_rows(always, device))
    if parts:
        row_ids, token_ids = (torch.cat(ids) for ids in zip(*parts, strict=True))
        logits[row_ids, token_ids] = float("-inf")


def _concat_rows(
    entries: SequenceOf[tuple[int, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids, token ids), [total] int64 each: every (row, its 1-d ids) entry's ids, after
    one another, each paired with its row. One op per entry, never one per id; the lengths
    are tensor metadata, so nothing is read back from the device."""
    token_ids = torch.cat([ids for _, ids in entries])
    lengths = torch.tensor([ids.shape[0] for _, ids in entries], device=device)
    rows = torch.tensor([index for index, _ in entries], device=device)
    return rows.repeat_interleave(lengths, output_size=token_ids.shape[0]), token_ids
