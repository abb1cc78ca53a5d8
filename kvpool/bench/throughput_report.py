"""The readable report of `kvpool bench throughput`: one table per dtype, one row per run."""

from __future__ import annotations

NAMES = {"kvpool": "kvpool", "vllm": "vLLM", "hf": "transformers"}


def format_report(report: dict) -> str:
    workload, peaks = report["workload"], report["matmul_peak_gflops_per_s"]
    counts = ", ".join(str(count) for count in report["num_prompts"])
    lines = [
        f"workload: prompts {workload['input_len'][0]}–{workload['input_len'][1]} tokens, "
        f"outputs {workload['output_len'][0]}–{workload['output_len'][1]} tokens, shared "
        f"prefix {workload['shared_prefix']}, seed {workload['seed']}; runs of the first "
        f"{counts} prompts; greedy, EOS ignored",
        "matmul peak (square torch.mm, this run): "
        + ", ".join(f"{name} {value:,.0f} GFLOP/s" for name, value in peaks.items()),
    ]
    for result in report["dtypes"]:
        lines += ["", *_dtype_section(result, peaks.get(result["dtype"]))]
    return "\n".join(lines)


def _dtype_section(result: dict, peak: float | None) -> list[str]:
    systems = [name for name in NAMES if name in result]
    header = ["prompts"] + [f"{NAMES[name]} output tok/s" for name in systems]
    header += [f"over {NAMES[name]}" for name in systems[1:]]
    if "vllm" in result:
        header.append("same tokens as vLLM")
    header.append("kvpool model GFLOP/s (of peak)")
    rows = [header]
    for label, ours in result["kvpool"]["runs"].items():
        comparison = result["comparison"][label]
        row = [label] + [f"{result[name]['runs'][label]['output_tokens_per_s']:.1f}"
                         for name in systems]
        row += [f"{comparison[f'over_{name}']:.2f}×" for name in systems[1:]]
        if "vllm" in result:
            row.append(_agreement(comparison["tokens_vs_vllm"]))
        gflops = ours["model_gflops_per_s"]
        row.append(f"{gflops:.1f} ({gflops / peak:.0%})" if peak else f"{gflops:.1f}")
        rows.append(row)
    kv_dtype = result.get("kv_cache_dtype", "auto")
    vllm_kv = f", vLLM KV {result['vllm']['kv_cache_dtype']}" if "vllm" in result else ""
    title = (f"{result['dtype']}, KV {kv_dtype} ({result.get('kv_bytes_per_token', 0):,} "
             f"bytes/token{vllm_kv}):")
    lines = [title, *_columns(rows)]
    if "vllm_error" in result:
        lines.append(f"vLLM did not finish: {result['vllm_error']}")
    lines.append(_latency_line(result, systems))
    lines += _kvpool_details(result["kvpool"]["runs"])
    return lines


def _agreement(tokens: dict) -> str:
    text = f"{tokens['identical_requests']}/{tokens['num_requests']}"
    if tokens["first_divergence"] is not None:
        request, position = tokens["first_divergence"]
        text += f" (first differs: request {request}, token {position})"
    return text


def _latency_line(result: dict, systems: list[str]) -> str:
    parts = [f"{NAMES[name]} {result[name]['decode_ms_per_token']:.1f}"
             for name in systems if "decode_ms_per_token" in result[name]]
    loads = [f"{NAMES[name]} {result[name]['load_s']:.1f} s"
             for name in systems if "load_s" in result[name]]
    return (f"single-request decode, ms/token: {', '.join(parts)}; "
            f"start-up: {', '.join(loads)}")


def _kvpool_details(runs: dict) -> list[str]:
    lines = []
    for label, run in runs.items():
        phases = run["step_phase_seconds"]
        model, decode = phases.get("model", 0.0), run["decode_only_model_seconds"]
        other = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in phases.items()
                          if phase != "model")
        lines.append(
            f"kvpool, {label} prompts: {run['elapsed_s']:.1f} s; peak blocks used "
            f"{run['peak_blocks_used']:,} of {run['num_blocks']:,}, preemptions "
            f"{run['num_preemptions']}, prefix-cache hit tokens "
            f"{run['prefix_cache_hit_tokens']:,}; time in model {model:.1f} s (in steps with "
            f"prefill chunks {model - decode:.1f} s, in decode-only steps {decode:.1f} s), "
            f"{other}")
    return lines


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            .rstrip() for row in rows]
