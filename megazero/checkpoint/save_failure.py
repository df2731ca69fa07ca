"""A checkpoint write that failed: said in one line, and its partial ``step_N.tmp`` removed.

DCP gathers every rank's errors into one CheckpointException (a BaseException) holding (exception,
traceback) pairs. An interruption among them (a second stop signal, Ctrl-C) is raised as itself, so the
run stops as interrupted. A full disk is named as one ("no space left on <folder> (needs about N)"), even
when torch's zip writer words it as "unexpected pos"; any other refusal by the disk names its path.
The partial folder this save made is removed (rank 0), so a failed save does not keep the disk full; the
previous checkpoint stays the latest.
"""
from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megazero.disk import is_no_space, write_refusal
from megazero.errors import UserError
from megazero.train.signals import Interrupted


def state_bytes(state: Iterable[torch.Tensor]) -> int:
    """What a checkpoint of these tensors needs on disk, about: each logical tensor's bytes, once."""
    return sum(t.numel() * t.element_size() for t in state)


def _failures(e: BaseException) -> Iterator[BaseException]:
    """The errors behind ``e``: each rank's, lowest rank first, for a CheckpointException; else ``e``."""
    found = e.failures if isinstance(e, CheckpointException) and e.failures else {0: e}
    for rank in sorted(found):
        failure = found[rank]
        while isinstance(failure, tuple) and failure:
            failure = failure[0]
        if isinstance(failure, BaseException):
            yield failure


def describe_failure(e: BaseException) -> str:
    """``Kind: first line`` of the error behind ``e`` (the lowest rank's, for DCP's gathered errors)."""
    first = next(_failures(e), e)
    text = str(first).splitlines()[0][:200] if str(first).strip() else "no detail"
    return f"{first.__class__.__name__}: {text}"


def interruption(e: BaseException) -> Optional[BaseException]:
    """The stop signal or Ctrl-C that DCP gathered into ``e``, if any."""
    return next((f for f in _failures(e) if isinstance(f, (KeyboardInterrupt, Interrupted))), None)


def failed_write(e: BaseException, root: Path, tmp: Path, needs: Optional[int], remove: bool,
                 doing: str = "the write failed") -> UserError:
    """The one line for a failed write of ``tmp`` (``needs`` bytes) under the checkpoint folder ``root``;
    with ``remove`` (rank 0) the partial folder goes first, once the disk has been looked at as the write
    left it."""
    failures = list(_failures(e))
    full = any(is_no_space(f, root, needs) for f in failures)
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    reason = next((r for f in failures if (r := write_refusal(f, tmp, root, needs, full=full))), None)
    if reason is not None:
        said = f"checkpoint {tmp.with_name(tmp.name.partition('.')[0])}: {reason}"
    else:
        said = f"checkpoint {tmp}: {doing} ({describe_failure(e)})"
    gone = f"the partial {tmp.name} was removed and " if remove else ""
    return UserError(f"{said}; {gone}the previous checkpoint stays the latest")
