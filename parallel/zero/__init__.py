"""ZeRO data parallelism as composed parts; see ``parallel.zero.optimizer``.

The names below are loaded on first use (PEP 562), so that importing a torch-free module of this package
(``parallel.zero.registry``, ``parallel.zero.policy``) does not import torch: loading a config does that.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Bucket", "BucketLayout", "DTYPES", "StagePolicy", "ZeroOptimizer", "grad_precision"]


def __getattr__(name: str) -> Any:
    if name in ("Bucket", "BucketLayout"):
        from megazero.parallel.zero import layout
        return getattr(layout, name)
    if name in ("DTYPES", "ZeroOptimizer"):
        from megazero.parallel.zero import optimizer
        return getattr(optimizer, name)
    if name == "StagePolicy":
        from megazero.parallel.zero.policy import StagePolicy
        return StagePolicy
    if name == "grad_precision":
        from megazero.parallel.zero.grads import grad_precision
        return grad_precision
    raise AttributeError(f"module 'megazero.parallel.zero' has no attribute {name!r}")
