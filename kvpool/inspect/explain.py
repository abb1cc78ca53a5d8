"""Why a prompt would hit or miss the prefix cache: one verdict per block, and one sentence.

The engine's lookup (`KVCacheManager.plan_admission`) walks a prompt's full blocks in order:
the device's prefix cache while it matches, then the tiers below in the engine's order (host,
then disk: `KVTiers.tiers`, each asked `holds`) while they match, and stops at the first block
found nowhere. Each block's hash chains on its parent's,
so nothing after that first miss can be served, even a block whose own hash is still cached.
The lookup also stops one token short of the prompt's end (`_num_query_tokens`): the last
prompt token is always computed, since its logits are needed, so a prompt that ends exactly on
a block boundary computes its last block even when that block is cached.

Verdicts, per block of the prompt:

    hit           on the device: served in place
    host, disk    found in a lower tier: copied up (a disk hit is predicted from the disk's
                  index; the engine still reads and validates the file)
    evicted       the first miss; its hash is among the pool's recently evicted ones
    salt_differs  the first miss; the same tokens in the same block positions are cached
                  under another salt (another tenant, or another cache_salt)
    never_seen    the first miss; none of the above (or evicted too long ago to remember)
    after_miss    after the first miss: the chain is broken (`still_cached` says whether the
                  block's own KV is still in a tier, unreachable)
    partial       the last, partly filled block: only full blocks are ever cached

Two entry points share one core (`_classify`): `explain_prompt` reads the live engine (between
steps: the server calls it on the engine thread), `explain_from_snapshot` a saved `KVSnapshot`,
which keeps only short hashes (so no salt_differs and no disk there).

"salt_differs" tells a tenant that someone else sent the same text, so it is reported only
when the caller asks (`reveal_other_salts`). It compares token contents of cached entries,
since the cache stores no salt and no parent link: each block up to the miss must have its
tokens cached under a hash other than ours, which is evidence, not proof, of the same chain.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.formats.snapshot_runs import short_hash
from kvpool.memory.prefix_cache import BlockHash, PrefixCache, hash_full_blocks, salt_key
from kvpool.memory.tiers.kv_tiers import TIERS  # the walk's order: device, host, disk, shared

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine

HIT, HOST, DISK = "hit", "host", "disk"
EVICTED, SALT_DIFFERS, NEVER_SEEN = "evicted", "salt_differs", "never_seen"
AFTER_MISS, PARTIAL = "after_miss", "partial"
VERDICTS = (HIT, HOST, DISK, EVICTED, SALT_DIFFERS, NEVER_SEEN, AFTER_MISS, PARTIAL)
SERVED = (HIT, HOST, DISK)  # verdicts whose blocks a lookup serves (query limit aside)


@dataclass(frozen=True, slots=True)
class BlockVerdict:
    """One block of the prompt: `index` in the prompt, what the lookup would find there."""

    index: int
    verdict: str  # one of VERDICTS
    short_hash: str | None  # None for the partial block, which has no hash
    num_tokens: int
    still_cached: str | None = None  # past the first miss: the tier still holding the block
    evictions_ago: int | None = None  # "evicted": 1 = the most recent eviction

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> BlockVerdict:
        return cls(int(doc["index"]), str(doc["verdict"]), doc.get("short_hash"),
                   int(doc["num_tokens"]), doc.get("still_cached"), doc.get("evictions_ago"))


@dataclass(frozen=True, slots=True)
class PrefixExplanation:
    """A prompt's verdicts and what they add up to.

    `num_hit_tokens` is what the engine would report as the request's cached tokens: blocks
    served by any tier, before the first miss and within the lookup's limit (module docstring).
    """

    num_prompt_tokens: int
    block_size: int
    num_hit_tokens: int
    verdicts: tuple[BlockVerdict, ...]
    summary: str

    def to_json(self) -> dict[str, Any]:
        return {"num_prompt_tokens": self.num_prompt_tokens, "block_size": self.block_size,
                "num_hit_tokens": self.num_hit_tokens,
                "verdicts": [verdict.to_json() for verdict in self.verdicts],
                "summary": self.summary}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PrefixExplanation:
        """ValueError for a document that is not an explanation."""
        try:
            return cls(int(doc["num_prompt_tokens"]), int(doc["block_size"]),
                       int(doc["num_hit_tokens"]),
                       tuple(BlockVerdict.from_json(v) for v in doc["verdicts"]),
                       str(doc["summary"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed prefix explanation: {error!r}") from error


@dataclass(frozen=True, slots=True)
class _Lookup:
    """What the core asks of a cache, per full block index: the tiers holding the block's own
    hash (any of `TIERS`, the engine's walk order), and why the first miss missed."""

    tiers_of: Callable[[int], Collection[str]]
    miss_of: Callable[[int], tuple[str, int | None]]  # (verdict, evictions_ago)


# ------------------------------------------------------------------ entry points
def explain_prompt(engine: LLMEngine, token_ids: Sequence[int], cache_salt: str | None,
                   reveal_other_salts: bool = False) -> PrefixExplanation:
    """The live engine's verdicts for a prompt sent with `cache_salt` (the engine-level salt:
    the server's tenant-derived one). Call between steps; nothing is taken or counted."""
    _check_prompt(token_ids)
    pool = engine.kv_memory.pool
    lower = engine.kv_tiers.tiers  # the engine's walk below the device, in order
    size = engine.kv_memory.layout.block_size
    hashes = hash_full_blocks(token_ids, size, salt_key(cache_salt))
    pools = [pool, *(tier.pool for tier in lower if tier.pool is not None)]
    caches = [each.prefix_cache for each in pools]
    device_evictions = list(pool.recent_evictions)
    # A spilled block the host evicted in turn is lost there too (without a disk tier).
    lower_evictions = {block_hash for each in pools[1:] for block_hash in each.recent_evictions}

    def block(index: int) -> list[int]:
        return list(token_ids[index * size:(index + 1) * size])

    def tiers_of(index: int) -> list[str]:
        block_hash, tokens = hashes[index], block(index)
        found = ["device"] if pool.prefix_cache.lookup(block_hash, tokens) is not None else []
        return found + [tier.name for tier in lower if tier.holds(block_hash, tokens)]

    def miss_of(index: int) -> tuple[str, int | None]:
        ago = _evictions_ago(device_evictions, hashes[index])
        if ago is not None or hashes[index] in lower_evictions:
            return EVICTED, ago
        if reveal_other_salts and _cached_under_other_salt(caches, hashes,
                                                           token_ids, size, index):
            return SALT_DIFFERS, None
        return NEVER_SEEN, None

    return _explain(token_ids, size, [short_hash(h) for h in hashes], _Lookup(tiers_of, miss_of))


def explain_from_snapshot(snapshot: KVSnapshot, token_ids: Sequence[int],
                          cache_salt: str | None) -> PrefixExplanation:
    """The same verdicts from a saved snapshot, by short hash: hit, host, evicted, never_seen,
    after_miss, partial (a snapshot keeps no token contents and no disk index). `cache_salt`
    must be the engine-level salt the prompt would be hashed with."""
    _check_prompt(token_ids)
    size = snapshot.device.block_size
    labels = [short_hash(h) for h in hash_full_blocks(token_ids, size, salt_key(cache_salt))]
    held = {name: set(view.hashes.values()) for name, view in snapshot.pools.items()}
    evicted = list(snapshot.recent_evictions)

    def tiers_of(index: int) -> list[str]:
        return [name for name, labels_held in held.items() if labels[index] in labels_held]

    def miss_of(index: int) -> tuple[str, int | None]:
        ago = _evictions_ago(evicted, labels[index])
        return (EVICTED, ago) if ago is not None else (NEVER_SEEN, None)

    return _explain(token_ids, size, labels, _Lookup(tiers_of, miss_of))


# ------------------------------------------------------------------------- core
def _explain(token_ids: Sequence[int], size: int, labels: list[str],
             lookup: _Lookup) -> PrefixExplanation:
    verdicts = _classify(len(token_ids), size, labels, lookup)
    served = _served_by_tier(verdicts, _num_query_blocks(len(token_ids), size))
    num_hit_tokens = sum(served.values()) * size
    return PrefixExplanation(len(token_ids), size, num_hit_tokens, tuple(verdicts),
                             _summary(len(token_ids), size, served, verdicts))


def _num_query_blocks(num_tokens: int, size: int) -> int:
    """Full blocks a lookup may serve: it stops one token short, the last one is computed."""
    return (num_tokens - 1) // size


def _served_by_tier(verdicts: list[BlockVerdict], num_query_blocks: int) -> dict[str, int]:
    """Blocks served per served verdict, within the lookup's limit."""
    served = dict.fromkeys(SERVED, 0)
    for verdict in verdicts[:num_query_blocks]:
        if verdict.verdict in served:
            served[verdict.verdict] += 1
    return served


def _classify(num_tokens: int, size: int, labels: list[str],
              lookup: _Lookup) -> list[BlockVerdict]:
    """The engine's walk: device while it matches, then host or disk while they match (it does
    not return to the device), then the first miss and the broken chain after it."""
    verdicts: list[BlockVerdict] = []
    phase = HIT  # HIT: still on the device; "below": past it; AFTER_MISS: chain broken
    for index, label in enumerate(labels):
        tiers = lookup.tiers_of(index)
        if phase == HIT and "device" in tiers:
            verdicts.append(BlockVerdict(index, HIT, label, size))
            continue
        if phase != AFTER_MISS:
            below = next((tier for tier in TIERS[1:] if tier in tiers), None)
            if below is not None:
                phase = "below"
                verdicts.append(BlockVerdict(index, below, label, size))
                continue
            verdict, ago = lookup.miss_of(index)
            still = "device" if "device" in tiers else None  # device, but after a reload
            verdicts.append(BlockVerdict(index, verdict, label, size, still, ago))
            phase = AFTER_MISS
            continue
        still = next((tier for tier in TIERS if tier in tiers), None)  # the nearest
        verdicts.append(BlockVerdict(index, AFTER_MISS, label, size, still))
    if num_tokens % size:
        verdicts.append(BlockVerdict(len(labels), PARTIAL, None, num_tokens % size))
    return verdicts


def _summary(num_tokens: int, size: int, served: dict[str, int],
             verdicts: list[BlockVerdict]) -> str:
    """One sentence: the served tokens by tier, then each reason the rest is computed."""
    count = {name: sum(1 for v in verdicts if v.verdict == name) for name in VERDICTS}
    num_hit_tokens = sum(served.values()) * size
    head = f"{num_hit_tokens} of {num_tokens} prompt tokens would be served from cache"
    parts = [f"{served[name] * size} from the {where}" for name, where in
             ((HIT, "device"), (HOST, "host tier"), (DISK, "disk tier")) if served[name]]
    if parts:
        head += f" ({', '.join(parts)})"
    clauses = [head]
    miss = next((v for v in verdicts if v.verdict in (EVICTED, SALT_DIFFERS, NEVER_SEEN)), None)
    if miss is not None:
        clauses.append(_miss_clause(miss, size))
    if count[AFTER_MISS]:
        stranded = sum(1 for v in verdicts if v.verdict == AFTER_MISS and v.still_cached)
        clause = (f"the {count[AFTER_MISS]} full block(s) after it cannot hit, since each "
                  "block's hash chains on the one before")
        if stranded:
            clause += f" ({stranded} of them still cached, unreachable)"
        clauses.append(clause)
    full = [v for v in verdicts if v.verdict != PARTIAL]
    if full and len(full) > _num_query_blocks(num_tokens, size) and full[-1].verdict in SERVED:
        clauses.append(f"block {full[-1].index} is cached but computed anyway: the last "
                       "prompt token is always computed, so the lookup stops one token short")
    if count[PARTIAL]:
        clauses.append(f"the last {num_tokens % size} tokens fill a partial block, "
                       "which is never cached")
    return "; ".join(clauses) + "."


def _miss_clause(miss: BlockVerdict, size: int) -> str:
    start = miss.index * size
    where = f"block {miss.index} (tokens {start}-{start + size - 1})"
    if miss.verdict == EVICTED:
        ago = f" {miss.evictions_ago} eviction(s) ago" if miss.evictions_ago else " recently"
        text = f"{where} was evicted{ago}"
    elif miss.verdict == SALT_DIFFERS:
        text = f"{where} is cached only under another salt (another tenant or cache_salt)"
    else:
        text = (f"{where} was never cached under this salt (or was evicted too long ago "
                "to be remembered)")
    if miss.still_cached:
        text += ("; it is on the device, but the lookup does not return to the device after "
                 "a block reloaded from below")
    return text


# ---------------------------------------------------------------------- helpers
def _check_prompt(token_ids: Sequence[int]) -> None:
    if not token_ids:
        raise ValueError("the prompt is empty")


def _evictions_ago(evictions: list, key: BlockHash | str) -> int | None:
    """1 for the most recent eviction of `key`, 2 for the one before, ...; None if absent."""
    for ago, evicted in enumerate(reversed(evictions), start=1):
        if evicted == key:
            return ago
    return None


def _cached_under_other_salt(caches: Collection[PrefixCache], hashes: list[BlockHash],
                             token_ids: Sequence[int], size: int, index: int) -> bool:
    """Whether every block 0..index has its tokens cached under a hash not in our chain."""
    wanted = {tuple(token_ids[j * size:(j + 1) * size]): j for j in range(index + 1)}
    ours = set(hashes)
    found: set[int] = set()
    for cache in caches:
        for entry in cache._entry_by_block_id.values():
            position = wanted.get(entry.token_ids)
            if position is not None and entry.block_hash not in ours:
                found.add(position)
    return len(found) == len(wanted)
