"""Blocks a beam search holds: copy-on-write forks in the block pool vs one copy per beam.

    python -m benchmarks.beam_memory [--widths 2 4 8] [--max-tokens 64] [--block-size 16]

Runs one beam search per width on the default model (SmolLM2-135M, greedy, EOS ignored so
every beam runs `--max-tokens`) over a ~250-token prompt, stepping the engine by hand. After
every step it counts the distinct device blocks the live beams' tables hold (what the pool
spends: shared prompt and shared history once, each beam's own tail) and the blocks one
private copy per beam would hold (the sum of the tables' lengths: what a copy-per-beam
engine allocates), over the steps where two or more beams live. Prints one JSON line per
width: the peak and mean of both, the peak ratio, and how many sequences the search made
(one per fork; pruned ones freed their blocks at once).
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvpool import LLM
from kvpool.bench.heldout_text import TEXT
from kvpool.sampling_params import BeamSearchParams


def measure(llm: LLM, prompt: str, width: int, max_tokens: int) -> dict[str, float]:
    engine = llm.engine
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    request = engine.add_request(prompt, params.sampling_params())
    shared, copies = [], []
    while engine.has_unfinished_requests():
        engine.step()
        live = [seq for seq in request.sequences if not seq.is_finished]
        if len(live) < 2:
            continue
        shared.append(len({b for seq in live for b in seq.block_table.live_block_ids}))
        copies.append(sum(seq.block_table.num_blocks for seq in live))
    return {
        "width": width, "prompt_tokens": len(request.prompt_token_ids),
        "max_tokens": max_tokens,
        "peak_blocks_forked": max(shared), "peak_blocks_copy_per_beam": max(copies),
        "peak_ratio": round(max(copies) / max(shared), 2),
        "mean_blocks_forked": round(statistics.fmean(shared), 1),
        "mean_blocks_copy_per_beam": round(statistics.fmean(copies), 1),
        "sequences_made": len(request.sequences),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    llm = LLM(block_size=args.block_size, enable_warmup=False, enable_prefix_caching=False)
    prompt = " ".join(TEXT.split()[:200])
    for width in args.widths:
        print(json.dumps(measure(llm, prompt, width, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
