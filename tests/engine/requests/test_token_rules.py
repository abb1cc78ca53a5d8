"""A request's token rules (logit bias, allowed ids, bad words), built once at admission.

The masks and biases they give equal, bit for bit, those of the per-step walk they replaced
(kept here as the reference), and greedy choices agree token for token; bad words are
tokenized once (ahead, by `prepare`, when the async engine adds the request); and on a real
engine a step never reads the request's dict or lists: they may be swapped for objects that
raise on any read without changing a single output token.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvpool import LLM
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling.constraints import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_token_bans,
)
from kvpool.engine.sampling.rows import SamplingRow
from kvpool.engine.sampling.sampler import choose_token_ids
from kvpool.engine.sampling.token_rules import (
    MAX_BAD_WORD_TOKENS,
    NO_TOKEN_RULES,
    TokenRuleBuilder,
    TokenRules,
)
from kvpool.engine.sampling_params import SamplingParams
from tests.model.test_loaders import save_tiny_hf_model

VOCAB = 97
CPU = torch.device("cpu")


# ------------------------------------------------ the per-step walk the rules replaced
def reference_rules(logits, rows, words_per_row) -> torch.Tensor:
    """The sampler's steps 2-3 as they were: Python lists rebuilt from every row's params
    (allowed ids, then bans, then bias, each by one index op)."""
    logits = logits.clone()
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.params.allowed_token_ids or ()]
    if pairs:
        row_ids, token_ids = torch.tensor(pairs).unbind(dim=1)
        is_limited = torch.zeros(logits.shape[0], dtype=torch.bool)
        is_limited[row_ids] = True
        allowed = torch.zeros(logits.shape, dtype=torch.bool)
        allowed[row_ids, token_ids] = True
        logits.masked_fill_(is_limited[:, None] & ~allowed, float("-inf"))
    bans = [(i, t) for i, r in enumerate(rows)
            for t in (*r.banned_token_ids, *reference_bans(words_per_row[i], r.output_token_ids))]
    if bans:
        row_ids, token_ids = torch.tensor(bans).unbind(dim=1)
        logits[row_ids, token_ids] = float("-inf")
    entries = [(i, t, b) for i, r in enumerate(rows)
               for t, b in (r.params.logit_bias or {}).items()]
    if entries:
        row_ids, token_ids, biases = zip(*entries, strict=True)
        logits.index_put_((torch.tensor(row_ids), torch.tensor(token_ids)),
                          torch.tensor(biases, dtype=torch.float32), accumulate=True)
    return logits


def reference_bans(words, output) -> list[int]:
    banned = []
    for word in words:
        num_prefix = len(word) - 1
        if num_prefix == 0 or (len(output) >= num_prefix
                               and tuple(output[len(output) - num_prefix:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def random_row(rng: random.Random) -> tuple[SamplingRow, list[tuple[int, ...]]]:
    """A greedy row with a random mix of rules (sometimes none), and its bad words."""
    bias = allowed = None
    if rng.random() < 0.6:
        keys = rng.sample(range(VOCAB), rng.randint(1, VOCAB))
        bias = {key: rng.choice([-100.0, 100.0, rng.uniform(-5, 5)]) for key in keys}
    if rng.random() < 0.5:
        allowed = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]  # repeats too
    words = [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
             for _ in range(rng.randint(0, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
    if words and output and rng.random() < 0.7:  # end the output with some word's prefix
        word = rng.choice(words)
        output += list(word[:-1])
    params = SamplingParams(temperature=0, logit_bias=bias, allowed_token_ids=allowed)
    rules = TokenRules.from_token_ids(bias, allowed, words, CPU)
    banned = tuple(rng.sample(range(VOCAB), rng.randint(0, 2)))  # min_tokens' stop tokens
    return SamplingRow(params, [1, 2], output, None, banned, rules=rules), words


def new_rules(logits, rows) -> torch.Tensor:
    logits = logits.clone()
    apply_allowed_token_ids(logits, rows)
    apply_token_bans(logits, rows)
    apply_logit_bias(logits, rows)
    return logits


@pytest.mark.parametrize("seed", range(20))
def test_masks_and_biases_equal_the_per_step_walk_bit_for_bit(seed):
    rng = random.Random(seed)
    made = [random_row(rng) for _ in range(rng.randint(1, 8))]
    rows, words = [row for row, _ in made], [words for _, words in made]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = reference_rules(logits, rows, words)
    assert torch.equal(new_rules(logits, rows), expected)
    # Greedy choices, token for token (the whole choose path: copy, masks, bias, argmax).
    reference_ids = expected.nan_to_num(nan=-torch.inf, posinf=-torch.inf).argmax(dim=-1)
    assert choose_token_ids(logits, rows, generator=None).tolist() == reference_ids.tolist()


def test_bad_word_bans_equal_the_walk_over_every_word():
    rng = random.Random(7)
    words = [tuple(rng.randrange(6) for _ in range(rng.randint(1, 4))) for _ in range(40)]
    words = list(dict.fromkeys(words))  # intake drops repeats
    rules = TokenRules.from_token_ids(None, None, words, CPU)
    one_token = sorted(word[0] for word in words if len(word) == 1)
    assert sorted(rules.banned_token_ids.tolist()) == one_token
    for _ in range(300):
        output = [rng.randrange(6) for _ in range(rng.randint(0, 5))]
        longer = [word for word in words if len(word) > 1]
        assert sorted(rules.bad_word_bans(output)) == sorted(reference_bans(longer, output))


def test_no_rules_is_empty_and_leaves_the_logits_alone():
    assert TokenRules.from_token_ids(None, None, [], CPU) is NO_TOKEN_RULES
    assert NO_TOKEN_RULES.is_empty and NO_TOKEN_RULES.bad_word_bans([1, 2]) == []
    assert not TokenRules.from_token_ids({3: 1.0}, None, [], CPU).is_empty
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], None)]
    logits = torch.randn(1, VOCAB)
    assert torch.equal(new_rules(logits, rows), logits)


# ------------------------------------------------------------------ building, bad words
class CountingTokenizer:
    """Splits on characters (one token per character, its code point), counting encodes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(text)
        return [ord(char) for char in text]


