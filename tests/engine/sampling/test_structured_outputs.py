"""Structured outputs end to end on SmolLM2: JSON schemas (hypothesis-generated, validated with
jsonschema), any JSON object, regex, choice and EBNF grammars, greedy and at temperature 1,
with n > 1, under preemption (recompute and swap), stop strings, max_tokens, aborts; and the
compiler's cache, errors and thread-safety, and the async engine compiling off its thread."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling.constraints import bitmask_penalty
from kvpool.engine.sampling.grammar import GrammarCompiler, choice_grammar
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.engine.structured_outputs import StructuredOutputsParams
from tests.engine.conftest import PROMPTS, fail_once, run_all

pytestmark = pytest.mark.slow

SMALL = {"dtype": "float32", "kv_cache_memory": 32 * 2**20, "max_model_len": 1024}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
}
CHOICES = ['say "yes"', "no\\maybe", "ünïcødé 🙂", "two\nlines"]


def prompt_for(smollm2, what: str) -> str:
    """A chat prompt asking for `what` (the grammar, not the prompt, guarantees the form)."""
    messages = [{"role": "user", "content": f"Reply with {what} and nothing else."}]
    return smollm2.tokenizer.hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


def structured(temperature: float = 0.0, max_tokens: int = 96, n: int = 1,
               seed: int | None = None, **spec) -> SamplingParams:
    """Sampling params whose output must match `spec` (StructuredOutputsParams' fields)."""
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=seed,
                          structured_outputs=StructuredOutputsParams(**spec))


# ------------------------------------------------------------------ JSON schemas
names = st.text(alphabet="abcdefgh", min_size=1, max_size=5)


@st.composite
def integer_schemas(draw) -> dict:
    low = draw(st.integers(-500, 500))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 500))}


@st.composite
def number_schemas(draw) -> dict:
    low = draw(st.integers(-50, 50)) / 4
    return {"type": "number", "minimum": low, "maximum": low + draw(st.integers(1, 200)) / 4}


leaf_schemas = st.one_of(
    integer_schemas(),
    number_schemas(),
    st.just({"type": "boolean"}),
    st.sampled_from([
        {"type": "string", "pattern": "^[a-z]{1,6}$"},
        {"type": "string", "pattern": "^[A-Z][a-z]{0,5}$"},
        {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
        {"type": "string", "maxLength": 8},
    ]),
    st.lists(st.one_of(names, st.integers(-9, 99), st.booleans()), min_size=1, max_size=4,
             unique_by=json.dumps).map(lambda values: {"enum": values}),
)


@st.composite
def object_schemas(draw, children) -> dict:
    properties = draw(st.dictionaries(names, children, min_size=1, max_size=3))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
    return {"type": "object", "properties": properties, "required": required}


@st.composite
def array_schemas(draw, children) -> dict:
    min_items = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": min_items,
            "maxItems": min_items + draw(st.integers(0, 2))}


schemas = object_schemas(st.recursive(
    leaf_schemas,
    lambda children: st.one_of(object_schemas(children), array_schemas(children)),
    max_leaves=3,
))


