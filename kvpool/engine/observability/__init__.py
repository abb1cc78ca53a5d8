"""The engine's KV observers: listeners registered once on the KV fan-out
(`kvpool.memory.kv_listener`) and the snapshot taken between two steps.

    events_config.py  `KVEventsConfig`: whether and where KV events are published
    event_log.py      `KVEventLog`: the step's KV events batch, numbered at each drain
    publisher.py      ZMQ / null publishers of those batches
    recorder.py       `KVRecorder`: the KV trace file, one JSON line per event
    snapshot.py       `take_kv_snapshot`: every pool and block table, as a `KVSnapshot`

These produce; the formats they write (events wire format, trace lines, snapshot JSON) are
`kvpool.formats`, which the router, the inspector and the simulator read without the engine.
"""
