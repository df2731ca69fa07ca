"""kernels.grouped: ``grouped_mm`` gives the per-group loop's values and gradients for every input the layer can
hand it, including those ``torch._grouped_mm`` itself refuses (widths that are not a multiple of 16 bytes,
float64, strided rows, a broadcast output gradient, an empty group): it falls back or adapts instead of failing."""
import pytest
import torch

from megazero.kernels.grouped import grouped_mm, grouped_mm_loop

CASES = {  # name: (dtype, in, out, sizes, how the input is laid out, the loss)
    "aligned": (torch.float32, 8, 16, [3, 0, 5], "rows", "random"),
    "output width of 12 bytes": (torch.float32, 8, 3, [4, 6], "rows", "random"),
    "input width of 24 bytes": (torch.float32, 6, 8, [4, 6], "rows", "random"),
    "bf16 width of 24 bytes": (torch.bfloat16, 12, 8, [4, 6], "rows", "random"),
    "float64": (torch.float64, 8, 8, [4, 6], "rows", "random"),
    "strided rows": (torch.float32, 8, 8, [4, 6], "columns", "random"),
    "loss = y.sum() (a broadcast gradient)": (torch.float32, 8, 8, [4, 6], "rows", "sum"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_mm_equals_the_loop(name):
    dtype, i, o, sizes, layout, loss = CASES[name]
    gen = torch.Generator().manual_seed(0)
    rows = sum(sizes)
    base = torch.randn(rows, i, generator=gen) if layout == "rows" else torch.randn(i, rows, generator=gen).t()
    w0 = torch.randn(len(sizes), o, i, generator=gen)
    dy = torch.randn(rows, o, generator=gen).to(dtype)
    got = []
    for fn in (grouped_mm, grouped_mm_loop):
        x = base.to(dtype).requires_grad_()
        w = w0.to(dtype).requires_grad_()
        y = fn(x, w, sizes)
        (y.sum() if loss == "sum" else (y * dy).sum()).backward()
        got.append([y.detach(), x.grad, w.grad])
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, **tol)
