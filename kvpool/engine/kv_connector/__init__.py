"""The KV connector: how one engine's KV blocks reach another's, for disaggregated prefill and
decode (a prefill worker computes a prompt's blocks; a decode worker pulls them).

It follows vLLM's KVConnector V1 concepts: a scheduler-side half that decides which blocks move
and a worker-side half that moves them, with a Mooncake implementation (RDMA or TCP through the
Mooncake transfer engine) and a loopback one for tests and single-process runs.

The engine drives a `KVConnectorBase` (`base`; `NoKVConnector` without kv_transfer_config),
built by `factory` from `config.KVTransferConfig`:
- `pool_connector`: `PoolKVConnector`, producer and consumer over the block pool, with
  `loopback` (engines in one process) and `mooncake_connector` (between processes) carrying
  the bytes;
- `producer`: leases on a finished prompt's blocks, and the gate readers pass;
- `consumer`: loads into the prefix cache on worker threads, under kv_load_failure_policy;
- `params`: `kv_transfer_params` as requests carry them; `stats`: what moved and is held.
Below them, the transport layer:
- `mooncake_transport`: `MooncakeTransport`, one Mooncake transfer engine that registers this
  process's KV tensors and reads or writes whole blocks of a peer's;
- `handshake`: `EngineDescriptor`, what two engines exchange before any transfer, and
  `check_compatible`, which refuses peers whose KV would not mean the same;
- `side_channel`: a ZMQ REQ/REP channel that carries descriptors and the lease traffic;
- `checksums`: per-block checksums a receiver verifies after a transfer;
- `regions`: registered KV tensors as base address, size and bytes per block;
- `bounded_call`: native calls run under a deadline, so no transfer hangs its caller.
"""
