"""vLLM's own KV capacity for a preset's shape: the "KV cache size: N tokens" and "Maximum
concurrency for L tokens per request: X" figures vLLM's CPU build resolves at start-up, per
`max_model_len`, with its hybrid KV cache manager on and off, so kvpool's capacity for the same
shape and budget (issue 33) can be set against vLLM's.

    python -m benchmarks.vllm_kv_capacity [--preset gemma-3-1b] [--kv-cache-gib 1]
        [--max-model-len 4096 8192 32768] [--hybrid on off] [--vllm-python PATH]

Each (max_model_len, hybrid) pair is one `LLM` built in vLLM's venv (`vllm_kv_capacity_runner`,
dummy weights, no generation), one after another. The model directory holds the preset's
`config.json` only: dummy weights need no checkpoint, and the runner skips the tokenizer.
Figures come from the engine object; the log lines are parsed too, as a cross-check and for
the padding layers vLLM adds to even out the hybrid manager's groups. Prints a markdown table,
then the JSON report as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

RUNNER = Path(__file__).with_name("vllm_kv_capacity_runner.py")
MAX_MODEL_LENS = (4096, 8192, 32768)

_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                       r"tokens per request: ([\d.]+)x")
_PADDING = re.compile(r"Add (\d+) padding layers, may waste at most ([\d.]+)% KV cache memory")


def parse_capacity_log(log: str) -> dict:
    """vLLM's start-up capacity lines in `log`: {"kv_cache_size_tokens", "max_model_len",
    "max_concurrency"} from the last "KV cache size ... Maximum concurrency" line (all None
    when there is none), and {"padding_layers", "padding_waste_percent"} from the hybrid
    manager's padding warning (0 and 0.0 when it added none)."""
    capacity = _CAPACITY.findall(log)
    padding = _PADDING.findall(log)
    tokens, length, concurrency = capacity[-1] if capacity else (None, None, None)
    layers, waste = padding[-1] if padding else (0, 0.0)
    return {"kv_cache_size_tokens": None if tokens is None else int(tokens.replace(",", "")),
            "max_model_len": None if length is None else int(length.replace(",", "")),
            "max_concurrency": None if concurrency is None else float(concurrency),
            "padding_layers": int(layers), "padding_waste_percent": float(waste)}


def write_model_directory(preset: str, dtype: str, directory: Path) -> Path:
    """`directory` holding preset `preset`'s `config.json` as a `dtype` checkpoint's (vLLM's
    dummy loader needs no weights)."""
    from benchmarks.random_checkpoint import checkpoint_config_json

    directory.mkdir(parents=True, exist_ok=True)
    fields = checkpoint_config_json(preset, dtype)
    (directory / "config.json").write_text(json.dumps(fields, indent=1))
    return directory


def run_capacity(model: Path, dtype: str, max_model_len: int, hybrid: bool, kv_cache_gib: int,
                 python: Path) -> dict:
    """One runner start (see `vllm_kv_capacity_runner`): its result, plus "log" (the figures
    parsed from vLLM's log, which is echoed to stderr). RuntimeError quoting the log's tail
    when the runner fails."""
    plan = {"model": str(model), "dtype": dtype, "max_model_len": max_model_len,
            "hybrid": hybrid}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-capacity-") as scratch:
        plan_path, result_path = Path(scratch, "plan.json"), Path(scratch, "result.json")
        plan_path.write_text(json.dumps(plan))
        completed = subprocess.run(
            [str(python), str(RUNNER), str(plan_path), str(result_path)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        sys.stderr.write(completed.stdout)
        if completed.returncode != 0 or not result_path.exists():
            tail = "\n".join(completed.stdout.splitlines()[-20:])
            raise RuntimeError(f"vLLM (max_model_len {max_model_len}, hybrid {hybrid}) exited "
                               f"with status {completed.returncode}:\n{tail}")
        result = json.loads(result_path.read_text())
    result["log"] = parse_capacity_log(completed.stdout)
    return result


def _groups_cell(groups: list[dict] | None) -> str:
    """'6 sliding(512) x4 + 1 full x4' style: how many groups of each spec, and the layers
    each holds. With the hybrid manager off vLLM keeps every layer in one full-attention
    group (its spec still names the window, which the layers use for compute only)."""
    if not groups:
        return "?"
    counts: dict[str, int] = {}
    for group in groups:
        kind = (f"sliding({group['sliding_window']})" if group["kind"] == "SlidingWindowSpec"
                else "full")
        key = f"{kind} x{group['num_layers']}"
        counts[key] = counts.get(key, 0) + 1
    return " + ".join(f"{count} {key}" for key, count in counts.items())


def format_table(report: dict) -> str:
    """The report as a markdown table, one row per (max_model_len, hybrid)."""
    lines = [
        f"vLLM {report['vllm_version']} CPU, {report['preset']}, {report['dtype']}, "
        f"VLLM_CPU_KVCACHE_SPACE={report['kv_cache_gib']} GiB, dummy weights",
        "",
        "| max_model_len | hybrid | KV blocks x size | KV cache size (tokens) | max concurrency "
        "| groups (layers each) | blocks/request | padding layers | max_num_batched_tokens |",
        "|---:|:---|---:|---:|---:|:---|---:|---:|---:|",
    ]
    for run in report["runs"]:
        groups = run.get("groups")
        per_request = sum(group["blocks_per_request"] for group in groups) if groups else "?"
        lines.append(
            f"| {run['max_model_len']} | {'on' if run['hybrid'] else 'off'} "
            f"| {run['num_blocks']} x {run['block_size']} | {run['kv_cache_size_tokens']:,} "
            f"| {run['max_concurrency']:.2f}x | {_groups_cell(groups)} | {per_request} "
            f"| {run['log']['padding_layers']} | {run['max_num_batched_tokens']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_kv_capacity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gemma-3-1b", help="a kvpool preset name")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="VLLM_CPU_KVCACHE_SPACE, whole GiB (default 1)")
    parser.add_argument("--max-model-len", type=int, nargs="+", default=list(MAX_MODEL_LENS))
    parser.add_argument("--hybrid", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="the hybrid KV cache manager (off: "
                             "disable_hybrid_kv_cache_manager=True)")
    parser.add_argument("--vllm-python", help="vLLM venv's interpreter (default: "
                        "$KVPOOL_VLLM_PYTHON, else .venv-vllm/bin/python)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.vllm_baseline import vllm_python

    args = build_parser().parse_args(argv)
    python = vllm_python(args.vllm_python)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-capacity-model-") as scratch:
        model = write_model_directory(args.preset, args.dtype, Path(scratch, args.preset))
        for max_model_len in args.max_model_len:
            for hybrid in args.hybrid:
                runs.append(run_capacity(model, args.dtype, max_model_len, hybrid == "on",
                                         args.kv_cache_gib, python))
    report = {"preset": args.preset, "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib,
              "vllm_version": runs[0]["vllm_version"], "runs": runs}
    print(format_table(report))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
