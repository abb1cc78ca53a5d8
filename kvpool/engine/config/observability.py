"""What the engine reports about its KV cache: a trace file of allocation events and vLLM's
KV event publishing for a prefix-aware router."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvpool.engine.config.options import option, parse_json_object
from kvpool.engine.observability.events_config import KVEventsConfig


@dataclass(frozen=True)
class ObservabilityConfig:
    """`kv_trace` names a file the engine writes its KV allocation events to, one JSON line
    each (`kvpool.formats.kv_trace`); its directory must exist. None: nothing is recorded.
    `kv_events_config` (vLLM's option; a dict or its JSON text is accepted, kept as a
    `KVEventsConfig`) publishes the engine's block stored / removed / cleared events for a
    prefix-aware router (`kvpool.engine.observability.events_config`)."""

    TITLE: ClassVar[str] = "observability"

    kv_trace: str | None = option(
        None, "write every KV block allocation, free, hit, eviction, preemption and resize to "
        "FILE, one JSON line each (kvpool.formats.kv_trace)", metavar="FILE")
    kv_events_config: KVEventsConfig | None = option(
        None, 'publish KV events, as vLLM does: \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}\'', parser=parse_json_object,
        metavar="JSON")

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_events_config",
                           KVEventsConfig.from_value(self.kv_events_config))
        if self.kv_trace is None:
            return
        path = Path(self.kv_trace)
        if not str(self.kv_trace).strip() or path.is_dir():
            raise ValueError(f"kv_trace (--kv-trace) must name a file, got {self.kv_trace!r}")
        if not path.parent.is_dir():
            raise ValueError(f"kv_trace (--kv-trace): the directory of {self.kv_trace!r} "
                             f"does not exist ({str(path.parent)!r})")
