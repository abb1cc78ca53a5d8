"""Fixtures shared by the whole suite: the real SmolLM2 model, loaded once per session, and
the fast random model over its tokenizer; and the markers that split the suite into tiers.

Tiers: `make test` runs everything; `make test-fast` skips tests marked `slow` (they load the
real SmolLM2, or transformers' copy of it) or `processes` (they start processes or servers).
Both marks are applied here, at collection, from the fixtures a test uses (directly or through
other fixtures: `MODEL_FIXTURES`, `PROCESS_FIXTURES`) and from `MODULE_MARKS` for modules that
load the model or start processes themselves; a test may also carry them by hand.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.memory_heavy import memory_heavy  # noqa: F401 (a suite-wide fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers and routers built by the tests (and the processes they start) key tenants' cache
# salts with this secret, rather than generating a file under the user's ~/.cache.
os.environ["KVPOOL_CACHE_SALT_SECRET"] = "kvpool-test-suite-cache-salt-secret"
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # pytest-xdist (`make test` runs one worker per core): each worker and every process it
    # starts gets its share of the cores, so torch's thread pools never oversubscribe them.
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Fixtures that load the real model, or that build on one that does.
MODEL_FIXTURES = frozenset({"smollm2", "fast_model", "hf_smollm2", "hf_tokenizer"})
# Fixtures that start another process (a server, a database).
PROCESS_FIXTURES = frozenset({"redis_server"})
# Modules (relative to tests/) whose tests load the model or start processes without one of
# those fixtures: subprocesses, spawned ranks, `kvpool` commands over the bundled model.
MODULE_MARKS: dict[str, tuple[str, ...]] = {
    "attention/test_selector.py": ("processes",),
    "attention/test_triton_kernels.py": ("processes",),
    "bench/test_bench_serve.py": ("processes",),
    "bench/test_disagg_bench.py": ("processes",),
    "bench/test_serve_noisy.py": ("processes",),
    "bench/test_tensor_parallel_bench.py": ("processes",),
    "benchmarks/test_gpu_check.py": ("slow", "processes"),
    "benchmarks/test_hf_export.py": ("slow",),
    "benchmarks/test_throughput_baselines.py": ("processes",),
    "cli/test_commands.py": ("slow",),
    "cli/test_demo.py": ("slow",),
    "cli/test_main.py": ("processes",),
    "engine/test_tensor_parallel_engine.py": ("processes",),
    "examples/test_examples.py": ("processes",),
    "experiments/test_experiments.py": ("processes",),
    "kernels/test_cpu_kernels_build.py": ("processes",),
    "model/test_tensor_parallel.py": ("processes",),
    "router/test_failover.py": ("processes",),
    "server/test_disaggregated_serving.py": ("processes",),
    "server/test_serve.py": ("processes",),
    "server/test_tp_server.py": ("processes",),
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test `slow` and/or `processes` by its fixtures and its module (docstring)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        marks = set(MODULE_MARKS.get(module, ()))
        if fixtures & MODEL_FIXTURES:
            marks.add("slow")
        if fixtures & PROCESS_FIXTURES:
            marks.add("processes")
        for mark in sorted(marks):
            item.add_marker(mark)


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct, dequantized to fp32 on the CPU (transformers'
    reference computes with the same weights), as a `LoadedModel`."""
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.setup import load_engine_model

    return load_engine_model(EngineConfig(dtype="float32", quantization="none"))


@pytest.fixture(scope="session")
def fast_model(smollm2):
    """A two-layer random Llama with SmolLM2's vocabulary, EOS and tokenizer, as a
    `LoadedModel`: it steps in milliseconds (for the server's and the router's tests)."""
    import dataclasses

    from kvpool.model import presets
    from kvpool.model.loaders.auto import load_model
    from kvpool.model.loaders.base import LoadedModel

    config = dataclasses.replace(
        presets.preset("tiny"),
        vocab_size=smollm2.config.vocab_size,
        eos_token_ids=smollm2.config.eos_token_ids,
        bos_token_id=smollm2.config.bos_token_id,
    )
    dummy = load_model(config, load_format="dummy")
    return LoadedModel(config, dummy.model, smollm2.tokenizer, dummy.load_seconds)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF file, fp32: the correctness reference."""
    from transformers import AutoModelForCausalLM

    from kvpool.model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """`tmpfs(size)` mounts a real tmpfs of `size` (e.g. "256k") for the test: a disk that
    fills up, for the disk tier's ENOSPC path. Mounting needs root, which `make test` and CI
    have on this project's machines; elsewhere the test is skipped, saying so."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a real full disk needs a tmpfs mount, which needs root (CI has it)")
        mount_point = tmp_path / f"tmpfs-{len(mounted)}"
        mount_point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                        str(mount_point)], check=True)
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, empty, killed at teardown
    (`tests.redis_server.RedisServer`: `.url`, `.client()`, `.stop()`, `.start()`)."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
