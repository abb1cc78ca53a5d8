"""`kvpool inspect`: read a KV snapshot (from a server or a file) or render a KV trace.

    kvpool inspect --url URL [--api-key KEY]    a running server's snapshot, summarised
    kvpool inspect FILE                         a saved snapshot (`-`: stdin)
        --json                                  print the snapshot JSON instead (saves one)
        --png OUT.png                           draw the pool map
        --prompt TEXT | --prompt-file F         why that prompt would hit or miss
    kvpool inspect trace FILE [--png] [--html]  a recorded KV trace (`--kv-trace`) as a timeline

"trace" as the first word selects the trace renderer; a snapshot file named "trace" is given
as "./trace". Explaining a prompt from a URL asks the server (`POST /v1/kv/explain`), which
tokenizes it and derives the salt from the key's tenant, narrowed by `--cache-salt` as a
request's `cache_salt` is. From a file the prompt is tokenized here with `--model`'s tokenizer
(the snapshot does not name its model), `--cache-salt` must be the engine-level salt itself,
and only short hashes are compared (no disk tier, no other salts).

Registration imports nothing heavy: httpx, numpy, matplotlib and the tokenizer load in `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.formats.kv_snapshot import KVSnapshot
    from kvpool.inspect.explain import PrefixExplanation
    from kvpool.model.tokenizer import Tokenizer

TRACE_WORD = "trace"
SALT_HELP = ("the prompt's cache salt. With --url: appended to your key's tenant, as a "
             "request's cache_salt is. With a FILE: the engine-level salt itself (for a "
             "server's snapshot the tenant, \"default\" without API keys, or tenant + NUL + "
             "the client's cache_salt); default: no salt")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="summarise, map and query a KV snapshot; render a KV trace",
        usage="kvpool inspect (FILE | --url URL) [--api-key KEY] [--json] [--png OUT] "
        "[--prompt TEXT | --prompt-file F] [--cache-salt SALT] [--model M] [--top N]\n"
        "       kvpool inspect trace TRACE [--png OUT] [--html OUT]",
        description="Read a KV snapshot from a running server (--url) or a saved file and "
        "print a summary, its JSON (--json), a pool map (--png) or why a prompt would hit or "
        "miss the prefix cache (--prompt). `kvpool inspect trace FILE` renders a KV trace "
        "recorded with --kv-trace as a timeline.",
        epilog="A snapshot file named 'trace' must be given as './trace'.")
    parser.add_argument("source", nargs="?", metavar="FILE",
                        help="a saved snapshot JSON ('-': stdin), or the word 'trace'")
    parser.add_argument("trace_file", nargs="?", metavar="TRACE",
                        help="after 'trace': the KV trace file to render")
    parser.add_argument("--url", help="a kvpool server, e.g. http://localhost:8000")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get("KVPOOL_API_KEY"),
                        help="the server's API key (default: $KVPOOL_API_KEY)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON: the snapshot, or with --prompt the explanation")
    parser.add_argument("--png", metavar="OUT", help="write the pool map (trace: the timeline)")
    parser.add_argument("--html", metavar="OUT", help="trace only: write the HTML timeline")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="explain why this prompt would hit or miss")
    prompt.add_argument("--prompt-file", help="the same, the prompt read from a file")
    parser.add_argument("--cache-salt", help=SALT_HELP)
    parser.add_argument("--model", help="the tokenizer for --prompt with a FILE (default: the "
                        "bundled SmolLM2)")
    parser.add_argument("--top", type=int, default=5, help="rows per ranked list (default 5)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.source == TRACE_WORD:
        return _run_trace(args)
    _check_snapshot_args(args)
    from kvpool.inspect.summary import format_summary

    prompt = _prompt_text(args)
    explanation = None
    if prompt is not None and args.url:
        explanation = _explain_remote(args, prompt)
    snapshot = None
    if explanation is None or args.png:
        snapshot = _load_snapshot(args)
    if prompt is not None and explanation is None:
        explanation = _explain_local(snapshot, prompt, args)
    if explanation is not None:
        print(json.dumps(explanation.to_json()) if args.json else format_explanation(explanation))
    elif args.json:
        print(json.dumps(snapshot.to_json(), separators=(",", ":")))
    else:
        print(format_summary(snapshot, args.top))
    if args.png:
        from kvpool.inspect.pool_map import draw_pool_map

        print(f"wrote {draw_pool_map(snapshot, args.png)}", file=sys.stderr)
    return 0


def format_explanation(explanation: PrefixExplanation) -> str:
    """The sentence, then the verdicts as runs of consecutive blocks."""
    lines = [explanation.summary]
    runs: list[list[Any]] = []  # [first index, last index, verdict, tokens]
    for verdict in explanation.verdicts:
        if runs and runs[-1][2] == verdict.verdict:
            runs[-1][1] = verdict.index
            runs[-1][3] += verdict.num_tokens
        else:
            runs.append([verdict.index, verdict.index, verdict.verdict, verdict.num_tokens])
    for first, last, verdict, num_tokens in runs:
        blocks = f"block {first}" if first == last else f"blocks {first}-{last}"
        lines.append(f"  {blocks:<16} {verdict:<13} {num_tokens} tokens")
    return "\n".join(lines)


# ----------------------------------------------------------------- snapshots
def _check_snapshot_args(args: argparse.Namespace) -> None:
    if args.trace_file is not None:
        raise ValueError(f"unexpected second argument {args.trace_file!r} (only 'trace' "
                         "takes one)")
    if (args.url is None) == (args.source is None):
        raise ValueError("give either a snapshot FILE ('-' for stdin) or --url")
    if args.html:
        raise ValueError("--html applies to `kvpool inspect trace` only")


def _load_snapshot(args: argparse.Namespace) -> KVSnapshot:
    from kvpool.formats.kv_snapshot import KVSnapshot

    if args.url:
        from kvpool.inspect.client import fetch_snapshot

        return KVSnapshot.from_json(fetch_snapshot(args.url, args.api_key))
    name = "stdin" if args.source == "-" else args.source
    try:
        text = sys.stdin.read() if args.source == "-" else Path(args.source).read_text("utf-8")
    except FileNotFoundError:
        raise  # the command line's own one-line report
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {name}: {error}") from None
    try:
        doc = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{name} is not a KV snapshot: not JSON ({error})") from None
    try:
        return KVSnapshot.from_json(doc)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def _prompt_text(args: argparse.Namespace) -> str | None:
    if args.prompt_file is not None:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    return args.prompt


def _explain_remote(args: argparse.Namespace, prompt: str) -> PrefixExplanation:
    from kvpool.inspect.client import fetch_explanation
    from kvpool.inspect.explain import PrefixExplanation

    return PrefixExplanation.from_json(
        fetch_explanation(args.url, args.api_key, prompt, args.cache_salt))


def _explain_local(snapshot: KVSnapshot, prompt: str,
                   args: argparse.Namespace) -> PrefixExplanation:
    from kvpool.inspect.explain import explain_from_snapshot

    token_ids = _tokenizer(args.model).encode(prompt)  # special tokens added, as the server's
    return explain_from_snapshot(snapshot, token_ids, args.cache_salt)


@cache
def _tokenizer(model: str | None) -> Tokenizer:
    """The model's tokenizer, read once per process (a GGUF file's takes seconds)."""
    from kvpool.model.loaders.auto import make_loader

    tokenizer = make_loader(model).load_tokenizer()
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to encode the prompt with")
    return tokenizer


# --------------------------------------------------------------------- trace
def _run_trace(args: argparse.Namespace) -> int:
    if args.trace_file is None:
        raise ValueError("`kvpool inspect trace` needs the trace FILE")
    extra = [flag for flag, value in (("--url", args.url), ("--json", args.json),
                                      ("--prompt", args.prompt or args.prompt_file))
             if value]
    if extra:
        raise ValueError(f"{', '.join(extra)} do(es) not apply to `kvpool inspect trace`")
    from kvpool.formats.kv_trace import read_kv_trace
    from kvpool.inspect.timeline import write_timeline

    path = Path(args.trace_file)
    png, html = args.png, args.html
    if png is None and html is None:
        png, html = path.with_suffix(".png"), path.with_suffix(".html")
    summary = write_timeline(read_kv_trace(path), png, html)
    print(summary.headline())
    counts = ", ".join(f"{kind} {count}" for kind, count in summary.event_counts.items())
    print(f"events: {counts or 'none'}")
    for written in (png, html):
        if written is not None:
            print(f"wrote {written}", file=sys.stderr)
    return 0
