"""After the start-up warm-up, serving compiles no new Triton kernel variant.

A variant compiled mid-request stalls every request in the step for the compile (seconds on a
GPU). The warm-up's first attention call launches every variant a step can use
(`TritonAttentionBackend`), and the kernels do not specialise on what varies between steps;
this test serves a mixed workload after the warm-up and checks that each launch's variant key
(`tests/attention/kernel_variants.py`, computed as Triton does) was already seen. It runs the
interpreter on the CPU and the compiled kernels on CUDA alike.
"""

from __future__ import annotations

from tests.attention.triton_interpreter import (
    DEVICE,
    IS_INTERPRETED,
    import_kernels_for_the_interpreter,
)

if IS_INTERPRETED:
    import_kernels_for_the_interpreter()


def kernels() -> list[tuple]:
    """(module, kernel name) of every kernel the backend launches: the modules imported now
    (another test module may have imported them again since this one was collected)."""
    from kvpool.attention import triton_decode, triton_kv, triton_prefill

    return [(triton_decode, "_decode_kernel"), (triton_decode, "_reduce_kernel"),
            (triton_prefill, "_prefill_kernel"), (triton_kv, "write_kv_kernel")]


def serve_mixed_steps(llm) -> None:
    """Decodes next to chunked prefills, 1..4 decodes a step, growing block tables, and one
    long context that the decode kernel splits."""
    from kvpool import SamplingParams

    prompts = [[(7 * i) % 500 + 3 for i in range(length)] for length in (600, 5, 33, 17, 90)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 6, 4, 5)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_serving_after_the_warm_up_compiles_no_new_variant(monkeypatch):
    from kvpool import LLM
    from kvpool.attention import triton_decode
    from tests.attention.kernel_variants import VariantRecorder  # after the interpreter switch

    # Plan splits as on an H200 (132 multiprocessors): a 600-token context splits in two.
    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)
    recorder = VariantRecorder(monkeypatch, kernels())
    llm = LLM(model="tiny", load_format="dummy", dtype="float32", device=DEVICE,
              attention_backend="triton", kv_cache_memory=1 << 26, max_num_batched_tokens=64,
              kv_cache_dtype="int8")
    warmed = recorder.snapshot()
    recorder.clear()
    serve_mixed_steps(llm)
    served = recorder.snapshot()
    assert served["_reduce_kernel"], "the workload never split a decode"
    for name, keys in served.items():
        assert keys <= warmed[name], f"{name} compiled {len(keys - warmed[name])} new variant(s)"


def test_a_sliding_window_compiles_no_new_variant(monkeypatch):
    # The window is a runtime scalar of both kernels: every layer's window (Gemma 3 alternates
    # sliding and global layers) runs on the variants the first, windowless, call compiled.

    from kvpool.attention import triton_backend, triton_decode
    from tests.attention.kernel_variants import VariantRecorder

    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)  # 600 tokens: 2 splits
    recorder = VariantRecorder(monkeypatch, kernels())
    query, key, value, cache, metadata = mixed_batch([600, 9, 20, 45], [1, 1, 20, 5])
    backend = triton_backend.TritonAttentionBackend()
    backend.forward(query, key, value, cache, metadata, 0.25)
    warmed = recorder.snapshot()
    recorder.clear()
    for sliding_window in (1, 7, 16, 512, 4096):
        backend.forward(query, key, value, cache, metadata, 0.25, sliding_window=sliding_window)
    for name, keys in recorder.snapshot().items():
        assert keys <= warmed[name], f"{name} compiled {len(keys - warmed[name])} new variant(s)"
    assert recorder.keys["_reduce_kernel"], "no windowed decode split"


def test_a_soft_capped_model_compiles_its_variants_at_its_first_call(monkeypatch):
    # Whether scores are capped is a constexpr (a property of the model): the first capped call
    # (the warm-up) compiles the capped variants, and every later capped call, whatever its
    # window and cap, runs on them.

    from kvpool.attention import triton_backend, triton_decode
    from tests.attention.kernel_variants import VariantRecorder

    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)  # 600 tokens: 2 splits
    recorder = VariantRecorder(monkeypatch, kernels())
    query, key, value, cache, metadata = mixed_batch([600, 9, 20], [1, 1, 20])
    backend = triton_backend.TritonAttentionBackend()
    backend.forward(query, key, value, cache, metadata, 0.25, logit_softcap=50.0)
    warmed = recorder.snapshot()
    recorder.clear()
    for sliding_window, logit_softcap in ((None, 30.0), (7, 50.0), (4096, 1.0)):
        backend.forward(query, key, value, cache, metadata, 0.25, sliding_window=sliding_window,
                        logit_softcap=logit_softcap)
    for name, keys in recorder.snapshot().items():
        assert keys <= warmed[name], f"{name} compiled {len(keys - warmed[name])} new variant(s)"
    assert recorder.keys["_reduce_kernel"], "no capped decode split"


def mixed_batch(seq_lens: list[int], query_lens: list[int]) -> tuple:
    """(query, key, value, cache, metadata) of one step over sequences of `seq_lens` tokens,
    the last `query_lens` of each new (1: a decode), in 16-token blocks, 6 query heads on 2 KV
    heads of 16 dimensions."""
    import torch

    from kvpool.attention.metadata import AttentionMetadata
    from kvpool.memory.kv_layout import KVLayout

    block_size, tables, first = 16, [], 1  # block 0 is the null block
    for seq_len in seq_lens:
        tables.append(list(range(first, first + -(-seq_len // block_size))))
        first += len(tables[-1])
    slots = [table[p // block_size] * block_size + p % block_size
             for table, seq_len, new in zip(tables, seq_lens, query_lens, strict=True)
             for p in range(seq_len - new, seq_len)]
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, slots, KVLayout(block_size),
                                       device=DEVICE)
    cache = torch.randn(first, 2, block_size, 2, 16, device=DEVICE)
    query = torch.randn(len(slots), 6, 16, device=DEVICE)
    key, value = torch.randn(2, len(slots), 2, 16, device=DEVICE)
    return query, key, value, cache, metadata
