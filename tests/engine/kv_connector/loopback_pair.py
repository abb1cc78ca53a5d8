"""A prefill and a decode engine in one process handing a prompt's KV over by
`LoopbackConnector`: their `kv_transfer_config`s and the two requests of one handover.

    handover = prefill(producer, PROMPT)          # the producer leases the prompt's blocks
    decode(consumer, PROMPT, handover)            # the consumer loads them, then releases
    producer.resize_kv_pool()                     # the producer's tick ends the lease

An engine ticks its connector at every step (and a server's idle loop now and then); a test of
bare engines ticks the producer itself once the consumer is done, so the lease ends and the
leak check at teardown finds no used block.
"""

from __future__ import annotations

from typing import Any

from kvpool.engine.engine import LLMEngine
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import run_all

PRODUCER = {"kv_connector": "LoopbackConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "LoopbackConnector", "kv_role": "kv_consumer"}
# 61 tokens: three full blocks of 16 before the last token are handed over.
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
          "steps ") * 4
NUM_HANDED_OVER = 3


def prefill(producer: LLMEngine, prompt: str = PROMPT) -> dict[str, Any]:
    """Run `prompt` on the producer for a remote decode; the handover its output carries."""
    params = SamplingParams(temperature=0, max_tokens=1,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    (output,) = run_all(producer, [prompt], params)
    assert output.kv_transfer_params is not None, "the producer handed nothing over"
    return output.kv_transfer_params


def decode(consumer: LLMEngine, handover: dict[str, Any], prompt: str = PROMPT,
           max_tokens: int = 8) -> RequestOutput:
    """Run `prompt` on the consumer from `handover` (greedy, `max_tokens` tokens)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": handover})
    (output,) = run_all(consumer, [prompt], params)
    return output
