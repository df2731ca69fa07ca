"""Where an export may be written, decided on resolved paths (symlinks followed, ``..`` folded) before anything
is read or written.

Refused:

* the working folder or a folder holding it (``.``, ``..``, ``/``): replacing it would pull the floor away;
* a folder holding the checkpoint being exported;
* a place inside a checkpoint folder (a folder megazero wrote as a checkpoint: its exact ``step_`` name, or
  meta.json beside DCP's ``.metadata``): ``keep_last`` rotation and ``log.overwrite`` delete a checkpoint
  folder whole, and a re-save of its step replaces it, an export inside with it;
* a place inside a folder checkpoints are saved into (one that holds megazero's checkpoint folders, or a
  log.dir's ``checkpoints/``, recognised before its first save by the log.dir's metrics.jsonl). megazero
  deletes only its exact ``step_`` names there: an export under one (``step_00000009/hf``, made before that
  step is saved) is deleted by ``log.overwrite`` or moved aside by the save of that step, and under a ``.tmp``
  name deleted by the next save's clean-up. Any other name is left alone, but refused too: that folder is the
  checkpoints' own, the one a user deletes or copies to drop or move them, and an export kept there would go
  with them;
* an existing OUT that is a mount point (a volume mounted into a container): it cannot be replaced by a rename,
  so the all-or-nothing write below it could not be kept; a subfolder of it can;
* an existing OUT that is not a folder; a non-empty one without ``--force``; and with ``--force``, one that is
  not a previous export: --force replaces a folder ``megazero.export`` wrote (only the files an export writes,
  its model.safetensors marked as an export's) and nothing else.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from megazero.errors import UserError

# the files an export writes (megazero.interop.export_folder, megazero.interop.export_tokenizer)
EXPORT_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                          "tokenizer.model"})
WEIGHTS = "model.safetensors"
MARK = ("written_by", "megazero.export")  # in model.safetensors' metadata: this folder is an export
DCP_METADATA = ".metadata"
LOG_DIR_MARK = "metrics.jsonl"  # a log.dir holds it from its first run


def resolved(path: Path, what: str) -> Path:
    """``path`` absolute, symlinks followed and ``..`` folded (the part that exists is read from the disk)."""
    try:
        return Path(os.path.realpath(path, strict=False))
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, an unreadable folder, a NUL byte
        raise UserError(f"{what} '{path}' cannot be resolved ({getattr(e, 'strerror', None) or e})") from None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink()
    except OSError:
        return False


def is_checkpoint(path: Path) -> bool:
    """A folder megazero wrote as a checkpoint: an exact ``step_`` name (a save in progress too), or meta.json
    beside DCP's metadata (a checkpoint moved aside, or copied under another name)."""
    from megazero.checkpoint.store import META, NAME

    if not _is_dir(path):
        return False
    return NAME.fullmatch(path.name) is not None or ((path / META).is_file() and (path / DCP_METADATA).is_file())


def holds_checkpoints(path: Path) -> bool:
    """A folder checkpoints are saved into: it holds megazero's checkpoint folders, or it is a log.dir's
    ``checkpoints/`` (whose log.dir holds metrics.jsonl) that has none yet."""
    from megazero.checkpoint.store import megazero_entries

    if not _is_dir(path):
        return False
    if path.name == "checkpoints" and (path.parent / LOG_DIR_MARK).is_file():
        return True
    return bool(megazero_entries(path))


def _cwd() -> Optional[Path]:
    try:
        return Path(os.path.realpath(os.getcwd()))
    except OSError:  # the working folder was deleted: nothing to protect
        return None


def check_place(out: Path, given: Path, checkpoint: Optional[Path] = None) -> None:
    """Refuse a resolved ``out`` (typed as ``given``) that is, holds or lies inside what an export must not
    replace or be deleted with (module doc)."""
    cwd = _cwd()
    if cwd is not None and cwd.is_relative_to(out):
        raise UserError(f"export output '{given}' is the working folder {cwd} or holds it; an export replaces its "
                        f"output, so choose a new folder")
    if checkpoint is not None and checkpoint.is_relative_to(out):
        raise UserError(f"export output '{given}' holds the checkpoint {checkpoint}; choose a folder outside it")
    for folder in (out, *out.parents):
        if is_checkpoint(folder):
            place = "is the checkpoint" if folder == out else "lies inside the checkpoint"
            raise UserError(f"export output '{given}' {place} {folder}: deleting or replacing that checkpoint "
                            f"(keep_last, a re-save) would delete the export with it; choose a folder outside it")
        if holds_checkpoints(folder):
            raise UserError(f"export output '{given}' lies inside {folder}, a folder that holds checkpoints (a "
                            f"log.dir's checkpoints/): it is the checkpoints' folder, where saves clean up and "
                            f"rotate; choose a folder outside it")


def mount_point_refusal(given: Path) -> UserError:
    """The refusal of an OUT that is a mount point: the export's folder is renamed into place whole, and a
    mount point cannot be renamed over; written into file by file, a failure or a kill midway would leave a
    partial export (or a mix of the old and the new one) where a loader finds it."""
    inside = given / "hf"
    return UserError(f"export output '{given}' is a mount point, which cannot be replaced in one step, and an "
                     f"export is written whole or not at all; export into a subfolder of it, e.g. '{inside}'")


def not_an_export(folder: Path) -> str:
    """Why ``folder`` is not a previous export (what it holds that an export does not write), or ""."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        return f"it cannot be listed ({e.strerror or e})"
    others = [p.name for p in entries if p.name not in EXPORT_FILES or p.is_symlink() or not p.is_file()]
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return f"it holds {shown}, which an export does not write"
    if not _marked(folder / WEIGHTS):
        return f"it holds no {WEIGHTS} that megazero.export wrote"
    return ""


def _marked(weights: Path) -> bool:
    """True when ``weights`` is a safetensors file whose header carries an export's mark (the header alone is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            return (f.metadata() or {}).get(MARK[0]) == MARK[1]
    except BaseException as e:  # SafetensorError for a file that is not one; the Rust side can also panic
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        return False


def check_output(out_dir: str | Path, force: bool, checkpoint: Optional[str | Path] = None) -> Path:
    """The resolved folder to write for OUT: missing or an empty folder; a previous export only with --force;
    never a place :func:`check_place` refuses. ``checkpoint``: the checkpoint being exported."""
    given = Path(out_dir)
    out = resolved(given, "export output")
    check_place(out, given, None if checkpoint is None else resolved(Path(checkpoint), "checkpoint"))
    if not os.path.lexists(out):
        return out
    if not _is_dir(out):
        raise UserError(f"export output '{given}' exists and is not a directory")
    if os.path.ismount(out):  # a bind mount on the same disk is not seen here: the rename's EBUSY says it
        raise mount_point_refusal(given)
    try:
        empty = next(out.iterdir(), None) is None
    except OSError as e:
        raise UserError(f"export output '{given}' cannot be listed ({e.strerror or e})") from None
    if empty:
        return out
    if not force:
        raise UserError(f"export output '{given}' is not empty; pass --force to replace a previous export, or "
                        f"choose a new folder")
    why = not_an_export(out)
    if why:
        raise UserError(f"export output '{given}' is not a previous export: {why}; --force replaces only a folder "
                        f"megazero.export wrote, so choose a new folder or move those away")
    return out
