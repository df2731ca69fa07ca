"""What a run does when the loss or the gradients go non-finite: stop, or skip the update (train.on_nonfinite).

A NaN that trains on silently is worse than a crash: every later checkpoint holds it, and keep_last rotates
the last good one away. So by default a non-finite loss or gradient norm, in any precision, ends the run
before anything is saved (exit 3), naming the step, what went non-finite and the first parameter whose
gradient did. ``skip`` drops the update instead (the optimizer already skips any step with a non-finite
gradient, on every rank alike), and either way ``train.max_skipped`` skipped updates in a row stop the run.
Under fp16 an overflow is the loss scaler's to handle (from 2^16 it halves its way down, skipping a step
each time, as it should), so there only skips with the scale at its minimum count: a scale stuck there
must not spin for ever.
"""
from __future__ import annotations

import math
from typing import Optional

import torch.distributed as dist

from megazero.errors import NonFiniteStop


class NonFiniteGuard:
    """Counts skipped updates and raises :class:`NonFiniteStop` when the policy says stop. Its inputs are
    agreed over every rank, so every rank stops at the same step."""

    def __init__(self, policy: str, max_skipped: int, fp16: bool):
        assert policy in ("stop", "skip"), policy
        self.policy, self.max_skipped, self.fp16 = policy, max_skipped, fp16
        self.skipped_in_a_row = 0

    def check(self, step: int, skipped: bool, loss_nonfinite: bool, norm: float,
              nonfinite_param: Optional[str], scale_at_min: bool = False) -> None:
        """After ``step``: ``skipped`` (the update was), ``loss_nonfinite`` (on some rank), the global gradient
        norm, this rank's first parameter with a non-finite gradient, if any, and (fp16) whether the loss
        scale is at its minimum."""
        if not skipped:
            self.skipped_in_a_row = 0
        elif not self.fp16 or scale_at_min:
            self.skipped_in_a_row += 1
        anomaly = loss_nonfinite or (skipped and not self.fp16)
        if not anomaly and self.skipped_in_a_row < self.max_skipped:
            return
        what = []
        if loss_nonfinite:
            what.append("the loss is not finite")
        if skipped and not math.isfinite(norm):
            where = _first_over_ranks(nonfinite_param)
            what.append(f"the gradient norm is {norm}" + (f" (first non-finite gradient: {where})" if where else ""))
        said = " and ".join(what) or "a value is not finite"
        if anomaly and self.policy == "stop":
            raise NonFiniteStop(f"step {step}: {said}; stopped before saving, so the latest checkpoint is the last "
                                f"good one (train.on_nonfinite=stop)")
        if self.skipped_in_a_row >= self.max_skipped:
            raise NonFiniteStop(f"step {step}: {self.skipped_in_a_row} updates in a row were skipped "
                                f"(train.max_skipped={self.max_skipped}): {said}; stopped before saving")


def _first_over_ranks(found: Optional[str]) -> Optional[str]:
    """The first rank's non-finite parameter (the stop path only: a gather over every rank)."""
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        found = next((f for f in everyone if f), None)
    return found
