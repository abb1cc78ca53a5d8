"""Paged strategies: sequences take fixed-size blocks as they grow, from the real `BlockPool`.

Each sample of a request is one `SequenceBlocks`. Two kinds of sharing, both through the real
memory core:

- `share_prefix`: the pool's prefix cache is on; a new table first takes the longest cached run
  of its prompt's full blocks (the shared system prompt), then allocates the rest.
- `fork_samples`: the prompt is stored once and the other n-1 samples are forks of it; the
  first token a sample appends to a shared, partly filled block copies it (copy-on-write).

Token ids only matter for prefix hashing, so they are synthetic but distinct where real ones
would differ: group g's shared prefix is `g * 2**16 + i`, the rest of request r's prompt is
`2**30 + r`, and sample s of request r generates `2**31 + r * 64 + s`.

Admission and growth are all-or-nothing: the exact number of blocks needed is computed first
(`_num_blocks_to_admit`, `_num_blocks_to_grow`) and compared with what the pool can give. The
first table of a request is sized with the engine's own admission arithmetic
(`BlockPool.match_prefix` + `BlockPool.num_blocks_to_admit`), and the match found while sizing
is the one the table takes.
"""

from __future__ import annotations

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout, cdiv
from kvpool.memory.prefix_cache import BlockHash, PrefixMatch, hash_full_blocks
from kvpool.memory.sequence_blocks import SequenceBlocks
from kvpool.sim.strategies import MemorySnapshot, SimConfig
from kvpool.sim.trace import Request


def prompt_token_ids(request: Request) -> list[int]:
    shared = []
    if request.prefix_group is not None:
        base = request.prefix_group << 16
        shared = list(range(base, base + request.prefix_len))
    return shared + [(1 << 30) + request.request_id] * (request.prompt_len - len(shared))


def generated_token_id(request: Request, sample: int) -> int:
    return (1 << 31) + request.request_id * 64 + sample