def test_every_completion_that_stops_matches_its_json_schema(make_engine, smollm2):
    """Four schemas per example in one batch, each greedy and twice at temperature 1."""
    engine = make_engine(**SMALL)
    prompt = prompt_for(smollm2, "a JSON object")
    finish_reasons = []

    @settings(max_examples=4, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(batch=st.lists(schemas, min_size=4, max_size=4), seed=st.integers(0, 2**16))
    def check(batch: list[dict], seed: int) -> None:
        params = []
        for schema in batch:
            params.append(structured(json=schema, max_tokens=96))
            params.append(structured(1.0, json=schema, max_tokens=96, n=2, seed=seed))
        outputs = run_all(engine, [prompt] * len(params), params)
        for output, request_params in zip(outputs, params, strict=True):
            schema = request_params.structured_outputs.json
            for completion in output.outputs:
                finish_reasons.append(completion.finish_reason)
                if completion.finish_reason == "stop":
                    jsonschema.validate(json.loads(completion.text), schema)

    check()
    assert finish_reasons.count("stop") >= len(finish_reasons) // 2, finish_reasons


def test_greedy_json_is_valid_and_forks_are_each_valid(make_engine, smollm2):
    engine = make_engine(**SMALL)
    prompt = prompt_for(smollm2, "a person as JSON")
    greedy, sampled = run_all(engine, [prompt, prompt], [
        structured(json=PERSON), structured(1.0, json=json.dumps(PERSON), n=4, seed=5)])
    assert len(sampled.outputs) == 4
    for completion in [*greedy.outputs, *sampled.outputs]:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    # The properties come in the schema's order (xgrammar's default), not sorted.
    assert list(json.loads(greedy.outputs[0].text))[:2] == ["name", "age"]


def test_json_object_gives_a_json_object(make_engine, smollm2):
    engine = make_engine(**SMALL)
    output = run_all(engine, [prompt_for(smollm2, "a small JSON object")],
                     structured(json_object=True, max_tokens=48))[0].outputs[0]
    if output.finish_reason == "stop":
        assert isinstance(json.loads(output.text), dict)
    else:
        assert output.text.lstrip().startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_always_returns_one_of_the_choices(make_engine, smollm2, temperature):
    engine = make_engine(**SMALL)
    params = structured(temperature, choice=CHOICES, n=4, seed=11)
    output = run_all(engine, [prompt_for(smollm2, "yes or no")], params)[0]
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        assert completion.text in CHOICES


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_matches_the_regex(make_engine, smollm2, temperature):
    engine = make_engine(**SMALL)
    patterns = [r"\d{3}-\d{4}", r"(red|green|blue) [a-z]{2,6}",
                r"[A-Z][a-z]{1,7}(, [A-Z][a-z]{1,7}){2}"]
    prompt = prompt_for(smollm2, "a phone number, a colour, or three names")
    params = [structured(temperature, 32, 2, 3, regex=pattern) for pattern in patterns]
    for pattern, output in zip(patterns, run_all(engine, [prompt] * 3, params), strict=True):
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                assert re.fullmatch(pattern, completion.text), (pattern, completion.text)
            else:  # a run of letters may reach max_tokens; what there is still fits
                assert completion.finish_reason == "length"


def test_ebnf_grammar_is_followed(make_engine, smollm2):
    grammar = '''
root ::= greeting " " name "!"
greeting ::= "hello" | "good " ("morning" | "evening")
name ::= [A-Z] [a-z]{1,8}
'''
    engine = make_engine(**SMALL)
    params = structured(1.0, grammar=grammar, n=3, seed=2, max_tokens=24)
    output = run_all(engine, [prompt_for(smollm2, "a greeting")], params)[0]
    for completion in output.outputs:
        if completion.finish_reason == "stop":
            assert re.fullmatch(r"(hello|good (morning|evening)) [A-Z][a-z]{1,8}!", completion.text)


def test_structured_and_free_requests_share_a_batch(make_engine, smollm2):
    """A free request batched with constrained ones gets exactly its solo tokens."""
    engine = make_engine(**SMALL)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = run_all(engine, [PROMPTS[1]], free)[0].outputs[0].token_ids
    prompt = prompt_for(smollm2, "a person as JSON")
    mixed = run_all(engine, [prompt, PROMPTS[1], prompt],
                    [structured(json=PERSON), free, structured(choice=CHOICES)])
    assert mixed[1].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), PERSON)
    assert mixed[2].outputs[0].text in CHOICES


# ------------------------------------------------------------------ preemption
PRESSURE = {"dtype": "float32", "num_gpu_blocks": 24, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def pressure_reference(smollm2) -> tuple[list[str], list[SamplingParams], list[list[int]]]:
    """Structured greedy requests with long prompts, and their outputs with room to spare."""
    prompts = [PROMPTS[index] + "\nAs JSON:" for index in (5, 8, 14, 2, 6, 9)]
    params = [structured(json=PERSON, max_tokens=48) if index % 2 == 0
              else structured(regex=r"[a-z]+( [a-z]+){3,9}\.", max_tokens=48)
              for index in range(len(prompts))]
    config = EngineConfig(dtype="float32")
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    reference = [output.outputs[0].token_ids for output in run_all(engine, prompts, params)]
    assert engine.stats().num_preemptions == 0
    engine.close()
    return prompts, params, reference


@pytest.mark.parametrize("options", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap", "swap_space": 0.1},
], ids=["recompute", "swap"])
def test_preemption_keeps_each_grammar_where_it_was(make_engine, pressure_reference, options):
    prompts, params, reference = pressure_reference
    engine = make_engine(**PRESSURE, **options)
    outputs = run_all(engine, prompts, params)
    stats = engine.stats()
    assert getattr(stats, f"num_{options['preemption_mode']}_preemptions") > 0
    assert [output.outputs[0].token_ids for output in outputs] == reference


