"""Reading DCP's ``.metadata`` file without running code from it.

DCP pickles its metadata, and a pickle may name any importable object: protocol 4
even resolves dotted names inside a module (module
``torch.distributed.checkpoint.filesystem`` + name ``os.system`` is ``os.system``),
and REDUCE calls whatever was named. So the unpickler admits exactly the
(module, name) pairs DCP's metadata is made of, by full name: the ones torch 2.11
and 2.13 write for plain tensors and for DTensors sharded over a mesh (found by
unpickling such checkpoints with a recording ``find_class``). It refuses BUILD on
a class or a function (that would set attributes process-wide), and then checks
the shape of what it built, so a well-formed but tampered file is an input error
rather than a traceback deep inside DCP.

Refused on purpose: ``BytesStorageMetadata`` (DCP reads such entries with
``torch.load(weights_only=False)``; megazero checkpoints hold tensors only),
shard paths that are not plain file names (no reading outside the checkpoint),
and storage transforms (megazero writes none).
"""
from __future__ import annotations

import enum
import os
import pickle
import stat
import types
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from megazero.errors import UserError

_DCP = "torch.distributed.checkpoint.metadata"
# Seen in the .metadata of checkpoints written by torch 2.11 (Python 3.12) and 2.13 (Python 3.11), two gloo
# ranks, plain fp32/bf16/fp16/0-dim tensors and DTensors sharded by rows, by columns and replicated: exactly these.
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout (torch.strided)
    # StorageMeta.checkpoint_id, the Path the save was given; Python 3.13 pickles it from pathlib._local
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),
    # a dtype pickles as the global torch.<name>: exactly the names under which torch holds a dtype
    *(("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)),
})
_MAX_SHOWN = 60


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


