"""RMSNorm (Zhang & Sennrich 2019) and LayerNorm (Ba et al. 2016), forward and backward, one Triton kernel each.

Unfused, a norm is a handful of elementwise kernels each way (mean, square, rsqrt, the multiplies; the backward
twice that), every one a pass over the activations: the largest non-matmul items of a step after the matmuls.
Here a program owns whole rows: the forward reads x, the weight (and bias) once and writes y and the row's
1/std (and mean); the backward reads x, dy, the weight and the row's statistics once, writes dx, and sums its
rows' shares of the weight's (and bias's) gradient in registers, so the only extra pass is the (programs x
hidden) sum of those shares. One kernel serves both norms: LayerNorm centres the row first (``CENTRED``).

The arithmetic is the torch paths' (``models.llama._RMSNormFunction``, torch's layer_norm under autocast):
float32 whatever the input's dtype; x̂ = (x - mean) r (RMSNorm: x r), y = x̂ w (+ b), and with g = dy w,
dx = r (g - mean(g) - x̂ mean(g x̂)) (RMSNorm: without mean(g)).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from megazero.kernels.errors import UserError

try:  # triton is optional: CPU-only installs run the torch implementation
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

IMPLS = ("auto", "torch", "triton")
ROWS_PER_PROGRAM = 16  # the backward's rows per program: fewer weight-gradient shares to sum


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: str, device_type: str) -> str:
    """kernels.norm: auto is torch until a GPU measurement shows the kernels faster (bench/mfu.py's row); triton
    needs CUDA or Triton's interpreter."""
    if impl not in IMPLS:
        raise UserError(f"kernels.norm={impl!r} is not a norm implementation; valid: {' | '.join(IMPLS)}")
    if impl == "triton" and (triton is None or (device_type != "cuda" and not _interpreting())):
        raise UserError(f"kernels.norm=triton needs a CUDA GPU with triton installed (this run is on {device_type}); "
                        "use kernels.norm=torch or auto")
    return "torch" if impl == "auto" else impl


def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps, CENTRED: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
    if CENTRED:
        mean = tl.sum(x, axis=0) / n
        x = tl.where(inb, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = x * rstd * tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + offs, y, mask=inb)
    tl.store(rstd_ptr + row, rstd)


def _backward_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, rows, n,
                     CENTRED: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    w = tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS):
        row = tl.minimum(pid * ROWS + i, rows - 1)  # past the last row: read it again, store and add nothing
        live = (tl.zeros((BLOCK,), dtype=tl.int32) + pid * ROWS + i) < rows
        x = tl.load(x_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        g = dy * w
        if CENTRED:
            xhat = tl.where(inb, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
            g_centred = g - tl.sum(g, axis=0) / n
        else:
            xhat = x * rstd
            g_centred = g
        dx = rstd * (g_centred - xhat * (tl.sum(g * xhat, axis=0) / n))
        tl.store(dx_ptr + row * n + offs, dx.to(dx_ptr.dtype.element_ty), mask=inb & live)
        dw += tl.where(live, dy * xhat, 0.0)
        if HAS_BIAS:
            db += tl.where(live, dy, 0.0)
    tl.store(dw_ptr + pid * n + offs, dw, mask=inb)
    if HAS_BIAS:
        tl.store(db_ptr + pid * n + offs, db, mask=inb)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """The jitted kernels for this mode (built on first use: TRITON_INTERPRET may be set after import)."""
    del interpret  # part of the cache key only
    return triton.jit(_forward_kernel), triton.jit(_backward_kernel)


class _NormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, centred: bool) -> Tensor:
        forward, _ = _kernels(_interpreting())
        n = x.shape[-1]
        rows = x.reshape(-1, n).contiguous()
        y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        mean = torch.empty_like(rstd) if centred else rstd  # RMSNorm: an unused pointer
        forward[(rows.shape[0],)](rows, weight, weight if bias is None else bias, y, mean, rstd, n, eps,
                                  CENTRED=centred, HAS_BIAS=bias is not None, BLOCK=triton.next_power_of_2(n))
        ctx.save_for_backward(rows, weight, mean, rstd)  # the input in its own dtype, as the torch path keeps it
        ctx.shape, ctx.centred, ctx.bias_dtype = x.shape, centred, None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, backward = _kernels(_interpreting())
        rows, weight, mean, rstd = ctx.saved_tensors
        n, has_bias = rows.shape[-1], ctx.bias_dtype is not None
        dy = grad.reshape(-1, n).contiguous()
        dx = torch.empty_like(rows)
        programs = triton.cdiv(rows.shape[0], ROWS_PER_PROGRAM)
        dw = torch.empty(programs, n, dtype=torch.float32, device=rows.device)
        db = torch.empty_like(dw) if has_bias else dw  # no bias: an unused pointer
        backward[(programs,)](rows, weight, dy, mean, rstd, dx, dw, db, rows.shape[0], n, CENTRED=ctx.centred,
                              HAS_BIAS=has_bias, ROWS=ROWS_PER_PROGRAM, BLOCK=triton.next_power_of_2(n))
        grad_bias = db.sum(0).to(ctx.bias_dtype) if has_bias else None
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), grad_bias, None, None


def _norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, centred: bool) -> Tensor:
    if triton is None:
        raise RuntimeError("the Triton norms need triton; use kernels.norm=torch")
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1], (x.shape, weight.shape)
    return _NormTriton.apply(x, weight, bias, eps, centred)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) * weight over the last dimension, in float32 (the result's dtype: x's promoted
    to float32). The weight a 1-D tensor of x's last size."""
    return _norm(x, weight, None, eps, False)


def layer_norm_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension, in float32 (as rms_norm_triton)."""
    return _norm(x, weight, bias, eps, True)
