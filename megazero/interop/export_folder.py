"""Writing an export's folder whole or not at all.

The files go into a hidden sibling of OUT (the same file system, so the final rename is atomic), which is
renamed into place only once every file is written; a previous export (``--force``) is set aside first and
removed only after the new folder is in place. A write that fails (a full disk, a quota) removes the
siblings and the parent folders the export made, leaves OUT as it was, and is one line (``megazero.disk``'s
wording): "no space left on OUT (needs about N MB, M free)" for a full disk. An OUT that is a mount point
cannot be renamed over (EBUSY): refused (``megazero.interop.export_place.mount_point_refusal``).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from torch import Tensor

from megazero.disk import is_no_space, no_space_text
from megazero.errors import UserError
from megazero.interop.export_place import MARK, WEIGHTS, check_output, mount_point_refusal

_RUST_OS_ERROR = re.compile(r"os error (\d+)\)")  # how safetensors' own error carries the OS error's number


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


def _replace(tmp: Path, out: Path, given: Path) -> None:
    """Put the complete ``tmp`` at ``out`` (typed as ``given``); a previous export there is set aside first and
    removed afterwards.
    Every failure leaves OUT as it was and no sibling of its own behind (the previous export is never deleted
    before the new folder is in place: kept aside, and named, where it cannot be put back)."""
    old = None
    try:
        if os.path.lexists(out) and next(out.iterdir(), None) is not None:
            old = _sibling(out, "old")
            os.rename(out, old / "out")
        try:
            os.rename(tmp, out)  # over a missing or empty folder: one atomic step
        except OSError:
            if old is not None:  # OUT as it was
                try:
                    os.rename(old / "out", out)
                except OSError as e:
                    raise UserError(f"export output '{given}': the new export could not be put in place, nor the "
                                    f"previous one back ({e.strerror or e}); it is kept at {old / 'out'}") from None
            raise
    except OSError as e:
        if old is not None and not os.path.lexists(old / "out"):
            old.rmdir()
        if e.errno == errno.EBUSY:  # a mount point os.path.ismount did not see (a bind mount on the same disk)
            raise mount_point_refusal(given) from None
        raise
    if old is not None:
        try:
            shutil.rmtree(old)
        except OSError as e:
            print(f"note: the previous export, set aside at {old}, could not be removed ({e.strerror or e}); "
                  f"delete it by hand")


def _os_error(e: BaseException) -> Optional[OSError]:
    """``e`` as an OSError: itself, or the one safetensors' own error names only in its text."""
    if isinstance(e, OSError):
        return e
    found = _RUST_OS_ERROR.search(str(e))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


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
        _replace(tmp, out, given)
        tmp = None
    except Exception as e:  # OSError, or safetensors' own error type for a failed write (a full disk)
        if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
            raise
        err = _os_error(e)
        if err is None:
            raise UserError(f"export output '{given}': cannot write it ({e})") from None
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + sum(map(len, files.values()))
        if is_no_space(err, given, need):  # asked before the partial folder is removed
            raise UserError(f"{no_space_text(given, need, err)}: nothing was written; free some space there or "
                            f"choose another folder") from None
        raise UserError(f"export output '{given}': cannot write it ({err.strerror or err}); nothing was written"
                        ) from None
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
