"""Logprob entries (vLLM's `{token_id: Logprob}` dicts) for many rows at once, with one
device→host read per call.

Both the sampler (the sampled token of each row that asked for `logprobs`) and prompt logprobs
(each prompt token given the ones before it) need, per row: the target token's log probability,
its rank (1 + the tokens strictly more likely), and the row's `num_top` most likely tokens. On a
GPU every value read back separately is a stream synchronisation, so the rows are computed
together on the device and packed into one float64 tensor that is copied to the host once:
float64 holds every float32 log probability and every token id and rank exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.engine.requests.outputs import Logprob


def logprob_entries(
    logprobs: torch.Tensor,  # [num_rows, vocab] float32 log-probabilities
    target_ids: Sequence[int],  # one per row
    num_tops: Sequence[int],  # one per row: how many of its most likely tokens to add
) -> list[dict[int, Logprob]]:
    """Per row: `{target: Logprob(value, rank)}`, then its `num_tops[row]` most likely tokens
    with ranks 1..k (a top token equal to the target keeps the target's entry)."""
    num_rows = len(target_ids)
    assert logprobs.shape[0] == num_rows == len(num_tops), "one target and top count per row"
    if num_rows == 0:
        return []
    targets = torch.tensor(target_ids, dtype=torch.int64, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, targets)  # [num_rows, 1]
    ranks = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    max_top = max(num_tops)
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top] (0 wide: none)
    packed = torch.cat([chosen.double(), ranks.double(), top_values.double(), top_ids.double()],
                       dim=1).tolist()  # the one read back
    entries = []
    for target, num_top, row in zip(target_ids, num_tops, packed, strict=True):
        entry = {target: Logprob(row[0], int(row[1]))}
        values, ids = row[2 : 2 + max_top], row[2 + max_top :]
        for rank in range(num_top):
            entry.setdefault(int(ids[rank]), Logprob(values[rank], rank + 1))
        entries.append(entry)
    return entries
