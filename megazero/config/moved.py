"""The optim keys that moved into their optimizer's section (``optim.freeze_step`` -> ``optim.onebit_adam.freeze_step``).

Before ``parallel.zero.registry``, every optimizer's settings were flat keys of ``optim``. A config or ``--set``
that still names one is refused in one line naming where it went; a checkpoint's meta.json that holds them is
read through ``sections_of`` so a resume compares like with like.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from megazero.parallel.zero.registry import OPTIMIZERS

# the flat keys optim had before its sections (frozen: what old files and checkpoints may hold)
FLAT_KEYS = ("beta1", "beta2", "eps", "momentum", "nesterov", "ns_steps", "adamw_lr", "freeze_step")


def _holders(key: str) -> list[str]:
    return [n for n, row in OPTIMIZERS.items() if key in {f.name for f in dataclasses.fields(row.section)}]


def moved_line(key: str) -> Optional[str]:
    """The one line for flat key ``optim.<key>`` (None: not a key that moved)."""
    if key not in FLAT_KEYS:
        return None
    holders = _holders(key)
    assert holders, key
    if len(holders) == 1:
        return f"optim.{key} moved to optim.{holders[0]}.{key}"
    listed = ", ".join(f"optim.{n}.{key}" for n in holders)
    return f"optim.{key} moved to optim.<name>.{key}, the section of optim.name ({listed})"


def sections_of(stored: dict) -> dict:
    """A checkpoint's stored ``optim`` mapping with its sections: one written with the flat keys gets them
    moved into the section of its own optimizer (``optim.name``, AdamW before there was one)."""
    name = stored.get("name", "adamw")
    flat = {k: v for k, v in stored.items() if k in FLAT_KEYS}
    if not flat:
        return stored
    out = {k: v for k, v in stored.items() if k not in FLAT_KEYS}
    if isinstance(name, str) and name in OPTIMIZERS:
        keys = {f.name for f in dataclasses.fields(OPTIMIZERS[name].section)}
        out[name] = {**{k: v for k, v in flat.items() if k in keys}, **(out.get(name) or {})}
    return out
