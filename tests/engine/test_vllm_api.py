"""vLLM's offline API surface beyond `generate`: its import paths (`kvpool.sampling_params`,
`kvpool.inputs`, `kvpool.outputs`), `generate(priority=)`, `lora_request=` refused by name,
`chat(chat_template=, chat_template_kwargs=, tools=)`, `beam_search` and `get_metrics`.

Most tests run a tiny random Llama (no tokenizer); the chat test uses the shared SmolLM2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvpool import LLM
from tests.model.test_loaders import save_tiny_hf_model

SMALL = {"dtype": "float32", "kv_cache_memory": 4 << 20, "enable_warmup": False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(directory)
    return directory


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(str(tiny_dir), **SMALL)


def _greedy(max_tokens: int):
    from kvpool.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ------------------------------------------------------------------ import paths
def test_vllm_import_paths():
    from kvpool.engine.requests.outputs import RequestOutput as EngineRequestOutput
    from kvpool.engine.sampling_params import SamplingParams as EngineSamplingParams
    from kvpool.inputs import TextPrompt, TokensPrompt
    from kvpool.outputs import BeamSearchOutput, CompletionOutput, RequestOutput
    from kvpool.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

    assert SamplingParams is EngineSamplingParams and RequestOutput is EngineRequestOutput
    assert StructuredOutputsParams(regex="a+").regex == "a+"
    assert BeamSearchParams(beam_width=2, max_tokens=3).length_penalty == 1.0
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}
    assert {CompletionOutput.__name__, BeamSearchOutput.__name__} == {"CompletionOutput",
                                                                      "BeamSearchOutput"}


def test_a_tokens_prompt_generates_like_its_ids(llm):
    from kvpool.inputs import TokensPrompt

    [as_ids] = llm.generate([[5, 6, 7]], _greedy(4), use_tqdm=False)
    [typed] = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], _greedy(4),
                           use_tqdm=False)
    assert typed.outputs[0].token_ids == as_ids.outputs[0].token_ids


# ------------------------------------------------------------------ lora, priority
def test_lora_request_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([[5, 6]], _greedy(2), lora_request=object(), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat([{"role": "user", "content": "hi"}], lora_request=object())
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 6]], _greedy(2), lora_request=None, use_tqdm=False)


def test_priority_orders_the_waiting_queue(tiny_dir):
    one_at_a_time = LLM(str(tiny_dir), **SMALL, max_num_seqs=1)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    outputs = one_at_a_time.generate(prompts, _greedy(3), priority=[2, 0, 1], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order kept
    finish_order = sorted(range(3), key=lambda i: outputs[i].metrics.finish_time)
    assert finish_order == [1, 2, 0]
    fcfs = one_at_a_time.generate(prompts, _greedy(3), priority=0, use_tqdm=False)
    assert sorted(range(3), key=lambda i: fcfs[i].metrics.finish_time) == [0, 1, 2]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        one_at_a_time.generate(prompts, _greedy(3), priority=[0, 1], use_tqdm=False)


def test_a_low_priority_request_waits_while_higher_ones_keep_coming(tiny_dir):
    """No aging (vLLM's rule): one seat, a priority-5 request first, then priority-0 ones
    arriving while each runs; the low one is served only when none of them waits."""
    from kvpool.engine.sampling_params import SamplingParams

    engine = LLM(str(tiny_dir), **SMALL, max_num_seqs=1).engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="low", priority=5)
    engine.add_request([8, 9], params, request_id="high-0")
    finished, arrivals = [], iter(range(1, 4))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished.append(output.request_id)
                index = next(arrivals, None)  # another urgent one as each ends
                if index is not None:
                    engine.add_request([8, 9, index], params, request_id=f"high-{index}")
    assert finished == ["high-0", "high-1", "high-2", "high-3", "low"]


def test_fcfs_serves_by_arrival_and_refuses_a_priority(tiny_dir):
    fcfs = LLM(str(tiny_dir), **SMALL, max_num_seqs=1, scheduling_policy="fcfs")
    prompts = [[5, 6, 7], [8, 9, 10]]
    outputs = fcfs.generate(prompts, _greedy(3), use_tqdm=False)
    assert outputs[0].metrics.finish_time < outputs[1].metrics.finish_time
    with pytest.raises(ValueError, match="priority 1 needs scheduling_policy 'priority'"):
        fcfs.generate(prompts, _greedy(3), priority=[0, 1], use_tqdm=False)
    assert not fcfs.engine.has_unfinished_requests()  # nothing of the refused batch is left


# ------------------------------------------------------------------ chat
def test_chat_takes_a_template_its_kwargs_and_tools(make_engine):
    llm = LLM.from_engine(make_engine(kv_cache_memory=16 << 20, enable_warmup=False))
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if tools %}[{{ tools[0]['function']['name'] }}]{% endif %}{{ suffix }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "Hi"}]
    [out] = llm.chat(messages, _greedy(2), use_tqdm=False, chat_template=template,
                     chat_template_kwargs={"suffix": "|"}, tools=tools)
    assert out.prompt == "<user>Hi[get_weather]|"
    assert out.prompt_token_ids == llm.engine.tokenizer.encode(out.prompt,
                                                               add_special_tokens=False)
    [plain] = llm.chat(messages, _greedy(2), use_tqdm=False)
    assert plain.prompt.startswith("<|im_start|>")


# ------------------------------------------------------------------ beam search
def test_beam_width_one_is_greedy(llm):
    from kvpool.sampling_params import BeamSearchParams

    prompts = [[5, 6, 7], [20, 21]]
    greedy = llm.generate(prompts, _greedy(5), use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                            BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    for prompt, out, beam_out in zip(prompts, greedy, beams, strict=True):
        [best] = beam_out.sequences
        assert best.tokens == prompt + list(out.outputs[0].token_ids)
        assert best.finish_reason == "length"


def test_wider_beams_find_at_least_the_greedy_score(llm):
    from kvpool.sampling_params import BeamSearchParams

    prompt = [5, 6, 7]
    greedy_params = dataclasses.replace(_greedy(6), logprobs=1)
    [greedy] = llm.generate([prompt], greedy_params, use_tqdm=False)
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6,
                                                       ignore_eos=True, length_penalty=0.0))
    assert len(out.sequences) == 3
    scores = [beam.cum_logprob for beam in out.sequences]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(beam.tokens) for beam in out.sequences}) == 3
    for beam in out.sequences:
        chosen = [step[token].logprob for step, token in zip(beam.logprobs, beam.tokens[3:],
                                                             strict=True)]
        assert beam.cum_logprob == pytest.approx(sum(chosen), abs=1e-5)
    assert scores[0] >= greedy.outputs[0].cumulative_logprob - 1e-5
    assert not llm.engine.has_unfinished_requests()


def test_beam_search_params_are_checked():
    from kvpool.sampling_params import BeamSearchParams

    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.7)


# ------------------------------------------------------------------ metrics
def test_get_metrics_counts_tokens_under_vllm_names(tiny_dir):
    from kvpool.engine.metrics_reader import Counter, Gauge, Histogram

    llm = LLM(str(tiny_dir), **SMALL)
    llm.generate([[5, 6, 7], [8, 9]], _greedy(4), use_tqdm=False)
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    assert isinstance(metrics["vllm:prompt_tokens"], Counter)
    assert metrics["vllm:prompt_tokens"].value == 5
    assert metrics["vllm:generation_tokens"].value == 8
    assert isinstance(metrics["vllm:num_requests_running"], Gauge)
    assert metrics["vllm:num_requests_running"].value == 0
    assert metrics["vllm:num_requests_waiting"].value == 0
    assert metrics["vllm:kv_cache_usage_perc"].value == 0.0
    assert metrics["vllm:prompt_tokens"].tags["model_name"] == str(tiny_dir)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        histogram = metrics[name]
        assert isinstance(histogram, Histogram)
        assert histogram.count == 2 and histogram.buckets["+Inf"] == 2 and histogram.sum > 0
        counts = list(histogram.buckets.values())
        assert counts == sorted(counts)  # cumulative
