"""AdamW over flat buffers with torch's fused kernel: no full-buffer temporaries.

``kernels.adam.adamw_step`` writes AdamW (Kingma & Ba 2015 moments, Loshchilov & Hutter 2019 decoupled
weight decay) as ~10 elementwise torch ops, each a pass over the buffer with temporaries; the optimizer
step is memory-bound, so that costs ~10x the bytes. ``torch._fused_adamw_`` does the whole update in one
pass per tensor, but takes one weight decay per call and its CPU kernel wants grads in the parameters'
dtype. So a flat buffer is split, once, into maximal runs of constant decay (:func:`decay_runs`), and each
step makes one call over the views of the decaying runs and one over the others (:func:`adamw_step_fused`).

What this relies on in torch's kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, checked on 2.13):
  * dtypes: param, grad, exp_avg, exp_avg_sq must share one dtype (fp16/bf16 grads with fp32 masters raise
    "expected scalar type Float but found Half"); mixed-dtype grads go through a bounded fp32 scratch.
  * step: read from a per-tensor float32 tensor (``item<float>()``) and NOT incremented (torch.optim adds 1
    in Python before the call), so we pass a tensor holding exactly ``step`` (exact below 2**24; beyond,
    beta**step is 0 in double anyway). On CUDA it is read from device memory: the tensor lives there.
  * grad_scale: the kernel DIVIDES grads by it and writes the quotient back into grad; we want grad times
    grad_scale, so we pass 1/grad_scale (None when it is 1: no division, no write-back).
  * no contiguity check: it walks raw pointers, so every tensor here must be a contiguous 1-D view.
  * threads: each tensor is one ``at::parallel_for`` with grain 0, i.e. split over all
    ``torch.get_num_threads()`` intra-op threads, however small (measured on a 2-core VM, 50M elements:
    2 threads 1.1-1.9x faster than 1, as the memory bandwidth available at the time allowed).
  * an empty tensor list raises; empty buffers return before any call.
"""
from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch
from torch import Tensor

Run = tuple[int, int, bool]  # [start, end) and whether weight decay applies there

# fp32 elements per scratch chunk when grads must be converted: 4 MiB on the CPU (stays in the last-level
# cache between the conversion and the kernel that reads it); 64 MiB on a GPU (few launches).
CPU_CHUNK = 1 << 20
GPU_CHUNK = 1 << 24


def decay_runs(decay_mask: Tensor) -> list[Run]:
    """The maximal runs ``(start, end, decays)`` of constant value in a 1-D bool mask, in order.

    Computed once per buffer (the mask is fixed for its life), so the step itself does no host sync and no
    boolean indexing. An empty mask has no runs.
    """
    mask = decay_mask.detach().reshape(-1).to(device="cpu", dtype=torch.bool)
    n = mask.numel()
    if n == 0:
        return []
    cuts = ((mask[1:] != mask[:-1]).nonzero().flatten() + 1).tolist()
    starts, ends = [0] + cuts, cuts + [n]
    values = mask[torch.tensor(starts, dtype=torch.long)].tolist()
    return [(s, e, bool(v)) for s, e, v in zip(starts, ends, values)]


def _check_flat(name: str, t: Tensor, n: int, device: torch.device) -> None:
    if t.dim() != 1 or not t.is_contiguous() or t.numel() != n or t.device != device:
        raise ValueError(f"adamw_step_fused: {name} must be a contiguous 1-D tensor of {n} elements on {device}, "
                         f"got shape {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")


def _check_runs(runs: Sequence[Run], n: int) -> None:
    at = 0
    for start, end, _ in runs:
        if start != at or end < start:
            raise ValueError(f"adamw_step_fused: runs must tile [0, {n}) in order, got ({start}, {end}) at {at}")
        at = end
    if at != n:
        raise ValueError(f"adamw_step_fused: runs end at {at}, the buffer has {n} elements")


def _pieces(runs: Sequence[Run], starts: list[int], lo: int, hi: int) -> list[Run]:
    """The parts of the runs inside [lo, hi); runs tile the buffer in order and ``starts`` are their starts."""
    out = []
    for start, end, decays in runs[max(0, bisect.bisect_right(starts, lo) - 1):]:
        if start >= hi:
            break
        out.append((max(start, lo), min(end, hi), decays))
    return out


