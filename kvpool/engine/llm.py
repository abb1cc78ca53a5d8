"""The offline API, shaped like vLLM's so code can switch by changing an import:

from kvpool import LLM, SamplingParams
llm = LLM()                                          # the bundled SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
outs = llm.chat([{"role": "user", "content": "Hi"}], params)
outs = llm.beam_search([{"prompt": "Hi"}], BeamSearchParams(beam_width=2, max_tokens=8))
metrics = llm.get_metrics()                           # vLLM-named Counter / Gauge records

`model` is a path or a Hugging Face Hub id in the local cache; the other keywords are
`EngineConfig` fields or vLLM arguments kvpool accepts for compatibility
(`kvpool.engine.vllm_compat`: harmless values are ignored with a warning, others refused).
Sampling params left out (None) are the model's defaults (`get_default_sampling_params`, from
its generation_config.json, as vLLM's `generation_config="auto"`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from numbers import Integral
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvpool.engine.beams import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvpool.engine.chat_prompts import as_conversations, chat_prompts
from kvpool.engine.engine import LLMEngine, PromptInput
from kvpool.engine.memory_stats import MemoryStats
from kvpool.engine.metrics_reader import LatencyRecorder, Metric, read_metrics
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpool.engine.vllm_compat import engine_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]


class LLM:
    """Batch generation over the engine; engine options are `EngineConfig` fields (and the
    vLLM arguments `kvpool.engine.vllm_compat` accepts)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        config = engine_config(model, engine_options)
        self.engine = LLMEngine(config)
        self.model_name = config.load.model
        self.latencies = LatencyRecorder()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An `LLM` over an engine already built (e.g. several engines sharing one model)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.model_name = engine.config.load.model
        llm.latencies = LatencyRecorder()
        return llm

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The transformers tokenizer, as vLLM's `get_tokenizer` returns (None for a model
        without one); kvpool's own wrapper is `self.engine.tokenizer`."""
        tokenizer = self.engine.tokenizer
        return None if tokenizer is None else tokenizer.hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params a request gets when it gives none: SamplingParams' defaults,
        with the fields the model's generation config sets (`generation_config`)."""
        return SamplingParams(**self.engine.default_sampling_params())

    def memory_stats(self) -> MemoryStats:
        """The block pool's snapshot: used, free, cached blocks, hits, evictions, and how many
        `max_model_len`-token requests fit at once (`max_concurrency`)."""
        return self.engine.memory_stats()

    def generate(
        self,
        prompts: PromptInput | SequenceOf[PromptInput],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: Any = None,
        priority: int | SequenceOf[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is text, token ids (a list of ints is ONE prompt, a list of such lists is
        many, as in vLLM), or {"prompt_token_ids": [...]}. `sampling_params` None is
        `get_default_sampling_params()`. If any prompt is invalid, ValueError names it and
        nothing runs. The engine hands out each request's output once, when it finishes
        (`RequestOutputKind.FINAL_ONLY`): nothing is copied along the way.

        `priority` (one per prompt, or one for all; as vLLM, a lower value is scheduled
        first, then arrival order) orders the waiting queue and preemption. kvpool has no
        LoRA adapters: a `lora_request` is refused with ValueError.
        """
        _refuse_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        priorities = _as_priority_list(priority, len(prompt_list))
        request_ids = self._add_all(prompt_list, params_list, priorities, cache_salt)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: SequenceOf[Message] | SequenceOf[SequenceOf[Message]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: SequenceOf[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's
        chat template or `chat_template` (Jinja text); `tools` and `chat_template_kwargs` go
        to the template (`kvpool.engine.chat_prompts`)."""
        _refuse_lora(lora_request)
        prompts = chat_prompts(self.engine.tokenizer, as_conversations(messages),
                               add_generation_prompt, chat_template, chat_template_kwargs, tools)
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: SequenceOf[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best beams of each prompt (text, token ids, or a
        TextPrompt / TokensPrompt dict), best first. The beams run in the engine as forks of
        one sequence in the block pool (`kvpool.engine.beams`)."""
        outputs = self.generate(list(prompts), params.sampling_params(), use_tqdm=use_tqdm)
        return [BeamSearchOutput([
            BeamSearchSequence(output.prompt_token_ids + list(beam.token_ids),
                               beam.logprobs or [], beam.cumulative_logprob or 0.0, beam.text,
                               beam.finish_reason, beam.stop_reason)
            for beam in output.outputs]) for output in outputs]

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges as vLLM's metric records, vLLM-named
        (`kvpool.engine.metrics_reader`)."""
        return read_metrics(self.engine, self.model_name or "default", self.latencies)

    def _add_all(
        self,
        prompts: list[PromptInput],
        params: list[SamplingParams],
        priorities: list[int],
        cache_salt: str | None,
    ) -> list[str]:
        request_ids: list[str] = []
        try:
            for index, (prompt, prompt_params, priority) in enumerate(
                    zip(prompts, params, priorities, strict=True)):
                try:
                    request = self.engine.add_request(prompt, prompt_params, priority=priority,
                                                      cache_salt=cache_salt)
                except ValueError as error:
                    raise ValueError(f"prompt {index}: {error}") from error
                request_ids.append(request.request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request finishes. If a step raises, or the user presses Ctrl-C
        (KeyboardInterrupt), the requests still pending are aborted before the error goes on:
        none stays queued to run inside the next `generate`."""
        pending = set(request_ids)
        try:
            return self._step_until_done(request_ids, pending, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                if request_id in pending:
                    self.engine.abort_request(request_id)
            raise

    def _step_until_done(
        self, request_ids: list[str], pending: set[str], use_tqdm: bool
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm)
        num_output_tokens = 0
        with progress:
            while pending and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        self.latencies.record(output.metrics)
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        progress.update(1)
                        rate = num_output_tokens / max(progress.format_dict["elapsed"], 1e-9)
                        progress.set_postfix(output_tok_s=f"{rate:.1f}")
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: PromptInput | SequenceOf[PromptInput]) -> list[PromptInput]:
    """One prompt (text, a dict, or token ids: a sequence whose first item is an int, as vLLM
    tells them apart) as a list of one; a sequence of prompts as a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], Integral):
        return [prompts]
    return prompts


def _as_params_list(
    params: SamplingParams | SequenceOf[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        params = [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    final_only = RequestOutputKind.FINAL_ONLY
    return [p if p.output_kind is final_only else dataclasses.replace(p, output_kind=final_only)
            for p in params]


def _as_priority_list(priority: int | SequenceOf[int] | None, num_prompts: int) -> list[int]:
    """One priority per prompt: None is 0 for all, an int is the same for all."""
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, Integral):
        return [int(priority)] * num_prompts
    priorities = [int(value) for value in priority]
    if len(priorities) != num_prompts:
        raise ValueError(f"got {len(priorities)} priorities for {num_prompts} prompts")
    return priorities


def _refuse_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: kvpool serves no LoRA adapters "
                         "(merge the adapter into the model's weights instead)")
