"""YAML for untrusted config input: plain data by the YAML 1.2 core schema, or one line saying why not.

Config files and ``--set`` values are read here, not with ``yaml.safe_load``, whose traps pass silently or
blow up later: duplicate keys (the last wins), YAML 1.1 scalars (``010`` is 8, ``1:30`` is 90, ``yes`` and
``on`` are true), alias bombs (nine aliases nine deep are 9**9 values, which formatting an error message
then walks), and a recursive composer that ends in a RecursionError on deep nesting.

This module builds the value from PyYAML's event stream (its scanner and parser keep explicit stacks: no
recursion) and refuses, with the line:

- anchors and aliases (``&a`` / ``*a``): a config is a few dozen keys, written out; an alias makes a value
  live elsewhere and is what makes a bomb;
- merge keys (``<<``): a second way to give a key, which would silently win or lose against the first;
- explicit tags (``!!python/object``, ``!!set``, ``!foo``): nothing here is constructed from a tag;
- duplicate keys, at any depth;
- nesting deeper than :data:`MAX_DEPTH` (a config needs three levels);
- more than one document;
- integers with a leading zero (``010``): YAML 1.1 reads them as octal 8, 1.2 as decimal 10 — ambiguous,
  so refused (write ``10``, or ``0o10`` for octal);
- integers longer than :data:`MAX_INT_DIGITS` digits (beyond every range; Python itself refuses to convert
  4300+ digits).

Plain scalars resolve by the YAML 1.2 core schema: null is ``~``/``null``/empty; booleans only
``true``/``false`` in their three cases (``yes``, ``on``, ``y`` are strings); integers are decimal, ``0o``
octal or ``0x`` hex; floats include ``1e-3`` (no dot needed), ``.inf`` and ``.nan``. Everything else,
``1:30`` included, is a string; quoted scalars are always strings. Keys resolve the same way (``1: 2`` has
the integer key 1; a mapping or list as a key is refused).
"""
from __future__ import annotations

import codecs
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

import yaml
from yaml import events as ev

from megazero.errors import UserError, shown, shown_name

MAX_DEPTH = 16  # mappings and lists inside each other; a config uses 3 (sections, keys, a list value)
MAX_BYTES = 1 << 20  # a config is a few KB; 1 MiB bounds the time and memory any file can cost
MAX_INT_DIGITS = 100  # far past 2**64 (20 digits); below Python's 4300-digit int conversion limit

_NULL = re.compile(r"~|null|Null|NULL|")
_TRUE = re.compile(r"true|True|TRUE")
_FALSE = re.compile(r"false|False|FALSE")
_DECIMAL = re.compile(r"[-+]?[0-9]+")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]+")
_OCTAL = re.compile(r"0o[0-7]+")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_NAN = re.compile(r"\.(nan|NaN|NAN)")


class YamlSyntaxError(UserError):
    """The text is not YAML at all (as opposed to YAML this loader refuses): ``--set`` then takes it as text."""


def read_config_text(path: str | Path) -> str:
    """The text of a config file: a regular file (a FIFO would block, a directory or device is no config),
    at most MAX_BYTES, UTF-8 (a BOM allowed) or UTF-16 with a BOM."""
    name = shown_name(str(path))
    try:  # non-blocking, so a FIFO is refused at once rather than waited on; fstat checks what was opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UserError(f"--config {name}: no such file") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--config {name}: cannot open ({getattr(e, 'strerror', None) or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UserError(f"--config {name} is a directory; expected a YAML file")
        if not stat.S_ISREG(mode):
            raise UserError(f"--config {name} is not a regular file (a FIFO, device or socket); "
                            "expected a YAML file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"{name}: unreadable ({e.strerror}); expected a UTF-8 YAML file") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise UserError(f"{name}: more than {MAX_BYTES} bytes; a config is at most {MAX_BYTES} bytes")
    try:
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            return data.decode("utf-16")
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: unreadable ({e.reason} at byte {e.start}); expected a UTF-8 YAML file") \
            from None


def load_yaml(text: str, source: str, lines: bool = True) -> Any:
    """The one YAML document in ``text`` as plain Python data (None when empty), by the rules above.

    ``source`` starts every message; ``lines`` adds the line number (a ``--set`` value has one line).
    """
    try:
        return _build(yaml.parse(text, Loader=yaml.SafeLoader), source, lines)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}" if lines and mark is not None else ""
        problem = " ".join(str(e.problem or e.context or "").split())
        raise YamlSyntaxError(f"{source}: not valid YAML{where}: {problem[:120]}") from None
    except yaml.reader.ReaderError as e:  # a control character, such as NUL
        char = e.character if isinstance(e.character, int) else ord(e.character[:1] or "\0")
        where = f" at line {text.count(chr(10), 0, e.position) + 1}" if lines else ""
        raise YamlSyntaxError(f"{source}: not valid YAML{where}: unacceptable character #x{char:04x}") from None
    except yaml.YAMLError as e:
        raise YamlSyntaxError(f"{source}: not valid YAML: {shown(str(e), 120)}") from None


