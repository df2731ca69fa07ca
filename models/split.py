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


class AuxLossWeight:
    """d(loss)/d(an auxiliary loss's sum over tokens): the loss scale over the global batch's tokens, set by
    whoever runs the forward (``parallel.pipeline``); 0 leaves auxiliary losses out of backward."""

    def __init__(self) -> None:
        self.value = 0.0


class Split:
    """The tp group, sequence parallelism, the per-rank random stream, the groups of tp ranks that share a
    replicated k/v head (grouped-query attention with kv_heads < tp), whether blocks run their microbatch
    as two halves that hide each other's tp collectives (``parallel.tp_overlap``), the expert-parallel group,
    and the weight of auxiliary losses in backward."""

    def __init__(self, tp: Optional[Comm], sequence_parallel: bool, rng: TPRandom, attention_impl: str = "torch",
                 kv_replicas: Optional[Comm] = None, overlap: bool = False, ep: Optional[Comm] = None):
        self.tp = tp
        self.ep = ep if ep is not None else Comm(None, "ep")  # the ranks a mixture of experts' experts split over
        self.aux_weight = AuxLossWeight()
        self.attention_impl = attention_impl
        self.rank, self.size = tp_rank_and_size(tp)
        self.sp = sequence_parallel and self.size > 1
        self.overlap = overlap and self.size > 1
        self.rng = rng
        self.kv_replicas = kv_replicas
