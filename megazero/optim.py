"""AdamW with GPT parameter groups, the LR schedule, and gradient reduction/clipping.

Decoupled weight decay (Loshchilov & Hutter 2019) on matrices only: biases
and norm weights are not decayed (GPT-3 practice). The schedule is a pure
function of the step so that a resumed run needs no scheduler state.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn

from parallel.comm import Comm


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from 0 to lr over warmup_steps, then cosine decay to min_lr at total_steps.

    `step` counts optimizer steps already taken (the first update uses step 0).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def decays(name: str, param: torch.Tensor) -> bool:
    """Matrices (linear weights, embeddings) decay; biases and norm weights do not."""
    return param.ndim >= 2


def build_adamw(named_params: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in named_params:
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def allreduce_gradients(params: list[nn.Parameter], comm: Optional[Comm]) -> None:
    """Sum gradients over a group in one flat buffer: one collective, not one per tensor.

    Over dp the loss is already divided by the global token count, so the sum
    is the mean. Over tp it completes the gradients of sequence-parallel
    parameters, each rank having seen only its own tokens.
    """
    if comm is None or comm.size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    comm.all_reduce(flat, tag="grad")
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def grad_norm(params: list[nn.Parameter], tp: Optional[Comm] = None, model_parallel: tuple = ()) -> torch.Tensor:
    """Global L2 norm of the model's gradient, each element counted exactly once.

    A tp-sharded parameter contributes its shard on every tp rank; a parameter
    replicated over tp (norms, row-parallel bias, positions) only on tp rank 0.
    The squares are then summed over tp and the other model-parallel groups
    (pipeline stages); data-parallel replicas hold the same gradient and are
    not summed.
    """
    tp_rank = 0 if tp is None else tp.rank
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tp_split_dim", None) is None and tp_rank != 0:
            continue
        total += p.grad.detach().float().pow(2).sum()
    for comm in (tp, *model_parallel):
        if comm is not None:
            comm.all_reduce(total, tag="grad_norm")
    return total.sqrt()


def clip_gradients(params: list[nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so their global norm is at most max_norm (0 disables)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, coef.to(grads[0].device))