def _layout_by_name(name: str) -> torch.layout:
    """Stands in for torch.serialization._get_layout, whose lookup cache a BUILD could otherwise replace."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown tensor layout {_short(name)}")
    return layouts[name]


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's Python implementation: the only one whose BUILD opcode can be checked."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"it refers to {_short(module)}.{_short(name)}, which is not allowed "
                                         f"(DCP metadata is made of torch's checkpoint metadata classes)")
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_by_name
        return super().find_class(module, name)

    def load_build(self) -> None:
        # BUILD sets attributes: refused on classes and functions, and on enum members (singletons shared by
        # the whole process: _MEM_FORMAT_ENCODING(0) returns one)
        if len(self.stack) >= 2 and isinstance(self.stack[-2], (type, types.FunctionType,
                                                                types.BuiltinFunctionType, enum.Enum)):
            raise pickle.UnpicklingError(f"it sets attributes of {_short(self.stack[-2])}, which is not allowed")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


def _size(value: Any, dims: int | None, what: str) -> torch.Size:
    if not isinstance(value, torch.Size) or (dims is not None and len(value) != dims) or min(value, default=0) < 0:
        raise ValueError(f"{what} is {_short(value)}, expected {dims if dims is not None else 'a'}"
                         f"-dimensional torch.Size of sizes >= 0")
    return value


def _check_tensor(key: str, md: Any) -> None:
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"entry {_short(key)} is {type(md).__name__}, expected TensorStorageMetadata "
                         f"(megazero checkpoints hold tensors only)")
    if not isinstance(md.properties, TensorProperties) or not isinstance(md.properties.dtype, torch.dtype):
        raise ValueError(f"entry {_short(key)} has properties {_short(md.properties)}, expected a dtype")
    size = _size(md.size, None, f"entry {_short(key)}'s size")
    if not isinstance(md.chunks, list) or not md.chunks:
        raise ValueError(f"entry {_short(key)} has chunks {_short(md.chunks)}, expected a non-empty list")
    for chunk in md.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise ValueError(f"entry {_short(key)} has a chunk {_short(chunk)}, expected ChunkStorageMetadata")
        offsets = _size(chunk.offsets, len(size), f"a chunk offset of {_short(key)}")
        sizes = _size(chunk.sizes, len(size), f"a chunk size of {_short(key)}")
        if any(o + s > whole for o, s, whole in zip(offsets, sizes, size)):
            raise ValueError(f"a chunk of {_short(key)} ({tuple(offsets)} + {tuple(sizes)}) lies outside its "
                             f"size {tuple(size)}")


def _check_storage(index: Any, info: Any) -> None:
    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        raise ValueError(f"storage key {_short(index)} is not a MetadataIndex")
    if not isinstance(info, _StorageInfo):
        raise ValueError(f"storage of {_short(index.fqn)} is {_short(info)}, expected _StorageInfo")
    name = info.relative_path
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"storage of {_short(index.fqn)} names the file {_short(name)}, expected a plain file "
                         f"name inside the checkpoint")
    for field in ("offset", "length"):
        v = getattr(info, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"storage of {_short(index.fqn)} has {field}={_short(v)}, expected an integer >= 0")
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"storage of {_short(index.fqn)} has transforms {_short(info.transform_descriptors)}; "
                         f"megazero writes none")


def check_metadata(md: Any) -> Metadata:
    """The structure DCP's reader relies on, or ValueError saying what differs."""
    if not isinstance(md, Metadata):
        raise ValueError(f"it holds {type(md).__name__}, expected DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise ValueError(f"state_dict_metadata is {_short(md.state_dict_metadata)}, expected a dict")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise ValueError(f"entry name {_short(key)} is not a string")
        _check_tensor(key, entry)
    if not isinstance(md.storage_data, dict):
        raise ValueError(f"storage_data is {_short(md.storage_data)}, expected a dict")
    for index, info in md.storage_data.items():
        _check_storage(index, info)
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise ValueError(f"planner_data is {_short(md.planner_data)}, expected a dict")
    if md.version is not None and not isinstance(md.version, str):
        raise ValueError(f"version is {_short(md.version)}, expected a string")
    if not isinstance(md.storage_meta, StorageMeta):  # absent in old files; the reader records its load id here
        md.storage_meta = StorageMeta()
    return md


def read_metadata_file(path: Path) -> Metadata:
    """Unpickle and check ``path`` (a checkpoint's .metadata); any problem is one UserError line."""
    if not path.is_file():
        raise UserError(f"checkpoint {path.parent}: no {path.name} file (not a complete DCP checkpoint)")
    try:
        with open(path, "rb") as f:
            md = check_metadata(_MetadataUnpickler(f).load())
    except OSError as e:
        raise UserError(f"checkpoint {path}: unreadable ({e.strerror or e})") from None
    except RecursionError:
        raise UserError(f"checkpoint {path}: unreadable metadata (nested too deeply)") from None
    except Exception as e:  # a crafted or damaged pickle raises anything its admitted constructors raise
        detail = str(e).splitlines()[0] if str(e) else "no detail"
        raise UserError(f"checkpoint {path}: unreadable metadata ({e.__class__.__name__}: {detail[:200]})") \
            from None
    _check_shards(path.parent, md)
    return md


def _check_shards(folder: Path, md: Metadata) -> None:
    """Every shard file the metadata names is a regular file in the folder, long enough for its entries: a
    FIFO would hang the reader, a link would read outside the checkpoint, a short file fail midway."""
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        try:
            st = os.lstat(folder / name)
        except OSError:
            raise UserError(f"checkpoint {folder}: unreadable (FileNotFoundError: shard {_short(name)} is "
                            f"missing)") from None
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"checkpoint {folder}: unreadable (shard {_short(name)} is not a regular file)")
        if st.st_size < end:
            raise UserError(f"checkpoint {folder}: unreadable (EOFError: shard {_short(name)} has {st.st_size} "
                            f"bytes, its entries need {end})")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the restricted, checked metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(Path(self.path) / ".metadata")
        metadata.storage_meta.load_id = self.load_id
        return metadata
