"""The output processor without a model: stop rules, held-back text, and output kinds.

A one-character-per-token tokenizer makes the text of every token obvious.
"""

from __future__ import annotations

import pytest

from kvpool.engine.requests.output_processor import OutputProcessor
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpool.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockTable
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import NO_SALT

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
EOS = 99


PIECES = {27: "lo wor"}  # a token of several characters


class LetterTokenizer:
    """Token i is the i-th letter of ALPHABET (or a piece of PIECES)."""

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return "".join(PIECES.get(t) or ALPHABET[t] for t in token_ids if t != EOS)


def ids(text: str) -> list[int]:
    return [ALPHABET.index(ch) for ch in text]


def make_sequence(params: SamplingParams) -> Sequence:
    request = Request("r", None, [0], params, 0.0, NO_SALT, (None,) * params.n)
    seq = Sequence(0, request, 0, BlockTable(BlockPool(4, KVLayout(4))), [])
    request.sequences.append(seq)
    return seq


def feed(processor: OutputProcessor, seq: Sequence, text: str):
    """Append `text` token by token until a stop; returns the stop decision (or None)."""
    for token_id in ids(text):
        seq.output_token_ids.append(token_id)
        decision = processor.on_token(seq, token_id, None)
        if decision is not None:
            seq.status, (seq.finish_reason, seq.stop_reason) = SequenceStatus.FINISHED, decision
            return decision
    return None


@pytest.fixture
def processor() -> OutputProcessor:
    return OutputProcessor(LetterTokenizer(), frozenset({EOS}), max_model_len=1000)


@pytest.mark.parametrize("stops", [["a"], ["a", "ccac"]])
def test_with_min_tokens_a_stop_string_fires_the_same_whatever_the_other_stops(processor, stops):
    # "a" is completed by token 2, before min_tokens allows a stop: it must not fire later,
    # when a longer stop string widens the search window (it used to, with ["a", "ccac"]).
    seq = make_sequence(SamplingParams(stop=stops, min_tokens=3, max_tokens=10))
    assert feed(processor, seq, "bab") is None
    assert feed(processor, seq, "xa") == (FinishReason.STOP, "a")
    assert processor.make_output(seq.request).outputs[0].text == "babx"


def test_a_stop_string_across_tokens_cuts_the_text_before_it(processor):
    seq = make_sequence(SamplingParams(stop=["lo w", "zz"], max_tokens=20))
    assert feed(processor, seq, "hello world") == (FinishReason.STOP, "lo w")
    output = processor.make_output(seq.request)
    assert output.finished and output.outputs[0].text == "hel"


def test_stop_tokens_come_first_and_max_tokens_last(processor):
    seq = make_sequence(SamplingParams(stop_token_ids=[ids("c")[0]], max_tokens=3))
    assert feed(processor, seq, "abc") == (FinishReason.STOP, ids("c")[0])
    assert processor.make_output(seq.request).outputs[0].text == "ab"  # the stop token's not
    seq = make_sequence(SamplingParams(max_tokens=3))
    assert feed(processor, seq, "abcd") == (FinishReason.LENGTH, None)


def test_delta_outputs_hold_back_a_possible_stop_string_and_never_take_text_back(processor):
    params = SamplingParams(stop=["xyz"], max_tokens=20, output_kind=RequestOutputKind.DELTA)
    seq = make_sequence(params)
    sent = []
    for token_text in "abxy":
        feed(processor, seq, token_text)
        sent.append(processor.make_output(seq.request).outputs[0].text)
    # The last len("xyz") - 1 = 2 characters are always held back: they may start "xyz".
    assert sent == ["", "", "a", "b"]
    feed(processor, seq, "q")
    delta = processor.make_output(seq.request).outputs[0]
    assert delta.text == "x" and delta.token_ids == ids("q")
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.LENGTH
    last = processor.make_output(seq.request)
    assert last.finished and last.outputs[0].text == "yq" and last.outputs[0].token_ids == []
    assert "".join([*sent, delta.text, last.outputs[0].text]) == "abxyq"


def test_final_only_hands_out_one_output_and_forgets_the_request(processor):
    seq = make_sequence(SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    feed(processor, seq, "abc")
    assert processor.make_output(seq.request) is None
    assert feed(processor, seq, "d") == (FinishReason.LENGTH, None)
    output = processor.make_output(seq.request)
    assert output.outputs[0].text == "abcd" and output.outputs[0].token_ids == ids("abcd")
    assert not processor._states, "a finished request's state is dropped"


def test_include_stop_str_keeps_the_stop_string_across_tokens(processor):
    seq = make_sequence(SamplingParams(stop=["lo w", "zz"], max_tokens=20,
                                       include_stop_str_in_output=True))
    assert feed(processor, seq, "hello world") == (FinishReason.STOP, "lo w")
    output = processor.make_output(seq.request).outputs[0]
    assert output.text == "hello w" and output.token_ids == ids("hello w")


@pytest.mark.parametrize(("include", "stop", "text"), [
    (False, "lo wor", "hel"),  # cut before the stop string that starts first
    (True, "o w", "hello w"),  # cut after the one that ends first, the rest of the token gone
])
def test_a_stop_string_inside_one_token(processor, include, stop, text):
    seq = make_sequence(SamplingParams(stop=["lo wor", "o w"], max_tokens=20,
                                       include_stop_str_in_output=include))
    assert feed(processor, seq, "hel") is None
    seq.output_token_ids.append(27)
    assert processor.on_token(seq, 27, None) == (FinishReason.STOP, stop)
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.STOP
    seq.stop_reason = stop
    assert processor.make_output(seq.request).outputs[0].text == text


def test_include_stop_str_streams_without_holding_back(processor):
    # Nothing handed out is ever taken back: the cut falls after a stop string that ends in
    # the newest text, so nothing needs holding back.
    params = SamplingParams(stop=["xyz"], max_tokens=20, output_kind=RequestOutputKind.DELTA,
                            include_stop_str_in_output=True)
    seq = make_sequence(params)
    sent = []
    for token_text in "abxy":
        feed(processor, seq, token_text)
        sent.append(processor.make_output(seq.request).outputs[0].text)
    assert sent == ["a", "b", "x", "y"]
    assert feed(processor, seq, "zq") == (FinishReason.STOP, "xyz")
    last = processor.make_output(seq.request)
    assert last.finished and last.outputs[0].text == "z"
    assert "".join([*sent, last.outputs[0].text]) == "abxyz"
