"""Checkpoint saves that stall training only for a copy: stage to host memory, write in the background.

``CheckpointWriter(root, keep_last, async_save=True)``: ``save`` copies the state
into host buffers it owns (kept between saves, pinned for CUDA tensors) and
returns; DCP's ``async_save`` writes them from a thread while training goes on
mutating the real parameters. The copy is made here, not left to DCP's stager:
a stager may hand a CPU tensor through uncopied, and then the checkpoint would
hold whatever the optimizer wrote after the save.

Crash safety is the synchronous save's: the write goes into ``step_N.tmp``; the
commit (meta.json last, then the rename, then rotation) is rank 0's, in
:meth:`poll` or :meth:`wait`, once DCP's future says every rank's write has
finished (DCP gathers all ranks' write results before it resolves). A process
killed mid-write leaves the previous checkpoint latest and a ``.tmp`` that the
next save clears. At most one save is in flight: a new one first waits for the
previous one. DCP's background collectives run on a gloo group of their own,
so they never interleave with training's collectives on the default group.

A failed write (or rank 0's failed commit) is noted, not raised where it is
found: :meth:`poll` runs on each rank on its own, and a rank raising alone
would leave the others waiting in the next step's collectives. The collective
calls (:meth:`save`, :meth:`wait`) agree over every rank whether any noted one,
and then all raise the same error together. Rank 0 removes a failed write's
partial ``step_N.tmp`` when it notes the failure (megazero.checkpoint.save_failure).
"""
from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from megazero.checkpoint import store as checkpoint
from megazero.checkpoint.save_failure import checkpoint_bytes, failed_write, interruption
from megazero.errors import UserError


class _StagedWriter(FileSystemWriter):
    """DCP's file writer for a state this module has already copied to host memory: staging is a no-op."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


@dataclass
class _Pending:
    future: Any  # concurrent.futures.Future of DCP's background save
    step: int
    meta: dict
    run_id: Optional[str]
    needs: int  # the bytes the write puts on disk, about


def _staged_like(t: torch.Tensor) -> torch.Tensor:
    """A host tensor (a DTensor keeps its mesh and placements) to copy ``t`` into, save after save."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.detach().to("cpu", copy=True)
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


