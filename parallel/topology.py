"""The topology grid: which rank does what along (pp, dp, cp, tp), with expert parallelism carved out of dp.

Rank order is Megatron's default, tp fastest: TP and CP groups stay inside a node
(NVLink), DP next, PP across nodes —
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``. Context parallelism (``cp``) splits
each sample's sequence: the cp ranks of one (pp, dp, tp) position see different tokens of the same samples,
so parameter gradients reduce (and ZeRO shards) over dp x cp, the "grad" group.
Expert parallelism (``ep``) splits dp, fastest within it, as Megatron's expert-data-parallel does:
``dp_rank = edp_rank * ep + ep_rank``. An expert lives on one rank of its ep group (the ep consecutive dp
ranks of one (pp, edp, tp) position) and is replicated over the edp = dp / ep ranks of its edp group.
The Grid is built over a torch DeviceMesh with dims ("pp", "dp", "cp", "tp") — ("pp", "edp", "ep", "cp",
"tp") with "dp" their flattening when ep > 1 — and is an object handed to whoever needs it, never a global.
Expert gradients reduce over edp x cp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megazero.parallel.comm import Comm, CommCounter


def rank_to_coords(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(pp_rank, dp_rank, cp_rank, tp_rank) of a global rank."""
    assert 0 <= rank < tp * pp * dp * cp, (rank, tp, pp, dp, cp)
    return rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp


def coords_to_rank(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


DIMS = ("pp", "dp", "cp", "tp")


def group_ranks(dim: str, tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every group of the given dimension, as lists of global ranks (what the mesh builds)."""
    assert dim in DIMS, dim
    groups: dict[tuple, list[int]] = {}
    for r in range(tp * pp * dp * cp):
        c = dict(zip(DIMS, rank_to_coords(r, tp, pp, dp, cp)))
        key = tuple(v for k, v in c.items() if k != dim)
        groups.setdefault(key, []).append(r)
    return [sorted(g) for _, g in sorted(groups.items())]


def embedding_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """For each (dp, cp, tp) position, the first- and last-stage ranks that both hold the tied embedding."""
    return [[coords_to_rank(0, d, t, tp, dp, c, cp), coords_to_rank(pp - 1, d, t, tp, dp, c, cp)]
            for d in range(dp) for c in range(cp) for t in range(tp)]


def new_embedding_group(tp: int, pp: int, dp: int, timeout: Optional[timedelta] = None,
                        cp: int = 1) -> Optional[dist.ProcessGroup]:
    """Megatron's embedding group: sums the two copies' gradients so the tied weights stay equal.

    Collective: every rank creates every group, and keeps its own.
    """
    if pp == 1:
        return None
    mine = None
    for ranks in embedding_group_ranks(tp, pp, dp, cp):
        group = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _mesh_groups(mesh, dims: tuple[str, ...], name: str, override: Optional[dict]) -> Optional[dist.ProcessGroup]:
    """The group over several mesh dims (flattened), or the one dim's group."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    flat = mesh[dims]._flatten(name, backend_override=override[dims[0]] if override else None)
    return flat.get_group()


@dataclass
class Grid:
    """This rank's place in the (pp, dp, cp, tp) grid and the process groups along each dimension.

    Groups are None when the run is a single process without a process group. ``grad_comm`` is where dense
    gradients reduce and ZeRO shards: dp x cp (the dp group itself at cp = 1); ``expert_grad_comm`` the
    experts': edp x cp.
    """

    tp: int
    pp: int
    dp: int
    rank: int = 0
    ep: int = 1  # expert-parallel ranks, carved out of dp (dp_rank = edp_rank * ep + ep_rank)
    cp: int = 1  # context-parallel ranks: each sample's sequence split over them (parallel.context)
    mesh: object = None
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    embed_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None  # the ranks that split one set of experts
    edp_group: Optional[dist.ProcessGroup] = None  # the ranks that hold copies of the same experts
    cp_group: Optional[dist.ProcessGroup] = None  # the ranks that split one sample's sequence
    grad_group: Optional[dist.ProcessGroup] = None  # dp x cp (cp > 1)
    expert_grad_group: Optional[dist.ProcessGroup] = None  # edp x cp (cp > 1, ep > 1)
    counter: CommCounter = field(default_factory=CommCounter)
    timeout: Optional[timedelta] = None  # every group's collective timeout (None: torch's default)
    replica_comms: dict = field(default_factory=dict)  # tp_replica_comm's groups, by size
    stage_comms: list = field(default_factory=list)  # stage_comm's group, once made

    def __post_init__(self) -> None:
        self.tp_comm = Comm(self.tp_group, "tp", self.counter)
        self.dp_comm = Comm(self.dp_group, "dp", self.counter)
        self.pp_comm = Comm(self.pp_group, "pp", self.counter)
        self.cp_comm = Comm(self.cp_group, "cp", self.counter)
        self.embed_comm = Comm(self.embed_group, "embed", self.counter)
        assert self.ep >= 1 and self.dp % self.ep == 0, (self.dp, self.ep)
        if self.ep == 1:  # the experts' groups are the dense ones: the same communicators, counted as such
            self.ep_comm, self.edp_comm = Comm(None, "ep", self.counter), self.dp_comm
        else:
            self.ep_comm = Comm(self.ep_group, "ep", self.counter)
            self.edp_comm = Comm(self.edp_group, "edp", self.counter)
        if self.cp == 1:
            self.grad_comm, self.expert_grad_comm = self.dp_comm, self.edp_comm
        else:
            self.grad_comm = Comm(self.grad_group, "dp", self.counter)
            self.expert_grad_comm = (self.grad_comm if self.ep == 1
                                     else Comm(self.expert_grad_group, "edp", self.counter))

    @classmethod
    def single(cls) -> "Grid":
        return cls(tp=1, pp=1, dp=1, rank=0)

    @classmethod
    def build(cls, tp: int, pp: int, dp: int, device_type: str = "cpu", timeout: Optional[timedelta] = None,
              ep: int = 1, cp: int = 1) -> "Grid":
        """Build the DeviceMesh over the initialised default process group.

        ``timeout`` bounds the collectives of every group (launch.timeout_minutes): a group made without one
        gets torch's default (30 minutes on gloo, 10 on NCCL), not the world group's."""
        if not dist.is_initialized():
            assert tp * pp * dp * cp == 1, "a multi-rank grid needs an initialised process group"
            return cls.single()
        world = dist.get_world_size()
        assert tp * pp * dp * cp == world, f"tp*pp*dp*cp={tp * pp * dp * cp} != world size {world}"
        from torch.distributed.device_mesh import init_device_mesh

        assert dp % ep == 0, f"parallel.ep={ep} must divide dp={dp}"
        names = ("pp", "dp", "cp", "tp") if ep == 1 else ("pp", "edp", "ep", "cp", "tp")
        shape = (pp, dp, cp, tp) if ep == 1 else (pp, dp // ep, ep, cp, tp)
        override = None
        if timeout is not None:
            backend = "nccl" if device_type == "cuda" else "gloo"
            options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            override = {name: (backend, options) for name in names}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
        dp_dims = ("dp",) if ep == 1 else ("edp", "ep")
        groups = dict(dp_group=_mesh_groups(mesh, dp_dims, "dp_flat", override))
        if ep > 1:
            groups.update(ep_group=mesh.get_group("ep"), edp_group=mesh.get_group("edp"))
        if cp > 1:
            groups.update(cp_group=mesh.get_group("cp"),
                          grad_group=_mesh_groups(mesh, dp_dims + ("cp",), "dp_cp", override))
            if ep > 1:
                groups.update(expert_grad_group=_mesh_groups(mesh, ("edp", "cp"), "edp_cp", override))
        return cls(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), mesh=mesh, ep=ep, cp=cp,
                   tp_group=mesh.get_group("tp"), pp_group=mesh.get_group("pp"),
                   embed_group=new_embedding_group(tp, pp, dp, timeout, cp), timeout=timeout, **groups)

    def tp_replica_comm(self, size: int) -> Comm:
        """This rank's group of ``size`` consecutive tp ranks: the ranks that hold one replicated k/v head when
        a model has fewer k/v heads than tp ranks (``parallel.tensor.ColumnParallelLinear``'s replicas).

        Collective the first time for a size: every rank of the world calls it together."""
        assert size >= 1 and self.tp % size == 0, (size, self.tp)
        if size not in self.replica_comms:
            mine = None
            if size > 1 and dist.is_initialized():
                for group in group_ranks("tp", self.tp, self.pp, self.dp, self.cp):
                    for start in range(0, self.tp, size):
                        made = dist.new_group(group[start:start + size], timeout=self.timeout)
                        if self.rank in group[start:start + size]:
                            mine = made
            self.replica_comms[size] = Comm(mine, "kv", self.counter)
        return self.replica_comms[size]

    def stage_comm(self) -> Comm:
        """Every rank of this rank's pipeline stage (dp x cp x tp, in global rank order): the group Muon
        assembles its matrices over (``parallel.zero.matrix_plan``).

        Collective the first time: every rank of the world calls it together."""
        if not self.stage_comms:
            mine = None
            size = self.dp * self.cp * self.tp
            if size > 1 and dist.is_initialized():
                for p in range(self.pp):
                    ranks = list(range(p * size, (p + 1) * size))
                    made = dist.new_group(ranks, timeout=self.timeout)
                    if self.rank in ranks:
                        mine = made
            self.stage_comms.append(Comm(mine, "stage", self.counter))
        return self.stage_comms[0]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def coords(self) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank)."""
        return rank_to_coords(self.rank, self.tp, self.pp, self.dp, self.cp)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def cp_rank(self) -> int:
        return self.coords[2]

    @property
    def tp_rank(self) -> int:
        return self.coords[3]

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

    def _stage_rank(self, pp_rank: int) -> int:
        return coords_to_rank(pp_rank, self.dp_rank, self.tp_rank, self.tp, self.dp, self.cp_rank, self.cp)

    @property
    def prev_stage_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage with the same (dp, cp, tp), or None on the first."""
        return None if self.is_first_stage else self._stage_rank(self.pp_rank - 1)

    @property
    def next_stage_rank(self) -> Optional[int]:
        return None if self.is_last_stage else self._stage_rank(self.pp_rank + 1)

    def __str__(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        lines = [f"grid pp={self.pp} x dp={self.dp}{cp} x tp={self.tp} (world {self.world_size}, tp fastest)"
                 + (f"; ep={self.ep} inside dp (dp_rank = edp_rank * {self.ep} + ep_rank)" if self.ep > 1 else "")]
        for p in range(self.pp):
            rows = []
            for d in range(self.dp):
                for c in range(self.cp):
                    ranks = [coords_to_rank(p, d, t, self.tp, self.dp, c, self.cp) for t in range(self.tp)]
                    rows.append(f"dp{d}" + (f"cp{c}" if self.cp > 1 else "") + ":[%s]" % " ".join(map(str, ranks)))
            lines.append(f"  stage {p}: " + "  ".join(rows))
        lines.append(f"  this rank {self.rank}: pp={self.pp_rank} dp={self.dp_rank}"
                     + (f" cp={self.cp_rank}" if self.cp > 1 else "") + f" tp={self.tp_rank}")
        return "\n".join(lines)