# ------------------------------------------------------------------ stopping
def test_max_tokens_cuts_the_json_short(make_engine, smollm2):
    engine = make_engine(**SMALL)
    output = run_all(engine, [prompt_for(smollm2, "a person as JSON")],
                     structured(json=PERSON, max_tokens=5))[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


def test_a_stop_string_ends_a_structured_completion(make_engine, smollm2):
    engine = make_engine(**SMALL)
    params = dataclasses.replace(structured(json=PERSON), stop=[","])
    output = run_all(engine, [prompt_for(smollm2, "a person as JSON")], params)[0].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == ","
    assert "," not in output.text and output.text.lstrip().startswith("{")


def test_ignore_eos_still_ends_when_the_grammar_is_complete(make_engine, smollm2):
    engine = make_engine(**SMALL)
    params = dataclasses.replace(structured(choice=["yes", "no"]), ignore_eos=True)
    output = run_all(engine, [prompt_for(smollm2, "yes or no")], params)[0].outputs[0]
    assert output.finish_reason == "stop" and output.text in ("yes", "no")
    assert output.token_ids[-1] in engine.eos_token_ids  # the grammar's stop token, then done


def test_a_token_the_grammar_rejects_stops_the_sequence_with_a_warning(make_engine, smollm2,
                                                                        caplog):
    # After "yes" only EOS fits the grammar, and min_tokens bans EOS: every token is masked,
    # the sampler picks one anyway, the matcher rejects it and the sequence stops.
    engine = make_engine(**SMALL)
    params = dataclasses.replace(structured(choice=["yes"]), min_tokens=6)
    with caplog.at_level("WARNING", logger="kvpool.engine.requests.output_processor"):
        output = run_all(engine, [prompt_for(smollm2, "yes")], params)[0].outputs[0]
    assert output.finish_reason == "stop" and output.text == "yes"
    assert "grammar rejected" in caplog.text


def test_a_step_rolled_back_after_sampling_rewinds_its_grammars(make_engine, smollm2):
    # The sampler advances the matchers; a step that fails after it (here: recording prompt
    # logprobs) never hands its tokens to the sequences, so the matchers must come back.
    prompt = prompt_for(smollm2, "a person as JSON")
    params = dataclasses.replace(structured(json=PERSON, n=2, max_tokens=40), prompt_logprobs=1)
    (reference,) = run_all(make_engine(**SMALL), [prompt], params)
    engine = make_engine(**SMALL)
    request = engine.add_request(prompt, params)
    for _ in range(4):
        engine.step()
    fail_once(engine.outputs, "add_prompt_logprobs", "out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    expected = [completion.token_ids for completion in reference.outputs]
    assert [seq.output_token_ids for seq in request.sequences] == expected


def test_abort_mid_generation_frees_everything(make_engine, smollm2):
    engine = make_engine(**SMALL)
    request = engine.add_request(prompt_for(smollm2, "a person as JSON"),
                                 structured(1.0, json=PERSON, n=3, seed=1))
    for _ in range(3):
        engine.step()
    assert request.sequences[1].output_token_ids
    output = engine.abort_request(request.request_id)
    assert [completion.finish_reason for completion in output.outputs] == ["abort"] * 3
    assert engine.memory_stats().num_used_blocks == 0
    assert not engine.requests and not engine.has_unfinished_requests()


# ------------------------------------------------------------------ invalid specs
@pytest.mark.parametrize(("spec", "param"), [
    ({"json": {"type": "no-such-type-XYZ"}}, "structured_outputs.json"),
    ({"json": {"$ref": "#/definitions/missing-XYZ"}}, "structured_outputs.json"),
    ({"regex": "(unclosed-XYZ"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule_XYZ"}, "structured_outputs.grammar"),
])
def test_an_invalid_spec_is_refused_with_its_param(make_engine, spec, param):
    engine = make_engine(**SMALL)
    spec = StructuredOutputsParams(**spec)
    with pytest.raises(InvalidRequestError) as raised:
        engine.grammar_compiler.compile(spec)
    assert raised.value.param == param and "XYZ" not in str(raised.value)  # no echo
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=spec))
    assert raised.value.param == param
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.grammar_compiler.num_cached == 0  # failures are not cached


def test_a_model_without_tokenizer_refuses_structured_outputs(smollm2):
    config = EngineConfig(dtype="float32", kv_cache_memory=8 * 2**20, enable_warmup=False)
    engine = LLMEngine(config, build_engine_parts(config, dataclasses.replace(
        smollm2, tokenizer=None)))
    assert engine.grammar_compiler is None
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request([1, 2, 3], structured(regex="a+"))
    assert raised.value.param == "structured_outputs"
    engine.close()


# ------------------------------------------------------------------ the compiler
@pytest.fixture(scope="module")
def compiler(smollm2) -> GrammarCompiler:
    return GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)


def test_equal_specs_share_one_grammar_and_the_cache_is_bounded(smollm2):
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size, cache_size=2)
    first = compiler.compile(StructuredOutputsParams(json={"type": "object", "required": []}))
    again = compiler.compile(StructuredOutputsParams(json='{ "required": [], "type": "object" }'))
    assert again is not first  # a different key order is a different grammar...
    same = compiler.compile(StructuredOutputsParams(json='{"type":"object",  "required":[]}'))
    assert same is first  # ...but whitespace is not
    compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.num_cached == 2  # the least recently used (`again`) went
    assert compiler.compile(StructuredOutputsParams(json={"type": "object", "required": []})) \
        is first


