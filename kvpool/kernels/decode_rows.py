"""Which leading rows of the matmuls now running are decode rows: the model says so for the
length of a step (`leading_decode_rows`), and a kernel that picks its algorithm by the number
of rows (`kvpool.kernels.quant_matmul`) reads it (`num_leading_decode_rows`).

Why: a row's result must not depend on what shares its step. The quantized matmul runs an
integer kernel for few rows and a dequantizing one for many; the two round differently, so a
decode token's logits would change with the number of prompt tokens, other decodes or drafts
in its step, and greedy output with speculative decoding could differ from output without it
at a near-tie. With the decode rows known, they always take the integer kernel, and the prompt
rows the kernel their own count picks.

The runner orders a step's tokens decodes first (`kvpool.engine.model_runner`), so in the
layers the decode rows are a count of leading rows. The language-model head multiplies only the
sampled rows, in the order of the step's requests, so there they are given as a boolean mask,
made by a function only when a kernel asks (a kernel asks only when the rows are many).
Outside a step the count is 0: every row counts as a prompt row, as before the split existed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A count of leading decode rows, or a function giving a bool mask [rows] of them.
DecodeRowCount = int | Callable[[], "torch.Tensor"]

_LEADING_DECODE_ROWS: ContextVar[DecodeRowCount] = ContextVar("leading_decode_rows", default=0)


@contextmanager
def leading_decode_rows(count: DecodeRowCount) -> Iterator[None]:
    """Within the block, the first `count` rows of every matmul are decode rows (or, for a
    function, the rows its mask sets)."""
    token = _LEADING_DECODE_ROWS.set(count)
    try:
        yield
    finally:
        _LEADING_DECODE_ROWS.reset(token)


def current_decode_rows() -> int | torch.Tensor:
    """The leading decode rows' count, or the decode rows' bool mask."""
    count = _LEADING_DECODE_ROWS.get()
    return count() if callable(count) else count
