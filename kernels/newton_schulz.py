"""Muon's orthogonalisation: the Newton-Schulz iteration that maps a matrix G = U S V^T to ~U V^T.

Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks": five steps of the quintic
``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and (a, b, c) = (3.4445, -4.7750, 2.0315), from X = G / ||G||_F
(so every singular value starts at or below 1). The coefficients trade exactness for speed: the singular values
end in roughly [0.7, 1.2], not at 1, which is what the published optimizer does. A tall matrix is transposed
first, so ``A`` is the smaller Gram matrix (min(m, n)^2).

Cost: 5 (4 m^2 n + 2 m^3) flops for m = min and n = max of the shape (:func:`newton_schulz_flops`).
The iteration commutes with permutations of rows and of columns (``P G Q -> P NS(G) Q``), so a matrix
assembled from tensor-parallel shards in any consistent order gives the same update, permuted alike.
"""
from __future__ import annotations

from torch import Tensor

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7  # added to the Frobenius norm, as published: a zero gradient gives a zero update


def newton_schulz(g: Tensor, steps: int = STEPS) -> Tensor:
    """~U V^T of a 2-D ``g`` (computed in ``g``'s dtype; fp32 or float64 here, bf16 where a caller wants it)."""
    assert g.dim() == 2, tuple(g.shape)
    a, b, c = COEFFICIENTS
    tall = g.shape[0] > g.shape[1]
    x = g.mT if tall else g
    x = x / (x.norm() + EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def newton_schulz_flops(rows: int, cols: int, steps: int = STEPS) -> int:
    """Multiply-adds x 2 of :func:`newton_schulz` on a rows x cols matrix: per step X X^T (2 m^2 n), A A
    (2 m^3) and (bA + cA^2) X (2 m^2 n), with m = min(rows, cols) and n = max."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)
