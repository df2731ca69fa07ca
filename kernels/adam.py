"""AdamW over flat buffers: one call per buffer, not one per tensor.

The optimizer step of ``parallel.zero`` calls :func:`adamw_step` on this
rank's flat fp32 master shard. This is the torch implementation; it is
written as the same sequence of operations as ``torch.optim.AdamW``
(decoupled weight decay, Loshchilov & Hutter 2019; bias-corrected moments,
Kingma & Ba 2015) so both give the same numbers in fp32.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from megazero.kernels.adam_cpu import Run, adamw_step_fused
from megazero.kernels.errors import UserError


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
    if model_copy is not None:  # host-to-device from pinned (offloaded) master: nothing to wait for; the next
        # host write to master comes after the next step's overflow check has synchronised the stream
        model_copy.copy_(master, non_blocking=model_copy.device.type == "cuda")


# --------------------------------------------------------------------------------------------------------------------
# Triton: the same update as one fused kernel launch per flat buffer.
# --------------------------------------------------------------------------------------------------------------------

try:  # triton is optional: CPU-only installs run the torch implementation above.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_IMPLS = ("auto", "fused", "torch", "triton")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, mask_ptr, copy_ptr, n, decay_factor, grad_scale,
                  lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size,
                  HAS_MASK: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    """One program updates BLOCK consecutive elements; every scalar but the flags is a runtime argument.

    The operations and their order are those of torch.optim.AdamW (single-tensor path) in fp32, with IEEE
    sqrt/division (sqrt_rn/div_rn, not the fast approximations) so the result matches torch to the last bits.
    """
    pid = tl.program_id(0).to(tl.int64)  # int64 offsets: a flat buffer may exceed 2**31 elements
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    g = tl.load(grad_ptr + offs, mask=inb, other=0.0).to(tl.float32) * grad_scale
    p = tl.load(master_ptr + offs, mask=inb, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=inb, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=inb, other=0.0)
    # Decoupled weight decay (Loshchilov & Hutter 2019): p *= 1 - lr*wd, only where the mask says so.
    if HAS_MASK:
        decay = tl.load(mask_ptr + offs, mask=inb, other=0) != 0
        p = tl.where(decay, p * decay_factor, p)
    else:
        p = p * decay_factor
    # exp_avg.lerp_(g, w): torch computes fma(w, g - m, m) for w < 0.5 and fma(w - 1, g - m, g) otherwise.
    small = lerp_weight < 0.5
    coeff = tl.where(small, lerp_weight, lerp_weight - 1.0)
    base = tl.where(small, m, g)
    m = tl.fma(coeff, g - m, base)
    # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    v = v * beta2 + one_minus_beta2 * g * g
    # p.addcdiv_(m, sqrt(v) / sqrt(bc2) + eps, value=-lr / bc1)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    tl.store(master_ptr + offs, p, mask=inb)
    tl.store(exp_avg_ptr + offs, m, mask=inb)
    tl.store(exp_avg_sq_ptr + offs, v, mask=inb)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=inb)


@functools.lru_cache(maxsize=None)
def _compiled_kernel(interpret: bool):
    """The jitted kernel for this mode (triton picks interpreter vs compiler when ``triton.jit`` runs).

    Built on first use, not at import, so setting TRITON_INTERPRET after importing this module still works.
    ``n`` stays specialised on divisibility by 16 (Triton's default): the bounds mask is then known constant
    over 4-element vectors and loads/stores compile to 128-bit ``ld.global.v4``; without it they are scalar.
    That costs at most a second variant for lengths that are not multiples of 16, never one per lr/step.
    """
    del interpret  # part of the cache key only
    return triton.jit(_adamw_kernel)


def _launch_config() -> tuple[int, int]:
    """(BLOCK, num_warps). GPU: 2048 fp32 elements per program, 8 warps = 8 elements per thread, i.e. two
    128-bit loads per fp32 stream, enough bytes in flight per SM to saturate HBM3e on Hopper. The interpreter
    pays per program, not per element, but tests want several programs and a ragged tail: 512."""
    return (512, 4) if _interpreting() else (2048, 8)


def _check_flat(name: str, t: Tensor, n: int, device: torch.device, dtype: Optional[torch.dtype] = None) -> None:
    if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"adamw_step_triton: {name} must be a contiguous 1-D tensor of {n} elements, "
                         f"got shape {tuple(t.shape)} (contiguous={t.is_contiguous()})")
    if t.device != device:
        raise ValueError(f"adamw_step_triton: {name} is on {t.device}, master on {device}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"adamw_step_triton: {name} must be {dtype}, got {t.dtype}")
    if dtype is None and not t.dtype.is_floating_point:
        raise ValueError(f"adamw_step_triton: {name} must be a float tensor, got {t.dtype}")


def adamw_step_triton(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                      decay_mask: Optional[Tensor] = None, grad_scale: float = 1.0,
                      model_copy: Optional[Tensor] = None) -> None:
    """:func:`adamw_step` as one fused Triton kernel launch over the whole flat buffer.

    Why: the optimizer step is memory-bound (a few flops per element), so its cost is bytes moved. Per
    element this kernel reads grad (2-4 B), master, exp_avg, exp_avg_sq (12 B) and the decay mask (1 B), and
    writes master, exp_avg, exp_avg_sq (12 B) plus the model copy (2 B): ~29 B for bf16 grads, each byte
    touched once. The torch implementation makes ~10 passes over the buffer (one per elementwise op, with
    temporaries), and a per-tensor optimizer also pays one launch per parameter tensor; here ZeRO's flat
    buffer is one launch, whatever the number of parameters.

    The math is AdamW: Adam's bias-corrected moments (Kingma & Ba 2015) with decoupled weight decay
    (Loshchilov & Hutter 2019), in the same operation order as ``torch.optim.AdamW``. Bias corrections,
    lr and grad_scale are computed on the host and passed as runtime scalars, so a new lr or step never
    recompiles; variants are selected only by the presence of ``decay_mask``/``model_copy``, the dtypes of
    grad and model_copy, and pointer alignment / ``n % 16``.

    Same contract as :func:`adamw_step`. All tensors are contiguous 1-D of the same length on the same
    device (ValueError otherwise); master/exp_avg/exp_avg_sq are fp32, grad any float dtype, decay_mask
    bool. A model_copy on another device (e.g. CPU-offloaded optimizer state) is filled by a copy after
    the kernel.
    """
    if triton is None:
        raise RuntimeError("adamw_step_triton needs triton; use adamw_step (see resolve_impl)")
    n, device = master.numel(), master.device
    _check_flat("master", master, n, device, torch.float32)
    _check_flat("exp_avg", exp_avg, n, device, torch.float32)
    _check_flat("exp_avg_sq", exp_avg_sq, n, device, torch.float32)
    _check_flat("grad", grad, n, device)
    interpret = _interpreting()
    if device.type != "cuda" and not interpret:
        raise ValueError(f"adamw_step_triton: tensors are on {device}; the Triton kernel needs CUDA "
                         "(or TRITON_INTERPRET=1)")
    has_mask = decay_mask is not None and weight_decay != 0.0  # no decay: the mask changes nothing
    if decay_mask is not None:
        _check_flat("decay_mask", decay_mask, n, device, torch.bool)
    copy_after = model_copy is not None and model_copy.device != device
    has_copy = model_copy is not None and not copy_after
    if model_copy is not None:
        _check_flat("model_copy", model_copy, n, model_copy.device)
    if n == 0:
        return
    block, num_warps = _launch_config()
    kernel = _compiled_kernel(interpret)
    kernel[(triton.cdiv(n, block),)](
        master, grad, exp_avg, exp_avg_sq,
        decay_mask.view(torch.uint8) if has_mask else master,  # unused pointer when HAS_MASK is False
        model_copy if has_copy else master,
        n,
        float(1.0 - lr * weight_decay), float(grad_scale),
        float(1.0 - beta1), float(beta2), float(1.0 - beta2),
        float(math.sqrt(1.0 - beta2 ** step)), float(eps), float(-lr / (1.0 - beta1 ** step)),
        HAS_MASK=has_mask, HAS_COPY=has_copy, BLOCK=block, num_warps=num_warps,
        enable_fp_fusion=False,  # keep torch's rounding: only the lerp is an fma, as in torch's kernel
    )
    if copy_after:
        model_copy.copy_(master)


def adamw(impl: str, master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
          runs: Optional[Sequence[Run]] = None, **kwargs) -> None:
    """Dispatch to :func:`adamw_step` (``impl="torch"``), :func:`adamw_step_triton` (``"triton"``) or
    :func:`kernels.adam_cpu.adamw_step_fused` (``"fused"``).

    ``impl`` is a resolved name (see :func:`resolve_impl`); keyword arguments are those of adamw_step.
    runs: the buffer's decay runs (:func:`kernels.adam_cpu.decay_runs`, computed once); only "fused" uses
    them, the others read decay_mask.
    """
    if impl == "torch":
        adamw_step(master, grad, exp_avg, exp_avg_sq, **kwargs)
    elif impl == "triton":
        adamw_step_triton(master, grad, exp_avg, exp_avg_sq, **kwargs)
    elif impl == "fused":
        adamw_step_fused(master, grad, exp_avg, exp_avg_sq, runs=runs, **kwargs)
    else:
        raise ValueError(f"adamw: impl must be 'torch', 'triton' or 'fused' (resolved), got {impl!r}")


def triton_available() -> bool:
    """True when the Triton kernel can run here: triton imports and there is a CUDA GPU or the interpreter
    (TRITON_INTERPRET=1) is on."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


def resolve_impl(requested: str, device_type: str) -> str:
    """The AdamW implementation for ``kernels.adam=requested`` with optimizer state on ``device_type``.

    "auto": on CUDA "triton" when triton imports, else "torch"; on the CPU "fused" (torch's fused AdamW
    kernel over the buffer's decay runs, see kernels.adam_cpu). "fused" and "torch": always. "triton":
    when triton imports and the state is on CUDA (or TRITON_INTERPRET=1 runs kernels on the CPU
    interpreter); else a UserError naming what would be valid here.
    """
    if requested not in _IMPLS:
        raise UserError(f"kernels.adam={requested!r} is not an AdamW implementation; valid: "
                                + " | ".join(_IMPLS))
    if requested in ("torch", "fused"):
        return requested
    runnable = triton is not None and (device_type == "cuda" or _interpreting())
    if requested == "auto":
        if device_type == "cuda":
            return "triton" if triton is not None else "torch"
        return "fused" if device_type == "cpu" else "torch"
    if not runnable:
        raise UserError("kernels.adam='triton' needs a CUDA GPU with triton installed (or TRITON_INTERPRET=1 "
                                "to run the kernels on the CPU interpreter); valid here: auto | fused | torch")
    return "triton"
