"""Grouped matmul: one matmul per expert over its contiguous rows, in one call (the experts' SwiGLU).

``torch._grouped_mm`` runs every group in one kernel on CUDA (sm90, bf16) and, in torch 2.13, on the CPU too
(fp32, bf16, fp16), where it is the fastest correct choice measured (bench/grouped_mm.py, in bench/moe.py;
docs/benchmarks.md): forward + backward, a per-group loop took 1.01-1.17x its time at every shape, and a
padded bmm, level with it only at balanced loads (0.98x), 3.9-4.5x with a skewed router. Where it cannot
run (a dtype or architecture it does not take, a width that is not a multiple of 16 bytes: its kernels want
every row of the input, the output and their gradients 16-byte aligned; an older torch) the per-group loop
is the fallback, with the same result. Weights are stored as ``nn.Linear``'s are, (groups, out, in).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def grouped_mm_supported(x: Tensor, weight: Tensor | None = None) -> bool:
    """Whether ``torch._grouped_mm`` takes inputs like ``x`` (and ``weight``, (groups, out, in)) here: its
    kernels want float32/bf16/fp16 (bf16 on sm90 CUDA) and every row of x, of the output and of their gradients
    starting on 16 bytes, i.e. widths in and out that are multiples of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        ok = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    else:
        ok = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return ok and (weight is None or all(n * x.element_size() % 16 == 0 for n in weight.shape[1:]))


def grouped_mm(x: Tensor, weight: Tensor, sizes: Sequence[int], offsets: Tensor | None = None,
               impl: str = "auto") -> Tensor:
    """y[rows of group g] = x[rows of group g] @ weight[g].T, groups of ``sizes`` rows in order.

    x: (rows, in); weight: (groups, out, in); ``offsets``: the groups' end rows as int32 on x's device
    (made from ``sizes`` when not given). impl: auto | grouped | loop."""
    assert weight.dim() == 3 and len(sizes) == weight.shape[0], (tuple(weight.shape), len(sizes))
    w = weight.to(x.dtype)  # under autocast the activations are 16-bit and the weights fp32
    if impl == "loop" or (impl == "auto" and not grouped_mm_supported(x, w)):
        return grouped_mm_loop(x, w, sizes)
    if offsets is None:
        offsets = torch.tensor(list(sizes), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
    y = torch._grouped_mm(x.contiguous(), w.transpose(-2, -1), offs=offsets)
    if y.requires_grad:  # its backward takes no broadcast gradient (a loss of y.sum() sends one)
        y.register_hook(Tensor.contiguous)
    return y


def grouped_mm_loop(x: Tensor, weight: Tensor, sizes: Sequence[int]) -> Tensor:
    """The same as :func:`grouped_mm`, one matmul per group: the reference and the fallback."""
    parts = [a @ w.t() for a, w in zip(x.split(list(sizes)), weight.to(x.dtype))]
    return torch.cat(parts) if parts else x.new_empty((0, weight.shape[1]))
