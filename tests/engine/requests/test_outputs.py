"""`kvpool.engine.requests.outputs`: `CompletionOutput.finished()` is a method as in vLLM (while
`RequestOutput.finished` stays a field), and merging two DELTA outputs keeps both outputs'
inter-token gaps, so a consumer that fell behind still counts every gap once."""

from __future__ import annotations

from kvpool.engine.requests.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    merge_deltas,
)


def output(text: str, gaps: tuple[float, ...], reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(index=0, text=text, token_ids=[len(text)],
                                  finish_reason=reason)
    metrics = RequestMetrics(0.0, 1.0, None, first_scheduled_time=0.5,
                             last_token_time=1.0 + sum(gaps), inter_token_latencies=gaps)
    return RequestOutput("r", None, [1], [completion], reason is not None, metrics=metrics)


def test_a_completion_says_whether_it_finished_by_a_method() -> None:
    running, done = output("a", ()), output("b", (), reason="stop")
    assert running.outputs[0].finished() is False
    assert done.outputs[0].finished() is True
    assert (running.finished, done.finished) == (False, True)  # the request's: a field


def test_merged_deltas_keep_every_gap_and_the_later_times() -> None:
    merged = merge_deltas(output("a", (0.1,)), output("b", (0.2, 0.3), reason="length"))
    assert merged.outputs[0].text == "ab" and merged.outputs[0].token_ids == [1, 1]
    assert merged.metrics is not None
    assert merged.metrics.inter_token_latencies == (0.1, 0.2, 0.3)
    assert merged.metrics.last_token_time == 1.5
    assert merged.finished
