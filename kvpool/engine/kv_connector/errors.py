"""The KV connector's error types: a transfer that did not happen, and a peer whose KV would
not mean the same as ours. Told apart by type and by `reason`, never by message text."""

from __future__ import annotations

from typing import Literal

# Why a transfer failed:
#   timeout   no answer within the transport's (or the side channel's) deadline
#   failed    the transfer engine reported failure (peer gone, range refused, I/O error)
#   checksum  bytes arrived but differ from what the sender holds
#   closed    the transport was closed, or never started
#   protocol  the peer refused a request, or answered what this version does not understand
#   lease     the producer's lease on the blocks ended (released, expired) or a block changed
#   prompt    the handed-over blocks hold another prompt than the request's
#   no_room   the consumer had no free blocks to load into
#   incompatible  the peers' KV differs (model, layout, version: `IncompatibleKVError`)
FailureReason = Literal["timeout", "failed", "checksum", "closed", "protocol", "lease",
                        "prompt", "no_room", "incompatible"]
FAILURE_REASONS: tuple[FailureReason, ...] = ("timeout", "failed", "checksum", "closed",
                                              "protocol", "lease", "prompt", "no_room",
                                              "incompatible")


class KVTransferError(RuntimeError):
    """A KV transfer or side-channel exchange that did not complete; `reason` says why."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"KV transfer {reason}: {message}")
        self.reason: FailureReason = reason


class IncompatibleKVError(ValueError):
    """Two engines whose KV blocks cannot be exchanged: `field` names the first fact that
    differs (model, block size, KV dtype, ...), with each side's value."""

    def __init__(self, field: str, local: object, remote: object) -> None:
        super().__init__(f"incompatible KV peer: {field} differs (local {local!r}, "
                         f"remote {remote!r})")
        self.field = field
        self.local = local
        self.remote = remote
