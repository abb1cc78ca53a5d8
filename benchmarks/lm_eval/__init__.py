"""lm-evaluation-harness tasks for kvpool (docs/lm_eval.md): their committed data, the script
that makes it, and a sample-by-sample comparison of two runs."""
