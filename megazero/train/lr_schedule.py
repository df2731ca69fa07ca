"""The learning-rate schedule (the optimizer itself is parallel.zero's, over flat buffers).

A pure function of the step, so a resumed run needs no scheduler state.
"""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from 0 to lr over warmup_steps, then cosine decay to min_lr at total_steps.

    `step` counts optimizer steps already taken (the first update uses step 0).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
