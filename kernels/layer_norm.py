"""LayerNorm (Ba et al. 2016) forward and backward as one Triton kernel each: what ``kernels/rms_norm.py`` does
for RMSNorm, for GPT-2's norms (``kernels.norm``, resolved there).

A program owns whole rows: the forward reads x, the weight and the bias once and writes y, the row's mean and
1/std; the backward writes dx = r (g - mean(g) - x̂ mean(g x̂)) with g = dy w, x̂ = (x - mean) r, and sums its
rows' shares of the weight's and bias's gradients in registers. float32 arithmetic whatever the input's dtype,
as torch's layer_norm under autocast.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from megazero.kernels.rms_norm import ROWS_PER_PROGRAM, _interpreting, tl, triton


def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    centred = tl.where(inb, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n + eps)
    y = centred * rstd * tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + offs, y, mask=inb)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


def _backward_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, rows, n, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
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
        xhat = tl.where(inb, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        g = dy * w
        dx = rstd * (g - tl.sum(g, axis=0) / n - xhat * (tl.sum(g * xhat, axis=0) / n))
        tl.store(dx_ptr + row * n + offs, dx.to(dx_ptr.dtype.element_ty), mask=inb & live)
        dw += tl.where(live, dy * xhat, 0.0)
        db += tl.where(live, dy, 0.0)
    tl.store(dw_ptr + pid * n + offs, dw, mask=inb)
    tl.store(db_ptr + pid * n + offs, db, mask=inb)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """The jitted kernels for this mode (built on first use: TRITON_INTERPRET may be set after import)."""
    del interpret  # part of the cache key only
    return triton.jit(_forward_kernel), triton.jit(_backward_kernel)


class _LayerNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
        forward, _ = _kernels(_interpreting())
        n = x.shape[-1]
        rows = x.reshape(-1, n).contiguous()
        y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        mean = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        forward[(rows.shape[0],)](rows, weight, weight if bias is None else bias, y, mean, rstd, n, eps,
                                  HAS_BIAS=bias is not None, BLOCK=triton.next_power_of_2(n))
        ctx.save_for_backward(rows, weight, mean, rstd)  # the input in its own dtype
        ctx.shape, ctx.has_bias, ctx.bias_dtype = x.shape, bias is not None, None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, backward = _kernels(_interpreting())
        rows, weight, mean, rstd = ctx.saved_tensors
        n = rows.shape[-1]
        dy = grad.reshape(-1, n).contiguous()
        dx = torch.empty_like(rows)
        programs = triton.cdiv(rows.shape[0], ROWS_PER_PROGRAM)
        dw = torch.empty(programs, n, dtype=torch.float32, device=rows.device)
        db = torch.empty_like(dw)
        backward[(programs,)](rows, weight, dy, mean, rstd, dx, dw, db, rows.shape[0], n, ROWS=ROWS_PER_PROGRAM,
                              BLOCK=triton.next_power_of_2(n))
        grad_bias = db.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), grad_bias, None


def layer_norm_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension, in float32 (the result's dtype:
    x's promoted to float32), through the two kernels above."""
    if triton is None:
        raise RuntimeError("layer_norm_triton needs triton; use kernels.norm=torch")
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1], (x.shape, weight.shape)
    return _LayerNormTriton.apply(x, weight, bias, eps)
