"""`kv_transfer_params`: what a request says about moving its KV, as vLLM's disaggregation
proxy sends it, and what a producer answers.

    client ─▶ router ─▶ prefill worker   {"do_remote_decode": true, ...}        (`RemoteDecode`)
                        ◀─ response's kv_transfer_params: the handover below
             router ─▶ decode worker     {"do_remote_prefill": true, "remote_engine_id": ...,
                                          "remote_block_ids": [...], "remote_host": ...,
                                          "remote_port": ..., kvpool's remote_* fields}
                                                                               (`RemotePrefill`)

vLLM's fields mean what they mean there. kvpool adds what makes the handover checkable:
`remote_lease_id` (the producer's lease on the blocks), `remote_block_generations` (each
block's generation when leased: the producer refuses a block reused since), and
`remote_num_tokens` with `remote_token_digest` (the prompt the blocks hold: a decode worker
whose prompt differs, by one token, does not load them).

A prompt's handed-over blocks are its full blocks before its last token (the decode worker
computes that token itself, for its logits), so `remote_block_ids` holds
`(remote_num_tokens - 1) // block_size` ids at most.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError

PARAM = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """The request runs here (prefill) and its KV is handed over for decoding elsewhere."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """The request's prompt was computed by the producer `engine_id`, whose side channel
    listens at `host`:`port`; its blocks are leased under `lease_id`."""

    engine_id: str
    host: str
    port: int
    lease_id: str
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    num_tokens: int
    token_digest: str

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(remote block id, generation) of each handed-over block, in prompt order."""
        return list(zip(self.block_ids, self.generations, strict=True))

    def to_wire(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_host": self.host,
                "remote_port": self.port, "remote_block_ids": list(self.block_ids),
                "remote_lease_id": self.lease_id,
                "remote_block_generations": list(self.generations),
                "remote_num_tokens": self.num_tokens,
                "remote_token_digest": self.token_digest}


def token_digest(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids, to tell whether two engines hold one prompt."""
    data = b"".join(token.to_bytes(4, "little", signed=True) for token in token_ids)
    return hashlib.sha256(data).hexdigest()[:32]


def parse(raw: object) -> RemoteDecode | RemotePrefill | None:
    """The request's `kv_transfer_params`: a handover asked of this producer, one to load
    from a producer, or None (absent, or neither flag set). InvalidRequestError (param
    "kv_transfer_params") for anything else."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _invalid("must be an object")
    decode, prefill = raw.get("do_remote_decode", False), raw.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        raise _invalid("do_remote_decode and do_remote_prefill must be true or false")
    if decode and prefill:
        raise _invalid("do_remote_decode and do_remote_prefill cannot both be true")
    if decode:
        return RemoteDecode()
    return _remote_prefill(raw) if prefill else None


def _remote_prefill(raw: Mapping[str, Any]) -> RemotePrefill:
    names = ("remote_engine_id", "remote_host", "remote_port", "remote_lease_id",
             "remote_block_ids", "remote_block_generations", "remote_num_tokens",
             "remote_token_digest")
    missing = [name for name in names if raw.get(name) is None]
    if missing:
        raise _invalid(f"do_remote_prefill needs {', '.join(missing)} (the producer's answer "
                       f"carries them)")
    block_ids, generations = raw["remote_block_ids"], raw["remote_block_generations"]
    if not (_ints(block_ids) and _ints(generations)) or len(block_ids) != len(generations):
        raise _invalid("remote_block_ids and remote_block_generations must be lists of "
                       "non-negative integers of one length")
    port, num_tokens = raw["remote_port"], raw["remote_num_tokens"]
    if not (_ints([port, num_tokens]) and port <= 65535 and num_tokens > 0):
        raise _invalid("remote_port must be a port (0: in-process) and remote_num_tokens a "
                       "positive integer")
    strings = [raw[name] for name in ("remote_engine_id", "remote_host", "remote_lease_id",
                                      "remote_token_digest")]
    if not all(isinstance(value, str) and value for value in strings):
        raise _invalid("remote_engine_id, remote_host, remote_lease_id and "
                       "remote_token_digest must be non-empty strings")
    return RemotePrefill(raw["remote_engine_id"], raw["remote_host"], port,
                         raw["remote_lease_id"], tuple(block_ids), tuple(generations),
                         num_tokens, raw["remote_token_digest"])


def _ints(values: object) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _invalid(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{PARAM}: {why}", PARAM)
