"""Speculative decoding on the bundled 4-bit model: greedy tokens identical to decoding without
it, although drafts change how many rows each step's matmuls have.

The quantized matmul picks its kernel by the number of rows (`kvpool.kernels.quant_matmul`);
decode rows always take the integer one (`kvpool.kernels.decode_rows`), so a decode token's
logits never depend on its step. The switch is lowered here so that small test batches cross
it: four requests decode 4 rows a step without drafts (the integer kernel, below 8) and up to
24 with them (all rows would dequantize but for the split), as 32 requests do at the default.
"""

from __future__ import annotations

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts, load_engine_model
from kvpool.kernels import quant_matmul
from tests.engine.conftest import PROMPTS, run_all, token_ids
from tests.engine.speculative.test_speculative_engine import GROUNDED, NGRAM


@pytest.fixture(scope="module")
def gguf_model():
    return load_engine_model(EngineConfig(dtype="bfloat16"))


def test_greedy_tokens_match_on_quantized_weights(gguf_model, monkeypatch):
    monkeypatch.setattr(quant_matmul, "DEQUANTIZED_FROM", 8)
    # Four requests, admitted together: their prompt rows share one step in both runs (the
    # dequantizing kernel's float GEMM is not row-invariant, so prompts admitted in other
    # groupings could round otherwise).
    prompts = [*GROUNDED, PROMPTS[5]]
    params = SamplingParams(temperature=0, max_tokens=32)
    outputs = []
    for speculative in (None, NGRAM):
        # A fixed thread count: by default the threads follow the machine's load, and the
        # prompt rows' float GEMM may split its sums otherwise on another count.
        config = EngineConfig(dtype="bfloat16", speculative_config=speculative,
                              max_num_seqs=4, cpu_threads=2)
        engine = LLMEngine(config, build_engine_parts(config, gguf_model))
        outputs.append(token_ids(run_all(engine, prompts, params)))
        if speculative:
            assert engine.stats().spec_decode.num_accepted_tokens > 0
        engine.close()
    assert outputs[1] == outputs[0]