def test_concurrent_compiles_of_one_spec_compile_it_once(compiler, monkeypatch):
    calls = []
    real_compile = compiler._compile

    def counting_compile(key, timeout):
        calls.append(key)
        return real_compile(key, timeout)

    monkeypatch.setattr(compiler, "_compile", counting_compile)
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    barrier = threading.Barrier(8)
    results = []

    def compile_it() -> None:
        barrier.wait()
        results.append(compiler.compile(spec))

    threads = [threading.Thread(target=compile_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 8
    assert all(result is results[0] for result in results)


def test_matcher_fills_accepts_and_terminates(compiler, smollm2):
    tokenizer = smollm2.tokenizer
    matcher = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).new_matcher()
    bitmask = torch.zeros(2, compiler.bitmask_width, dtype=torch.int32)
    assert matcher.fill(bitmask, 1) and not bitmask[0].any()
    is_allowed = torch.isfinite(bitmask_penalty(bitmask, compiler.vocab_size))
    assert not is_allowed[0].any()  # an untouched all-zero row forbids everything
    allowed = set(is_allowed[1].nonzero().flatten().tolist())
    yes, no = tokenizer.encode("yes", False), tokenizer.encode("no", False)
    assert {yes[0], no[0]} <= allowed and len(allowed) < 10
    assert not matcher.accept(tokenizer.encode("maybe", False)[0])
    assert all(matcher.accept(token) for token in yes) and not matcher.is_terminated
    eos = next(iter(tokenizer.eos_token_ids))
    assert matcher.accept(eos) and matcher.is_terminated
    assert not matcher.fill(bitmask, 0)  # a terminated matcher leaves its row alone


def test_a_matcher_counts_what_it_accepted_and_rewinds_to_a_token_count(compiler, smollm2):
    tokenizer = smollm2.tokenizer
    matcher = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).new_matcher()
    yes, eos = tokenizer.encode("yes", False), next(iter(tokenizer.eos_token_ids))
    assert all(matcher.accept(token) for token in yes)
    assert not matcher.accept(tokenizer.encode("maybe", False)[0]) and matcher.is_rejected
    assert matcher.num_accepted == len(yes)  # a rejected token is not counted
    assert matcher.accept(eos) and matcher.is_terminated and not matcher.is_rejected
    matcher.rewind_to(len(yes))  # the step that accepted EOS was rolled back
    assert not matcher.is_terminated and matcher.num_accepted == len(yes)
    matcher.rewind_to(0)
    assert matcher.accept(tokenizer.encode("no", False)[0]) and matcher.num_accepted == 1


def test_choice_grammar_escapes_every_choice(compiler):
    spec = StructuredOutputsParams(choice=CHOICES)
    assert compiler.compile(spec) is not None  # xgrammar parsed the escaped literals
    assert choice_grammar(["a\"b"]) == 'root ::= "a\\"b"'


# ------------------------------------------------------------------ async engine
def test_async_engine_compiles_off_the_engine_thread(make_engine, smollm2, monkeypatch):
    engine = make_engine(**SMALL)
    compiler = engine.grammar_compiler
    compiling_threads = []
    real_compile = compiler._compile

    def recording_compile(key, timeout):
        compiling_threads.append(threading.current_thread().name)
        return real_compile(key, timeout)

    monkeypatch.setattr(compiler, "_compile", recording_compile)

    async def main() -> tuple[str, InvalidRequestError]:
        async_engine = AsyncLLMEngine(engine)
        try:
            assert async_engine.grammar_compiler is compiler
            stream = await async_engine.add_request(
                prompt_for(smollm2, "yes or no"), structured(choice=["yes", "no"]))
            text = [output async for output in stream][-1].outputs[0].text
            with pytest.raises(InvalidRequestError) as raised:
                await async_engine.add_request([1, 2], structured(regex="(XYZ"))
            return text, raised.value
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    text, error = asyncio.run(main())
    assert text in ("yes", "no")
    assert error.param == "structured_outputs.regex"
    assert len(compiling_threads) == 2 and "kvpool-engine" not in compiling_threads
