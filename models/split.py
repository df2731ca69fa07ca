"""How one pipeline stage is split: the parallel state its parts are built with.

The attention, MLP and norm constructors of every architecture take this one object, so a block's parts agree
on the tensor-parallel group, sequence parallelism, the random stream and the Domino overlap
(``parallel.tp_overlap``) without each reading them from the stage.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from megazero.kernels.attend import attention
from megazero.parallel.comm import Comm
from megazero.parallel.context import context_attention
from megazero.parallel.sequence import SequenceInfo
from megazero.parallel.tensor import tp_rank_and_size
from megazero.parallel.tp_random import TPRandom
from megazero.parallel.ulysses import ulysses_attention


class AuxLossWeight:
    """d(loss)/d(an auxiliary loss's sum over tokens): the loss scale over the global batch's tokens, set by
    whoever runs the forward (``parallel.pipeline``); 0 leaves auxiliary losses out of backward."""

    def __init__(self) -> None:
        self.value = 0.0


class Split:
    """The tp group, sequence parallelism, the per-rank random stream, the groups of tp ranks that share a
    replicated k/v head (grouped-query attention with kv_heads < tp), whether blocks run their microbatch
    as two halves that hide each other's tp collectives (``parallel.tp_overlap``), the expert-parallel group,
    the context-parallel group and its mode, and the weight of auxiliary losses in backward."""

    def __init__(self, tp: Optional[Comm], sequence_parallel: bool, rng: TPRandom, attention_impl: str = "torch",
                 kv_replicas: Optional[Comm] = None, overlap: bool = False, ep: Optional[Comm] = None,
                 cp: Optional[Comm] = None, cp_mode: str = "ring", norm_impl: str = "torch"):
        self.tp = tp
        self.cp = cp if cp is not None else Comm(None, "cp")  # the ranks one sample's sequence is split over
        assert cp_mode in ("ring", "all_to_all"), cp_mode
        self.cp_mode = cp_mode
        self.ep = ep if ep is not None else Comm(None, "ep")  # the ranks a mixture of experts' experts split over
        self.aux_weight = AuxLossWeight()
        self.attention_impl = attention_impl
        self.norm_impl = norm_impl  # kernels.norm, resolved: torch | triton
        self.rank, self.size = tp_rank_and_size(tp)
        self.sp = sequence_parallel and self.size > 1
        self.overlap = overlap and self.size > 1
        self.rng = rng
        self.kv_replicas = kv_replicas

    def attend(self, q: Tensor, k: Tensor, v: Tensor, info: Optional[SequenceInfo] = None) -> Tensor:
        """Causal attention of this rank's queries over the whole sequence: ``kernels.attention`` at cp 1, else
        ring attention (``parallel.context``) or Ulysses (``parallel.ulysses``) over the cp group."""
        docs = None if info is None else info.documents
        masked = {} if docs is None else {"documents": docs}
        if self.cp.size == 1:
            return attention(q, k, v, causal=True, impl=self.attention_impl, **masked)
        if self.cp_mode == "ring":
            return context_attention(q, k, v, self.cp, self.attention_impl, docs,
                                     None if docs is None else info.host_documents)
        return ulysses_attention(q, k, v, self.cp, self.attention_impl, **masked)
