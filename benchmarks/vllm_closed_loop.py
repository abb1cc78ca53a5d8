"""The vLLM side of `python -m benchmarks.speculative_baselines --vllm`, run as a script in vLLM's
venv: kvpool's runs through vLLM's engine with the same closed loop as
`kvpool.bench.closed_loop` (N requests in flight, the next added as one finishes).

    <vllm venv>/bin/python vllm_closed_loop.py PLAN.json RESULT.json

It imports nothing from kvpool (kvpool is not installed there): the plan carries everything,
token ids included, so both engines see the same requests. Plan:

    {"model": HF directory, "dtype": str, "kv_cache_dtype": str, "max_num_seqs": int,
     "seed": int, "max_model_len": int, "rounds": int, "warmup": bool,
     "runs": [{"label": str, "concurrency": int, "prompts": [[token ids], ...],
               "max_tokens": int, "ignore_eos": bool}, ...]}

Result: {"vllm_version", "load_s", "runs": {label: {"output_tokens_per_s_rounds",
"steady_output_tokens_per_s_rounds", "token_ids" (the first round's)}}}. The steady rate counts
the tokens produced until the batch first holds fewer than N requests with none left to add,
as kvpool's does. Every run starts from an empty prefix cache. The KV cache size comes from
`VLLM_CPU_KVCACHE_SPACE` (whole GiB), which the caller sets.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque


def closed_loop(llm, run: dict, tag: str) -> dict:
    """One run of `run`'s prompts, `run["concurrency"]` in flight; rates and tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=run["max_tokens"],
                            ignore_eos=run["ignore_eos"], output_kind=RequestOutputKind.DELTA)
    waiting = deque(enumerate(run["prompts"]))
    in_flight: dict[str, int] = {}
    token_ids: list[list[int]] = [[] for _ in run["prompts"]]
    steady = None
    produced = 0
    start = time.perf_counter()
    while waiting or in_flight:
        while waiting and len(in_flight) < run["concurrency"]:
            index, prompt = waiting.popleft()
            request_id = f"{tag}-{index}"
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            in_flight[request_id] = index
        if steady is None and len(in_flight) < run["concurrency"]:
            steady = (time.perf_counter() - start, produced)
        for output in engine.step():
            new_tokens = output.outputs[0].token_ids if output.outputs else []
            token_ids[in_flight[output.request_id]].extend(new_tokens)
            produced += len(new_tokens)
            if output.finished:
                del in_flight[output.request_id]
    elapsed = time.perf_counter() - start
    steady_s, steady_tokens = steady or (elapsed, produced)
    return {"output_tokens_per_s": produced / elapsed,
            "steady_output_tokens_per_s": steady_tokens / steady_s, "token_ids": token_ids}


def main(plan_path: str, result_path: str) -> None:
    with open(plan_path) as file:
        plan = json.load(file)
    start = time.perf_counter()
    import vllm
    from vllm import LLM

    llm = LLM(model=plan["model"], dtype=plan["dtype"], max_num_seqs=plan["max_num_seqs"],
              seed=plan["seed"], kv_cache_dtype=plan["kv_cache_dtype"],
              max_model_len=plan["max_model_len"])
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - start,
              "kv_cache_dtype": plan["kv_cache_dtype"], "runs": {}}
    if plan["warmup"]:
        first = plan["runs"][0]
        closed_loop(llm, {**first, "prompts": first["prompts"][:2], "max_tokens": 16,
                          "concurrency": 2}, "warmup")
    for round_index in range(plan["rounds"]):
        for run in plan["runs"]:
            measured = closed_loop(llm, run, f"{run['label']}-{round_index}")
            entry = result["runs"].setdefault(run["label"], {
                "output_tokens_per_s_rounds": [], "steady_output_tokens_per_s_rounds": [],
                "token_ids": measured["token_ids"]})
            for key in ("output_tokens_per_s", "steady_output_tokens_per_s"):
                entry[f"{key}_rounds"].append(measured[key])
            print(f"vllm {plan['dtype']} {run['label']} round {round_index}: "
                  f"{measured['steady_output_tokens_per_s']:.1f} output tok/s at "
                  f"{run['concurrency']} in flight", file=sys.stderr, flush=True)
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":  # vLLM's CPU workers re-import the main module: guard the run
    main(*sys.argv[1:3])
