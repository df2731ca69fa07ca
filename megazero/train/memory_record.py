"""The memory a log step reports, and the bytes sent so far: each figure the largest over all ranks (the one that
runs out first, or sends the most: pipeline stages and tp/dp shards differ)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.train.metrics import memory_gb
from megazero.parallel.zero import ZeroOptimizer


def memory_record(zero: ZeroOptimizer, device: torch.device) -> dict:
    """Peak memory and model-state bytes (params, grads, optimizer, offloaded), in GB, and the bytes this run has
    put on the wire so far (``comm/sent_gb``, the comm counter's: the difference of two records is what the steps
    between sent). Collective."""
    state = zero.model_state_bytes()
    kinds = ("params", "grads", "optimizer", "cpu")
    sent = sum(zero.grid.counter.sent_bytes().values()) / 1e9
    worst = torch.tensor([memory_gb(device)] + [state[k] / 1e9 for k in kinds] + [sent], dtype=torch.float64,
                         device=device)
    zero.world.all_reduce(worst, op=dist.ReduceOp.MAX, tag="metrics")
    values = worst.tolist()
    return {"memory_gb": values[0], **{f"{'offloaded' if k == 'cpu' else k}_gb": v
                                       for k, v in zip(kinds, values[1:])}, "comm/sent_gb": values[-1]}
