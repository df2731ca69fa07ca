"""Layout-free, atomic, resumable checkpoints on torch.distributed.checkpoint (DCP).

Every tensor is stored under its logical name (``model/layers.3.mlp.fc1.weight``,
``optim/layers.3.mlp.fc1.weight/exp_avg``), never per rank, so a checkpoint
can be loaded into another layout. Scalars (step, consumed samples, the run's
config, the id of the run that wrote it) live in ``meta.json``.

Atomicity: a save writes into ``step_N.tmp/``; only when every rank has
finished does rank 0 write ``meta.json`` and rename the folder to ``step_N``.
A crash mid-save leaves a ``.tmp`` folder that is never read, so the latest
complete checkpoint stays the latest; a save that fails (a full disk) removes
its own ``.tmp`` and says why in one line (megazero.checkpoint.save_failure).
"Latest" is the one written last (each meta.json holds a save sequence number),
not the highest step: a run resumed from an older checkpoint continues, and
keeps, its own line.

The folder is the user's too: only exact names (``step_`` + 8 digits, optionally
``.tmp`` / ``.old.tmp``, real directories) are megazero's; anything else is
foreign, never listed and never deleted (:func:`foreign_entries` names them).
``keep_last`` deletes only the saving run's own complete checkpoints (by the
``run_id`` in meta.json), and a re-save over another run's ``step_N`` moves that
one aside (``step_N.other-run-ID``) instead of deleting it.

Loading never runs code from the checkpoint: meta.json is checked field by field
(megazero.checkpoint.meta), DCP's pickled metadata goes through an exact
allow-list (megazero.checkpoint.unpickle), tensors are read with ``weights_only``.
Asynchronous saves: :class:`megazero.checkpoint.writer.CheckpointWriter`, built on this module.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.meta import (FORMAT_VERSION, INT_LIMIT, MAX_STEP, META, RESUME_FIELDS, RUN_ID, check_meta,
                                      checkpoint_run_id, peek_meta, read_meta)
from megazero.checkpoint.save_failure import checkpoint_bytes, describe_failure, failed_write, interruption
from megazero.disk import write_refusal
from megazero.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["FORMAT_VERSION", "META", "RESUME_FIELDS", "check_save_args",
           "checkpoint_dir", "checkpoint_run_id", "commit", "describe_failure", "foreign_entries", "latest_checkpoint",
           "list_checkpoints", "load", "megazero_entries", "prepare", "read_checkpoint_config", "read_meta",
           "read_model_state", "save", "stored_tensors", "tmp_dir"]

NAME = re.compile(r"step_([0-9]{8})((?:\.old)?\.tmp)?")
# For one step, the folders that can hold it whole (meta.json is written last, so with it a folder is
# complete), best first: committed; written but not yet renamed; the one a re-save of the step replaces.
_SUFFIXES = ("", ".tmp", ".old.tmp")
_RESERVED = ("format", "step", "sequence", "run_id")


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    """Where a save of ``step`` writes until it is committed."""
    return Path(root) / f"step_{step:08d}.tmp"


def _ours(p: Path) -> bool:
    """An exact megazero name on a real directory (a symlink or a file of that name is the user's)."""
    return NAME.fullmatch(p.name) is not None and not p.is_symlink() and p.is_dir()


def _entries(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []


def megazero_entries(root: str | Path) -> list[Path]:
    """The entries of the checkpoint folder megazero names (exact names on real directories), complete or not."""
    return [p for p in _entries(Path(root)) if _ours(p)]


def foreign_entries(root: str | Path) -> list[str]:
    """Names in the checkpoint folder that megazero did not make (user copies, notes): never listed or deleted."""
    return [p.name for p in _entries(Path(root)) if not _ours(p)]


def _written(path: Path) -> tuple[int, int]:
    """(save sequence number, step): the order checkpoints were written in. A run resumed from an older
    checkpoint (a roll-back past a loss spike) writes lower steps after higher ones."""
    sequence = peek_meta(path).get("sequence", 0)
    valid = isinstance(sequence, int) and not isinstance(sequence, bool) and 0 <= sequence < INT_LIMIT // 2
    return (sequence if valid else 0), int(NAME.fullmatch(path.name).group(1))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, one folder per step, in the order they were written, oldest first.

    A save killed between its two renames (re-saving a step) leaves no ``step_N``, but a complete
    ``step_N.tmp`` or ``step_N.old.tmp``: that step is still listed, from the best of them."""
    best: dict[str, tuple[int, Path]] = {}
    for p in _entries(Path(root)):
        if _ours(p) and (p / META).is_file():
            digits, suffix = NAME.fullmatch(p.name).groups()
            rank = _SUFFIXES.index(suffix or "")
            if digits not in best or rank < best[digits][0]:
                best[digits] = (rank, p)
    return sorted((p for _, p in best.values()), key=_written)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The checkpoint written last (what ``train.resume=auto`` continues from)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _settle(root: Path) -> None:
    """Before a save (rank 0): give each step listed from a leftover folder its committed name back, then clear
    the other leftovers of megazero's own saves (interrupted writes, replaced copies). Only ``.tmp`` names."""
    for p in list_checkpoints(root):
        committed = p.with_name(p.name.partition(".")[0])
        if p.name != committed.name and not os.path.lexists(committed):
            os.rename(p, committed)
    listed = set(list_checkpoints(root))
    for p in _entries(root):
        if _ours(p) and p.name.endswith(".tmp") and p not in listed:
            shutil.rmtree(p, ignore_errors=True)


def check_save_args(step: int, keep_last: int, run_id: Optional[str], meta: dict) -> None:
    """Before anything is written: what the caller passes is what a resume can read back."""
    if not (isinstance(step, int) and 0 <= step <= MAX_STEP):
        raise ValueError(f"checkpoint step {step!r} is outside [0, {MAX_STEP}] (8-digit folder names)")
    if not (isinstance(keep_last, int) and keep_last >= 1):
        raise ValueError(f"keep_last={keep_last!r}; expected an integer >= 1")
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        raise ValueError(f"run_id={run_id!r}; expected 1-64 letters, digits, '-' or '_'")
    if clash := [k for k in _RESERVED if k in meta]:
        raise ValueError(f"meta holds {clash}, which the checkpoint writes itself")
    check_meta(Path(META), {**meta, "format": FORMAT_VERSION, "step": step}, require=())  # readable back


def prepare(root: str | Path, step: int, needs: Optional[int] = None) -> Path:
    """Rank 0: clear leftovers and make the empty ``step_N.tmp`` a save writes into (callers barrier after).
    ``needs``: the bytes the save will write, for the message when the disk has no room."""
    root, tmp = Path(root), tmp_dir(root, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _settle(root)
        if os.path.lexists(tmp) and not _ours(tmp):
            raise UserError(f"checkpoint folder {root}: {tmp.name} is not a folder megazero wrote (a file or a "
                            f"link), and a save of step {step} would write there; move it away")
        if os.path.lexists(tmp):  # a complete copy of this very step, listed because step_N is not ours
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        reason = write_refusal(e, tmp, root, needs) or f"cannot prepare {tmp.name} ({e.strerror or e})"
        raise UserError(f"checkpoint folder {root}: {reason}") from None
    return tmp


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _aside(final: Path) -> Path:
    """Where another run's (or an unknown) ``step_N`` goes when this run writes step N: a foreign name."""
    base = final.with_name(f"{final.name}.other-run-{checkpoint_run_id(final) or 'unknown'}")
    candidate, n = base, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def commit(root: str | Path, step: int, meta: dict, keep_last: int, run_id: Optional[str]) -> Path:
    """Rank 0, once every rank's tensors are in ``step_N.tmp``: write meta.json last, rename into place, rotate."""
    root, final, tmp = Path(root), checkpoint_dir(root, step), tmp_dir(root, step)
    sequence = max((_written(p)[0] for p in list_checkpoints(root)), default=0) + 1
    body = {**meta, "format": FORMAT_VERSION, "step": step, "sequence": sequence}
    if run_id is not None:
        body["run_id"] = run_id
    check_meta(tmp / META, body, require=())  # never write what a resume could not read back
    text = json.dumps(body, indent=1)
    try:
        _write_synced(tmp / META, text)
        replaced = None
        if os.path.lexists(final):
            if run_id is not None and _ours(final) and checkpoint_run_id(final) == run_id:
                replaced = final.with_name(final.name + ".old.tmp")  # listed (and settled) in its place
                os.rename(final, replaced)
            else:  # another run's step N: moved aside, never deleted
                os.rename(final, _aside(final))
        os.rename(tmp, final)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    except OSError as e:  # the partial is ours (a renamed-aside copy of the step stays listed in its place)
        raise failed_write(e, root, tmp, len(text), remove=_ours(tmp), doing="cannot commit it") from None
    if run_id is not None:  # the keep_last this run wrote last stay; other runs' checkpoints are not ours to drop
        mine = [p for p in list_checkpoints(root) if checkpoint_run_id(p) == run_id]
        for old in mine[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _dcp():
    """torch.distributed.checkpoint, its exception and megazero's checked reader, imported on first use: DCP
    (DTensor, sympy) is ~0.6 s of a 2-core machine's start-up, which a dry run, a config error or the planner
    never needs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from megazero.checkpoint.unpickle import SafeFileSystemReader

    return dcp, CheckpointException, SafeFileSystemReader


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns that a single process saves or loads alone: that is intended."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def save(root: str | Path, step: int, state: dict[str, torch.Tensor], meta: dict, keep_last: int,
         run_id: Optional[str] = None) -> Path:
    """Write ``state`` (logical name -> tensor) and ``meta`` atomically as checkpoint ``step``; collective.

    ``run_id`` marks the checkpoint as this run's: ``keep_last`` deletes only checkpoints with the same id
    (none when it is None)."""
    check_save_args(step, keep_last, run_id, meta)
    needs = checkpoint_bytes(state.values())  # every rank's share: the whole folder
    tmp = prepare(root, step, needs) if _rank() == 0 else tmp_dir(root, step)
    _barrier()
    dcp, CheckpointException, _ = _dcp()
    with quiet_dcp():
        try:
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not _is_dist())
        except (CheckpointException, OSError) as e:  # every rank gets DCP's gathered errors: its peers are done
            stop = interruption(e)
            if stop is not None:
                raise stop from None
            raise failed_write(e, Path(root), tmp, needs, remove=_rank() == 0) from None
    _barrier()
    if _rank() == 0:
        commit(root, step, meta, keep_last, run_id)
    _barrier()
    return checkpoint_dir(root, step)


def stored_tensors(path: str | Path) -> dict[str, TensorStorageMetadata]:
    """Logical name -> stored size/dtype, read from the checkpoint's (checked) metadata."""
    return dict(_dcp()[2](str(path)).read_metadata().state_dict_metadata)


def load(path: str | Path, state: dict[str, torch.Tensor], require: Iterable[str] = ()) -> dict:
    """Fill the tensors of ``state`` in place from checkpoint ``path``; returns its checked meta.

    Everything is checked (meta.json, the metadata, names and shapes) before the first tensor is written."""
    meta = read_meta(path, require)
    stored = stored_tensors(path)
    missing = sorted(set(state) - set(stored))
    if missing:
        raise UserError(f"checkpoint {path}: has no tensor {missing[0]!r} "
                        f"({len(missing)} missing; was it written by another model config?)")
    for key, tensor in state.items():
        if tuple(stored[key].size) != tuple(tensor.shape):
            raise UserError(f"checkpoint {path}: {key} has shape {tuple(stored[key].size)}, "
                            f"this run expects {tuple(tensor.shape)}")
    with _readable(path):
        dcp, _, reader = _dcp()
        dcp.load(state, storage_reader=reader(str(path)), no_dist=not _is_dist())
    return meta


@contextlib.contextmanager
def _readable(path: str | Path):
    """A checkpoint whose files are missing or cut short is an input error, not a crash (DCP raises the
    readers' errors, gathered from every rank, as one CheckpointException)."""
    _, CheckpointException, _ = _dcp()
    with quiet_dcp():
        try:
            yield
        except (OSError, EOFError, CheckpointException, RuntimeError, ValueError) as e:
            raise UserError(f"checkpoint {path}: unreadable ({describe_failure(e)})") from None


def read_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Full model tensors keyed by global parameter name, in one process (export, inspection)."""
    path = Path(path)
    read_meta(path, require=())
    stored = {k: v for k, v in stored_tensors(path).items() if k.startswith("model/")}
    try:
        state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in stored.items()}
    except (RuntimeError, MemoryError) as e:  # sizes a crafted metadata file made up
        raise UserError(f"checkpoint {path}: cannot hold its model tensors in memory "
                        f"({str(e).splitlines()[0][:200]})") from None
    with _readable(path):
        dcp, _, reader = _dcp()
        dcp.load(state, storage_reader=reader(str(path)), no_dist=True)
    return {k[len("model/"):]: v for k, v in state.items()}


def read_checkpoint_config(path: str | Path) -> dict:
    """The run's config (sections as plain dicts, the model section checked) stored with the checkpoint."""
    return read_meta(path, require=("config",))["config"]
