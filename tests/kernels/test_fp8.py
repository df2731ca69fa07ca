"""FP8 GEMMs (kernels/fp8.py) against float64: the forward and both gradients of a linear, each recipe.

Bounds, relative Frobenius error of the whole tensor: round-to-nearest E4M3 (3 mantissa bits) errs by up to
2^-4 of a value at the bottom of a binade and 2^-5 at its top, ~2.5% RMS over a binade; a product of two
quantized operands ~3.6%, and the sums of a GEMM keep that relative size. E5M2 (2 bits, the gradients) doubles
its operand's share: ~5.6% with an E4M3 partner. Measured on these shapes: forward 3.7-3.8%, gradients
5.8-6.0%, in fp32 and bf16. The bounds, 5% and 8%, fail a scale applied twice or not at all (errors of order
1) and an E4M3 gradient taken for E5M2's range. The bias gradient is a plain sum (1e-6 in fp32; bf16's
rounding, 2^-8, in bf16).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.kernels.fp8 import fp8_linear, quantize


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_linear_is_within_fp8_rounding_of_float64(recipe, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 128, generator=g).to(dtype).requires_grad_()
    w = (0.05 * torch.randn(256, 128, generator=g)).to(dtype).requires_grad_()
    b = torch.randn(256, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(4, 32, 256, generator=g).to(dtype)
    y = fp8_linear(x, w, b, recipe)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(x64, w64, b64)
    rx, rw, rb = torch.autograd.grad(ref, (x64, w64, b64), dy.double())
    assert y.dtype == gx.dtype == gw.dtype == dtype
    assert _relative(y - b, ref - b64) <= 0.05
    assert _relative(gx, rx) <= 0.08 and _relative(gw, rw) <= 0.08
    assert _relative(gb, rb) <= (1e-6 if dtype == torch.float32 else 2 ** -8)


def test_rowwise_scales_each_row_on_its_own():
    """Rows 10^6 apart: one scale for the tensor flushes the small rows below E4M3's smallest value (~2^-9 of
    the largest after scaling), rowwise keeps each row within its rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g) * torch.tensor([1e3, 1e-3] * 4)[:, None]
    for recipe, small_error in (("tensorwise", lambda e: e > 0.5), ("rowwise", lambda e: e < 0.05)):
        x8, scale = quantize(x, torch.float8_e4m3fn, recipe, dim=1)
        back = x8.float() * scale
        error = _relative(back[1::2], x[1::2].double())
        assert small_error(error), (recipe, error)
