"""What a resume demands of the optimizer: the checkpoint's own (its states are that optimizer's), unless
``optim.switch_from`` names it and its registry row lets it continue as ``optim.name`` (1-bit and 0/1 Adam's
masters and moments going on in full precision as AdamW or LAMB); then one line says so. What the optimizer's
states assume of the layout is its row's ``resume_check``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megazero.checkpoint.meta import short
from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.parallel.zero.registry import OPTIMIZERS


def check_optimizer_resume(path: Path, meta: dict, cfg: Config) -> Optional[str]:
    """Refuse, in one line, a resume of checkpoint ``path`` (its ``meta``) with another optimizer than the one
    that wrote it, unless ``optim.switch_from`` asks for a switch its row allows; returns the line that states
    such a switch (None: the same optimizer)."""
    optim = meta.get("config", {}).get("optim")
    theirs = optim.get("name", "adamw") if isinstance(optim, dict) else "adamw"  # before optim.*: AdamW's
    note, mine = None, cfg.optim.name
    if theirs != mine or cfg.optim.switch_from:
        row = OPTIMIZERS.get(theirs) if isinstance(theirs, str) else None
        targets = row.switches_to if row is not None else ()
        if cfg.optim.switch_from != theirs or mine not in targets:
            how = (f"; optim.switch_from={theirs} continues its states with {' or '.join(targets)}" if targets
                   else "")
            asked = f" (optim.switch_from={cfg.optim.switch_from!r})" if cfg.optim.switch_from else ""
            raise UserError(f"checkpoint {path}: optim.name is {short(theirs)} there and {mine!r} here{asked}; a "
                            f"resume keeps the optimizer, whose states the checkpoint holds{how}")
        note = (f"checkpoint {path}: optim.switch_from={theirs}: its masters and moments continue with "
                f"optim.name={mine} in full precision from optimizer step {meta.get('optimizer_step', 0)}; its "
                f"per-rank state (error feedback) is dropped")
    row = OPTIMIZERS[mine]
    if row.resume_check is not None and note is None:  # what the optimizer's states assume of the layout
        row.resume_check(path, meta, cfg)
    return note
