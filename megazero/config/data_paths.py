"""``data.paths`` entries: a path, or a mapping ``{path: P, weight: W, name: N}`` for a weighted blend.

A plain path's share of the training stream is its share of the tokens (the
sources read as one corpus). Weights make a mixture (Megatron-LM's
``--data-path 0.7 web 0.3 code``): either every entry has one or none does,
since a weight beside "as many as it has" has no meaning. A name labels the
source's validation loss (``val_loss/<name>``); it defaults to the file name
without its suffixes.

Checked here, with the config, so a bad entry stops the run before any rank
reads data (one line naming ``data.paths[i]``). Entries stay plain dicts so a
config still dumps to YAML.
"""

from __future__ import annotations

import math
import re
from pathlib import PurePath
from typing import Any, Callable, Union

from megazero.errors import invalid

ENTRY_KEYS = ("path", "weight", "name")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
Entry = Union[str, dict]


def parse_data_paths(source: str, full: str, value: Any, text: Callable[[str, str, Any, str], str]) -> list[Entry]:
    """The entries of ``data.paths`` (a string is a one-entry list); ``text`` checks a string that names a file."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise invalid(source, full, value, "expected a list of paths or {path, weight, name} mappings")
    entries: list[Entry] = []
    for i, v in enumerate(value):
        key = f"{full}[{i}]"
        if isinstance(v, str):
            entries.append(text(source, full, v, "expected a list of paths"))
            continue
        if not isinstance(v, dict):
            raise invalid(source, full, value, "expected a list of paths or {path, weight, name} mappings")
        unknown = [k for k in v if k not in ENTRY_KEYS]
        if unknown:
            raise invalid(source, f"{key}.{unknown[0]}", v[unknown[0]], f"unknown key; valid: {', '.join(ENTRY_KEYS)}")
        if "path" not in v:
            raise invalid(source, key, v, "a mapping needs path: (and optionally weight:, name:)")
        entry = {"path": text(source, f"{key}.path", v["path"], "expected a path")}
        if "weight" in v:
            w = v["weight"]
            number = float(w) if isinstance(w, (int, float)) and not isinstance(w, bool) else math.nan
            if not (math.isfinite(number) and number > 0):
                raise invalid(source, f"{key}.weight", w, "expected a finite number > 0")
            entry["weight"] = number
        if "name" in v:
            name = v["name"]
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise invalid(source, f"{key}.name", name, "expected 1-64 letters, digits, '_', '.' or '-'")
            entry["name"] = name
        entries.append(entry)
    weighted = [isinstance(e, dict) and "weight" in e for e in entries]
    if any(weighted) and not all(weighted):
        i = weighted.index(False)
        raise invalid(source, f"{full}[{i}]", entries[i], "every entry needs a weight once one has one "
                      "(without weights each source counts by its tokens)")
    names = source_names(entries)
    for i, n in enumerate(names):
        if n in names[:i] and isinstance(entries[i], dict) and "name" in entries[i]:
            raise invalid(source, f"{full}[{i}].name", n, "names must differ between entries")
    return entries


def entry_path(entry: Entry) -> str:
    return str(entry["path"] if isinstance(entry, dict) else entry)


def entry_weight(entry: Entry) -> float | None:
    return None if isinstance(entry, str) else entry.get("weight")


def source_names(entries: list[Entry]) -> list[str]:
    """Each entry's name: its own, or its file name without suffixes (numbered where two would collide)."""
    given = {e["name"] for e in entries if isinstance(e, dict) and "name" in e}  # str or Path entries otherwise
    names: list[str] = []
    for e in entries:
        if isinstance(e, dict) and "name" in e:
            names.append(e["name"])
            continue
        stem = PurePath(entry_path(e)).name.split(".")[0]
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)[:56] or "data"
        name, n = base, 1
        while name in given or name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names
