"""`kvpool bench disagg`: short chats beside long prompts, colocated vs disaggregated serving.

Workload (seeded, token-id prompts on `/v1/completions`, greedy, EOS ignored): `--num-chats`
chats, each sending short prompts (`--chat-len MIN MAX` tokens) back to back, streamed, each
generating `--chat-output-len` tokens, for the whole run; meanwhile `--num-long` long prompts
of `--long-len` tokens arrive `--long-interval` seconds apart (the first one interval in, so
the chats first decode alone), each generating `--long-output-len` tokens. The run ends when
the last long prompt and the chats' requests then in flight are done. Prompts are windows of
held-out prose (`heldout_text`) in the model's tokenizer, or seeded random ids below
`--vocab-size` for a model without one (the dummy presets); every window starts at its own
offset, so the long prompts share no prefix.

Configurations, each on fresh processes, one at a time, each behind a `kvpool router` (so both
pay the same proxy hop):
  colocated  one `kvpool serve` with `--threads` CPU threads
  disagg     a prefill worker (kv_producer, `--prefill-threads`, default half) and a decode
             worker (kv_consumer, the rest), Mooncake over loopback, the router's
             `--prefill` / `--decode` in front
What it reports per configuration (client side, `disagg_report`): the chats' inter-token
latency p50/p99 (SSE chunk gaps after the first token), TTFT p50/p99 of chats and of long
prompts, output tok/s; for disagg also the decode worker's transfer counters, a quiet probe
of single handovers and the paper projection to RDMA (`disagg_transfer`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvpool.bench.disagg_report import plot_itl, print_table, report
from kvpool.bench.disagg_transfer import (
    crc32_bytes_per_s,
    probe_handovers,
    read_block_size,
    read_transfer,
)
from kvpool.bench.disagg_workload import ConfigResult, MixedWorkload, prompt_source, run_workload
from kvpool.bench.processes import ManagedProcess, free_port, start_kvpool

CONFIGS = ("colocated", "disagg")
_TRANSFER = {"kv_connector": "MooncakeConnector"}


# ---------------------------------------------------------------- processes
@dataclass(frozen=True, slots=True)
class Deployment:
    """A configuration's running processes: the router in front, and where to read the
    transfer counters (the decode worker; None when colocated)."""

    router_url: str
    decode_url: str | None
    server_url: str  # a server whose /metrics give the KV layout


def thread_split(threads: int, prefill_threads: int | None) -> tuple[int, int]:
    """(prefill, decode) worker threads out of `threads`: `prefill_threads` (default half)
    and the rest; ValueError unless each gets at least one."""
    prefill = prefill_threads if prefill_threads is not None else threads // 2
    if not 1 <= prefill < threads:
        raise ValueError(f"--threads {threads} cannot give the prefill worker {prefill} and "
                         "the decode worker at least 1")
    return prefill, threads - prefill


def _serve_args(args: argparse.Namespace, threads: int, role: str | None) -> list[str]:
    served = [args.model] if args.model else []
    served += ["--served-model-name", "bench", "--cpu-threads", str(threads)]
    if args.load_format:
        served += ["--load-format", args.load_format]
    if role is not None:
        served += ["--kv-transfer-config", json.dumps({**_TRANSFER, "kv_role": role})]
    return served + shlex.split(args.serve_args or "")


def _start_servers(args: argparse.Namespace, specs: list[tuple[str, int, str | None]],
                   started: list[ManagedProcess]) -> list[str]:
    """Start `kvpool serve` per (name, threads, kv_role) at once; their URLs in order. Every
    process that started is appended to `started` (to be stopped), even when another fails."""
    ports = [free_port() for _ in specs]

    def start(spec: tuple[str, int, str | None], port: int) -> ManagedProcess:
        name, threads, role = spec
        return start_kvpool(name, "serve", _serve_args(args, threads, role), port,
                            {"OMP_NUM_THREADS": str(threads)})

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start, spec, port) for spec, port in zip(specs, ports,
                                                                         strict=True)]
    errors = []
    for future in futures:
        if future.exception() is None:
            started.append(future.result())
        else:
            errors.append(future.exception())
    if errors:
        raise errors[0]
    return [f"http://127.0.0.1:{port}" for port in ports]


def deploy(config: str, args: argparse.Namespace, started: list[ManagedProcess]
           ) -> Deployment:
    """Start `config`'s servers and the router in front; every process joins `started`."""
    router_args = ["--model", args.model] if args.model else []
    if config == "colocated":
        (server,) = _start_servers(args, [("colocated", args.threads, None)], started)
        router_args += ["--replica", server]
        decode = None
    else:
        prefill_threads, decode_threads = thread_split(args.threads, args.prefill_threads)
        prefill, decode = _start_servers(args, [("prefill", prefill_threads, "kv_producer"),
                                                ("decode", decode_threads, "kv_consumer")],
                                         started)
        router_args += ["--prefill", prefill, "--decode", decode]
        server = decode
    port = free_port()
    started.append(start_kvpool("router", "router", router_args, port))
    return Deployment(f"http://127.0.0.1:{port}", decode, server)


def run_config(config: str, args: argparse.Namespace, workload: MixedWorkload,
               source: list[int]) -> ConfigResult:
    """Fresh processes for `config`, the workload, then (disagg) the transfer counters and the
    quiet probe; every process is stopped on the way out."""
    started: list[ManagedProcess] = []
    try:
        deployment = deploy(config, args, started)
        requests, wall = asyncio.run(run_workload(deployment.router_url, workload, source))
        result = ConfigResult(config, wall, requests, read_block_size(deployment.server_url))
        if deployment.decode_url is not None:
            counters = read_transfer(deployment.decode_url)
            result.transfer = counters.figures() if counters is not None else None
            result.probe = {kind: probe_handovers(deployment.router_url, deployment.decode_url,
                                                  prompts)
                            for kind, prompts in workload.probe_prompts(
                                source, args.probe_repeats).items()}
    finally:
        for process in reversed(started):
            process.stop()
    return result


def run(args: argparse.Namespace) -> int:
    if "disagg" in args.configs:
        thread_split(args.threads, args.prefill_threads)  # a bad split fails before any start
    workload = MixedWorkload(args.num_chats, tuple(args.chat_len), args.chat_output_len,
                             args.num_long, args.long_len, args.long_output_len,
                             args.long_interval, args.workload_seed)
    source = prompt_source(args.model, args.vocab_size, args.workload_seed)
    results = {}
    for config in args.configs:
        results[config] = run_config(config, args, workload, source)
        print(f"{config}: done in {results[config].wall_s:.1f} s", file=sys.stderr, flush=True)
    body = report(workload, results, crc32_bytes_per_s(), args.rdma_gbps)
    text = json.dumps(body, indent=2)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    if args.plot:
        plot_itl(results, args.plot)
    if args.json:
        print(text)
    else:
        print_table(body)
    return 0
