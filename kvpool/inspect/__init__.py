"""Looking at the KV pool: what a snapshot or a recorded trace says, for operators.

    explain.py    why a prompt would hit or miss the prefix cache, block by block
    summary.py    a snapshot as a readable report (holders, shared prefixes, fragmentation)
    pool_map.py   a snapshot as a PNG grid of blocks coloured by state
    timeline.py   a recorded KV trace as a PNG and a self-contained HTML timeline
    palette.py    the block-state colours every view uses (the dashboard's too)
    client.py     fetching a snapshot or an explanation from a running server

The data these read is the engine's: `kvpool.formats.kv_snapshot` (snapshots) and
`kvpool.formats.kv_trace` (traces). The command is `kvpool inspect` (`kvpool.cli.inspect`).
"""
