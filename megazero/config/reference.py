"""The configuration reference, docs/config.md, written from the schema: each key's comment in its dataclass is
its documentation, its default the dataclass's, its valid values megazero.config.ranges' (the choice lists, the
registries' names among them), so the page cannot drift from what the loader accepts.

    python -m megazero.config.reference            # print the page
    python -m megazero.config.reference --write    # write docs/config.md

tests/config/test_config_reference.py fails when the page and the schema disagree, or a key has no comment.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import textwrap
import tokenize
from pathlib import Path
from typing import Iterator

from megazero.config import ranges
from megazero.config.schema import SECTIONS, OptimConfig
from megazero.parallel.zero.registry import OPTIMIZERS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
HEADER = """# Configuration reference

Every key of a run's YAML file, by section, with its default, its valid values and what it does. A key is set in
the file (`section: {key: value}`) or on the command line (`--set section.key=value`); an unknown key, a value
of the wrong type or out of range is refused in one line naming it. This page is written from the schema's
dataclasses (`megazero/config/schema.py`; the `model` sections' are in `models/config.py`) by
`python -m megazero.config.reference --write`; a test keeps the two equal.
"""


def _own_comments(cls: type) -> dict[str, str]:
    """The comments of the fields ``cls``'s own source declares ({} for a class made without source)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # dataclasses.make_dataclass: the fields come from elsewhere
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip()
        if not line.startswith("    ") or line.startswith("     ") or name not in names or ":" not in stripped:
            continue
        above, k = [], number - 1
        while k >= 1 and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments[k])
            k -= 1
        parts = above + ([comments[number]] if number in comments else [])
        out[name] = " ".join(p for p in parts if p)
    return out


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the full-line comments right above it and the one at the end of its line, joined,
    from whichever class of ``cls``'s bases declares it; a field that is a section of its own (a dataclass made
    from a table, as ``optim``'s) is described by the first line of that section's docstring."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_comments(base))
    for f in dataclasses.fields(cls):
        section = _section_type(f)
        if not out.get(f.name) and section is not None and section.__doc__:
            out[f.name] = inspect.getdoc(section).split("\n")[0]
    return out


def _section_type(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds when it is a section of its own (model.moe, optim.adamw), else None."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def sections() -> Iterator[tuple[str, type]]:
    """(dotted section name, dataclass), nested sections (model.moe, optim.adamw) after their parent's keys; the
    optimizers' sections as parallel.zero.registry holds them now (a row added after the schema was made too)."""
    for name, cls in SECTIONS.items():
        yield name, cls
        nested = [(f.name, _section_type(f)) for f in dataclasses.fields(cls)]
        if cls is OptimConfig:
            nested = [(key, row.section) for key, row in OPTIMIZERS.items()]
        for key, section in nested:
            if section is not None:
                yield f"{name}.{key}", section


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(value):
        return "(a section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if value != "" else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def missing_comments() -> list[str]:
    """Keys without a comment, as section.key."""
    return [f"{name}.{f.name}" for name, cls in sections() for f in dataclasses.fields(cls)
            if not field_comments(cls).get(f.name)]


def page() -> str:
    out = [HEADER]
    for name, cls in sections():
        doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        out.append(f"\n## `{name}`\n")
        if doc:
            out.append(doc + "\n")
        out.append("| key | default | valid | what it does |\n|---|---|---|---|")
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            valid = ranges.allowed(name, f.name) or ""
            out.append(f"| `{name}.{f.name}` | {_cell(_default(f))} | {_cell(valid)} | "
                       f"{_cell(comments.get(f.name, ''))} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megazero.config.reference", description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {PAGE.name} instead of printing it")
    args = ap.parse_args(argv)
    if args.write:
        PAGE.write_text(page())
        print(f"wrote {PAGE}")
    else:
        print(page(), end="")


if __name__ == "__main__":
    main()
