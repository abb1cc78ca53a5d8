"""What every Python step of the GPU check gets: where to write, whether this is a smoke run,
its results log, and the device.

A step records each measurement as it finishes (`ResultLog.add`). `attempt` runs one
measurement and records its error instead of raising, so one broken shape or variant costs that
record only; the step then exits 1 so the script marks it failed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu.results import ResultLog, last_value, read_records

# Where the read bandwidth comes from when the env step measured none: a tensor this big.
SMOKE_BANDWIDTH_BYTES = 16 << 20
FULL_BANDWIDTH_BYTES = 4 << 30


@dataclass
class StepContext:
    out: Path
    smoke: bool
    log: ResultLog
    num_errors: int = 0

    @property
    def device(self):
        import torch

        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def bandwidth_bytes(self) -> int:
        return SMOKE_BANDWIDTH_BYTES if self.smoke else FULL_BANDWIDTH_BYTES

    def attempt(self, record: str, measure: Callable[[], dict], **labels: object) -> dict | None:
        """Record `measure()`'s fields under `record` (with `labels`), or its error."""
        try:
            fields = measure()
        except Exception as error:  # recorded; the step goes on to its next measurement
            traceback.print_exc()
            self.num_errors += 1
            self.log.add(record, **labels, error=f"{type(error).__name__}: {error}")
            return None
        return self.log.add(record, **labels, **fields)

    def read_bandwidth(self) -> float:
        """Bytes/s read by the env step's reduction; measured (and recorded) now if it has none."""
        measured = last_value(read_records(self.out), "env", "read_bandwidth", "bytes_per_s")
        if measured:
            return float(measured)
        from benchmarks.device_timing import read_bandwidth

        entry = self.log.add("read_bandwidth", **read_bandwidth(self.device, self.bandwidth_bytes))
        return float(entry["bytes_per_s"])
