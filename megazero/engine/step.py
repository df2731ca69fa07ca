"""One training step: begin -> pipeline run -> reduce -> clip -> update -> gather, in one place.

The trainer, the tests and the benchmarks all call :func:`train_step` (or :func:`forward_backward`, its
first half, to look at gradients), so the order of a step and the loss scale's handling live only here:
the executor multiplies the loss by the scale before backward, the optimizer divides it out of the
gradients and the scaler learns whether the step overflowed (Micikevicius et al. 2018).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megazero.engine.routers import RouterStats, balance_routers
from megazero.parallel.loss_scale import LossScaler
from megazero.parallel.pipeline import PipelineExecutor
from megazero.parallel.schedules import Action
from megazero.parallel.zero import ZeroOptimizer


@dataclass
class StepResult:
    loss_sum: Tensor  # this rank's summed token loss (0 off the last stage)
    grad_norm: float  # the global gradient norm, unscaled, before clipping
    skipped: bool  # not applied: a non-finite gradient or loss somewhere
    nonfinite_param: Optional[str]  # the first parameter with a non-finite gradient here (not under fp16)
    loss_nonfinite: bool  # some rank's loss was non-finite
    flags: list[float]  # the caller's flags, agreed (MAX) over every rank, read on the host with the norm
    loss_total: Tensor  # the loss sum over the dp group (the global batch's, on the last pipeline stage)
    routers: Optional[RouterStats] = None  # the mixture-of-experts layers' load and losses (None: dense)
    loss_agreed: Optional[float] = None  # with agree_loss: the global batch's loss sum, the same on every rank


def forward_backward(zero: ZeroOptimizer, executor: PipelineExecutor, schedule: list[Action],
                     microbatches: list[Tensor], scaler: Optional[LossScaler] = None) -> Tensor:
    """Run the schedule's forwards and backwards and complete the gradients' reduction; returns the loss sum."""
    zero.begin(len(microbatches))
    executor.loss_scale = scaler.scale if scaler is not None and scaler.enabled else 1.0
    loss_sum = executor.run(schedule, microbatches)
    zero.reduce()
    return loss_sum


def train_step(zero: ZeroOptimizer, executor: PipelineExecutor, schedule: list[Action], microbatches: list[Tensor],
               lr: float, max_norm: float, scaler: Optional[LossScaler] = None,
               flags: Optional[Tensor] = None, agree_loss: bool = False) -> StepResult:
    """One optimizer step over ``microbatches``. ``flags``: per-rank values agreed (MAX) over every rank in the
    step's own all-reduce (see ``ZeroOptimizer.step``). ``agree_loss``: the global batch's loss sum joins them
    (the last stage's; every other stage adds 0 and a loss is >= 0), for a decision every rank makes alike
    (``train.on_spike``): its dp x cp sum then completes before the update rather than during it."""
    loss_sum = forward_backward(zero, executor, schedule, microbatches, scaler)
    # summed over dp x cp now, in flight during the update: after it, the dp group's queue holds the parameter
    # all-gathers that overlap the next forward, and nothing may wait behind them
    loss_total = loss_sum.clone()
    loss_work = zero.grid.grad_comm.all_reduce(loss_total, tag="loss", async_op=True)
    fp16 = scaler is not None and scaler.enabled
    agreed = torch.isfinite(loss_sum).logical_not().float().reshape(1)  # and the caller's flags after it
    if flags is not None:
        agreed = torch.cat([agreed, flags.float().reshape(-1)])
    if agree_loss:
        if loss_work is not None:
            loss_work.wait()
            loss_work = None
        agreed = torch.cat([agreed, loss_total.float().reshape(1)])
    norm, skipped = zero.step(lr, max_norm, grad_scale=1.0 / scaler.scale if fp16 else 1.0, loss=loss_sum,
                              flags=agreed, locate_nonfinite=not fp16)  # fp16 overflows are routine
    if flags is not None:
        flags.copy_(agreed[1:1 + flags.numel()].view_as(flags))
    if scaler is not None:
        scaler.update(skipped)
    routers = balance_routers(executor.chunks, zero.world, update=not skipped)
    if loss_work is not None:
        loss_work.wait()
    agreed_host = zero.host_flags  # [some rank's loss non-finite, the caller's flags, the loss]: no wait of
    # their own
    loss_agreed = agreed_host[-1] if agree_loss else None
    caller = agreed_host[1:len(agreed_host) - int(agree_loss)]
    return StepResult(loss_sum, norm, skipped, zero.nonfinite_param, bool(agreed_host[0]), caller, loss_total,
                      routers, loss_agreed)