class CheckpointWriter:
    """Checkpoints of one run under ``root``; synchronous, or staged and written in the background.

    Construct it on every rank: with async_save under torch.distributed the constructor creates a gloo group
    collectively (its collectives bounded by ``timeout``, launch.timeout_minutes). ``save`` is collective;
    ``poll`` is local (call it every step); ``wait`` is collective; ``close`` is local (call it in a
    ``finally``; ``abandon=True`` on an error path: a write in flight is left to fail or finish alone)."""

    def __init__(self, root: str | Path, keep_last: int, async_save: bool = False,
                 timeout: Optional[timedelta] = None) -> None:
        self.root, self.keep_last, self.async_save = Path(root), keep_last, async_save
        self._dist = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._dist else 0
        self._group = dist.new_group(backend="gloo", timeout=timeout) if async_save and self._dist else None
        self.failed: Optional[str] = None  # this rank's noted failure of a background write or commit
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: Optional[_Pending] = None
        if async_save and not self._dist:  # DCP's background thread says so on every save; quiet_dcp cannot
            # reach into that thread, so this one message (and nothing else) is filtered process-wide
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                    "uninitialized, assuming the intent is to save", category=UserWarning)

    # ----- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, torch.Tensor], meta: dict, run_id: Optional[str]) -> Path:
        """Checkpoint ``state`` as of this call as step ``step``. Synchronous: returns once committed.
        Asynchronous: returns once the state is copied to host memory; the write goes on in the background
        and is committed by a later :meth:`poll`, :meth:`wait` or :meth:`save`."""
        if not self.async_save:
            return checkpoint.save(self.root, step, state, meta, self.keep_last, run_id)
        checkpoint.check_save_args(step, self.keep_last, run_id, meta)
        self._finish()  # at most one save in flight; its buffers are about to be reused
        self._raise_if_any_failed()
        needs = checkpoint_bytes(state.values(), self._group)  # every rank's share, as the write begins
        tmp = checkpoint.prepare(self.root, step, needs) if self._rank == 0 else checkpoint.tmp_dir(self.root, step)
        self._barrier()
        staged = self._stage(state)
        writer = _StagedWriter(str(tmp))
        kwargs: dict[str, Any] = {"storage_writer": writer, "process_group": self._group, "no_dist": not self._dist}
        if "async_stager" in inspect.signature(dcp.async_save).parameters:
            kwargs["async_stager"] = writer  # the writer's no-op stage, whichever way this torch picks a stager
        future = dcp.async_save(staged, **kwargs)
        self._pending = _Pending(future, step, copy.deepcopy(meta), run_id, needs)
        return checkpoint.checkpoint_dir(self.root, step)

    def _stage(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor into this writer's host buffers (reused while names, shapes and dtypes hold)."""
        from torch.distributed.tensor import DTensor

        staged, on_device = {}, False
        for key, t in state.items():
            buf = self._buffers.get(key)
            same = (buf is not None and isinstance(buf, DTensor) == isinstance(t, DTensor) and buf.shape == t.shape
                    and buf.dtype == t.dtype
                    and (not isinstance(t, DTensor) or (buf.placements == t.placements
                                                        and buf.device_mesh == t.device_mesh)))
            if not same:
                buf = _staged_like(t)
            source = t.to_local() if isinstance(t, DTensor) else t
            target = buf.to_local() if isinstance(buf, DTensor) else buf
            if same or not isinstance(t, DTensor):  # a new DTensor buffer was made as a copy already
                target.copy_(source.detach(), non_blocking=source.is_cuda)
            on_device = on_device or source.is_cuda
            staged[key] = buf
        if on_device:
            torch.cuda.synchronize()  # the copies are done before training may touch the sources again
        self._buffers = staged
        return staged

    # ----- committing -------------------------------------------------------------------------
    def poll(self) -> Optional[Path]:
        """Commit a finished background write without blocking; the committed path, else None. Local: a
        failure is noted for the next collective call, not raised."""
        if self._pending is None or not self._pending.future.done():
            return None
        return self._finish()

    def wait(self) -> Optional[Path]:
        """Block until the pending save is committed (on every rank's return); its path, or None if none was
        pending here. Collective under torch.distributed with async saves: raises, on every rank, if any
        rank's write or commit failed."""
        path = self._finish()
        self._raise_if_any_failed()
        return path

    def close(self, abandon: bool = False) -> None:
        """Finish (and commit) the pending save and release the writer's process group; never raises a write
        failure. Local. ``abandon``: on an error path, do not wait for a write in flight (its peers may be
        gone): it finishes or fails on its own, and the previous checkpoint stays the latest."""
        if abandon and self._pending is not None and not self._pending.future.done():
            self._pending = None
            return  # its thread still uses the group and the buffers: leave both to the exiting process
        try:
            self._finish()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            self._buffers = {}

    def _finish(self) -> Optional[Path]:
        """Wait for the pending write and (rank 0) commit it; a failure is noted in ``failed``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        tmp = checkpoint.tmp_dir(self.root, pending.step)
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException gathering every rank's errors
            stop = interruption(e)
            if stop is not None:
                raise stop from None
            # the future resolves once every rank's write is done: rank 0 removes the partial folder
            self.failed = str(failed_write(e, self.root, tmp, pending.needs, remove=self._rank == 0,
                                           doing="the background write failed"))
            return None
        if self._rank != 0:
            return checkpoint.checkpoint_dir(self.root, pending.step)
        try:
            return checkpoint.commit(self.root, pending.step, pending.meta, self.keep_last, pending.run_id)
        except UserError as e:  # commit's own line (a refused write removed its partial folder)
            self.failed = str(e)
            return None
        except OSError as e:
            self.failed = str(failed_write(e, self.root, tmp, None, remove=True, doing="committing it failed"))
            return None

    def _raise_if_any_failed(self) -> None:
        """Collective: every rank raises the same error if any rank noted a failed write or commit."""
        failed_rank = self._rank if self.failed else -1
        if self._group is not None:
            flag = torch.tensor([failed_rank], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            failed_rank = int(flag)
        said, self.failed = self.failed, None  # reported once, here, on every rank
        if failed_rank >= 0:
            raise UserError(said or f"a background checkpoint write failed on rank {failed_rank}; the previous "
                                    f"checkpoint stays the latest")

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)
