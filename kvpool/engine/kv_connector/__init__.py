"""The KV connector: how one engine's KV blocks reach another's, for disaggregated prefill and
decode (a prefill worker computes a prompt's blocks; a decode worker pulls them).

It follows vLLM's KVConnector V1 concepts: a scheduler-side half that decides which blocks move
and a worker-side half that moves them, with a Mooncake implementation (RDMA or TCP through the
Mooncake transfer engine) and, later, a loopback one for tests and single-host runs.

What exists now is the transport layer alone:
- `mooncake_transport`: `MooncakeTransport`, one Mooncake transfer engine that registers this
  process's KV tensors and reads or writes whole blocks of a peer's;
- `handshake`: `EngineDescriptor`, what two engines exchange before any transfer, and
  `check_compatible`, which refuses peers whose KV would not mean the same;
- `side_channel`: a ZMQ REQ/REP channel that carries descriptors and block checksums;
- `checksums`: per-block checksums a receiver verifies after a transfer;
- `regions`: registered KV tensors as base address, size and bytes per block;
- `bounded_call`: native calls run under a deadline, so no transfer hangs its caller.
The scheduler and worker connector, block leases and routing come later.
"""
