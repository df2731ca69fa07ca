"""Layout-free, atomic, resumable checkpoints on torch.distributed.checkpoint (DCP).

Every tensor is stored under its logical name (``model/layers.3.mlp.fc1.weight``,
``optim/layers.3.mlp.fc1.weight/exp_avg``), never per rank, so a checkpoint
can be loaded into another layout. Scalars (step, consumed samples, the run's
config) live in ``meta.json``.

Atomicity: a save writes into ``step_N.tmp/``; only when every rank has
finished does rank 0 write ``meta.json`` and rename the folder to ``step_N``.
A crash mid-save leaves a ``.tmp`` folder that is never read, so the latest
complete checkpoint stays the latest. "Latest" is the one written last (each
meta.json holds a save sequence number), not the highest step: a run resumed
from an older checkpoint continues, and keeps, its own line. Loading never
unpickles arbitrary objects: tensors are read with ``weights_only``, and DCP's
metadata file goes through an unpickler that admits only DCP's own metadata
classes.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from megazero.errors import UserError

FORMAT_VERSION = 1
META = "meta.json"
_PREFIX = "step_"


class _MetadataUnpickler(pickle.Unpickler):
    """Admit only the classes DCP's own metadata is made of."""

    _MODULES = ("torch.distributed.checkpoint.",)
    _TORCH_NAMES = {"Size"}

    def find_class(self, module: str, name: str):
        if module.startswith(self._MODULES):
            return super().find_class(module, name)
        if module == "torch" and (name in self._TORCH_NAMES or isinstance(getattr(torch, name, None),
                                                                          (torch.dtype, torch.layout,
                                                                           torch.memory_format))):
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)
        if module == "torch.serialization" and name == "_get_layout":  # maps a layout's name to it
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for the metadata file."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise UserError(f"checkpoint {self.path}: unreadable metadata ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def _written(path: Path) -> tuple[int, int]:
    """(save sequence number, step): the order checkpoints were written in. A run resumed from an older
    checkpoint (a roll-back past a loss spike) writes lower steps after higher ones."""
    try:
        sequence = int(json.loads((path / META).read_text()).get("sequence", 0))
    except (OSError, ValueError, AttributeError):
        sequence = 0
    return sequence, int(path.name[len(_PREFIX):].split(".")[0])


# For one step, the folders that can hold it whole (meta.json is written last, so with it a folder is
# complete), best first: committed; written but not yet renamed; the one a re-save of the step replaces.
_SUFFIXES = ("", ".tmp", ".old.tmp")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, one folder per step, in the order they were written, oldest first.

    A save killed between its two renames (re-saving a step) leaves no ``step_N``, but a complete
    ``step_N.tmp`` or ``step_N.old.tmp``: that step is still listed, from the best of them."""
    root = Path(root)
    if not root.is_dir():
        return []
    best: dict[str, Path] = {}
    for p in root.iterdir():
        step, _, rest = p.name.partition(".")
        suffix = "." + rest if rest else ""
        if p.is_dir() and p.name.startswith(_PREFIX) and suffix in _SUFFIXES and (p / META).is_file():
            if step not in best or _SUFFIXES.index(suffix) < _SUFFIXES.index(best[step].name[len(step):]):
                best[step] = p
    return sorted(best.values(), key=_written)


def _settle(root: Path) -> None:
    """Before a save (rank 0): give each step listed from a leftover folder its committed name back, then
    clear every other leftover (interrupted writes, replaced copies)."""
    for p in list_checkpoints(root):
        if p.name.endswith(".tmp"):
            os.rename(p, p.with_name(p.name.partition(".")[0]))
    for stale in root.glob(f"{_PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The checkpoint written last (what ``train.resume=auto`` continues from)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save(root: str | Path, step: int, state: dict[str, torch.Tensor], meta: dict, keep_last: int) -> Path:
    """Write `state` (logical name -> tensor) and `meta` atomically as checkpoint `step` under `root`."""
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        _settle(Path(root))
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # DCP warns that a single process saves alone: that is intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _is_dist())
    _barrier()
    if _rank() == 0:
        sequence = max((_written(p)[0] for p in list_checkpoints(root)), default=0) + 1
        body = json.dumps({"format": FORMAT_VERSION, "step": step, "sequence": sequence, **meta}, indent=1)
        with open(tmp / META, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        replaced = final.with_name(final.name + ".old.tmp")  # listed (and settled) in its place, should we die here
        if final.exists():
            os.rename(final, replaced)
        os.rename(tmp, final)
        shutil.rmtree(replaced, ignore_errors=True)
        for old in list_checkpoints(root)[:-keep_last]:  # the keep_last written last stay
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise UserError(f"checkpoint {path}: not a complete megazero checkpoint (no {META})")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError:
        raise UserError(f"checkpoint {path}: {META} is not valid JSON") from None
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(f"checkpoint {path}: format {meta.get('format')!r}, this megazero reads {FORMAT_VERSION}")
    return meta


def load(path: str | Path, state: dict[str, torch.Tensor]) -> dict:
    """Fill the tensors of `state` in place from checkpoint `path`; returns its meta."""
    meta = read_meta(path)
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
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=not _is_dist())
    return meta


@contextlib.contextmanager
def _readable(path: str | Path):
    """A checkpoint whose files are missing or cut short is an input error, not a crash (DCP raises the
    readers' errors, gathered from every rank, as one CheckpointException)."""
    with warnings.catch_warnings():  # DCP warns that a single process loads alone: that is intended
        warnings.simplefilter("ignore", UserWarning)
        try:
            yield
        except (OSError, EOFError, CheckpointException) as e:
            first = e.failures[min(e.failures)] if isinstance(e, CheckpointException) and e.failures else e
            while isinstance(first, tuple) and first:  # DCP keeps (exception, traceback) pairs
                first = first[0]
            raise UserError(f"checkpoint {path}: unreadable ({first.__class__.__name__}: "
                            f"{str(first).splitlines()[0] if str(first) else 'no detail'})") from None


def stored_tensors(path: str | Path) -> dict[str, TensorStorageMetadata]:
    """Logical name -> stored size/dtype, read from the checkpoint's metadata."""
    md = SafeFileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Full model tensors keyed by global parameter name, in one process (export, inspection)."""
    path = Path(path)
    read_meta(path)
    stored = stored_tensors(path)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in stored.items() if k.startswith("model/")}
    with _readable(path):
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return {k[len("model/"):]: v for k, v in state.items()}


def read_checkpoint_config(path: str | Path) -> dict:
    """The run's config (sections as plain dicts) stored with the checkpoint."""
    meta = read_meta(path)
    if "config" not in meta:
        raise UserError(f"checkpoint {path}: {META} holds no config")
    return meta["config"]
