"""`kvpool bench throughput` side by side with vLLM, llama.cpp and transformers `generate`, in
one sitting.

    python -m benchmarks.throughput_baselines [throughput flags] --baseline vllm llamacpp hf

Every flag of `kvpool bench throughput` (the engine flags included) means the same here; this
adds which baselines run and their settings. The benchmark is kvpool's own
(`kvpool.bench.throughput.run`); the baselines are handed to it through its `Baseline`
interface, so the user command carries no vLLM or transformers code. vLLM runs from its own
venv (`make vllm-venv`, or `--vllm-python`); a GGUF model is given to it as a HuggingFace
directory exported from the same file (`benchmarks.hf_export`). llama.cpp runs from its own
venv too (`make llamacpp-venv`, or `--llamacpp-python`) on the GGUF file itself: `llamacpp` one
request at a time (llama-cpp-python's `Llama`), `llamacpp-batched` a run's requests together
(its low-level batch API).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks.llamacpp_baseline import LlamaCppBaseline
from benchmarks.transformers_baseline import TransformersBaseline
from benchmarks.vllm_baseline import VLLMBaseline
from kvpool.bench import throughput
from kvpool.bench.throughput import Baseline
from kvpool.cli.args import add_engine_args, engine_config_from_args
from kvpool.cli.bench import add_throughput_args

BASELINES = ("vllm", "llamacpp", "llamacpp-batched", "hf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput_baselines",
                                     description=__doc__.split("\n\n")[0])
    add_throughput_args(parser)
    parser.add_argument("--baseline", action="extend", nargs="+", choices=BASELINES,
                        default=[], help="run vLLM (its venv: `make vllm-venv`), llama.cpp "
                        "(`make llamacpp-venv`; one request at a time, or batched) and/or "
                        "transformers generate on the same "
                        "requests, once per dtype and KV dtype, next to the first preemption "
                        "mode")
    parser.add_argument("--baseline-batch-size", type=int, default=16,
                        help="transformers' static batch size")
    parser.add_argument("--vllm-python", default=None, help="the interpreter of vLLM's venv "
                        "(default $KVPOOL_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--llamacpp-python", default=None, help="the interpreter of "
                        "llama-cpp-python's venv (default $KVPOOL_LLAMACPP_PYTHON, else "
                        ".venv-llamacpp/bin/python)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)
    return parser


def baselines_from_args(args: argparse.Namespace) -> list[Baseline]:
    """The baselines `--baseline` names, in the order given."""
    made = {"vllm": lambda: VLLMBaseline(args.vllm_python, args.latency_tokens),
            "llamacpp": lambda: LlamaCppBaseline(args.llamacpp_python, args.latency_tokens),
            "llamacpp-batched": lambda: LlamaCppBaseline(args.llamacpp_python,
                                                         args.latency_tokens, batched=True),
            "hf": lambda: TransformersBaseline(args.baseline_batch_size, not args.json)}
    return [made[name]() for name in dict.fromkeys(args.baseline)]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return throughput.run(args, engine_config_from_args(args), baselines_from_args(args))
    except (ValueError, FileNotFoundError) as error:  # bad input in one line, as `kvpool`'s
        print(f"throughput_baselines: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
