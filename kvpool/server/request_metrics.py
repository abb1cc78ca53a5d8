"""The per-request histograms of `/metrics`: vLLM's request-level metrics, with its meanings.

Each is computed from what the engine's outputs carry (`RequestMetrics`), never from when the
server happens to see them: the engine stamps every step that gives a request tokens, as vLLM's
engine core stamps its NEW_TOKENS event, so a late or batched delivery to the HTTP side cannot
stretch a gap, and a FINAL_ONLY (non-streamed) request is measured as fully as a stream.

    per token gap  kvpool:inter_token_latency_seconds       successive token steps' gap
                   kvpool:time_per_output_token_seconds     the same samples (vLLM's older
                                                            name for that histogram)
    per request    kvpool:time_to_first_token_seconds       arrival → first token
                   kvpool:e2e_request_latency_seconds       arrival → finish
                   kvpool:request_queue_time_seconds        arrival → first admission
                   kvpool:request_prefill_time_seconds      first admission → first token
                   kvpool:request_decode_time_seconds       first token → last token
                   kvpool:request_inference_time_seconds    first admission → last token
                   kvpool:request_time_per_output_token_seconds  decode / (tokens - 1), else 0
                   kvpool:request_prompt_tokens, kvpool:request_generation_tokens  (tokens)
                   kvpool:request_success_total{finished_reason}

Gaps are observed as each output passes (an output carries only the gaps since the previous
one); the rest once, when the finished output reaches its route, so a request its client
abandoned is not observed there. A request here is one prompt with its n completions: vLLM
runs n > 1 as n child requests, each observed on its own; here the request is observed once,
its generation tokens summed over its completions, its time per output token taken over the
longest one (the one its last token step ends), and one gap per step whatever n.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpool.engine.observability.latency_buckets import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)
from kvpool.engine.requests.outputs import RequestMetrics, RequestOutput

FINISH_REASONS = ("stop", "length", "abort")



def token_count_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class RequestHistograms:
    """The per-request metrics of one app's registry, all labelled by `model_name`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        seconds = {
            "time_to_first_token": ("Arrival to first generated token.",
                                    TIME_TO_FIRST_TOKEN_BUCKETS),
            "inter_token_latency": ("Gap between successive engine steps that gave a request "
                                    "tokens.", INTER_TOKEN_LATENCY_BUCKETS),
            "time_per_output_token": ("The inter-token latency under vLLM's older name: the "
                                      "same samples.", INTER_TOKEN_LATENCY_BUCKETS),
            "request_time_per_output_token": ("Per request: decode time / (generation tokens "
                                              "- 1), 0 for one token.",
                                              INTER_TOKEN_LATENCY_BUCKETS),
            "e2e_request_latency": ("Arrival to finish, per request.", REQUEST_LATENCY_BUCKETS),
            "request_queue_time": ("Arrival to first admission to a batch (waiting).",
                                   REQUEST_LATENCY_BUCKETS),
            "request_prefill_time": ("First admission to first token (prefill).",
                                     REQUEST_LATENCY_BUCKETS),
            "request_decode_time": ("First token to last token (decode).",
                                    REQUEST_LATENCY_BUCKETS),
            "request_inference_time": ("First admission to last token (running).",
                                       REQUEST_LATENCY_BUCKETS),
        }
        self.seconds = {
            name: Histogram(f"kvpool:{name}_seconds", documentation, ["model_name"],
                            registry=registry, buckets=buckets).labels(model_name)
            for name, (documentation, buckets) in seconds.items()
        }
        tokens = token_count_buckets(max_model_len)
        self.prompt_tokens = Histogram(
            "kvpool:request_prompt_tokens", "Prompt tokens per request.", ["model_name"],
            registry=registry, buckets=tokens).labels(model_name)
        self.generation_tokens = Histogram(
            "kvpool:request_generation_tokens", "Generated tokens per request (all its "
            "completions).", ["model_name"], registry=registry, buckets=tokens).labels(model_name)
        self.request_success = Counter(
            "kvpool:request_success", "Finished requests, by finish reason of their first "
            "completion (stop, length, abort).",
            ["model_name", "finished_reason"], registry=registry,
        )
        for reason in FINISH_REASONS:  # a scrape shows zeros rather than nothing before traffic
            self.request_success.labels(model_name, reason)

    def observe_output(self, output: RequestOutput) -> None:
        """The inter-token gaps `output` carries (those since the request's previous output)."""
        if output.metrics is None:
            return
        for gap in output.metrics.inter_token_latencies:
            self.seconds["inter_token_latency"].observe(gap)
            self.seconds["time_per_output_token"].observe(gap)

    def observe_finished(self, output: RequestOutput, num_tokens: dict[int, int]) -> None:
        """A finished request: its success, sizes and intervals. `num_tokens` maps each
        completion to its length (counted by the caller: a DELTA output holds only the last
        tokens)."""
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.request_success.labels(self.model_name, reason or "abort").inc()
        times = output.metrics
        if times is None or times.finish_time is None:
            return
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(num_tokens.values()))
        for name, value in _intervals(times, max(num_tokens.values(), default=0)).items():
            self.seconds[name].observe(value)


def _intervals(times: RequestMetrics, num_longest: int) -> dict[str, float]:
    """A finished request's intervals, as vLLM's `update_from_finished_request` defines them;
    those whose events never happened (aborted before admission or first token) are left out."""
    assert times.finish_time is not None
    intervals = {"e2e_request_latency": times.finish_time - times.arrival_time}
    scheduled, first = times.first_scheduled_time, times.first_token_time
    last = times.last_token_time
    if scheduled is None:
        return intervals
    intervals["request_queue_time"] = scheduled - times.arrival_time
    if first is None or last is None:
        return intervals
    decode = last - first
    intervals |= {
        "time_to_first_token": first - times.arrival_time,
        "request_prefill_time": first - scheduled,
        "request_decode_time": decode,
        "request_inference_time": last - scheduled,
        "request_time_per_output_token": decode / (num_longest - 1) if num_longest > 1 else 0.0,
    }
    return intervals
