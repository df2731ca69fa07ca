"""The topology grid: which rank does what along (pp, dp, tp), with expert parallelism carved out of dp.

Rank order is Megatron's default, tp fastest: TP groups stay inside a node
(NVLink), DP next, PP across nodes —
``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``.
Expert parallelism (``ep``) splits dp, fastest within it, as Megatron's expert-data-parallel does:
``dp_rank = edp_rank * ep + ep_rank``. An expert lives on one rank of its ep group (the ep consecutive dp
ranks of one (pp, edp, tp) position) and is replicated over the edp = dp / ep ranks of its edp group.
The Grid is built over a torch DeviceMesh with dims ("pp", "dp", "tp") — ("pp", "edp", "ep", "tp") with
"dp" their flattening when ep > 1 — and is an object handed to whoever needs it, never a global.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from parallel.comm import Comm, CommCounter


def rank_to_coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    assert 0 <= rank < tp * pp * dp, (rank, tp, pp, dp)
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def coords_to_rank(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def group_ranks(dim: str, tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every group of the given dimension, as lists of global ranks (what the mesh builds)."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    assert dim in sizes, dim
    groups: dict[tuple, list[int]] = {}
    for r in range(tp * pp * dp):
        c = dict(zip(("pp", "dp", "tp"), rank_to_coords(r, tp, pp, dp)))
        key = tuple(v for k, v in c.items() if k != dim)
        groups.setdefault(key, []).append(r)
    return [sorted(g) for _, g in sorted(groups.items())]


def embedding_group_ranks(tp: int, pp: int, dp: int) -> list[list[int]]:
    """For each (dp, tp) position, the first- and last-stage ranks that both hold the tied embedding."""
    return [[coords_to_rank(0, d, t, tp, dp), coords_to_rank(pp - 1, d, t, tp, dp)]
            for d in range(dp) for t in range(tp)]


def new_embedding_group(tp: int, pp: int, dp: int, timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroup]:
    """Megatron's embedding group: sums the two copies' gradients so the tied weights stay equal.

    Collective: every rank creates every group, and keeps its own.
    """
    if pp == 1:
        return None
    mine = None
    for ranks in embedding_group_ranks(tp, pp, dp):
        group = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
    return mine


@dataclass
class Grid:
    """This rank's place in the (pp, dp, tp) grid and the process groups along each dimension.

    Groups are None when the run is a single process without a process group.
    """

    tp: int
    pp: int
    dp: int
    rank: int = 0
    ep: int = 1  # expert-parallel ranks, carved out of dp (dp_rank = edp_rank * ep + ep_rank)
    mesh: object = None
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    embed_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None  # the ranks that split one set of experts
    edp_group: Optional[dist.ProcessGroup] = None  # the ranks that hold copies of the same experts
    counter: CommCounter = field(default_factory=CommCounter)
    timeout: Optional[timedelta] = None  # every group's collective timeout (None: torch's default)
    replica_comms: dict = field(default_factory=dict)  # tp_replica_comm's groups, by size

    def __post_init__(self) -> None:
        self.tp_comm = Comm(self.tp_group, "tp", self.counter)
        self.dp_comm = Comm(self.dp_group, "dp", self.counter)
        self.pp_comm = Comm(self.pp_group, "pp", self.counter)
        self.embed_comm = Comm(self.embed_group, "embed", self.counter)
        assert self.ep >= 1 and self.dp % self.ep == 0, (self.dp, self.ep)
        if self.ep == 1:  # the experts' groups are the dense ones: the same communicators, counted as such
            self.ep_comm, self.edp_comm = Comm(None, "ep", self.counter), self.dp_comm
        else:
            self.ep_comm = Comm(self.ep_group, "ep", self.counter)
            self.edp_comm = Comm(self.edp_group, "edp", self.counter)

    @classmethod
    def single(cls) -> "Grid":
        return cls(tp=1, pp=1, dp=1, rank=0)

    @classmethod
    def build(cls, tp: int, pp: int, dp: int, device_type: str = "cpu", timeout: Optional[timedelta] = None,
              ep: int = 1) -> "Grid":
        """Build the DeviceMesh over the initialised default process group.

        ``timeout`` bounds the collectives of every group (launch.timeout_minutes): a group made without one
        gets torch's default (30 minutes on gloo, 10 on NCCL), not the world group's."""
        if not dist.is_initialized():
            assert tp * pp * dp == 1, "a multi-rank grid needs an initialised process group"
            return cls.single()
        world = dist.get_world_size()
        assert tp * pp * dp == world, f"tp*pp*dp={tp * pp * dp} != world size {world}"
        from torch.distributed.device_mesh import init_device_mesh

        assert dp % ep == 0, f"parallel.ep={ep} must divide dp={dp}"
        names = ("pp", "dp", "tp") if ep == 1 else ("pp", "edp", "ep", "tp")
        shape = (pp, dp, tp) if ep == 1 else (pp, dp // ep, ep, tp)
        override = None
        if timeout is not None:
            backend = "nccl" if device_type == "cuda" else "gloo"
            options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            override = {name: (backend, options) for name in names}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
        experts, dp_mesh = {}, mesh["dp"] if ep == 1 else None
        if ep > 1:
            dp_mesh = mesh["edp", "ep"]._flatten("dp", backend_override=override["edp"] if override else None)
            experts = dict(ep_group=mesh.get_group("ep"), edp_group=mesh.get_group("edp"))
        return cls(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), mesh=mesh, ep=ep,
                   tp_group=mesh.get_group("tp"), dp_group=dp_mesh.get_group(),
                   pp_group=mesh.get_group("pp"), embed_group=new_embedding_group(tp, pp, dp, timeout),
                   timeout=timeout, **experts)

    def tp_replica_comm(self, size: int) -> Comm:
        """This rank's group of ``size`` consecutive tp ranks: the ranks that hold one replicated k/v head when
        a model has fewer k/v heads than tp ranks (``parallel.tensor.ColumnParallelLinear``'s replicas).

        Collective the first time for a size: every rank of the world calls it together."""
        assert size >= 1 and self.tp % size == 0, (size, self.tp)
        if size not in self.replica_comms:
            mine = None
            if size > 1 and dist.is_initialized():
                for group in group_ranks("tp", self.tp, self.pp, self.dp):
                    for start in range(0, self.tp, size):
                        made = dist.new_group(group[start:start + size], timeout=self.timeout)
                        if self.rank in group[start:start + size]:
                            mine = made
            self.replica_comms[size] = Comm(mine, "kv", self.counter)
        return self.replica_comms[size]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def coords(self) -> tuple[int, int, int]:
        return rank_to_coords(self.rank, self.tp, self.pp, self.dp)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group: which slice of the experts it holds."""
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage with the same (dp, tp), or None on the first."""
        if self.is_first_stage:
            return None
        return coords_to_rank(self.pp_rank - 1, self.dp_rank, self.tp_rank, self.tp, self.dp)

    @property
    def next_stage_rank(self) -> Optional[int]:
        if self.is_last_stage:
            return None
        return coords_to_rank(self.pp_rank + 1, self.dp_rank, self.tp_rank, self.tp, self.dp)

    def __str__(self) -> str:
        lines = [f"grid pp={self.pp} x dp={self.dp} x tp={self.tp} (world {self.world_size}, tp fastest)"
                 + (f"; ep={self.ep} inside dp (dp_rank = edp_rank * {self.ep} + ep_rank)" if self.ep > 1 else "")]
        for p in range(self.pp):
            rows = []
            for d in range(self.dp):
                ranks = [coords_to_rank(p, d, t, self.tp, self.dp) for t in range(self.tp)]
                rows.append("dp%d:[%s]" % (d, " ".join(str(r) for r in ranks)))
            lines.append(f"  stage {p}: " + "  ".join(rows))
        lines.append(f"  this rank {self.rank}: pp={self.pp_rank} dp={self.dp_rank} tp={self.tp_rank}")
        return "\n".join(lines)
