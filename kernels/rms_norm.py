"""RMSNorm (Zhang & Sennrich 2019) forward and backward as one Triton kernel each.

Unfused, a norm is a handful of elementwise kernels each way (square, mean, rsqrt, two multiplies; the backward
twice that), every one a pass over the activations: the largest non-matmul items of a step after the matmuls.
Here a program owns whole rows: the forward reads x and the weight once and writes y and the row's 1/rms; the
backward reads x, dy, the weight and 1/rms once, writes dx, and sums its rows' share of the weight's gradient in
registers, so the only extra pass is the (programs x hidden) sum of those shares. The arithmetic is the torch
path's (``models.llama._RMSNormFunction``): float32 whatever the input's dtype, y = x r w, dx = r (g - x̂ mean(g x̂))
with g = dy w, x̂ = x r.
"""
from __future__ import annotations

import functools
import os

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
    """kernels.norm (this kernel and kernels/layer_norm.py's): auto is torch until a GPU measurement shows the
    kernels faster (bench/mfu.py's row); triton needs CUDA or Triton's interpreter."""
    if impl not in IMPLS:
        raise UserError(f"kernels.norm={impl!r} is invalid; valid: {', '.join(IMPLS)}")
    if impl == "triton" and (triton is None or (device_type != "cuda" and not _interpreting())):
        raise UserError(f"kernels.norm=triton needs a CUDA GPU with triton installed (this run is on {device_type}); "
                        "use kernels.norm=torch or auto")
    return "torch" if impl == "auto" else impl


def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(y_ptr + row * n + offs, x * rstd * w, mask=inb)
    tl.store(rstd_ptr + row, rstd)


def _backward_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, n, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    w = tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS):
        row = tl.minimum(pid * ROWS + i, rows - 1)  # past the last row: read it again, store and add nothing
        live = (tl.zeros((BLOCK,), dtype=tl.int32) + pid * ROWS + i) < rows
        x = tl.load(x_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n + offs, mask=inb, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n))
        tl.store(dx_ptr + row * n + offs, dx.to(dx_ptr.dtype.element_ty), mask=inb & live)
        dw += tl.where(live, dy * xhat, 0.0)
    tl.store(dw_ptr + pid * n + offs, dw, mask=inb)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """The jitted kernels for this mode (built on first use: TRITON_INTERPRET may be set after import)."""
    del interpret  # part of the cache key only
    return triton.jit(_forward_kernel), triton.jit(_backward_kernel)


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        forward, _ = _kernels(_interpreting())
        n = x.shape[-1]
        rows = x.reshape(-1, n).contiguous()
        y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        forward[(rows.shape[0],)](rows, weight, y, rstd, n, eps, BLOCK=triton.next_power_of_2(n))
        ctx.save_for_backward(rows, weight, rstd)  # the input in its own dtype, as the torch path keeps it
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, backward = _kernels(_interpreting())
        rows, weight, rstd = ctx.saved_tensors
        n = rows.shape[-1]
        dy = grad.reshape(-1, n).contiguous()
        dx = torch.empty_like(rows)
        programs = triton.cdiv(rows.shape[0], ROWS_PER_PROGRAM)
        dw = torch.empty(programs, n, dtype=torch.float32, device=rows.device)
        backward[(programs,)](rows, weight, dy, rstd, dx, dw, rows.shape[0], n, ROWS=ROWS_PER_PROGRAM,
                              BLOCK=triton.next_power_of_2(n))
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), None


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) * weight over the last dimension, in float32 (the result's dtype: x's promoted
    to float32), through the two kernels above. Contiguous rows; the weight a 1-D tensor of x's last size."""
    if triton is None:
        raise RuntimeError("rms_norm_triton needs triton; use kernels.norm=torch")
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1], (x.shape, weight.shape)
    return _RMSNormTriton.apply(x, weight, eps)
