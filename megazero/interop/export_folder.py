"""Writing an export's folder whole or not at all.

The files go into a hidden sibling of OUT (the same file system, so the final rename is atomic), which is
renamed into place only once every file is written; a previous export (``--force``) is set aside first and
removed only after the new folder is in place. A write that fails (a full disk, a quota) removes the sibling
and the parent folders the export made, leaves OUT as it was, and is one line: "no space left on OUT (the
export needs about N MB)" for a full disk.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from torch import Tensor

from megazero.errors import UserError
from megazero.interop.export_place import MARK, WEIGHTS, check_output

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _sibling(out: Path, kind: str) -> Path:
    """A new hidden folder beside ``out`` (same file system; made with the user's umask)."""
    path = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.{kind}")
    path.mkdir()
    return path


def _missing_parents(out: Path) -> list[Path]:
    """The folders above ``out`` that do not exist yet, deepest first: what a failed export removes again."""
    missing = []
    for parent in out.parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing


def _replace(tmp: Path, out: Path) -> None:
    """Put the complete ``tmp`` at ``out``; a previous export there is set aside first and removed afterwards."""
    old = None
    if os.path.lexists(out) and next(out.iterdir(), None) is not None:
        old = _sibling(out, "old")
        os.rename(out, old / "out")
    try:
        os.rename(tmp, out)  # over a missing or empty folder: one atomic step
    except OSError:
        if old is not None:  # OUT as it was
            os.rename(old / "out", out)
            old.rmdir()
        raise
    if old is not None:
        try:
            shutil.rmtree(old)
        except OSError as e:
            print(f"note: the previous export, set aside at {old}, could not be removed ({e.strerror or e}); "
                  f"delete it by hand")


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{-(-n // 1000)} KB"


def _no_space(e: BaseException) -> Optional[str]:
    """The reason when ``e`` says the disk (or a quota) is full: an OSError, or safetensors' own error
    carrying the OS error's number in its text."""
    if isinstance(e, OSError):
        return (e.strerror or str(e)) if e.errno in _NO_SPACE else None
    text = str(e)
    return next((os.strerror(code) for code in _NO_SPACE if f"os error {code})" in text), None)


def write_hf_folder(out_dir: str | Path, hf_config: dict, hf_state: Mapping[str, Tensor],
                    force: bool = False, extra_files: Optional[Mapping[str, bytes]] = None,
                    checkpoint: Optional[str | Path] = None) -> Path:
    """Write config.json, model.safetensors and ``extra_files`` (name -> bytes: the tokenizer) into OUT, all or
    nothing; returns OUT resolved. ``checkpoint``: the checkpoint exported (OUT must not hold it)."""
    from safetensors.torch import save_file

    given = Path(out_dir)
    out = check_output(given, force, checkpoint)
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    config = (json.dumps(hf_config, indent=2, sort_keys=True) + "\n").encode()
    files = {"config.json": config, **(extra_files or {})}
    made, tmp = _missing_parents(out), None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(out, "tmp")
        (tmp / "config.json").write_bytes(config)
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", MARK[0]: MARK[1]})
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        _replace(tmp, out)
        tmp = None
    except Exception as e:  # OSError, or safetensors' own error type for a failed write (a full disk)
        if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
            raise
        reason = _no_space(e)
        if reason is not None:
            need = sum(t.numel() * t.element_size() for t in tensors.values()) + sum(map(len, files.values()))
            raise UserError(f"no space left on {given} (the export needs about {_size(need)}; {reason}): nothing "
                            f"was written; free some space there or choose another folder") from None
        raise UserError(f"export output '{given}': cannot write it ({getattr(e, 'strerror', None) or e})") from None
    finally:
        if tmp is not None:  # a failed write leaves nothing behind, and OUT as it was
            shutil.rmtree(tmp, ignore_errors=True)
        if tmp is not None or not os.path.isdir(out):
            for parent in made:
                try:
                    parent.rmdir()
                except OSError:
                    break
    return out
