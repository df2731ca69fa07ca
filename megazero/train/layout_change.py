"""The line a resume at another layout prints: the world and the dimensions that changed, and the microbatches
per rank that keep the global batch.

Elastic continuation rests on it: ``torchrun --nnodes MIN:MAX`` restarts the job on the nodes that remain,
``parallel.dp: auto`` takes the new world, ``train.resume: auto`` the latest (layout-free) checkpoint, and the
global batch stays ``train.global_batch`` by running more microbatches per rank. A world that cannot hold
tp x pp x cp is refused in one line before anything is read or written (``megazero.config.rules.world_dp``).
"""
from __future__ import annotations

from typing import Any, Optional

DIMS = ("tp", "pp", "cp", "ep", "dp")


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def layout_change(saved: dict, cfg: Any) -> Optional[str]:
    """``saved``: the checkpoint's config (meta.json); ``cfg``: this run's, resolved. None when the layout is the
    same (or the checkpoint does not say: an older one)."""
    par, train = saved.get("parallel"), saved.get("train")
    if not isinstance(par, dict) or not isinstance(train, dict):
        return None
    before = {d: _count(par.get(d, 1)) for d in DIMS}
    batch, micro = _count(train.get("global_batch")), _count(train.get("micro_batch"))
    if None in before.values() or batch is None or micro is None:
        return None
    after = {d: getattr(cfg.parallel, d) for d in DIMS}
    if before == after:
        return None
    world = [b["tp"] * b["pp"] * b["cp"] * b["dp"] for b in (before, after)]
    head = f"world {world[0]} → {world[1]}: " if world[0] != world[1] else "layout: "
    dims = ", ".join(f"{d} {before[d]} → {after[d]}" for d in DIMS if before[d] != after[d])
    t = cfg.train
    kept = f"global batch {t.global_batch} kept" if batch == t.global_batch else \
        f"global batch {batch} → {t.global_batch}"
    return (f"{head}{dims}, microbatches per rank {batch // (micro * before['dp'])} → "
            f"{t.global_batch // (t.micro_batch * after['dp'])} ({kept})")
