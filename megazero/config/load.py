"""One YAML file describes a run: typed sections, checked before anything is allocated.

Every check that can be made from the file and the world size is made before
anything starts (the rules live in megazero.config.rules), so a typo costs a second,
not a queue slot on a cluster. Errors are one line (megazero.errors.invalid):
the file, the key, the bad value (cut short) and what would be valid.

This module reads and types the values; megazero.config.rules checks them:
``load_config`` ends with its ``validate`` and returns the config as written,
checked but not resolved (``auto`` stays ``auto``): megazero.config.resolve
fixes the derived values once, in the run's entry point. Imports go one
way, load -> rules -> errors: megazero.config.rules imports nothing from here.

Files and ``--set`` values are untrusted: megazero.config.yaml_load reads them (YAML 1.2 core schema; no
aliases, tags, merge keys or duplicate keys; bounded size and depth), values are strictly typed here,
and every number has a range in megazero.config.ranges. An empty file, or a section whose keys are all
commented out, means the defaults.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any, Union

from megazero.config.data_paths import parse_data_paths
from megazero.config.moved import moved_line
from megazero.errors import UserError, invalid, shown, shown_name
from megazero.config.rules import validate
from megazero.config.schema import SECTIONS, AUTO, Config
from megazero.config.yaml_load import YamlSyntaxError, load_yaml, read_config_text

MAX_STR = 4096  # characters in a string value: PATH_MAX on Linux; a longer path fails in the OS anyway
MAX_LIST = 65536  # entries in a list value (data.paths, parallel.pp_layers)


def _type_name(t: Any) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "list": "a list"}.get(t, t)


def _coerce(source: str, section: str, key: str, value: Any, annotation: str) -> Any:
    """Check one value against its field's annotation (kept as a string by `from __future__`).

    Strictly typed: a quoted "10" is no integer and "1e-3" no number (the YAML loader reads unquoted
    numbers as numbers); ranges are megazero.config.ranges' job.
    """
    full = f"{section}.{key}"
    if (section, key) == ("parallel", "pp_layers"):
        return _layer_counts(source, full, value)
    if (section, key) == ("data", "paths"):
        if isinstance(value, list) and len(value) > MAX_LIST:
            raise invalid(source, full, value, f"at most {MAX_LIST} entries")
        return parse_data_paths(source, full, value, _text)
    ann = annotation.replace("typing.", "")
    allows_none = "None" in ann
    allows_auto = "str" in ann and ann.startswith("Union") and (section, key) != ("train", "resume")
    if value is None and allows_none:
        return None
    if isinstance(value, str) and allows_auto and ann != "str":
        if value == AUTO:
            return value
        raise invalid(source, full, value, f"expected {_type_name(_base(ann))} or 'auto'")
    base = _base(ann)
    or_auto = " or 'auto'" if allows_auto else ""
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise invalid(source, full, value, f"expected true or false{or_auto}")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise invalid(source, full, value, f"expected an integer{or_auto}")
    if base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer past 1.8e308
                number = math.inf
            if math.isfinite(number):
                return number
        raise invalid(source, full, value, f"expected a finite number{or_auto}")
    if base == "str":
        return _text(source, full, value, "expected a string")
    if base == "list":
        if isinstance(value, list) and len(value) > MAX_LIST:
            raise invalid(source, full, value, f"at most {MAX_LIST} entries")
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [_text(source, full, v, "expected a list of paths") for v in value]
        raise invalid(source, full, value, "expected a list of paths")
    raise AssertionError(f"unhandled annotation {annotation} for {full}")


def _layer_counts(source: str, full: str, value: Any) -> Union[list, str]:
    """parallel.pp_layers: a list of integers (their ranges are megazero.config.rules' to check), or auto."""
    if isinstance(value, list) and len(value) > MAX_LIST:
        raise invalid(source, full, value, f"at most {MAX_LIST} entries")
    if value == AUTO or (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in value)):
        return list(value) if isinstance(value, list) else value
    raise invalid(source, full, value, "expected a list of layer counts, one per (virtual) stage, or auto")


def _text(source: str, full: str, value: Any, expected: str) -> str:
    """A string that can name a file: bounded, UTF-8, without control characters.

    NUL makes os calls raise ValueError, a newline splits one-line messages, a lone surrogate cannot be
    encoded for the OS, and a path longer than PATH_MAX fails there with a traceback-worthy OSError.
    """
    if not isinstance(value, str):
        raise invalid(source, full, value, expected)
    if len(value) > MAX_STR:
        raise invalid(source, full, value, f"{len(value)} characters; at most {MAX_STR}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise invalid(source, full, value, "must not contain a control character (NUL, newline, tab, ...)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(source, full, value, "not valid UTF-8 text (a lone surrogate)") from None
    return value


def _base(ann: str) -> str:
    for t in ("bool", "int", "float", "list", "str"):
        if ann == t or ann.startswith(f"Union[{t}") or ann.startswith(t):
            return t
    return ann


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word[:100], list(options), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(sorted(options))}"


