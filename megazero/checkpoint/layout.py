"""How a rank's tensors are stored under logical names: tp shards as DTensors over the tp mesh.

A checkpoint holds every parameter whole (layout-free; a mixture of experts' stacked experts as one (E, ...)
tensor, split over ep like a tp shard); DCP writes and reads each rank's piece of it
from the DTensor's placement. A piece replicated on r tp ranks (k/v heads fewer than tp ranks) is stored as
the even tp split of the whole tensor seen r times: tp rank t's even share is the (t mod r)-th r-th of its
piece, a view, so a save needs no communication, and after a load :func:`complete_replicas` gathers the
other r-1 parts from the piece's other ranks.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from megazero.parallel.topology import Grid


def logical(local: Tensor, param: nn.Parameter, grid: Grid) -> Tensor:
    """This rank's ``local`` tensor of ``param`` (its value or an optimizer state), as DCP stores it. Stacked
    experts split over ep are the (E, ...) tensor sharded along their ``ep_split_dim`` over the ep mesh."""
    from torch.distributed.tensor import DTensor, Shard

    experts = getattr(param, "ep_split_dim", None)
    if experts is not None:
        return local if grid.ep == 1 else DTensor.from_local(local, grid.mesh["ep"], [Shard(experts)],
                                                             run_check=False)
    if param.tp_split_dim is None or grid.tp == 1:
        return local

    replicas, dim = getattr(param, "tp_replicas", 1), param.tp_split_dim
    if replicas > 1:
        local = local.chunk(replicas, dim=dim)[grid.tp_rank % replicas]
    return DTensor.from_local(local, grid.mesh["tp"], [Shard(dim)], run_check=False)


def complete_replicas(loaded: dict[str, dict[str, Tensor]], params: dict[str, nn.Parameter], grid: Grid) -> None:
    """After a load into :func:`logical`'s views: each replicated piece's parts, gathered over its ranks."""
    for n, kinds in loaded.items():
        replicas = getattr(params[n], "tp_replicas", 1)
        if replicas == 1 or grid.tp == 1:
            continue
        comm, dim = grid.tp_replica_comm(replicas), params[n].tp_split_dim
        for tensor in kinds.values():
            moved = tensor.movedim(dim, 0)  # collectives concatenate along dim 0
            part = moved.chunk(replicas)[comm.rank].contiguous()
            whole = torch.empty_like(moved.contiguous())
            comm.all_gather_into(whole, part, tag="checkpoint")
            moved.copy_(whole)
