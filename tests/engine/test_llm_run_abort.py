"""`LLM.generate` must not leave requests queued when it is interrupted: a step that raises,
or Ctrl-C (KeyboardInterrupt) between steps, aborts the call's pending requests before the
error goes on, so the engine is empty and the next `generate` runs only its own prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool import LLM, SamplingParams
from tests.model.test_loaders import save_tiny_hf_model

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = {"dtype": "float32", "kv_cache_memory": 4 << 20, "enable_warmup": False}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(directory)
    return directory


def _fail_on_step(llm: LLM, monkeypatch, failing_step: int, error: BaseException) -> None:
    real_step = llm.engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == failing_step:
            raise error
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)


@pytest.mark.parametrize("error", [RuntimeError("step failed"), KeyboardInterrupt()],
                         ids=["step-raises", "ctrl-c"])
def test_an_interrupted_generate_aborts_its_requests(tiny_dir, monkeypatch, error):
    llm = LLM(str(tiny_dir), **SMALL)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    _fail_on_step(llm, monkeypatch, failing_step=3, error=error)
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.request_counts() == (0, 0)
    assert llm.memory_stats().num_used_blocks == 0
    outputs = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:1]
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("error", [RuntimeError("model failed"), KeyboardInterrupt()],
                         ids=["model-raises", "ctrl-c-in-model"])
def test_a_failure_inside_a_step_is_rolled_back_then_aborted(tiny_dir, monkeypatch, error):
    """The model raises mid-step (after the scheduler admitted and allocated): the engine rolls
    the step back, then `generate` aborts its requests; every block is free again."""
    llm = LLM(str(tiny_dir), **SMALL)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.request_counts() == (0, 0)
    assert llm.memory_stats().num_used_blocks == 0
    llm.engine.check_invariants()
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
