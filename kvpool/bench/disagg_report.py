"""`kvpool bench disagg`'s report: each configuration's latencies from its requests, the
handover figures and the projection (`disagg_transfer`) as one JSON object, the same as a
table, and the chats' inter-token latency CDFs on one figure (`--plot`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.disagg_transfer import fit_handover, project
from kvpool.bench.disagg_workload import ConfigResult, MixedWorkload, RequestResult


def _ms(values: list[float], q: float) -> float | None:
    return float(1e3 * np.percentile(values, q)) if values else None


def summarize(result: ConfigResult) -> dict[str, Any]:
    """One configuration's row: counts, latencies (ms), throughput, and on disagg what the
    handover moved and the probe's fit."""
    done = [request for request in result.requests if request.error is None]
    chats = [request for request in done if request.kind == "chat"]
    longs = [request for request in done if request.kind == "long"]
    row: dict[str, Any] = {
        "wall_s": result.wall_s,
        "num_chat_requests": sum(request.kind == "chat" for request in result.requests),
        "num_long_requests": sum(request.kind == "long" for request in result.requests),
        "num_failed": len(result.requests) - len(done),
        "errors": sorted({request.error for request in result.requests if request.error})[:5],
        "num_output_tokens": sum(request.output_tokens for request in done),
        "output_tokens_per_s": sum(request.output_tokens for request in done) / result.wall_s,
        "chat_itl_ms_p50": _ms(_itls(chats), 50), "chat_itl_ms_p99": _ms(_itls(chats), 99),
        "chat_ttft_ms_p50": _ms([r.ttft for r in chats], 50),
        "chat_ttft_ms_p99": _ms([r.ttft for r in chats], 99),
        "long_ttft_ms_p50": _ms([r.ttft for r in longs], 50),
        "long_ttft_ms_p99": _ms([r.ttft for r in longs], 99),
        "block_size": result.block_size,
        "long_cached_blocks_p50": (statistics.median(r.cached_tokens for r in longs)
                                   / result.block_size if longs else None)}
    if result.config == "disagg":
        points = [point for kind_points in result.probe.values() for point in kind_points]
        row["transfer"] = result.transfer
        row["probe"] = {**{kind: [list(point) for point in kind_points]
                           for kind, kind_points in result.probe.items()},
                        "fit": fit_handover(points)}
    return row


def _itls(requests: list[RequestResult]) -> list[float]:
    return [gap for request in requests for gap in request.itls]


def report(workload: MixedWorkload, results: dict[str, ConfigResult], crc_rate: float,
           rdma_gbps: float) -> dict[str, Any]:
    """The JSON object: the workload, a row per configuration, and (with disagg) the
    projection of a long prompt's handover to RDMA."""
    configs = {name: summarize(result) for name, result in results.items()}
    body: dict[str, Any] = {"workload": asdict(workload), "configs": configs}
    disagg = configs.get("disagg")
    if disagg is not None:
        long_points = results["disagg"].probe.get("long") or []
        measured = (1e3 * statistics.median(seconds for _, seconds in long_points)
                    if long_points else None)
        bytes_per_block = (disagg["transfer"] or {}).get("bytes_per_block")
        body["projection"] = project(disagg["probe"]["fit"], bytes_per_block,
                                     disagg["long_cached_blocks_p50"], crc_rate, rdma_gbps,
                                     measured)
    return body


