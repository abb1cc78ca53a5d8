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
sequence). A step rolled back after the sampler ran leaves its matchers one token ahead; the
next fill rewinds them to the tokens their sequence really has.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf

import torch

from kvpool.engine.sampling.rows import SamplingRow

_BITS_PER_WORD = 32  # the grammar bitmask is int32: bit t % 32 of word t // 32 is token t


def apply_grammar_bitmask(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> None:
    """Forbid (-inf, in place) every token a constrained row's grammar does not allow next.

    One int32 bitmask [num_constrained_rows, ceil(vocab / 32)] for the batch, filled by the
    rows' matchers in host memory (where xgrammar writes), copied to the logits' device once,
    turned into 0 / -inf and added to all constrained rows by one op. Unconstrained rows are
    never touched; a batch without constrained rows returns at once.
    """
    constrained = [(index, row.matcher) for index, row in enumerate(rows)
                   if row.matcher is not None]
    if not constrained:
        return
    for index, matcher in constrained:
        matcher.rewind_to(len(rows[index].output_token_ids))
    num_rows, vocab_size = logits.shape
    num_words = -(-vocab_size // _BITS_PER_WORD)
    bitmask = torch.full((len(constrained), num_words), -1, dtype=torch.int32)  # all allowed
    needs_apply = [matcher.fill(bitmask, position)
                   for position, (_, matcher) in enumerate(constrained)]
    if not any(needs_apply):
        return
    penalty = bitmask_penalty(bitmask.to(logits.device), vocab_size)
    if len(constrained) == num_rows:
        logits.add_(penalty)
    else:
        row_ids = torch.tensor([index for index, _ in constrained], device=logits.device)
        logits.index_add_(0, row_ids, penalty)


def advance_grammars(rows: SequenceOf[SamplingRow], token_ids: SequenceOf[int]) -> None:
    """Advance each constrained row's matcher by the token chosen for it. A token the grammar
    rejects (possible only when it had masked every token) leaves the matcher marked, and the
    stop rules end the sequence."""
    for row, token_id in zip(rows, token_ids, strict=True):
        if row.matcher is not None:
            row.matcher.accept(token_id)


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
