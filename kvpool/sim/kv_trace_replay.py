"""Requests from a recorded KV trace (`--kv-trace FILE`), for the allocation simulator.

`kvpool simulate --trace kv --trace-file FILE` replays real traffic through every strategy
("what would block size 32 have done on my requests?"). From the trace (format:
`kvpool.formats.kv_trace`) only the requests are taken, never the engine's decisions:

    arrival      the "s" of the request's "arrive" event (engine steps, the simulator's clock;
                 where the numbers start again from 0, after a `reset_stats`, they continue
                 from the last step instead)
    prompt_len   its "p"
    output_len   the "o" of its "finish" event (the longest completion). A request still
                 running when the trace ended has no finish, and the trace does not say how
                 many tokens it had produced (alloc events count blocks, not tokens), so it
                 is dropped and counted in `num_unfinished`; one that finished without an
                 output token (aborted early) is dropped too (`num_without_output`).
    prefix       from the "h" chains of full-block hashes: equal leading hashes mean an equal
                 prefix. A request's group is its longest leading run shared with any other
                 replayed request (a node of the hash trie; groups numbered in order of first
                 appearance) and prefix_len = shared blocks x the recorded block size. All
                 members of a group share exactly that run, so it is exact at the recorded
                 block size and a lower bound at others (a shorter run shared with a third
                 request, or a partial block, is not modelled: a request has one group).

The simulator runs one `--num-samples` for every request; the trace records each request's
"n". `KVTraceRequests.num_samples` is that n when every replayed request asked for the same
one (the CLI uses it unless `--num-samples` is given) and None when they differ.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from kvpool.formats.kv_trace import KVTrace, TraceHeader
from kvpool.sim.trace import Request


@dataclass(frozen=True, slots=True)
class KVTraceRequests:
    """The replayable requests of a KV trace and what was left out (module docstring)."""

    requests: list[Request]  # in arrival order; request_id is the index
    num_unfinished: int  # arrived but never finished: dropped
    num_without_output: int  # finished with no output token: dropped
    sample_counts: dict[int, int]  # n -> replayed requests that asked for n completions
    header: TraceHeader  # the recorded pool; prefix_len is exact at its block_size

    @property
    def num_dropped(self) -> int:
        return self.num_unfinished + self.num_without_output

    @property
    def num_samples(self) -> int | None:
        """The n every replayed request asked for; None when they differ (or there are none)."""
        return next(iter(self.sample_counts)) if len(self.sample_counts) == 1 else None

    def describe(self) -> str:
        """One line: how many requests were replayed and how many dropped, and why."""
        line = f"replayed {len(self.requests)} requests from the KV trace"
        reasons = [f"{count} {why}" for count, why in (
            (self.num_unfinished, "still running when the trace ended"),
            (self.num_without_output, "finished without output")) if count]
        return line + (f", dropped {self.num_dropped} ({', '.join(reasons)})" if reasons
                       else ", dropped 0")


@dataclass(slots=True)
class _Arrival:
    event: dict[str, Any]
    step: int  # on a clock that never goes back (module docstring)
    output_len: int | None = None


def requests_from_kv_trace(trace: KVTrace) -> KVTraceRequests:
    """The simulator's requests for the traffic `trace` recorded; ValueError on a bad event."""
    arrivals = _pair_finishes(trace)
    finished = [a for a in arrivals if a.output_len]
    block_size = trace.header.block_size
    groups = _prefix_groups([_hashes(a.event) for a in finished])
    requests = []
    for request_id, (arrival, (group, num_shared)) in enumerate(zip(finished, groups,
                                                                    strict=True)):
        event = arrival.event
        prompt_len = _int_field(event, "p")
        requests.append(Request(
            request_id=request_id, arrival=float(max(0, arrival.step)), prompt_len=prompt_len,
            output_len=arrival.output_len, prefix_group=group,
            prefix_len=min(prompt_len, num_shared * block_size)))
    sample_counts = Counter(int(a.event.get("n", 1)) for a in finished)
    return KVTraceRequests(
        requests=requests,
        num_unfinished=sum(a.output_len is None for a in arrivals),
        num_without_output=sum(a.output_len == 0 for a in arrivals),
        sample_counts=dict(sorted(sample_counts.items())),
        header=trace.header)


def _pair_finishes(trace: KVTrace) -> list[_Arrival]:
    """Every arrival, with the output length of its finish (ids may be reused after a finish,
    so a finish closes the oldest open arrival of its id)."""
    arrivals: list[_Arrival] = []
    open_arrivals: dict[str, deque[_Arrival]] = {}
    offset = last_step = 0
    for event in trace.events:
        if event["s"] < last_step:  # the engine's step numbers started again
            offset += last_step + 1
        last_step = event["s"]
        if event["e"] not in ("arrive", "finish"):
            continue
        request_id = str(event.get("r"))
        if event["e"] == "arrive":
            arrivals.append(_Arrival(event, offset + event["s"]))
            open_arrivals.setdefault(request_id, deque()).append(arrivals[-1])
        elif open_arrivals.get(request_id):
            open_arrivals[request_id].popleft().output_len = max(0, _int_field(event, "o"))
    return arrivals


def _prefix_groups(chains: list[list[str]]) -> list[tuple[int | None, int]]:
    """(group, shared blocks) per chain: the deepest trie node on its path that another chain
    also passes through (module docstring); (None, 0) when it shares no block."""
    node_of: dict[tuple[int, str], int] = {}  # (parent node, hash) -> node
    num_passing: list[int] = []  # chains through each node
    paths = []
    for chain in chains:
        parent, path = -1, []
        for block_hash in chain:
            node = node_of.setdefault((parent, block_hash), len(num_passing))
            if node == len(num_passing):
                num_passing.append(0)
            num_passing[node] += 1
            path.append(node)
            parent = node
        paths.append(path)
    group_of: dict[int, int] = {}
    groups: list[tuple[int | None, int]] = []
    for path in paths:
        # Counts never grow along a path, so the shared nodes are a leading run.
        num_shared = sum(num_passing[node] > 1 for node in path)
        if num_shared:
            group = group_of.setdefault(path[num_shared - 1], len(group_of))
            groups.append((group, num_shared))
        else:
            groups.append((None, 0))
    return groups


def _hashes(event: dict[str, Any]) -> list[str]:
    hashes = event.get("h") or []
    if not isinstance(hashes, list):
        raise ValueError(f"arrive of {event.get('r')!r} at step {event['s']}: 'h' is not a list")
    return [str(block_hash) for block_hash in hashes]


def _int_field(event: dict[str, Any], key: str) -> int:
    try:
        return int(event[key])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{event['e']} of {event.get('r')!r} at step {event['s']}: "
                         f"needs an integer {key!r}") from None