# ---------------------------------------------------------------- the table
def _cell(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def print_table(body: dict[str, Any]) -> None:
    workload = body["workload"]
    low, high = workload["chat_len"]
    print(f"{workload['num_chats']} chats ({low}-{high} tokens in, "
          f"{workload['chat_output_len']} out, back to back) beside {workload['num_long']} "
          f"long prompts ({workload['long_len']} tokens in, {workload['long_output_len']} "
          f"out) every {workload['long_interval']:g} s\n")
    print(f"{'':12}{'chat ITL ms':>16}{'chat TTFT ms':>16}{'long TTFT ms':>16}"
          f"{'output':>9}  requests")
    print(f"{'config':12}" + f"{'p50':>8}{'p99':>8}" * 3 + f"{'tok/s':>9}  chat/long/failed")
    for name, row in body["configs"].items():
        latencies = "".join(f"{_cell(row[key]):>8}" for key in (
            "chat_itl_ms_p50", "chat_itl_ms_p99", "chat_ttft_ms_p50", "chat_ttft_ms_p99",
            "long_ttft_ms_p50", "long_ttft_ms_p99"))
        print(f"{name:12}{latencies}{row['output_tokens_per_s']:>9.1f}  "
              f"{row['num_chat_requests']}/{row['num_long_requests']}/{row['num_failed']}")
    if "disagg" in body["configs"]:
        _print_handover(body["configs"]["disagg"], body["projection"])


def _print_handover(row: dict[str, Any], projection: dict[str, Any]) -> None:
    transfer, fit = row["transfer"], row["probe"]["fit"]
    print()
    if transfer is None:
        print("KV handover: the decode worker exports no kvpool:kv_transfer_* metrics")
    else:
        failures = ", ".join(f"{reason} {count:g}" for reason, count
                             in transfer["failures"].items()) or "none"
        print(f"KV handover (the decode worker's /metrics): {transfer['blocks_received']:g} "
              f"blocks, {transfer['bytes_received'] / 1e6:.1f} MB in "
              f"{transfer['num_loads']:g} loads taking {transfer['load_seconds_sum']:.2f} s: "
              f"{_cell(transfer['mb_per_s'], 1)} MB/s, {_cell(transfer['ms_per_block'], 2)} "
              f"ms/block; failures: {failures}")
    if fit is not None:
        print(f"quiet probe (one handover at a time): fixed {fit['fixed_ms']:.1f} ms, "
              f"{fit['ms_per_block']:.2f} ms per block; a long prompt's "
              f"({_cell(projection['blocks_per_long_prompt'])} blocks) took "
              f"{_cell(projection['measured_loopback_long_ms'])} ms on loopback")
    if projection["rdma_long_ms"] is not None:
        print(f"projection, two machines over RDMA at {projection['rdma_gbps']:g} Gb/s (paper, "
              f"not measured): {projection['rdma_long_ms']:.0f} ms per long prompt = "
              f"{max(0.0, projection['fixed_ms']):.1f} ms fixed + "
              f"{projection['checksum_ms_per_block']:.2f} ms/block checksums (CRC-32 at "
              f"{projection['crc32_mb_per_s']:.0f} MB/s, both sides) + "
              f"{projection['rdma_ms_per_block']:.3f} ms/block on the wire; without "
              f"checksums {projection['rdma_long_ms_without_checksums']:.1f} ms; loopback "
              f"here {_cell(projection['measured_loopback_long_ms'])} ms "
              f"({_cell(projection['loopback_over_rdma'], 1)}x the projection)")


# ---------------------------------------------------------------- the figure
def plot_itl(results: dict[str, ConfigResult], path: str | Path) -> None:
    """The chats' inter-token latency CDF per configuration, on one log-scale axis: the
    tail is where a long prefill shows."""
    from matplotlib.figure import Figure  # draws with the Agg canvas: no display needed
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    figure = Figure(figsize=(6.4, 4.0), layout="constrained")
    axes = figure.subplots()
    for name, result in results.items():
        gaps = np.sort(1e3 * np.array(_itls([r for r in result.requests if r.kind == "chat"])))
        if len(gaps):
            axes.step(gaps, np.arange(1, len(gaps) + 1) / len(gaps), where="post", label=name)
    axes.set_xscale("log")
    # Milliseconds as plain numbers (1, 2, 5, 10, 20, 50, ...); no crowded minor labels.
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel("chat inter-token latency (ms, log scale)")
    axes.set_ylabel("share of gaps at most this long")
    axes.set_title("short chats' ITL beside long prompts", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(frameon=False)
    figure.savefig(path, dpi=110)
