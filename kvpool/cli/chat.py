"""`kvpool chat`: an interactive conversation, streaming the reply as it is generated.

Commands at the prompt: `/reset` starts a new conversation, `/exit` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from kvpool.cli.args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling_params import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="chat interactively, streaming replies")
    parser.add_argument("--system", default=None, help="a system message to start with")
    add_sampling_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run, max_tokens=256)


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from kvpool.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("this model has no tokenizer, so it cannot chat", file=sys.stderr)
        return 2
    params = sampling_params_from_args(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("kvpool chat: /reset for a new conversation, /exit to leave", file=stdout)
    while True:
        print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = stream_reply(engine, messages, params, stdout)
        messages.append({"role": "assistant", "content": reply})


def stream_reply(
    engine: LLMEngine, messages: list[dict[str, str]], params: SamplingParams, stdout: TextIO
) -> str:
    """Generate one reply, printing text as it arrives; returns the whole reply.

    The reply is built from the `RequestOutput`s that `engine.step()` returns for this request
    (each carries the completion's text so far), never from the engine's internal sequences.
    """
    prompt = engine.tokenizer.apply_chat_template(messages)
    request_id = engine.add_request({"prompt_token_ids": prompt}, params).request_id
    reply, is_finished = "", False
    while not is_finished and engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            text = output.outputs[0].text
            print(text[len(reply):], end="", file=stdout, flush=True)
            reply, is_finished = text, output.finished
    print(file=stdout)
    return reply
