"""How one pipeline stage is split: the parallel state its parts are built with.

The attention, MLP and norm constructors of every architecture take this one object, so a block's parts agree
on the tensor-parallel group, sequence parallelism, the random stream and the Domino overlap
(``parallel.tp_overlap``) without each reading them from the stage.
"""
from __future__ import annotations

from typing import Optional

from parallel.comm import Comm
from parallel.tensor import tp_rank_and_size
from parallel.tp_random import TPRandom


class Split:
    """The tp group, sequence parallelism, the per-rank random stream, the groups of tp ranks that share a
    replicated k/v head (grouped-query attention with kv_heads < tp), and whether blocks run their microbatch
    as two halves that hide each other's tp collectives (``parallel.tp_overlap``)."""

    def __init__(self, tp: Optional[Comm], sequence_parallel: bool, rng: TPRandom, attention_impl: str = "torch",
                 kv_replicas: Optional[Comm] = None, overlap: bool = False):
        self.tp = tp
        self.attention_impl = attention_impl
        self.rank, self.size = tp_rank_and_size(tp)
        self.sp = sequence_parallel and self.size > 1
        self.overlap = overlap and self.size > 1
        self.rng = rng
        self.kv_replicas = kv_replicas
