"""The observability formats, readable without the engine, torch or a model.

    kv_events.py      KV events on the wire (vLLM's ZMQ format): `KVEventBatch`, encode/decode
    kv_trace.py       the KV trace file's JSON lines: `TraceHeader`, `KVTrace`, `read_kv_trace`
    kv_snapshot.py    the KV snapshot JSON: `KVSnapshot`, `PoolView`, block states
    snapshot_runs.py  the run encodings and short hashes the snapshot and the trace use

Producers live with their owners (`kvpool.engine.observability`, `kvpool.memory.pool_view`);
consumers are the router (events), `kvpool.inspect` (snapshots, traces) and `kvpool.sim`
(traces). Imports: the standard library, msgspec, numpy, and the pure-Python records of
`kvpool.memory.block_pool` (`BlockPoolStats`, the medium names) — never torch, never the
engine. `tests/formats/test_light_imports.py` holds this.
"""
