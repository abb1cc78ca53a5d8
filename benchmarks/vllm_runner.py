"""The vLLM side of `python -m benchmarks.throughput_baselines --baseline vllm`, run as a script in
vLLM's venv.

    <vllm venv>/bin/python vllm_runner.py PLAN.json RESULT.json

It imports nothing from kvpool (kvpool is not installed there): the plan carries everything,
token ids included, so both engines see the same requests. Plan:

    {"model": HF directory, "dtype": str, "kv_cache_dtype": str, "max_num_seqs": int,
     "seed": int, "max_model_len": int (optional; default the model's),
     "runs": [{"label": str, "requests": [[prompt token ids, max_tokens], ...]}, ...],
     "latency_prompt": [token ids], "latency_tokens": int}

Result: {"vllm_version", "load_s", "max_num_batched_tokens", "runs": {label: {"elapsed_s",
"output_tokens_per_s", "token_ids"}}, "decode_ms_per_token"}. The KV cache size comes from
`VLLM_CPU_KVCACHE_SPACE` (whole GiB), which the caller sets: vLLM's CPU backend reads nothing
else.
"""

from __future__ import annotations

import json
import sys
import time


def _generate(llm, requests: list, sampling_params, tokens_prompt) -> tuple[float, list]:
    """Wall time of one `generate` over `requests` from an empty prefix cache, and the tokens."""
    llm.reset_prefix_cache()
    prompts = [tokens_prompt(prompt_token_ids=prompt) for prompt, _ in requests]
    params = [sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
              for _, max_tokens in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(output.outputs[0].token_ids) for output in outputs]


def main(plan_path: str, result_path: str) -> None:
    with open(plan_path) as file:
        plan = json.load(file)
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=plan["model"], dtype=plan["dtype"], max_num_seqs=plan["max_num_seqs"],
              seed=plan["seed"], kv_cache_dtype=plan.get("kv_cache_dtype", "auto"),
              max_model_len=plan.get("max_model_len"))
    result = {
        "vllm_version": vllm.__version__,
        "load_s": time.perf_counter() - start,
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config
        .max_num_batched_tokens,
        "kv_cache_dtype": plan.get("kv_cache_dtype", "auto"),
        "num_gpu_blocks": getattr(llm.llm_engine.vllm_config.cache_config, "num_gpu_blocks",
                                  None),
        "runs": {},
    }
    for run in plan["runs"]:
        elapsed, token_ids = _generate(llm, run["requests"], SamplingParams, TokensPrompt)
        num_output = sum(len(tokens) for tokens in token_ids)
        result["runs"][run["label"]] = {"elapsed_s": elapsed, "token_ids": token_ids,
                                        "output_tokens_per_s": num_output / elapsed}
        print(f"vllm {plan['dtype']} (KV {plan.get('kv_cache_dtype', 'auto')}) {run['label']}: "
              f"{num_output / elapsed:.1f} output tok/s",
              file=sys.stderr, flush=True)
    # Single-request decode latency: the time the last `latency_tokens` tokens add (median
    # of three pairs of runs).
    prompt, count = plan["latency_prompt"], plan["latency_tokens"]
    samples = []
    for _ in range(3):
        first, _ = _generate(llm, [(prompt, 1)], SamplingParams, TokensPrompt)
        full, _ = _generate(llm, [(prompt, count + 1)], SamplingParams, TokensPrompt)
        samples.append((full - first) / count * 1e3)
    result["decode_ms_per_token"] = sorted(samples)[1]
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":  # vLLM's CPU workers re-import the main module: guard the run
    main(*sys.argv[1:3])
