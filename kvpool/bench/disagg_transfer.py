"""The KV handover's figures for `kvpool bench disagg`: what the decode worker's /metrics say
it loaded, a quiet probe that times single handovers, and the paper projection to RDMA.

Read from the decode worker's /metrics (absent before a server exports them: then None):
`kvpool:kv_transfer_blocks_total` and `kvpool:kv_transfer_bytes_total` (direction
"received"), the `kvpool:kv_transfer_seconds` histogram (one observation per successful load:
the lease check, the read, both sides' checksums and the release) and
`kvpool:kv_transfer_failures_total{reason}`; `kvpool:cache_config_info` gives the block size.

The probe sends prompts one at a time through the router after the workload, so each load
runs alone; their (blocks, seconds) points fit seconds = fixed + blocks x per-block cost.
`project` turns the fit into the TTFT a handover would add between two machines over RDMA:
the fixed cost (side-channel round trips: assumed to cost what they cost here), both sides'
CRC-32 checksums at this CPU's rate (CPU work, not moved by a faster wire), and the bytes
over an RDMA link at `rdma_gbps`. A paper model, never a measurement.
"""

from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import httpx

_RECEIVED = {"direction": "received"}


@dataclass(frozen=True, slots=True)
class TransferCounters:
    """The decode worker's transfer counters at one moment (or the change between two)."""

    num_blocks: float
    num_bytes: float
    load_seconds_sum: float
    num_loads: float
    failures: dict[str, float] = field(default_factory=dict)

    def since(self, earlier: TransferCounters) -> TransferCounters:
        failures = {reason: count - earlier.failures.get(reason, 0.0)
                    for reason, count in self.failures.items()}
        return TransferCounters(self.num_blocks - earlier.num_blocks,
                                self.num_bytes - earlier.num_bytes,
                                self.load_seconds_sum - earlier.load_seconds_sum,
                                self.num_loads - earlier.num_loads, failures)

    def figures(self) -> dict[str, Any]:
        """The counters, with loopback throughput (MB/s) and cost per block (ms/block)."""
        seconds, blocks = self.load_seconds_sum, self.num_blocks
        return {"blocks_received": blocks, "bytes_received": self.num_bytes,
                "load_seconds_sum": seconds, "num_loads": self.num_loads,
                "bytes_per_block": self.num_bytes / blocks if blocks else None,
                "mb_per_s": self.num_bytes / 1e6 / seconds if seconds else None,
                "ms_per_block": 1e3 * seconds / blocks if blocks else None,
                "failures": {reason: count for reason, count in self.failures.items() if count}}


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def _total(samples: list[tuple[str, dict[str, str], float]], name: str,
           labels: dict[str, str] | None = None) -> float | None:
    values = [value for sample_name, sample_labels, value in samples if sample_name == name
              and (labels or {}).items() <= sample_labels.items()]
    return sum(values) if values else None


def read_transfer(url: str) -> TransferCounters | None:
    """The transfer counters on `url`'s /metrics; None where the server exports none."""
    samples = _samples(url)
    blocks = _total(samples, "kvpool:kv_transfer_blocks_total", _RECEIVED)
    if blocks is None:
        return None
    failures = {labels["reason"]: value for name, labels, value in samples
                if name == "kvpool:kv_transfer_failures_total" and "reason" in labels}
    return TransferCounters(
        blocks, _total(samples, "kvpool:kv_transfer_bytes_total", _RECEIVED) or 0.0,
        _total(samples, "kvpool:kv_transfer_seconds_sum") or 0.0,
        _total(samples, "kvpool:kv_transfer_seconds_count") or 0.0, failures)


def read_block_size(url: str) -> int:
    """Tokens per KV block, from `kvpool:cache_config_info`'s label."""
    for name, labels, _ in _samples(url):
        if name == "kvpool:cache_config_info" and "block_size" in labels:
            return int(labels["block_size"])
    raise RuntimeError(f"{url}/metrics has no kvpool:cache_config_info")


# ---------------------------------------------------------------- the quiet probe
def probe_handovers(router_url: str, decode_url: str, prompts: list[list[int]],
                    wait: float = 10.0) -> list[tuple[float, float]]:
    """(blocks loaded, load seconds) of each prompt sent alone through the router with
    max_tokens 1; empty where the decode worker exports no transfer counters."""
    points = []
    for prompt in prompts:
        before = read_transfer(decode_url)
        if before is None:
            return []
        response = httpx.post(f"{router_url}/v1/completions", timeout=600, json={
            "model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        response.raise_for_status()
        deadline = time.monotonic() + wait  # the histogram may lag the answer a little
        while (change := read_transfer(decode_url).since(before)).num_loads < 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if change.num_loads == 1:
            points.append((change.num_blocks, change.load_seconds_sum))
    return points


def fit_handover(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Least squares seconds = fixed + blocks x per-block over the probe's points (None
    without two block counts)."""
    if len({blocks for blocks, _ in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return {"fixed_ms": 1e3 * intercept, "ms_per_block": 1e3 * slope}


def crc32_bytes_per_s(num_bytes: int = 32 * 2**20, repeats: int = 3) -> float:
    """This CPU's zlib CRC-32 rate (the checksum each side of a handover computes)."""
    data = bytes(num_bytes)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        zlib.crc32(data)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


# ---------------------------------------------------------------- the paper model
def project(fit: dict[str, float] | None, bytes_per_block: float | None,
            blocks_per_long_prompt: float | None, crc_rate: float, rdma_gbps: float,
            measured_long_ms: float | None) -> dict[str, Any]:
    """TTFT a long prompt's handover would add between two machines over RDMA (module
    docstring), beside the loopback handover measured here. Fields are None where an input is
    missing (no transfer metrics, no handover)."""
    out: dict[str, Any] = {
        "measured": False,
        "model": "fixed (side-channel round trips, as measured here) + blocks x bytes per "
                 "block x (2 / CRC-32 rate + 1 / RDMA bandwidth)",
        "rdma_gbps": rdma_gbps, "crc32_mb_per_s": crc_rate / 1e6,
        "bytes_per_block": bytes_per_block, "blocks_per_long_prompt": blocks_per_long_prompt,
        "fixed_ms": fit["fixed_ms"] if fit else None,
        "loopback_ms_per_block": fit["ms_per_block"] if fit else None,
        "measured_loopback_long_ms": measured_long_ms}
    if bytes_per_block is None or blocks_per_long_prompt is None or fit is None:
        return {**out, "checksum_ms_per_block": None, "rdma_ms_per_block": None,
                "rdma_long_ms": None, "rdma_long_ms_without_checksums": None,
                "loopback_over_rdma": None}
    checksum_ms = 1e3 * 2 * bytes_per_block / crc_rate
    wire_ms = 1e3 * bytes_per_block / (rdma_gbps * 1e9 / 8)
    fixed = max(0.0, fit["fixed_ms"])  # a negative intercept is noise around zero
    rdma_long = fixed + blocks_per_long_prompt * (checksum_ms + wire_ms)
    return {**out, "checksum_ms_per_block": checksum_ms, "rdma_ms_per_block": wire_ms,
            "rdma_long_ms": rdma_long,
            "rdma_long_ms_without_checksums": fixed + blocks_per_long_prompt * wire_ms,
            "loopback_over_rdma": measured_long_ms / rdma_long if measured_long_ms else None}
