"""Beam search inside the engine, on copy-on-write forks of one sequence (the PagedAttention
paper's own example): `params` (vLLM's `BeamSearchParams` and outputs), `group` (a request's
beams and how one round expands them)."""

from kvpool.engine.beams.group import BeamGroup, FinishedBeam
from kvpool.engine.beams.params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence

__all__ = ["BeamGroup", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "FinishedBeam"]
