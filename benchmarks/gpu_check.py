"""The one-call GPU check's Python steps (`scripts/gpu_check.sh` runs each in its own process).

    python -m benchmarks.gpu_check STEP --out DIR [--smoke]

Steps: `bandwidth` (device facts and copy bandwidth), `attention` (decode kernel vs SDPA),
`engine` (kvpool end to end), `hf` (transformers `generate`, same weights), `summary` (merges
every step's JSON into `gpu_check.json` and checks the targets). Each step writes
`DIR/<step>.json`; a step that fails writes its error there instead, so the others still run.
`--smoke` runs tiny shapes on whatever device there is (the CPU tests use it).

This module imports torch only inside the steps: `summary` needs none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

STEPS = ("bandwidth", "attention", "engine", "hf", "summary")
TARGETS = {
    "attention_min_fraction_of_copy_bandwidth": 0.70,  # at batch >= 64 and context >= 2k
    "attention_max_time_vs_sdpa": 1.0,  # at the same shapes
    "decode_step_max_over_bound": 1.5,  # at batch 64
}


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "gguf"):
        try:
            info[name] = __import__(name).__version__
        except Exception as error:  # absent or broken: recorded, not fatal
            info[name] = f"unavailable: {error}"
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info |= {
            "device_name": properties.name,
            "num_sms": properties.multi_processor_count,
            "memory_bytes": properties.total_memory,
            "capability": list(torch.cuda.get_device_capability(0)),
        }
    return info


def step_bandwidth(args: argparse.Namespace) -> dict:
    from benchmarks.device_timing import copy_bandwidth

    nbytes = (16 << 20) if args.smoke else (4 << 30)
    return {"environment": _environment(), **copy_bandwidth(_device(), nbytes)}


def _bandwidth(out_dir: Path, smoke: bool) -> float:
    """The copy bandwidth measured by the bandwidth step, or measured now if it failed."""
    measured = _read_json(out_dir / "bandwidth.json").get("bytes_per_s")
    if measured:
        return float(measured)
    from benchmarks.device_timing import copy_bandwidth

    return copy_bandwidth(_device(), (16 << 20) if smoke else (4 << 30))["bytes_per_s"]


def step_attention(args: argparse.Namespace) -> dict:
    from benchmarks import decode_attention
    from kvpool.memory.kv_layout import KVLayout

    bandwidth = _bandwidth(args.out, args.smoke)
    if not args.smoke:
        return decode_attention.run(_device(), bandwidth)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # set before this process imports triton
    layout = decode_attention.AttentionLayout(8, KVLayout(16, 1, 2, 32, "float32"))
    return decode_attention.run(_device(), bandwidth, (1, 3), (40, 64), ((3, 64),), layout)


def _workload(smoke: bool):
    from benchmarks.generation import Workload

    if smoke:
        return Workload(preset="tiny", batch=3, prompt_len=20, output_len=6, dtype="float32")
    return Workload()


def step_engine(args: argparse.Namespace) -> dict:
    from benchmarks.generation import run_engine

    bandwidth = _bandwidth(args.out, args.smoke)
    return run_engine(_workload(args.smoke), _device(), args.attention_backend, bandwidth)


def step_hf(args: argparse.Namespace) -> dict:
    from benchmarks.generation import run_transformers

    return run_transformers(_workload(args.smoke), _device())


def step_summary(args: argparse.Namespace) -> dict:
    steps = {name: _read_json(args.out / f"{name}.json") for name in STEPS[:-1]}
    summary = {
        "step_status": read_step_status(args.out / "steps.tsv"),
        "tests": read_junit(args.out / "gpu_tests.xml"),
        "steps": steps,
        "targets": TARGETS,
        "checks": check_targets(steps),
    }
    print(format_summary(summary))
    return summary


def read_step_status(path: Path) -> dict:
    """The shell script's record: step -> exit code and seconds (124/137: timed out)."""
    try:
        rows = [line.split("\t") for line in path.read_text().splitlines()[1:] if line]
    except OSError:
        return {}
    return {name: {"exit_code": int(code), "seconds": int(sec)} for name, code, sec in rows}


def read_junit(path: Path) -> dict:
    """Test counts from pytest's JUnit XML (empty when the test step wrote none)."""
    from xml.etree import ElementTree

    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed": failed}


def check_targets(steps: dict) -> dict:
    """Each target: measured values and pass/fail (None where its step produced nothing)."""
    shapes = [
        s
        for s in steps.get("attention", {}).get("shapes", [])
        if s["batch"] >= 64 and s["context"] >= 2048
    ]
    min_fraction = min((s["triton_fraction_of_copy_bandwidth"] for s in shapes), default=None)
    max_vs_sdpa = max((s["triton_us"] / s["sdpa_us"] for s in shapes), default=None)
    engine = steps.get("engine", {})
    over_bound = engine.get("decode_step_over_bound")
    if engine.get("workload", {}).get("batch") != 64:
        over_bound = None
    hf = steps.get("hf", {})
    ratio = None
    if engine.get("output_tok_per_s") and hf.get("output_tok_per_s"):
        ratio = engine["output_tok_per_s"] / hf["output_tok_per_s"]
    sampled = engine.get("sampled", {}).get("passed")
    return {
        "sampled_decoding_on_device": {"value": None if sampled is None else float(sampled),
                                       "passed": sampled},
        "attention_min_fraction_of_copy_bandwidth": _check(min_fraction, ">=", 0.70),
        "attention_max_time_vs_sdpa": _check(max_vs_sdpa, "<=", 1.0),
        "decode_step_max_over_bound": _check(over_bound, "<=", 1.5),
        "engine_over_transformers_output_tok_per_s": {"value": ratio},
    }


def _check(value: float | None, op: str, target: float) -> dict:
    if value is None:
        return {"value": None, "passed": None}
    passed = value >= target if op == ">=" else value <= target
    return {"value": value, "target": f"{op} {target}", "passed": passed}


def format_summary(summary: dict) -> str:
    lines = ["step        status"]
    for name, status in summary["step_status"].items():
        verdict = {0: "ok", 124: "TIMED OUT", 137: "TIMED OUT"}.get(status["exit_code"], "FAILED")
        lines.append(f"{name:<11} {verdict:<10} {status['seconds']:>4}s")
    tests = summary["tests"]
    if tests:
        lines.append(
            f"tests: {tests['tests']} run, {tests['failures'] + tests['errors']} failed, "
            f"{tests['skipped']} skipped"
        )
    lines.append("")
    for name, check in summary["checks"].items():
        value = check.get("value")
        shown = "n/a" if value is None else f"{value:.3f}"
        verdict = {True: "pass", False: "FAIL", None: ""}[check.get("passed")]
        lines.append(f"{name:<45} {shown:>10} {check.get('target', ''):>8} {verdict}")
    return "\n".join(lines)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


STEP_FUNCTIONS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "bandwidth": step_bandwidth,
    "attention": step_attention,
    "engine": step_engine,
    "hf": step_hf,
    "summary": step_summary,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON files")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / ("gpu_check.json" if args.step == "summary" else f"{args.step}.json")
    try:
        result, status = STEP_FUNCTIONS[args.step](args), 0
    except Exception as error:  # recorded for the summary; the script goes on to the next step
        traceback.print_exc()
        result, status = {"error": f"{type(error).__name__}: {error}"}, 1
    target.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
