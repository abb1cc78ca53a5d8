"""`kvpool generate "prompt" [...]`: one batch of prompts through the engine, outputs printed."""

from __future__ import annotations

import argparse
import sys

from kvpool.cli.args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate completions for prompts")
    parser.add_argument("prompts", nargs="+", help="prompt texts (- reads one per line from stdin)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_sampling_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.llm import LLM

    prompts = _read_prompts(args.prompts)
    params = sampling_params_from_args(args)
    config = engine_config_from_args(args)
    llm = LLM.from_engine(LLMEngine(config))
    if args.chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        outputs = llm.chat(conversations, params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"\n=== {prompt!r}")
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}{completion.text}")
            print(f"    ({len(completion.token_ids)} tokens, finish: {completion.finish_reason})")
    stats = llm.engine.stats()
    print(f"\n{stats.num_generated_tokens} tokens generated in {stats.num_steps} steps")
    return 0


def _read_prompts(prompts: list[str]) -> list[str]:
    if prompts == ["-"]:
        return [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return prompts