class PagedStrategy:
    """Block tables over one `BlockPool` holding as many blocks as the budget allows."""

    def __init__(self, config: SimConfig, block_size: int, *, share_prefix: bool = False,
                 fork_samples: bool = False) -> None:
        self.config = config
        self.block_size = block_size
        self.share_prefix = share_prefix
        self.fork_samples = fork_samples
        self.name = f"paged-{block_size}" + "+prefix" * share_prefix + "+fork" * fork_samples
        self._bytes_per_token = config.shape.bytes_per_token
        self._block_nbytes = block_size * self._bytes_per_token
        num_blocks = config.budget_bytes // self._block_nbytes
        if num_blocks < 1:
            raise ValueError(f"the budget does not hold one block of {block_size} tokens")
        self.pool = BlockPool(num_blocks, KVLayout(block_size), enable_prefix_caching=share_prefix)
        self._tables: dict[int, list[SequenceBlocks]] = {}
        self._prompt_hashes: dict[int, list[BlockHash]] = {}

    # --------------------------------------------------------------- admission
    def try_admit(self, request: Request, num_generated: int) -> bool:
        prompt = prompt_token_ids(request)
        match = self._match(request, prompt)
        needed = self._num_blocks_to_admit(request, num_generated, match)
        if needed > self.pool.num_allocatable_blocks:
            return False
        tables: list[SequenceBlocks] = []
        try:
            self._build_tables(request, prompt, match, num_generated, tables)
        except OutOfBlocksError:  # a rare prefix-cache corner the count did not foresee
            for table in tables:
                table.free()
            return False
        self._tables[request.request_id] = tables
        self._prompt_hashes.pop(request.request_id, None)
        return True

    def _build_tables(self, request: Request, prompt: list[int], match: PrefixMatch,
                      num_generated: int, tables: list[SequenceBlocks]) -> None:
        for sample in range(self.config.num_samples):
            if self.fork_samples and sample > 0:
                tables.append(tables[0].fork())
            else:  # later samples look their prompt up again: the first one's blocks hit
                match = match if sample == 0 else self._match(request, prompt)
                tables.append(self._prompt_table(request, prompt, match))
        if num_generated:
            for sample, table in enumerate(tables):
                tokens = [generated_token_id(request, sample)] * num_generated
                table.append_tokens(tokens, computed=self.share_prefix)

    def _prompt_table(self, request: Request, prompt: list[int],
                      match: PrefixMatch) -> SequenceBlocks:
        table = SequenceBlocks(self.pool)
        hashes = self._hashes(request, prompt) if self.share_prefix else []
        num_cached = table.take_prefix(match, prompt, hashes)
        table.append_tokens(prompt[num_cached:], computed=self.share_prefix)
        return table

    def _match(self, request: Request, prompt: list[int]) -> PrefixMatch:
        """The cached prefix of the prompt (none when prefix sharing is off)."""
        hashes = self._hashes(request, prompt) if self.share_prefix else []
        return self.pool.match_prefix(hashes, prompt)

    def _hashes(self, request: Request, prompt: list[int]) -> list[BlockHash]:
        # A head-of-line request is asked every step until it fits: hash its prompt once.
        hashes = self._prompt_hashes.get(request.request_id)
        if hashes is None:
            hashes = hash_full_blocks(prompt, self.block_size)
            self._prompt_hashes[request.request_id] = hashes
        return hashes

    def _num_blocks_to_admit(self, request: Request, num_generated: int,
                             match: PrefixMatch) -> int:
        size, num_samples = self.block_size, self.config.num_samples
        num_prompt, num_tokens = request.prompt_len, request.prompt_len + num_generated
        first = self.pool.num_blocks_to_admit(match, num_prompt if self.fork_samples else
                                              num_tokens)
        if self.fork_samples:
            # Every sample appends its generated tokens; all but the last holder of a shared,
            # partly filled prompt block copy it first.
            num_new = cdiv(num_tokens, size) - cdiv(num_prompt, size)
            num_copies = (num_samples - 1) * (num_generated > 0 and num_prompt % size != 0)
            return first + num_samples * num_new + num_copies
        # Later samples find the first sample's full prompt blocks in the prefix cache.
        num_shared = num_prompt // size if self.share_prefix else 0
        return first + (num_samples - 1) * (cdiv(num_tokens, size) - num_shared)

    # ------------------------------------------------------------------ growth
    def try_grow(self, request: Request) -> bool:
        tables = self._tables[request.request_id]
        if self._num_blocks_to_grow(tables) > self.pool.num_allocatable_blocks:
            return False
        for sample, table in enumerate(tables):
            table.append_tokens([generated_token_id(request, sample)], computed=self.share_prefix)
        return True

    def _num_blocks_to_grow(self, tables: list[SequenceBlocks]) -> int:
        num_needed = sum(table.num_blocks_to_append(1) for table in tables)
        if len(tables) == 1:
            return num_needed
        # Each table holding a shared, partly filled last block counts a copy, but the last of
        # its holders (all samples of this request) writes in place.
        shared_partial_ids = {
            table.block_ids[-1] for table in tables
            if table.num_tokens % self.block_size and self.pool.ref_count(table.block_ids[-1]) > 1
        }
        return num_needed - len(shared_partial_ids)

    def release(self, request: Request) -> None:
        for table in self._tables.pop(request.request_id):
            table.free()

    # --------------------------------------------------------------- reporting
    def memory(self) -> MemorySnapshot:
        stats = self.pool.stats()
        num_used_slots = stats.num_used_blocks * self.block_size
        per_token = self._bytes_per_token
        return MemorySnapshot(
            token_states=(num_used_slots - stats.num_unfilled_slots) * per_token,
            reservation=0,
            internal=stats.num_unfilled_slots * per_token,
            free=self.config.budget_bytes - stats.num_used_blocks * self._block_nbytes,
            external_fragmentation=0.0,  # any free block serves any request
        )
