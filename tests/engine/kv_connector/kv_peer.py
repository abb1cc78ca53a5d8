"""A KV peer in a process of its own: a plain KV cache filled with known bytes, registered with
a real `MooncakeTransport` and offered on a real side channel, as a prefill engine would: every
block is leased under `LEASE_ID` by a real `KVProducer`, so the side channel answers for them.

    python -m tests.engine.kv_connector.kv_peer LAYOUT_JSON NUM_BLOCKS SEED MODEL TIMEOUT

Once ready it prints one JSON line (`endpoint`, `rpc_port`, `generations`); it serves until its
stdin closes, then closes both and exits 0. `PeerProcess` starts one and reads that line;
`filled_cache` makes the same bytes in the test's own process, to compare with what a transfer
brought.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kvpool.engine.kv_connector.mooncake_transport import MooncakeConfig, MooncakeTransport
from kvpool.engine.kv_connector.producer import KVProducer
from kvpool.engine.kv_connector.regions import kv_tensors
from kvpool.engine.kv_connector.side_channel import SideChannelServer
from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout

REPO = Path(__file__).resolve().parents[3]
READY_TIMEOUT_SECONDS = 120.0
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LEASE_ID = "peer"  # the lease on every block
DIGEST = "peer-prompt"  # the prompt digest it was granted for


def filled_cache(layout: KVLayout, num_blocks: int, seed: int) -> KVCache:
    """A KV cache whose every block but the null block holds bytes drawn from `seed`."""
    cache = KVCache(layout, num_blocks)
    generator = torch.Generator().manual_seed(seed)
    if layout.is_quantized:
        codes = torch.randint(-127, 128, cache.tensor.shape, generator=generator)
        cache.tensor.copy_(codes.to(cache.tensor.dtype))
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=generator))
        cache.scales[NULL_BLOCK_ID] = 1.0
    else:
        cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=generator))
    cache.tensor[NULL_BLOCK_ID].zero_()
    return cache


class PeerProcess:
    """A `kv_peer` process, started and ready: its side channel's `endpoint`, its transfer
    engine's `rpc_port`. Its stderr (Mooncake's log) goes to `log_path`."""

    def __init__(self, layout: KVLayout, num_blocks: int, seed: int, log_path: Path,
                 model: str = MODEL, timeout_seconds: float = 30.0) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "tests.engine.kv_connector.kv_peer",
                   json.dumps(asdict(layout)), str(num_blocks), str(seed), model,
                   str(timeout_seconds)]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log)
        ready = self._ready_line()
        self.endpoint: str = ready["endpoint"]
        self.rpc_port: int = ready["rpc_port"]
        self.generations: dict[int, int] = {int(b): g for b, g in ready["generations"].items()}

    def pairs(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """(block id, generation) of `block_ids` under the peer's lease."""
        return [(block_id, self.generations[block_id]) for block_id in block_ids]

    def _ready_line(self) -> dict:
        readable, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_SECONDS)
        line = self.process.stdout.readline() if readable else b""
        if not line:
            self.kill()
            raise RuntimeError(f"the KV peer did not start; its log:\n{self.log()}")
        return json.loads(line)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """Close its stdin (it closes down and exits); its exit code."""
        if self.process.poll() is None:
            self.process.stdin.close()
        return self.process.wait(timeout=120)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=120)


def serve(layout: KVLayout, num_blocks: int, seed: int, model: str, timeout: float) -> None:
    cache = filled_cache(layout, num_blocks, seed)
    with MooncakeTransport(MooncakeConfig(timeout_seconds=timeout)) as transport:
        transport.register(kv_tensors(cache))
        descriptor = transport.describe(f"peer-{seed}", model, layout)
        pool = BlockPool(num_blocks - 1, layout)
        producer = KVProducer(pool, kv_tensors(cache), lease_seconds=3600)
        lease = producer.hand_over(LEASE_ID, pool.allocate(num_blocks - 1), DIGEST,
                                   time.monotonic())
        with SideChannelServer(descriptor, producer) as server:
            print(json.dumps({"endpoint": server.endpoint, "rpc_port": transport.rpc_port,
                              "generations": dict(lease.generations)}), flush=True)
            sys.stdin.read()  # until the test closes our stdin


if __name__ == "__main__":
    layout_json, num_blocks, seed, model, timeout = sys.argv[1:]
    serve(KVLayout(**json.loads(layout_json)), int(num_blocks), int(seed), model,
          float(timeout))
