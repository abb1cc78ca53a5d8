"""The sampler's steps 2 and 3 (see `kvpool.engine.sampling.sampler`): what each row may not
generate, and its logit bias; and, once tokens are chosen, the grammars' advance.

Each function works in place on float32 logits [num_rows, vocab] and skips itself when no row
needs it. Forbidden tokens become -inf: a grammar's (structured outputs), those outside
`allowed_token_ids`, and bad words' (`bad_word_bans`, which the sampler bans together with
the stop tokens of rows below `min_tokens`). Everything runs on the logits' device but the
grammar bitmask, which xgrammar fills in host memory and which is copied over once per step.

Grammar matchers advance here, on the sampling side, by the token chosen for their row
(`advance_grammars`), so a matcher is always at its row's next token when the stop rules read
it (`kvpool.engine.requests.output_processor`: a rejected token or a terminated grammar stops the
sequence). A step rolled back after the sampler ran leaves its matchers one token ahead; the
next fill rewinds them to the tokens their sequence really has.
"""

from __future__ import annotations

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
    pairs = [(index, token_id) for index, row in enumerate(rows)
             for token_id in row.params.allowed_token_ids or ()]
    if not pairs:
        return
    row_ids, token_ids = torch.tensor(pairs, device=logits.device).unbind(dim=1)
    is_limited = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    is_limited[row_ids] = True
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[row_ids, token_ids] = True
    logits.masked_fill_(is_limited[:, None] & ~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> None:
    """Add each row's `logit_bias` to its tokens' logits, in place."""
    entries = [(index, token_id, bias) for index, row in enumerate(rows)
               for token_id, bias in (row.params.logit_bias or {}).items()]
    if not entries:
        return
    device = logits.device
    row_ids, token_ids, biases = zip(*entries, strict=True)
    logits.index_put_(
        (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(biases, dtype=torch.float32, device=device),
        accumulate=True,
    )


def bad_word_bans(row: SamplingRow) -> list[int]:
    """The row's bad-word tokens banned now: a one-token word's always; a longer word's last
    token when the output so far ends with the word's other tokens (vLLM's rule)."""
    output = row.output_token_ids
    banned = []
    for word in row.bad_words_token_ids:
        num_prefix = len(word) - 1
        if num_prefix == 0 or (
            len(output) >= num_prefix and tuple(output[len(output) - num_prefix:]) == word[:-1]
        ):
            banned.append(word[-1])
    return banned
