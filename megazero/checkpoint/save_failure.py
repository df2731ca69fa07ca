"""A checkpoint write that failed: said in one line, and its partial ``step_N.tmp`` removed.

DCP gathers every rank's errors into one CheckpointException (a BaseException) holding (exception,
traceback) pairs. An interruption among them (a second stop signal, Ctrl-C) is raised as itself, so the
run stops as interrupted. A full disk is named as one ("no space left on <folder> (needs about N)", N the whole
checkpoint: every rank's share), even when torch's zip writer words it as "unexpected pos"; any other
refusal by the disk names its path.
The partial folder this save made is removed (rank 0), so a failed save does not keep the disk full; the
previous checkpoint stays the latest.
"""
from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megazero.disk import is_no_space, write_refusal
from megazero.errors import UserError
from megazero.train.signals import Interrupted


def local_bytes(state: Iterable[torch.Tensor]) -> int:
    """This rank's share of a checkpoint of these tensors: a DTensor's local piece, any other tensor whole."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in state)


def checkpoint_bytes(state: Iterable[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> int:
    """What the whole checkpoint needs on disk, about: every rank's share, summed over ``group`` (the world
    by default). Every rank writes into the one folder, and under ZeRO and pipelining each holds only the
    parameters it owns of its own stage, so one rank's share can be a small part of it. Collective (one
    scalar): call it on every rank before the write begins, never on a failure's path, where a peer may be
    gone. A tensor replicated over tp ranks (a norm's weight) is counted on each though written once: a
    small excess."""
    total = local_bytes(state)
    if not (dist.is_available() and dist.is_initialized()):
        return total
    on_cuda = str(dist.get_backend(group)) == "nccl"  # an nccl-only group reduces device tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    summed = torch.tensor([total], dtype=torch.int64, device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    return int(summed.item())


def _failures(e: BaseException) -> Iterator[BaseException]:
    """The errors behind ``e``: each rank's, lowest rank first, for a CheckpointException; else ``e``."""
    from torch.distributed.checkpoint.api import CheckpointException  # on first use: DCP is ~0.6 s of start-up

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
