"""The KV allocation trace (`--kv-trace`), end to end on SmolLM2: the file parses, replaying
its reference events reproduces the pool's used-block count at every step and ends at zero,
and each kind of event appears where the engine does that thing (prefix hits, forks,
copy-on-write, both preemptions, evictions and spills, elastic grows and shrinks). Tracing
changes no output token."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest

from kvpool.cli.args import add_engine_args, engine_config_from_args
from kvpool.engine.config import EngineConfig
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.vllm_compat import engine_config
from kvpool.formats.kv_trace import KVTrace, read_kv_trace
from tests.engine.conftest import PROMPTS, run_all, token_ids

# Few steps per test (each costs a forward pass): tiny blocks make tiny pools fill quickly.
FAST = {"dtype": "float32", "enable_warmup": False}
TINY = {**FAST, "block_size": 4}


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def distinct_prompt(index: int, num_tokens: int) -> list[int]:
    """Token ids no other prompt of these tests starts with."""
    return [100 + (index * 61 + position * 7) % 5000 for position in range(num_tokens)]


def replay(trace: KVTrace) -> Counter:
    """Every block's references after replaying the trace (the format's replay rules),
    checking at each step event that the referenced blocks are its "u"."""
    refs: Counter = Counter()
    for event in trace.events:
        kind = event["e"]
        if kind in ("hit", "alloc", "fork", "swap_in"):
            refs.update(event["b"])
        elif kind in ("free", "preempt"):
            refs.subtract(event["b"])
        elif kind == "cow":
            refs[event["src"]] -= 1
            refs[event["dst"]] += 1
        elif kind == "shrink":
            for old, new in event.get("m", []):
                refs[new], refs[old] = refs[old], 0
        elif kind == "step":
            assert sum(1 for count in refs.values() if count > 0) == event["u"], event
        assert all(count >= 0 for count in refs.values()), event
    return refs


def traced(tmp_path: Path, make_engine, **options):
    path = tmp_path / "kv.trace"
    return make_engine(kv_trace=str(path), **options), path


def closed_trace(engine, path: Path) -> KVTrace:
    engine.close()
    trace = read_kv_trace(path)
    assert all(count == 0 for count in replay(trace).values()), "references left at the end"
    times = [event["t"] for event in trace.events]
    assert times == sorted(times)
    return trace


def test_a_traced_run_replays_to_zero_and_changes_no_token(make_engine, tmp_path):
    prompts = [*PROMPTS[:3], PROMPTS[10]]  # 5, 5, 8 and 16 tokens
    plain = token_ids(run_all(make_engine(**FAST), prompts, greedy(3)))
    engine, path = traced(tmp_path, make_engine, dtype="float32")  # warmed up, untraced
    assert token_ids(run_all(engine, prompts, greedy(3))) == plain
    trace = closed_trace(engine, path)
    pool = engine.memory_stats()
    assert (trace.header.block_size, trace.header.num_blocks) == (16, pool.num_blocks)
    assert trace.header.bytes_per_block == pool.bytes_per_block
    arrivals = list(trace.of_kind("arrive"))
    assert [event["r"] for event in arrivals] == ["0", "1", "2", "3"]
    assert arrivals[0]["s"] == 0 and trace.events[0] is arrivals[0]  # no warm-up event
    assert [(event["p"], len(event["h"])) for event in arrivals][3] == (16, 1)
    assert {event["r"] for event in trace.of_kind("finish")} == {"0", "1", "2", "3"}
    assert all(event["o"] == 3 and event["why"] == "length"
               for event in trace.of_kind("finish"))
    steps = list(trace.of_kind("step"))
    assert [event["s"] for event in steps] == list(range(engine.stats().num_steps))
    assert steps[-1] == {**steps[-1], "u": 0, "o": pool.num_blocks}


def test_an_aborted_request_frees_and_finishes(make_engine, tmp_path):
    engine, path = traced(tmp_path, make_engine, **FAST)
    request = engine.add_request(PROMPTS[8], greedy(4))
    engine.step()
    engine.abort_request(request.request_id)
    trace = closed_trace(engine, path)
    assert [event["e"] for event in trace.events] == [
        "arrive", "alloc", "step", "free", "finish"]
    assert trace.events[-1]["why"] == "abort"


def test_a_repeated_prompt_is_a_prefix_hit(make_engine, tmp_path):
    engine, path = traced(tmp_path, make_engine, **FAST)
    run_all(engine, [PROMPTS[8]], greedy(1))
    run_all(engine, [PROMPTS[8]], greedy(1))
    trace = closed_trace(engine, path)
    [hit] = trace.of_kind("hit")
    first_alloc = next(trace.of_kind("alloc"))
    assert hit["r"] == "1" and hit["c"] == 4 * 16 and "k" not in hit
    assert hit["b"] == first_alloc["b"][:4]  # 78 tokens: the 4 full blocks of the first


def test_n_completions_fork_then_copy_on_write(make_engine, tmp_path):
    engine, path = traced(tmp_path, make_engine, **FAST)
    run_all(engine, [PROMPTS[0]], greedy(3, n=2))
    trace = closed_trace(engine, path)
    [fork] = trace.of_kind("fork")
    [cow] = trace.of_kind("cow")  # 5 prompt tokens: the shared block is partly filled
    assert (fork["q"], fork["from"]) == (1, 0)
    assert cow["src"] == fork["b"][-1] and cow["dst"] not in fork["b"]


@pytest.mark.parametrize("options", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap", "swap_space": 0.05},
], ids=["recompute", "swap"])
def test_preemptions_are_traced(make_engine, tmp_path, options):
    # Three 7-token prompts fill 6 blocks of 4; their third output token needs a seventh.
    engine, path = traced(tmp_path, make_engine, **TINY, num_gpu_blocks=6, **options)
    run_all(engine, [distinct_prompt(index, 7) for index in range(3)], greedy(4))
    trace = closed_trace(engine, path)
    preempts = list(trace.of_kind("preempt"))
    assert len(preempts) == engine.stats().num_preemptions > 0
    assert {event["m"] for event in preempts} == {options["preemption_mode"]}
    if options["preemption_mode"] == "swap":
        assert {event["r"] for event in trace.of_kind("swap_in")} == {
            event["r"] for event in preempts}


def test_evictions_and_spills_are_traced(make_engine, tmp_path):
    engine, path = traced(tmp_path, make_engine, **TINY, num_gpu_blocks=6, swap_space=0.05)
    for index in (0, 1, 2, 0):  # 4 blocks each, 3 left cached: the next one evicts some
        run_all(engine, [distinct_prompt(index, 12)], greedy(2))
    trace = closed_trace(engine, path)
    [hit] = trace.of_kind("hit")  # the first prompt again: its blocks come back from the host
    assert hit["r"] == "3" and hit["k"]["host"] > 0 and hit["c"] == hit["k"]["host"] + 4 * len(
        hit["b"])
    evicted = [block_id for event in trace.of_kind("evict") for block_id in event["b"]]
    spilled = [block_id for event in trace.of_kind("spill") for block_id in event["b"]]
    assert len(evicted) == engine.memory_stats().num_evictions > 0
    assert spilled and set(spilled) <= set(evicted)


def test_elastic_grows_and_shrinks_are_traced(make_engine, tmp_path):
    # Segments of 2 blocks from none, given back at once when idle; requests of mixed
    # lengths end at different steps, so a shrink must migrate a block that is still used.
    elastic = {"kv_pool": "elastic", "kv_pool_segment_blocks": 2, "kv_pool_initial_blocks": 0,
               "kv_pool_idle_seconds": 0.0}
    engine, path = traced(tmp_path, make_engine, **TINY, num_gpu_blocks=64, **elastic)
    run_all(engine, [distinct_prompt(index, length) for index, length in enumerate((6, 18, 10, 3))],
            [greedy(max_tokens) for max_tokens in (2, 7, 4, 1)])
    trace = closed_trace(engine, path)  # the replay follows the migrations
    stats = engine.kv_pool_stats()
    grows, shrinks = list(trace.of_kind("grow")), list(trace.of_kind("shrink"))
    assert (len(grows), len(shrinks)) == (stats.num_grows, stats.num_shrinks)
    moved = sum(len(event.get("m", [])) for event in shrinks)
    assert moved == stats.num_migrated_blocks > 0
    evicted = sum(len(event["b"]) for event in trace.of_kind("evict"))
    assert evicted == engine.memory_stats().num_evictions
    online = trace.header.num_blocks
    for event in trace.of_kind("grow", "shrink", "step"):
        if event["e"] == "step":
            assert event["o"] == online
        else:
            online += event["d"] if event["e"] == "grow" else -event["d"]
            assert event["n"] == online


def test_the_kv_trace_flag_and_option_reach_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    path = str(tmp_path / "run.trace")
    def kv_trace(config: EngineConfig) -> str | None:
        return config.observability.kv_trace

    assert kv_trace(engine_config_from_args(parser.parse_args(["--kv-trace", path]))) == path
    assert kv_trace(engine_config_from_args(parser.parse_args([]))) is None
    assert kv_trace(engine_config(None, {"kv_trace": path})) == path  # LLM(kv_trace=...)
    with pytest.raises(ValueError, match=r"--kv-trace.*does not exist"):
        EngineConfig(kv_trace=str(tmp_path / "missing" / "run.trace"))
    with pytest.raises(ValueError, match=r"--kv-trace.*must name a file"):
        EngineConfig(kv_trace=str(tmp_path))
