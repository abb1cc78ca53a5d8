"""Request traces for the allocation simulator: built-in length distributions and JSONL files.

A trace is a list of `Request`s; time is counted in engine steps (one decode token per running
sequence per step). Built-in traces:

- `sharegpt_trace`: a ShareGPT-like chat workload. Prompt and output lengths are log-normal with
  the means the vLLM paper reports for ShareGPT (Kwon et al., SOSP 2023, Fig. 11a: 161.31 input
  and 337.99 output tokens on average; the paper notes 8.4x longer prompts and 5.8x longer
  outputs than Alpaca). The spreads (sigma 1.0 for prompts, 0.9 for outputs) are our choice: the
  paper publishes histograms, not fitted parameters, and these give its long right tails. As in
  vLLM's benchmark filter, prompts are kept within 4..1024 tokens and prompt + output within
  `max_seq_len` (2048, OPT's context, the paper's setting) — we clip where vLLM drops.
- `uniform_trace`: prompt and output lengths uniform in inclusive ranges.
- `add_shared_prefix`: puts one of `num_groups` shared system prompts in front of every prompt.

Arrivals are all at step 0 (an offline batch: memory is the only limit) or a Poisson process of
`arrival_rate` requests per step. JSONL lines hold `arrival`, `prompt_len`, `output_len` and
optionally `prefix_group` and `prefix_len` (the group's shared leading prompt tokens).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SHAREGPT_MEAN_PROMPT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
SHAREGPT_PROMPT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.9
MIN_LEN = 4
MAX_PROMPT_LEN = 1024


@dataclass(frozen=True, slots=True)
class Request:
    """One request: arrival step, lengths in tokens, and its shared-prefix group if any."""

    request_id: int
    arrival: float
    prompt_len: int  # includes the shared prefix
    output_len: int
    prefix_group: int | None = None
    prefix_len: int = 0  # leading prompt tokens every request of the group has in common

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len and output_len must be >= 1")
        if self.arrival < 0:
            raise ValueError(f"request {self.request_id}: arrival must be >= 0")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"request {self.request_id}: prefix_len must be in 0..prompt_len")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError(f"request {self.request_id}: prefix_len needs a prefix_group")

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


def arrivals(num_requests: int, arrival_rate: float | None, rng: random.Random) -> list[float]:
    """All at 0 when `arrival_rate` is None or 0, else Poisson with that many per step."""
    if not arrival_rate:
        return [0.0] * num_requests
    if arrival_rate < 0:
        raise ValueError(f"arrival_rate must be >= 0, got {arrival_rate}")
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(arrival_rate)
        times.append(now)
    return times


def _lognormal_len(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the (unclipped) mean is `mean`
    return min(high, max(low, round(rng.lognormvariate(mu, sigma))))


def sharegpt_trace(num_requests: int, *, seed: int = 0, arrival_rate: float | None = None,
                   max_seq_len: int = 2048) -> list[Request]:
    """The ShareGPT-like trace described in the module docstring."""
    if max_seq_len < 2 * MIN_LEN:
        raise ValueError(f"max_seq_len must be >= {2 * MIN_LEN}, got {max_seq_len}")
    rng = random.Random(seed)
    max_prompt = min(MAX_PROMPT_LEN, max_seq_len - MIN_LEN)
    requests = []
    for request_id, arrival in enumerate(arrivals(num_requests, arrival_rate, rng)):
        prompt_len = _lognormal_len(rng, SHAREGPT_MEAN_PROMPT_LEN, SHAREGPT_PROMPT_SIGMA,
                                    MIN_LEN, max_prompt)
        output_len = _lognormal_len(rng, SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_OUTPUT_SIGMA,
                                    MIN_LEN, max_seq_len - prompt_len)
        requests.append(Request(request_id, arrival, prompt_len, output_len))
    return requests


def uniform_trace(num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], *, seed: int = 0,
                  arrival_rate: float | None = None) -> list[Request]:
    """Prompt and output lengths drawn uniformly from inclusive `(low, high)` ranges."""
    for low, high in (prompt_range, output_range):
        if not 1 <= low <= high:
            raise ValueError(f"a length range needs 1 <= low <= high, got {(low, high)}")
    rng = random.Random(seed)
    return [
        Request(request_id, arrival, rng.randint(*prompt_range), rng.randint(*output_range))
        for request_id, arrival in enumerate(arrivals(num_requests, arrival_rate, rng))
    ]


def add_shared_prefix(trace: Iterable[Request], num_groups: int, prefix_len: int, *,
                      seed: int = 0, max_seq_len: int | None = None) -> list[Request]:
    """Prepend one of `num_groups` shared `prefix_len`-token system prompts to every request.

    Outputs are shortened where needed to stay within `max_seq_len`.
    """
    if num_groups < 1 or prefix_len < 1:
        raise ValueError("num_groups and prefix_len must be >= 1")
    rng = random.Random(seed)
    shared = []
    for request in trace:
        prompt_len = request.prompt_len + prefix_len
        output_len = request.output_len
        if max_seq_len is not None:
            if prompt_len >= max_seq_len:
                raise ValueError(f"a {prefix_len}-token prefix leaves no room for request "
                                 f"{request.request_id} within max_seq_len {max_seq_len}")
            output_len = min(output_len, max_seq_len - prompt_len)
        shared.append(replace(request, prompt_len=prompt_len, output_len=output_len,
                              prefix_group=rng.randrange(num_groups), prefix_len=prefix_len))
    return shared


def load_jsonl(path: str | Path, default_prefix_len: int = 0) -> list[Request]:
    """Read a JSONL trace; `default_prefix_len` applies to grouped lines without `prefix_len`."""
    requests = []
    lines = Path(path).read_text().splitlines()
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            group = record.get("prefix_group")
            requests.append(Request(
                request_id=len(requests),
                arrival=float(record["arrival"]),
                prompt_len=int(record["prompt_len"]),
                output_len=int(record["output_len"]),
                prefix_group=None if group is None else int(group),
                prefix_len=int(record.get("prefix_len", default_prefix_len if group is not None
                                          else 0)),
            ))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{line_number}: bad trace line ({error})") from error
    return requests


def save_jsonl(trace: Iterable[Request], path: str | Path) -> None:
    fields = ("arrival", "prompt_len", "output_len", "prefix_group", "prefix_len")
    rows = []
    for request in trace:
        record = {key: value for key, value in asdict(request).items() if key in fields}
        if request.prefix_group is None:
            del record["prefix_group"], record["prefix_len"]
        rows.append(json.dumps(record))
    Path(path).write_text("".join(row + "\n" for row in rows))


def describe(trace: list[Request]) -> str:
    """One line: count and mean lengths."""
    if not trace:
        return "empty trace"
    num = len(trace)
    mean_prompt = sum(r.prompt_len for r in trace) / num
    mean_output = sum(r.output_len for r in trace) / num
    num_grouped = sum(r.prefix_group is not None for r in trace)
    grouped = f", {num_grouped} with a shared prefix" if num_grouped else ""
    return (f"{num} requests, mean prompt {mean_prompt:.1f} tokens, "
            f"mean output {mean_output:.1f} tokens{grouped}")
