"""Tensor parallelism in the engine: one engine, its model split over `tensor_parallel_size`
ranks (`kvpool.model.parallel` says which slice of each weight a rank holds).

    rank 0 (the engine's process)               ranks 1..tp-1 (workers)
    scheduler, block pool, prefix cache         model shard, KV cache (same block ids)
    TensorParallelRunner.run_step ── step ──▶   worker loop: copy blocks, run the shard
    shard forward  ◀──── all-reduce / gather ──▶ shard forward
    logits → sampler

Files: `group.py` (rendezvous, the two process groups), `messages.py` (what rank 0 sends),
`worker.py` (a worker's life), `executor.py` (rank 0's `WorkerGroup`: start, faults, stop),
`runner.py` (rank 0's runner).

Two launches:

- spawned (the default): `LLM(tensor_parallel_size=2)` or `kvpool serve -tp 2` starts tp-1
  worker processes itself (spawn), which rendezvous on a free loopback port. A script doing
  this must guard its entry point (`if __name__ == "__main__":`), as any spawn user must.
- torchrun: `torchrun --nproc-per-node 2 -m kvpool serve -tp 2`; with RANK and WORLD_SIZE in
  the environment nothing is spawned: every rank runs the same command, rank 0 runs it as
  usual and ranks > 0 serve as workers (`kvpool.cli.main`). Across nodes, torchrun's usual
  flags: `torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST
  --master-port 29500 -m kvpool serve -tp 2` (the server listens on rank 0's node).

Collectives are gloo on the CPU and NCCL on CUDA (one GPU per rank: LOCAL_RANK, else the
rank). The NCCL path is written but untested here (no GPUs in CI). Not yet supported with
tp > 1: host and disk KV tiers (`swap_space`, `kv_disk_cache`), the elastic pool, devices
other than CPU and CUDA, and a model loaded beforehand (each rank loads its own shard).
A dead or hung worker fails the step within `distributed_timeout_seconds`, and the engine
then reports itself unhealthy (`LLMEngine.unhealthy_reason`).
"""

from kvpool.engine.parallel.executor import WorkerError, WorkerGroup
from kvpool.engine.parallel.runner import TensorParallelRunner

__all__ = ["TensorParallelRunner", "WorkerError", "WorkerGroup"]
