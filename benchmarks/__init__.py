"""Development benchmarks: tools for kvpool's developers, not user commands, and not shipped in
the wheel (pyproject's package list holds `kvpool*` only).

Each module runs from the repository root as `python -m benchmarks.<name>`:
`gpu_check` (the steps `scripts/gpu_check.sh` runs on a GPU machine, one module each in
`gpu/`), `throughput_baselines` (`kvpool bench throughput` side by side with vLLM and
transformers). The rest are their parts: `decode_attention` (the Triton decode kernel against
SDPA), `generation` (kvpool and transformers `generate` end to end, same dummy weights),
`device_timing` (timing, and the machine's bandwidth and matmul ceilings), `vllm_baseline`,
`vllm_runner` (run inside vLLM's own venv), `hf_export`, `transformers_baseline`.

Benchmarks import kvpool; nothing in kvpool imports from here.
"""
