"""Raw text inputs: which files a path names, and the documents inside them.

A ``.txt`` file is one document; a ``.jsonl`` file holds one document per line
(a JSON object whose ``json_key`` field is the text); a directory stands for
every ``.txt``/``.jsonl`` file below it, sorted by path, so that the token
stream (and so every batch) is the same on every machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from megazero.errors import UserError

TEXT_SUFFIXES = (".txt", ".jsonl")


def expand_inputs(paths: Iterable[str | Path], what: str = "input") -> list[Path]:
    """Return the text files named by ``paths`` (directories walked, sorted).

    ``what`` names the setting the paths came from (``data.paths``,
    ``--input``) so that an error tells the person which value to fix.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UserError(f"{what}: {path} does not exist")
        if path.is_dir():
            found = _walk(path)
            if not found:
                raise UserError(f"{what}: directory {path} holds no .txt or .jsonl files")
            files.extend(found)
        elif path.suffix in TEXT_SUFFIXES:
            files.append(path)
        else:
            raise UserError(
                f"{what}: {path} has suffix {path.suffix or '(none)'!r}; "
                "valid inputs are .txt files (one document), .jsonl files (one document per line) "
                "or directories of them"
            )
    return files


def _walk(directory: Path) -> list[Path]:
    """Text files below ``directory`` (hidden ones skipped), sorted by relative path."""
    found: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if not name.startswith(".") and Path(name).suffix in TEXT_SUFFIXES:
                path = Path(root) / name
                found.append((path.relative_to(directory).as_posix(), path))
    return [path for _, path in sorted(found)]


def iter_documents(files: Iterable[Path], json_key: str = "text") -> Iterator[str]:
    """Yield every non-empty document of ``files`` in order."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, json_key)
        else:
            text = _read_text(path)
            if text:
                yield text


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _jsonl_documents(path: Path, json_key: str) -> Iterator[str]:
    try:
        handle = path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{where}: not UTF-8 text (bad byte at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                kind = type(record).__name__
                raise UserError(f"{where}: expected a JSON object with a {json_key!r} field, got {kind}")
            if json_key not in record:
                keys = ", ".join(sorted(map(str, record))) or "none"
                raise UserError(f"{where}: no {json_key!r} field (fields: {keys})")
            text = record[json_key]
            if not isinstance(text, str):
                raise UserError(f"{where}: field {json_key!r} is {type(text).__name__}, expected a string")
            if text:
                yield text
