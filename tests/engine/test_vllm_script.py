"""A vLLM offline script runs with only its imports changed (`vllm` -> `kvpool`): the
import paths, the default sampling params edited for one call, chat with template kwargs,
token prompts with priorities, beam search and metrics, as vLLM's own examples use them
(`sp.max_tokens = N` on the defaults is vLLM's chat example).
"""

from __future__ import annotations

VLLM_SCRIPT = '''
from kvpool import LLM
from kvpool.inputs import TokensPrompt
from kvpool.outputs import RequestOutput
from kvpool.sampling_params import BeamSearchParams, SamplingParams

llm = LLM.from_engine(engine)
sp = llm.get_default_sampling_params()
sp.max_tokens = 8
sp.temperature = 0.0
conversation = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a color."}]
chat_outputs = llm.chat(conversation, sp, use_tqdm=False,
                        chat_template_kwargs={"enable_thinking": False})
prompts = [TokensPrompt(prompt_token_ids=[1, 504, 3458, 282]), "The sky is"]
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4),
                       priority=[1, 0], use_tqdm=False)
beams = llm.beam_search([{"prompt": "The sky is"}],
                        BeamSearchParams(beam_width=2, max_tokens=3))
metrics = {m.name: m for m in llm.get_metrics()}
'''


def test_a_vllm_script_runs_with_its_imports_changed(make_engine):
    engine = make_engine(kv_cache_memory=16 << 20, enable_warmup=False)
    scope = {"engine": engine}
    exec(compile(VLLM_SCRIPT, "vllm_script.py", "exec"), scope)
    [chat] = scope["chat_outputs"]
    assert isinstance(chat, scope["RequestOutput"]) and chat.finished
    assert 0 < len(chat.outputs[0].token_ids) <= 8
    first, second = scope["outputs"]
    assert first.prompt_token_ids == [1, 504, 3458, 282]
    assert second.prompt == "The sky is" and len(second.outputs[0].token_ids) == 4
    [beam_output] = scope["beams"]
    assert len(beam_output.sequences) == 2
    assert all(beam.text is not None for beam in beam_output.sequences)
    metrics = scope["metrics"]
    assert metrics["vllm:num_requests_running"].value == 0
    assert metrics["vllm:generation_tokens"].value > 0