class _Mapping:
    """A mapping being built: its dict, the key waiting for its value, and where each key was given."""

    def __init__(self) -> None:
        self.value: dict = {}
        self.key: Any = None
        self.has_key = False
        self.key_lines: dict = {}


def _build(stream: Iterator[ev.Event], source: str, lines: bool) -> Any:
    """Fold the event stream into dicts, lists and scalars with an explicit stack (no recursion)."""
    stack: list[Any] = []  # open _Mapping and list containers, innermost last
    root: Any = None
    documents = 0

    def refuse(line: int, what: str) -> UserError:
        return UserError(f"{source}, line {line}: {what}" if lines else f"{source}: {what}")

    def add(value: Any, line: int, plain_text: str | None = None) -> None:
        nonlocal root
        if not stack:
            root = value
            return
        top = stack[-1]
        if isinstance(top, list):
            top.append(value)
        elif top.has_key:
            top.value[top.key] = value
            top.has_key = False
        else:
            if isinstance(value, (dict, list)):
                raise refuse(line, f"a key must be a name or a number, not {shown(value)}")
            if plain_text == "<<":
                raise refuse(line, "merge key '<<' is not supported; write the keys out")
            if value in top.key_lines:
                first = f", first given at line {top.key_lines[value]}" if lines else ""
                raise refuse(line, f"duplicate key {shown(value)}{first}")
            top.key, top.has_key = value, True
            top.key_lines[value] = line

    for event in stream:
        if isinstance(event, (ev.StreamStartEvent, ev.StreamEndEvent, ev.DocumentEndEvent)):
            continue
        line = event.start_mark.line + 1
        if isinstance(event, ev.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise refuse(line, "holds more than one YAML document ('---'); a config is one YAML document")
            continue
        if isinstance(event, ev.AliasEvent):
            raise refuse(line, f"alias *{shown_name(event.anchor, 60)}: anchors and aliases are not supported; "
                               "write the value out")
        if getattr(event, "anchor", None) is not None:
            raise refuse(line, f"anchor &{shown_name(event.anchor, 60)}: anchors and aliases are not supported; "
                               "write the value out")
        if getattr(event, "tag", None) is not None:
            tag = event.tag.replace("tag:yaml.org,2002:", "!!", 1)
            raise refuse(line, f"tag {shown(tag)} is not supported; plain values only")
        if isinstance(event, (ev.MappingStartEvent, ev.SequenceStartEvent)):
            if len(stack) >= MAX_DEPTH:
                raise refuse(line, f"nested deeper than {MAX_DEPTH} levels; a config needs 3")
            stack.append(_Mapping() if isinstance(event, ev.MappingStartEvent) else [])
        elif isinstance(event, (ev.MappingEndEvent, ev.SequenceEndEvent)):
            top = stack.pop()
            add(top.value if isinstance(top, _Mapping) else top, line)
        elif isinstance(event, ev.ScalarEvent):
            if event.implicit[0]:  # plain: resolved by the core schema
                add(_resolve(event.value, lambda what: refuse(line, what)), line, event.value)
            else:  # quoted or block: a string
                add(event.value, line)
    return root


def _resolve(text: str, refuse) -> Any:
    """A plain scalar by the YAML 1.2 core schema; ``010`` and overlong integers are refused."""
    if _NULL.fullmatch(text):
        return None
    if _TRUE.fullmatch(text):
        return True
    if _FALSE.fullmatch(text):
        return False
    if _DECIMAL.fullmatch(text) or _OCTAL.fullmatch(text) or _HEX.fullmatch(text):
        digits = len(text.lstrip("+-")) - (2 if text[:2] in ("0o", "0x") else 0)
        if digits > MAX_INT_DIGITS:
            raise refuse(f"an integer of {digits} digits is out of range")
        if _LEADING_ZERO.fullmatch(text):
            octal = text.lstrip("+-").lstrip("0") or "0"
            hint = f" or 0o{octal} for octal" if set(octal) <= set("01234567") else ""
            raise refuse(f"{shown(text)} is ambiguous (YAML 1.1 reads a leading 0 as octal, YAML 1.2 as "
                         f"decimal); write {int(text, 10)} for decimal{hint}")
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text, 10)
    if _FLOAT.fullmatch(text):
        return float(text)
    if _INF.fullmatch(text):
        return float("-inf") if text.startswith("-") else float("inf")
    if _NAN.fullmatch(text):
        return float("nan")
    return text
