"""The readable report of `kvpool bench throughput`: one table per dtype (and KV dtype and
preemption mode), one row per run, one column per engine (kvpool, then each baseline, by its
`label`); with `--preemption-modes`, a table comparing the modes."""

from __future__ import annotations


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
    if report.get("preemption_modes"):
        lines += ["", *_preemption_section(report)]
    return "\n".join(lines)


def _preemption_section(report: dict) -> list[str]:
    """One row per dtype, KV dtype, run and mode: tokens/s, preemptions, KV moved, and the
    tokens/s over recompute's (where recompute ran)."""
    budget, num_blocks = report.get("kv_cache_memory"), report.get("num_gpu_blocks")
    budget_text = (f"{num_blocks:,} blocks" if num_blocks else
                   f"{budget / 2**20:,.1f} MiB" if budget else "default")
    title = (f"preemption modes (KV cache {budget_text}, swap space "
             f"{report.get('swap_space_gib', 0):g} GiB):")
    rows = [["dtype", "KV", "prompts", "mode", "output tok/s", "preemptions recompute/swap",
             "MiB moved (out+in)", "over recompute"]]
    for result in report["dtypes"]:
        for label, run in result["kvpool"]["runs"].items():
            moved = run["num_swapped_out_bytes"] + run["num_swapped_in_bytes"]
            ratio = result["comparison"][label].get("over_recompute")
            rows.append([
                result["dtype"], result.get("kv_cache_dtype", "auto"), label,
                result["preemption_mode"], f"{run['output_tokens_per_s']:.1f}",
                f"{run['num_recompute_preemptions']}/{run['num_swap_preemptions']}",
                f"{moved / 2**20:,.1f}", "–" if ratio is None else f"{ratio:.2f}×",
            ])
    return [title, *_columns(rows)]


def _dtype_section(result: dict, peak: float | None) -> list[str]:
    names = {"kvpool": "kvpool", **result.get("baselines", {})}
    systems = [name for name in names if name in result]
    header = ["prompts"] + [f"{names[name]} output tok/s" for name in systems]
    header += [f"over {names[name]}" for name in systems[1:]]
    compared = [name for name in systems[1:]
                if any(f"tokens_vs_{name}" in row for row in result["comparison"].values())]
    header += [f"same tokens as {names[name]}" for name in compared]
    header.append("kvpool model GFLOP/s (of peak)")
    rows = [header]
    for label, ours in result["kvpool"]["runs"].items():
        comparison = result["comparison"][label]
        row = [label] + [f"{result[name]['runs'][label]['output_tokens_per_s']:.1f}"
                         for name in systems]
        row += [f"{comparison[f'over_{name}']:.2f}×" for name in systems[1:]]
        row += [_agreement(comparison[f"tokens_vs_{name}"]) for name in compared]
        gflops = ours["model_gflops_per_s"]
        row.append(f"{gflops:.1f} ({gflops / peak:.0%})" if peak else f"{gflops:.1f}")
        rows.append(row)
    kv_dtype = result.get("kv_cache_dtype", "auto")
    their_kv = "".join(f", {names[name]} KV {result[name]['kv_cache_dtype']}"
                       for name in systems[1:] if "kv_cache_dtype" in result[name])
    mode = f", preemption {result['preemption_mode']}" if "preemption_mode" in result else ""
    title = (f"{result['dtype']}, KV {kv_dtype} ({result.get('kv_bytes_per_token', 0):,} "
             f"bytes/token{their_kv}){mode}:")
    lines = [title, *_columns(rows)]
    lines += [f"{label} did not finish: {result[f'{name}_error']}"
              for name, label in names.items() if f"{name}_error" in result]
    lines.append(_latency_line(result, systems, names))
    lines += _kvpool_details(result["kvpool"]["runs"])
    return lines


def _agreement(tokens: dict) -> str:
    text = f"{tokens['identical_requests']}/{tokens['num_requests']}"
    if tokens["first_divergence"] is not None:
        request, position = tokens["first_divergence"]
        text += f" (first differs: request {request}, token {position})"
    return text


def _latency_line(result: dict, systems: list[str], names: dict[str, str]) -> str:
    parts = [f"{names[name]} {result[name]['decode_ms_per_token']:.1f}"
             for name in systems if "decode_ms_per_token" in result[name]]
    loads = [f"{names[name]} {result[name]['load_s']:.1f} s"
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
            f"{run['peak_blocks_used']:,} of {run['num_blocks']:,}, {_preemptions(run)}, "
            f"prefix-cache hit tokens "
            f"{run['prefix_cache_hit_tokens']:,}; time in model {model:.1f} s (in steps with "
            f"prefill chunks {model - decode:.1f} s, in decode-only steps {decode:.1f} s), "
            f"{other}")
    return lines


def _preemptions(run: dict) -> str:
    text = (f"preemptions {run['num_preemptions']} (recompute "
            f"{run['num_recompute_preemptions']}, swap {run['num_swap_preemptions']})")
    if run["num_swapped_out_blocks"] or run["num_swapped_in_blocks"]:
        text += (f", swapped out {run['num_swapped_out_blocks']:,} blocks "
                 f"({run['num_swapped_out_bytes'] / 2**20:,.1f} MiB) and in "
                 f"{run['num_swapped_in_blocks']:,} ({run['num_swapped_in_bytes'] / 2**20:,.1f} "
                 f"MiB), recompute avoided for {run['num_recompute_tokens_avoided']:,} tokens")
    return text


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            .rstrip() for row in rows]
