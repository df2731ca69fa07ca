"""Timing shared by the distributed benchmarks."""
from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist


def timed_between_barriers(fn: Callable[[], object]) -> float:
    """Wall time of fn on this rank, between barriers of the whole world (the step's makespan)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0