def adamw_step_fused(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                     runs: Optional[Sequence[Run]] = None, decay_mask: Optional[Tensor] = None,
                     grad_scale: float = 1.0, model_copy: Optional[Tensor] = None) -> None:
    """One AdamW update of ``master`` in place, as ``kernels.adam.adamw_step`` computes it, in two calls of
    ``torch._fused_adamw_`` (decaying runs with ``weight_decay``, the rest with 0) over views of the buffers.

    runs: from :func:`decay_runs` (pass them: deriving them costs a host sync); if None they come from
    decay_mask, or one decaying run when that is None too. grad: any float dtype, multiplied by grad_scale
    first; when it is master's dtype and grad_scale != 1, grad is left holding grad*grad_scale (the kernel
    unscales in place); other dtypes are converted chunk by chunk into a bounded scratch and left as they
    were. model_copy: receives the updated master in its own dtype (on the CPU chunk by chunk, while master
    is in cache). Meant for CPU and CUDA tensors (the kernel exists for both; only the CPU is tested); the
    CPU kernel uses all ``torch.get_num_threads()`` threads.
    """
    n, device = master.numel(), master.device
    for name, t in (("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_flat(name, t, n, device)
    if exp_avg.dtype != master.dtype or exp_avg_sq.dtype != master.dtype or not grad.dtype.is_floating_point:
        raise ValueError(f"adamw_step_fused: exp_avg/exp_avg_sq must be {master.dtype} and grad a float tensor, "
                         f"got {exp_avg.dtype}, {exp_avg_sq.dtype}, {grad.dtype}")
    if model_copy is not None:
        _check_flat("model_copy", model_copy, n, model_copy.device)
    if n == 0:
        return
    if weight_decay == 0.0:
        runs = [(0, n, False)]  # nothing decays: one call over the whole buffer
    elif runs is None:
        runs = decay_runs(decay_mask) if decay_mask is not None else [(0, n, True)]
    else:
        _check_runs(runs, n)
    step_t = torch.full((), float(step), dtype=torch.float32, device=device)
    scale_t = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
    hyper = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps), amsgrad=False,
                 maximize=False, grad_scale=scale_t, found_inf=None)

    def update(pieces: Sequence[Run], g: Tensor, offset: int) -> None:
        """The fused kernel over the pieces (absolute offsets; g starts at ``offset``), one call per decay."""
        for decays in (True, False):
            views = [(s, e) for s, e, d in pieces if d == decays and e > s]
            if not views:
                continue
            torch._fused_adamw_([master[s:e] for s, e in views], [g[s - offset:e - offset] for s, e in views],
                                [exp_avg[s:e] for s, e in views], [exp_avg_sq[s:e] for s, e in views], [],
                                [step_t] * len(views), weight_decay=float(weight_decay) if decays else 0.0, **hyper)

    convert = grad.dtype != master.dtype
    # A model copy on the CPU is written chunk by chunk, while that chunk of master is still in cache.
    inline_copy = model_copy is not None and model_copy.device == device and device.type == "cpu"
    if not convert and not inline_copy:
        update(runs, grad, 0)
    else:  # bounded chunks, and a bounded fp32 scratch reused chunk after chunk: never a full-buffer temporary
        chunk = min(n, CPU_CHUNK if device.type == "cpu" else GPU_CHUNK)
        scratch = torch.empty(chunk, dtype=master.dtype, device=device) if convert else None
        starts = [s for s, _, _ in runs]
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            if scratch is not None:
                g = scratch[:hi - lo]
                g.copy_(grad[lo:hi])
            else:
                g = grad[lo:hi]
            update(_pieces(runs, starts, lo, hi), g, lo)
            if inline_copy:
                model_copy[lo:hi].copy_(master[lo:hi])
    if model_copy is not None and not inline_copy:  # as adamw_step: an offloaded master's host-to-device copy
        model_copy.copy_(master, non_blocking=model_copy.device.type == "cuda")  # needs no wait
