"""AdamW over flat buffers: one call per buffer, not one per tensor.

The optimizer step of ``parallel.zero`` calls :func:`adamw_step` on this
rank's flat fp32 master shard. This is the torch implementation; it is
written as the same sequence of operations as ``torch.optim.AdamW``
(decoupled weight decay, Loshchilov & Hutter 2019; bias-corrected moments,
Kingma & Ba 2015) so both give the same numbers in fp32.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def adamw_step(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, step: int, decay_mask: Optional[Tensor] = None,
               grad_scale: float = 1.0, model_copy: Optional[Tensor] = None) -> None:
    """One AdamW update of ``master`` (fp32) in place.

    grad: any float dtype; multiplied by ``grad_scale`` first (loss-scale
    unscaling and clipping folded in). decay_mask: where weight decay applies
    (None: everywhere). model_copy: if given, receives the updated weights in
    its own dtype (the bf16/fp16 model parameters) in the same pass.
    """
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        factor = 1.0 - lr * weight_decay
        if decay_mask is None:
            master.mul_(factor)
        else:
            master.mul_(torch.where(decay_mask, torch.tensor(factor, dtype=master.dtype, device=master.device),
                                    torch.ones((), dtype=master.dtype, device=master.device)))
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if model_copy is not None:
        model_copy.copy_(master)
