"""What a run may do with its log.dir: continue the run there, start afresh, or refuse.

A log.dir holds a run's checkpoints, metrics and TensorBoard files, and it is the user's folder too. A fresh
run never deletes checkpoints it did not write: where an earlier run left checkpoints, ``train.resume=none``
refuses unless ``log.overwrite=true`` says to replace them; ``train.resume=auto`` continues the latest, or
starts afresh where there is none. Entries of checkpoints/ that megazero did not name are left alone.
"""
from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megazero.checkpoint import store as checkpoint
from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.train.resume_changes import check_resume


@dataclass(frozen=True)
class Start:
    """How this run begins: from a checkpoint (``resume``) or afresh, and the run id its checkpoints carry
    (keep_last rotates only checkpoints of this id)."""

    resume: Optional[Path]
    run_id: str
    notes: tuple[str, ...]  # lines for the writing rank to print


def plan_start(cfg: Config) -> Start:
    """Decide from the folder alone (every rank reaches the same decision); nothing is changed here."""
    root = Path(cfg.log.dir) / "checkpoints"
    notes = []
    foreign = checkpoint.foreign_entries(root)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        notes.append(f"{root}: ignoring {len(foreign)} entr{'ies' if len(foreign) > 1 else 'y'} megazero did not "
                     f"write ({shown})")
    resume = cfg.train.resume
    latest = checkpoint.latest_checkpoint(root)
    path = latest if resume == "auto" else None if resume == "none" else Path(resume)
    if path is not None:
        switched = check_resume(path, cfg)  # a changed tokenizer is refused here, before any data is built (the
        # other changes are named once it is: Trainer.load)
        notes += [switched] if switched else []
        return Start(path, checkpoint.checkpoint_run_id(path) or _new_id(), tuple(notes))
    if latest is not None:
        if not cfg.log.overwrite:
            raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} holds an earlier run's checkpoints (latest "
                            f"{latest.name}); train.resume=auto continues it, log.overwrite=true replaces it, or "
                            f"choose another log.dir")
        notes.append(f"{root}: log.overwrite=true: this run starts afresh and replaces the earlier run's "
                     f"checkpoints (latest {latest.name}) and logs")
    return Start(None, _new_id(), tuple(notes))


def clear_earlier_run(cfg: Config) -> None:
    """log.overwrite=true on a fresh start (the writing rank, before its first save): delete the checkpoints
    megazero wrote here before, and only those."""
    root = Path(cfg.log.dir) / "checkpoints"
    for path in checkpoint.megazero_entries(root):
        shutil.rmtree(path, ignore_errors=True)


def _new_id() -> str:
    return uuid.uuid4().hex
