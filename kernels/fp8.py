"""FP8 matmuls with dynamic scaling for the linears' three GEMMs (``train.fp8``), through ``torch._scaled_mm``.

Each operand is scaled so that its largest magnitude lands on the format's largest value, cast to FP8, and
multiplied with the scales' inverses applied to the product (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", §3-4; the recipes torchao's float8 training names): ``tensorwise`` one scale per operand,
``rowwise`` one per row of the left operand and per column of the right, along the dimension that is not
summed. Activations and weights go to E4M3 (more mantissa), gradients to E5M2 (more range). Nothing FP8 is
kept: the forward saves its input and weight as they came, and the backward quantizes them again, each GEMM
with its own scales. ``torch._scaled_mm`` runs on CUDA from sm_89 and on the CPU, which is where the tests run.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_TINY = 1e-12  # an all-zero operand keeps a finite scale


def quantize(x: Tensor, dtype: torch.dtype, recipe: str, dim: Optional[int]) -> tuple[Tensor, Tensor]:
    """(x in FP8, the fp32 scale that restores it: x ≈ x8 * scale). ``dim``: the dimension summed over by the
    GEMM; rowwise keeps one scale per index of the other dimension (as a column or a row vector)."""
    top = torch.finfo(dtype).max
    x32 = x.float()
    if recipe == "tensorwise":
        amax = x32.abs().amax()
    else:
        amax = x32.abs().amax(dim=dim, keepdim=True)
    scale = amax.clamp(min=_TINY) / top
    return (x32 / scale).clamp(-top, top).to(dtype), scale


def scaled_matmul(a: Tensor, b: Tensor, recipe: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
                  out_dtype: torch.dtype) -> Tensor:
    """a (m, k) @ b (k, n) in FP8: a quantized per row (rowwise) and b per column, over k."""
    a8, sa = quantize(a, a_dtype, recipe, dim=1)
    b8, sb = quantize(b, b_dtype, recipe, dim=0)
    b8 = b8.t().contiguous().t()  # the right operand column-major, as _scaled_mm takes it
    return torch._scaled_mm(a8.contiguous(), b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class Fp8Linear(torch.autograd.Function):
    """y = x wᵀ (+ b) with the forward, input-gradient and weight-gradient GEMMs in FP8."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = scaled_matmul(flat, w.t(), recipe, E4M3, E4M3, x.dtype)
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.has_bias = recipe, b is not None
        y = y.view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b.to(y.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        flat = x.reshape(-1, x.shape[-1])
        grad_x = scaled_matmul(g, w.to(g.dtype), ctx.recipe, E5M2, E4M3, g.dtype).view(x.shape)
        grad_w = scaled_matmul(g.t(), flat.to(g.dtype), ctx.recipe, E5M2, E4M3, torch.float32).to(w.dtype)
        grad_b = g.sum(0).to(w.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str) -> Tensor:
    """``F.linear`` with its GEMMs in FP8 (``recipe``: tensorwise | rowwise); under autocast the input and weight
    come in autocast's dtype, as ``F.linear`` would compute them."""
    assert recipe in RECIPES, recipe
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    with torch.autocast(device, enabled=False):
        return Fp8Linear.apply(x, w, b, recipe)