def test_bad_words_are_tokenized_once_by_prepare_and_build_finds_them():
    tokenizer = CountingTokenizer()
    builder = TokenRuleBuilder(tokenizer, vocab_size=128, device=CPU)
    params = SamplingParams(bad_words=["  ab", "ab", "c", "\u00e9t\u00e9"])
    builder.prepare(params)  # the async engine's worker thread
    assert tokenizer.calls == ["ab", " ab", "ab", " ab", "c", " c", "\u00e9t\u00e9",
                               " \u00e9t\u00e9"]
    rules = builder.build(params)  # the engine thread: no tokenizing left
    assert len(tokenizer.calls) == 8
    # Stripped, both forms, repeats dropped; ids past the vocabulary (é) never generated.
    assert rules.bad_words_token_ids == ((97, 98), (32, 97, 98), (99,), (32, 99))
    assert rules.banned_token_ids.tolist() == [99]
    assert rules.bad_word_bans([5, 32, 97]) == [98, 98]  # both forms end there


def test_bad_words_past_the_token_cap_or_without_a_tokenizer_are_refused():
    builder = TokenRuleBuilder(CountingTokenizer(), vocab_size=128, device=CPU)
    word = "x" * (MAX_BAD_WORD_TOKENS // 2)  # alone and after a space: one token too many
    with pytest.raises(InvalidRequestError, match="at most 1024 tokens") as raised:
        builder.prepare(SamplingParams(bad_words=[word]))
    assert raised.value.param == "bad_words"
    builder.build(SamplingParams(bad_words=[word[1:]]))  # exactly at the cap
    with pytest.raises(InvalidRequestError, match="no tokenizer") as raised:
        TokenRuleBuilder(None, 128, CPU).build(SamplingParams(bad_words=["x"]))
    assert raised.value.param == "bad_words"


# ------------------------------------------------------------------ on a real engine
class Tripwire(dict):
    """A dict or list stand-in that fails any read of its contents."""

    def _fail(self, *args, **kwargs):
        raise AssertionError("a step read the request's own dict or list")

    __iter__ = __len__ = __bool__ = __contains__ = __getitem__ = _fail
    keys = values = items = get = _fail


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(directory)
    return LLM(str(directory), dtype="float32", kv_cache_memory=4 << 20, enable_warmup=False)


RULED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                       logit_bias={token_id: (token_id % 7) - 3.0 for token_id in range(200)},
                       allowed_token_ids=list(range(0, 256, 3)), bad_words=["BQ", "c"])


def run(engine, params_list, trip=False) -> list[list[int]]:
    requests = [engine.add_request([5, 6, 7, 8 + index], params)
                for index, params in enumerate(params_list)]
    if trip:  # the rules are built: nothing after admission may read these again
        for request in requests:
            request.params.logit_bias = Tripwire()
            request.params.allowed_token_ids = Tripwire()
            request.params.bad_words = Tripwire()
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    return [finished[request.request_id] for request in requests]


def test_a_step_never_walks_the_requests_lists_and_rules_are_built_once(tiny_llm):
    engine = tiny_llm.engine
    builder = engine.intake.token_rules
    tokenizer = CountingTokenizer()
    builder.tokenizer = tokenizer  # the tiny model has none; bad words need one
    builds = []
    original_build = builder.build
    builder.build = lambda params: builds.append(params) or original_build(params)
    try:
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        control = run(engine, [RULED, plain, RULED])
        num_encodes = len(tokenizer.calls)
        assert run(engine, [RULED, plain, RULED], trip=True) == control
    finally:
        del builder.build
        builder.tokenizer = None
    assert len(builds) == 6  # once per request, at admission, for 12 steps each
    assert num_encodes == 4 and len(tokenizer.calls) == 4  # the second run hit the cache
    allowed = set(RULED.allowed_token_ids)
    for token_ids in (control[0], control[2]):
        assert set(token_ids) <= allowed and 99 not in token_ids  # "c" is token 99
        assert (66, 81) not in set(itertools.pairwise(token_ids))  # nor "BQ"
    assert control[0] != control[1]
