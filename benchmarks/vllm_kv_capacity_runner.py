"""The vLLM side of `python -m benchmarks.vllm_kv_capacity`, run as a script in vLLM's venv:
build one `LLM` (dummy weights, no generation) and report the KV capacity vLLM resolved.

    <vllm venv>/bin/python vllm_kv_capacity_runner.py PLAN.json RESULT.json

It imports nothing from kvpool (kvpool is not installed there). Plan:

    {"model": HF directory (config.json only), "dtype": str, "max_model_len": int,
     "hybrid": bool (False: disable_hybrid_kv_cache_manager=True)}

Result: {"vllm_version", "init_s", "num_blocks", "block_size", "kv_cache_size_tokens",
"max_concurrency", "max_num_batched_tokens", "max_in_flight_tokens", "groups": [{"kind",
"num_layers", "block_size", "page_size_bytes", "sliding_window", "blocks_per_request"}],
"kv_cache_bytes"}: the engine's own figures (the ones vLLM logs as "KV cache size" and
"Maximum concurrency"), and the groups from the engine core's `kv_cache_config`, which this
script keeps in process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so it can read them. The KV size
comes from `VLLM_CPU_KVCACHE_SPACE` (whole GiB), which the caller sets.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _groups(llm, vllm_config) -> tuple[list[dict] | None, int | None]:
    """Each KV cache group (spec class, layers, block and page size, window, and the blocks a
    `max_model_len` request is charged), and the bytes of the KV allocation (the groups'
    tensors overlay one allocation); (None, None) when the engine core is not in this
    process."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    if config is None:
        return None, None
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        usage = spec.max_memory_usage_bytes(vllm_config)
        groups.append({"kind": type(spec).__name__, "num_layers": len(group.layer_names),
                       "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes,
                       "sliding_window": getattr(spec, "sliding_window", None),
                       "blocks_per_request": -(-usage // spec.page_size_bytes)})
    return groups, max(tensor.offset + tensor.size for tensor in config.kv_cache_tensors)


def main(plan_path: str, result_path: str) -> None:
    with open(plan_path) as file:
        plan = json.load(file)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    start = time.perf_counter()
    import vllm
    from vllm import LLM

    # enforce_eager: no torch.compile warm-up (a minute on 2 cores); it does not touch the KV
    # sizing, which on CPU is VLLM_CPU_KVCACHE_SPACE alone. With no tokenizer, vLLM logs a
    # failed chat-template warm-up (a traceback, as a warning): harmless here.
    llm = LLM(model=plan["model"], dtype=plan["dtype"], load_format="dummy",
              skip_tokenizer_init=True, enforce_eager=True, seed=0,
              max_model_len=plan["max_model_len"],
              disable_hybrid_kv_cache_manager=not plan["hybrid"])
    vllm_config = llm.llm_engine.vllm_config
    cache = vllm_config.cache_config
    groups, kv_cache_bytes = _groups(llm, vllm_config)
    result = {
        "vllm_version": vllm.__version__,
        "init_s": time.perf_counter() - start,
        "max_model_len": vllm_config.model_config.max_model_len,
        "hybrid": plan["hybrid"],
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_cache_size_tokens": getattr(cache, "kv_cache_size_tokens", None),
        "max_concurrency": getattr(cache, "kv_cache_max_concurrency", None),
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "max_in_flight_tokens": getattr(vllm_config, "max_in_flight_tokens", None),
        "groups": groups,
        "kv_cache_bytes": kv_cache_bytes,
    }
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":  # vLLM's CPU workers re-import the main module: guard the run
    main(*sys.argv[1:3])
