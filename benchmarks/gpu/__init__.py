"""The GPU check's Python steps, one module each (`scripts/gpu_check.sh` runs every step in
its own process through `python -m benchmarks.gpu_check STEP`; docs/gpu.md says what each
number means): `env`, `e2e`, `attention`, `engine`, `hf`, `summary`. `results` owns the one
results file they all append to; `step` is what each step is handed.
"""
