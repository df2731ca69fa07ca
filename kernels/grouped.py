"""Grouped matmul: one matmul per expert over its contiguous rows, in one call (the experts' SwiGLU).

``torch._grouped_mm`` runs every group in one kernel on CUDA (sm90, bf16) and, in torch 2.13, on the CPU too,
where it is the fastest correct choice measured (bench/moe.py: against a per-expert loop and a padded bmm).
Where it cannot run (a CUDA dtype or architecture it does not take, or an older torch) the per-group loop is
the fallback, with the same result. Weights are stored as ``nn.Linear``'s are, (groups, out, in).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def grouped_mm_supported(x: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes inputs like ``x`` here."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu"


def grouped_mm(x: Tensor, weight: Tensor, sizes: Sequence[int], offsets: Tensor | None = None,
               impl: str = "auto") -> Tensor:
    """y[rows of group g] = x[rows of group g] @ weight[g].T, groups of ``sizes`` rows in order.

    x: (rows, in); weight: (groups, out, in); ``offsets``: the groups' end rows as int32 on x's device
    (made from ``sizes`` when not given). impl: auto | grouped | loop."""
    assert weight.dim() == 3 and len(sizes) == weight.shape[0], (tuple(weight.shape), len(sizes))
    w = weight.to(x.dtype)  # under autocast the activations are 16-bit and the weights fp32
    if impl == "loop" or (impl == "auto" and not grouped_mm_supported(x)):
        return grouped_mm_loop(x, w, sizes)
    if offsets is None:
        offsets = torch.tensor(list(sizes), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def grouped_mm_loop(x: Tensor, weight: Tensor, sizes: Sequence[int]) -> Tensor:
    """The same as :func:`grouped_mm`, one matmul per group: the reference and the fallback."""
    parts = [a @ w.t() for a, w in zip(x.split(list(sizes)), weight.to(x.dtype))]
    return torch.cat(parts) if parts else x.new_empty((0, weight.shape[1]))
