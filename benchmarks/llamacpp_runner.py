"""The llama.cpp side of `python -m benchmarks.throughput_baselines --baseline llamacpp`, run as
a script in llama-cpp-python's venv.

    <llama.cpp venv>/bin/python llamacpp_runner.py PLAN.json RESULT.json

It imports nothing from kvpool: the plan carries everything, token ids included, so both
engines see the same prompts. Plan:

    {"model": GGUF path, "n_ctx": int, "n_threads": int,
     "runs": [{"label": str, "requests": [[prompt token ids, max_tokens], ...]}, ...],
     "latency_prompt": [token ids], "latency_tokens": int}

Result: {"llama_cpp_version", "load_s", "runs": {label: {"elapsed_s", "output_tokens_per_s",
"token_ids"}}, "decode_ms_per_token"}. llama-cpp-python's `Llama` holds one sequence, so a
run's requests go one after another (greedy, EOS ignored: each makes exactly `max_tokens`).
It reads the GGUF's weights as they are stored (4-bit here), where kvpool dequantizes them.
"""

from __future__ import annotations

import json
import sys
import time


def _complete(llm, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens after `prompt`, EOS not stopping it, from an empty KV cache."""
    llm.reset()
    tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens


def _run(llm, requests: list) -> tuple[float, list]:
    start = time.perf_counter()
    token_ids = [_complete(llm, prompt, max_tokens) for prompt, max_tokens in requests]
    return time.perf_counter() - start, token_ids


def main(plan_path: str, result_path: str) -> None:
    with open(plan_path) as file:
        plan = json.load(file)
    start = time.perf_counter()
    import llama_cpp

    llm = llama_cpp.Llama(model_path=plan["model"], n_ctx=plan["n_ctx"],
                          n_threads=plan["n_threads"], n_threads_batch=plan["n_threads"],
                          n_batch=512, verbose=False)
    result = {"llama_cpp_version": llama_cpp.__version__, "load_s": time.perf_counter() - start,
              "runs": {}}
    for run in plan["runs"]:
        elapsed, token_ids = _run(llm, run["requests"])
        num_output = sum(len(tokens) for tokens in token_ids)
        result["runs"][run["label"]] = {"elapsed_s": elapsed, "token_ids": token_ids,
                                        "output_tokens_per_s": num_output / elapsed}
        print(f"llama.cpp {run['label']}: {num_output / elapsed:.1f} output tok/s",
              file=sys.stderr, flush=True)
    # Single-request decode latency: the time the last `latency_tokens` tokens add (median of
    # three pairs of runs), as the vLLM runner measures it.
    prompt, count = plan["latency_prompt"], plan["latency_tokens"]
    samples = []
    for _ in range(3):
        first, _ = _run(llm, [(prompt, 1)])
        full, _ = _run(llm, [(prompt, count + 1)])
        samples.append((full - first) / count * 1e3)
    result["decode_ms_per_token"] = sorted(samples)[1]
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
