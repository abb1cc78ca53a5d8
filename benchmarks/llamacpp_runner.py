"""The llama.cpp side of `python -m benchmarks.throughput_baselines --baseline llamacpp` (and
`llamacpp-batched`), run as a script in llama-cpp-python's venv.

    <llama.cpp venv>/bin/python llamacpp_runner.py PLAN.json RESULT.json

It imports nothing from kvpool: the plan carries everything, token ids included, so both
engines see the same prompts. Plan:

    {"model": GGUF path, "n_ctx": int (tokens one sequence holds), "n_threads": int,
     "n_seq_max": int (batched mode only: the most requests decoding at once),
     "runs": [{"label": str, "requests": [[prompt token ids, max_tokens], ...]}, ...],
     "latency_prompt": [token ids], "latency_tokens": int}

Result: {"llama_cpp_version", "load_s", "runs": {label: {"elapsed_s", "output_tokens_per_s",
"token_ids"}}, "decode_ms_per_token"}. Greedy, EOS ignored: each request makes exactly
`max_tokens`. Without `n_seq_max`, llama-cpp-python's `Llama` runs a run's requests one after
another (it holds one sequence); with it, `llamacpp_batched.BatchedLlama` decodes them all
together, one sequence id each. It reads the GGUF's weights as they are stored (4-bit here),
where kvpool dequantizes them.
"""

from __future__ import annotations

import json
import sys
import time

N_BATCH = 512  # tokens per llama_decode call (prompts longer than this go in chunks)


class OneAtATime:
    """llama-cpp-python's `Llama`: one request at a time, each from an empty KV cache."""

    def __init__(self, plan: dict) -> None:
        import llama_cpp

        self._llm = llama_cpp.Llama(model_path=plan["model"], n_ctx=plan["n_ctx"],
                                    n_threads=plan["n_threads"],
                                    n_threads_batch=plan["n_threads"], n_batch=N_BATCH,
                                    verbose=False)

    def generate(self, requests: list) -> list[list[int]]:
        return [self._complete(prompt, max_tokens) for prompt, max_tokens in requests]

    def _complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens after `prompt`, EOS not stopping it."""
        self._llm.reset()
        tokens = []
        for token in self._llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0,
                                        repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        return tokens


def _engine(plan: dict):
    """The plan's mode: batched when it gives `n_seq_max`."""
    if "n_seq_max" not in plan:
        return OneAtATime(plan)
    from llama_cpp._logger import set_verbose  # llama.cpp's log: errors only, as verbose=False
    from llamacpp_batched import BatchedLlama  # this script's directory is on sys.path

    set_verbose(False)
    return BatchedLlama(plan["model"], plan["n_ctx"], plan["n_seq_max"], plan["n_threads"],
                        N_BATCH)


def _run(engine, requests: list) -> tuple[float, list]:
    start = time.perf_counter()
    token_ids = engine.generate(requests)
    return time.perf_counter() - start, token_ids


def main(plan_path: str, result_path: str) -> None:
    with open(plan_path) as file:
        plan = json.load(file)
    start = time.perf_counter()
    import llama_cpp

    engine = _engine(plan)
    name = "llama.cpp batched" if "n_seq_max" in plan else "llama.cpp"
    result = {"llama_cpp_version": llama_cpp.__version__, "load_s": time.perf_counter() - start,
              "runs": {}}
    for run in plan["runs"]:
        elapsed, token_ids = _run(engine, run["requests"])
        num_output = sum(len(tokens) for tokens in token_ids)
        result["runs"][run["label"]] = {"elapsed_s": elapsed, "token_ids": token_ids,
                                        "output_tokens_per_s": num_output / elapsed}
        print(f"{name} {run['label']}: {num_output / elapsed:.1f} output tok/s",
              file=sys.stderr, flush=True)
    # Single-request decode latency: the time the last `latency_tokens` tokens add (median of
    # three pairs of runs), as the vLLM runner measures it.
    prompt, count = plan["latency_prompt"], plan["latency_tokens"]
    samples = []
    for _ in range(3):
        first, _ = _run(engine, [(prompt, 1)])
        full, _ = _run(engine, [(prompt, count + 1)])
        samples.append((full - first) / count * 1e3)
    result["decode_ms_per_token"] = sorted(samples)[1]
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
