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
