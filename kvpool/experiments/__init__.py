"""The seed's four memory experiments, shipped with the package so `kvpool demo --experiments`
works from any install (a wheel included).

Each module runs one experiment on the pure-Python memory core: `main()` prints what happens,
asserts the claim it demonstrates and returns its `BlockPool` so a caller can report on it.
Each also runs on its own: `python -m kvpool.experiments.refcount`. `SEED_EXPERIMENTS` names the
modules in the seed's order; importing this package imports none of them.
"""

SEED_EXPERIMENTS = ("refcount", "block_table", "fragmentation", "prefix_sharing")
