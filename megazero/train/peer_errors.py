"""An input error that only some ranks meet once the process group has started, reported by rank 0.

pretrain.py prints an input error on rank 0 (and each node's first process), so one found by another rank
alone (a damaged weight that only a later pipeline stage reads) would be printed by nobody, and rank 0 would
report its failed collective with the rank that exited instead. That rank leaves its line in the process
group's store before it exits, and so before rank 0's collective with it fails; rank 0 finds it there.
"""
from __future__ import annotations

import json

from megazero.errors import UserError

PEER_ERROR_KEY = "megazero/input_error"  # in the process group's store: a rank's input error, for rank 0 to report


def _default_store():
    """The default process group's store (hosted by rank 0 or torchrun's agent: it outlives a rank that exits),
    or None without one."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (AttributeError, ValueError, RuntimeError):  # a torch without it: rank 0 reports the collective
        return None


def leave_for_rank_0(e: UserError, rank: int) -> None:
    """Called by a rank about to exit with ``e`` (a no-op on rank 0, which prints its own)."""
    store = _default_store()
    if store is not None and rank != 0:
        try:
            store.set(PEER_ERROR_KEY, json.dumps([rank, str(e)]))
        except (RuntimeError, ValueError):  # the store is gone too: rank 0 reports the collective
            pass


def peer_error() -> UserError | None:
    """The input error a peer left (:func:`leave_for_rank_0`): the cause of this rank's failed collective."""
    store = _default_store()
    try:
        if store is None or not store.check([PEER_ERROR_KEY]):
            return None
        rank, message = json.loads(store.get(PEER_ERROR_KEY))
        return UserError(f"{message} (found by rank {int(rank)})")
    except (RuntimeError, ValueError, TypeError):
        return None