def apply_value(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    """Set ``section.key`` to ``value`` after checking the names and the value's type (not its range): a file's
    key, a ``--set`` and a checkpoint's stored model setting alike; an error names ``source``. A key may name
    a nested mapping's key (``moe.experts`` in ``model``), and a nested mapping takes a mapping of its keys."""
    if section not in SECTIONS:
        raise UserError(f"{source}: unknown section {shown(section)}; {_suggest(str(section), SECTIONS)}")
    moved = moved_line(key) if section == "optim" else None
    if moved:
        raise UserError(f"{source}: {moved}")
    obj, name = getattr(cfg, section), section
    while True:
        fields = {f.name: f for f in dataclasses.fields(obj)}
        head, dot, rest = key.partition(".")
        if not dot or head not in fields or not dataclasses.is_dataclass(getattr(obj, head)):
            break
        obj, name, key = getattr(obj, head), f"{name}.{head}", rest
    if key not in fields:
        raise UserError(f"{source}: unknown key {shown(f'{name}.{key}')}; {_suggest(str(key), fields)}")
    nested = getattr(obj, key)
    if dataclasses.is_dataclass(nested):
        if value is None:  # a mapping whose keys are all commented out: its defaults
            return
        if not isinstance(value, dict):
            raise invalid(source, f"{name}.{key}", value, f"expected a mapping of {name}.{key}'s keys")
        for sub, v in value.items():
            if not isinstance(sub, str):
                raise UserError(f"{source}: unknown key {shown(sub)} in '{name}.{key}'; valid: "
                                f"{', '.join(sorted(f.name for f in dataclasses.fields(nested)))}")
            apply_value(cfg, section, f"{key}.{sub}" if name == section else f"{name[len(section) + 1:]}.{key}.{sub}",
                        v, source)
        return
    setattr(obj, key, _coerce(source, name, key, value, str(fields[key].type)))


def parse_set(item: str) -> tuple[str, str, Any]:
    """`section.key=value` from the command line; the value is read as YAML (so 2 is an int).

    A value that is not YAML at all (``[a``) is taken as its text; one the loader refuses (``010``, an
    alias, a tag, deep nesting) is an error, as in a file.
    """
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UserError(f"--set {shown(item)} is invalid; expected section.key=value, e.g. train.steps=10")
    lhs, raw = item.split("=", 1)
    section, key = lhs.split(".", 1)
    if raw == "":
        return section.strip(), key.strip(), ""
    try:
        value = load_yaml(raw, f"--set {shown_name(lhs.strip())}", lines=False)
    except YamlSyntaxError:
        value = raw
    return section.strip(), key.strip(), value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `--set` overrides and validate all that needs no process group; the values
    are as written (megazero.config.resolve.resolve fixes the derived ones)."""
    cfg = Config()
    source = "<defaults>"
    if path is not None:
        source = shown_name(str(path))
        raw = load_yaml(read_config_text(path), source)
        if raw is None:  # an empty file (or only comments): the defaults
            raw = {}
        if not isinstance(raw, dict):
            raise UserError(f"{source}: holds {shown(raw)}; expected a mapping of sections "
                            f"({', '.join(SECTIONS)})")
        cfg.name = Path(path).stem
        for section, values in raw.items():
            if section not in SECTIONS:
                raise UserError(f"{source}: unknown section {shown(section)}; "
                                f"{_suggest(str(section), SECTIONS)}")
            if values is None:  # a section whose keys are all commented out
                continue
            if not isinstance(values, dict):
                raise UserError(f"{source}: section '{section}' is {shown(values)}; expected a mapping of "
                                "key: value")
            for key, value in values.items():
                if not isinstance(key, str):
                    names = [f.name for f in dataclasses.fields(getattr(cfg, section))]
                    raise UserError(f"{source}: unknown key {shown(key)} in section '{section}'; "
                                    f"valid: {', '.join(sorted(names))}")
                apply_value(cfg, section, key, value, source)
    cfg.source = source
    for item in overrides:
        section, key, value = parse_set(item)
        apply_value(cfg, section, key, value, f"{source} (--set)")
    validate(cfg)
    return cfg
