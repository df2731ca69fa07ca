"""What a resume compares with the checkpoint it continues: the data settings its meta.json records.

A resume continues the sample stream at the checkpoint's ``consumed_samples``; that is the run's own stream only
while what decides it is unchanged, and the weights see it as they were trained only while the document
settings are. Three kinds of change:

* The tokenizer. The checkpoint's weights are of its token ids, and another tokenizer gives the same ids other
  meanings: refused, in one line, whatever ``train.resume_changes`` says. Where the checkpoint recorded the
  content of its tokenizer (``tokenizer_fingerprint``) the tokenizers compare by content (a renamed copy is the
  same tokenizer, the same path rewritten is not); older checkpoints compare by name. ``data.tokenizer: train``
  trains on the files of ``data.paths``, in order, read by ``data.text_key``: a change of those is a change of
  the tokenizer, refused before anything is built; a change of the files' text under the same paths, or
  ``train`` after a checkpoint that named a file, is found by content once the tokenizer is trained, before the
  weights are loaded (``check_built_data``).
* The sample stream: ``data.paths`` (by resolved path: ``a``, ``a/`` and a link to ``a`` are one folder), the
  files under each (by the fingerprint the data cache names them by), their blend weights, ``data.text_key``,
  ``data.split`` (as fractions: ``98,2`` is ``49,1``) and ``train.seed``. The run goes on, and the writing rank
  says in one line what changed and what it does to the samples, unless ``train.resume_changes: allow``
  acknowledges it.
* What the model computes of the same samples: ``data.document_mask`` (a token attends within its own document
  of a packed sample, or across the sample) and ``data.reset_positions`` (positions restart at each document,
  or run over the sample). The weights fit either (the same shapes, and the samples are the same), so, like a
  changed seed's dropout masks, this is a change the user asked for: named in the same line and acknowledged
  by ``allow``, not refused as another tokenizer or another architecture is. A checkpoint from before a key
  was trained without it.

What a save records is taken from the data as the run built it (``GPTData``), never from the files at the time
of the save: the tokenizer the ids came from, and no file read by every rank in the save's collective.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from megazero.checkpoint.meta import read_meta, short
from megazero.config.data_paths import entry_path, entry_weight
from megazero.config.schema import Config
from megazero.data.cache_plan import content_fingerprint
from megazero.data.gpt_data import SourceStamp
from megazero.errors import UserError
from megazero.train.optimizer_resume import check_optimizer_resume

_KEEP = "a resume keeps the tokenizer, since another gives the token ids other meanings"
_REORDERED = ("the sample order after step {n} differs from the one the run started with (samples already trained "
              "on may come again, others not at all)")

Paths = list[tuple[str, Optional[float]]]  # (resolved path, blend weight or None) per data.paths entry


def resume_record(cfg: Config, tokenizer_fingerprint: Optional[str], stamps: Sequence[SourceStamp]) -> dict:
    """What a save records beside the config, for a later resume to compare: ``data.paths`` resolved (against
    this run's working folder, which a later one may not share), the content fingerprint of the tokenizer the
    data was read with and each entry's files as built (``GPTData``: nothing is read here)."""
    return {"data_paths": [os.path.realpath(entry_path(e)) for e in cfg.data.paths],
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "data_sources": [{"path": s.path, "fingerprint": s.fingerprint, "files": s.files} for s in stamps]}


def check_resume(path: Path, cfg: Config) -> Optional[str]:
    """Before anything is built: refuse a resume of checkpoint ``path`` with another optimizer (unless
    ``optim.switch_from`` asks for that switch, which the returned line states) or another tokenizer (the other
    changes are named once the data is built: ``check_built_data``)."""
    meta = read_meta(path)
    note = check_optimizer_resume(path, meta, cfg)
    data = meta.get("config", {}).get("data")
    if isinstance(data, dict):
        _check_tokenizer(path, meta, data, cfg, _their_paths(meta, data), _our_paths(cfg))
    return note


def check_built_data(path: Path, cfg: Config, tokenizer_fingerprint: Optional[str],
                     stamps: Optional[Sequence[SourceStamp]]) -> Optional[str]:
    """Once the data is built, before the weights are loaded: the tokenizer the data was read with must be the
    one checkpoint ``path`` recorded (``data.tokenizer: train`` trains again when the text under ``data.paths``
    changed); returns the one line that names the other changes (None where nothing changed, or
    train.resume_changes=allow). ``stamps``: the entries as built (None: data not built from cfg.data)."""
    meta = read_meta(path)
    fingerprint = meta.get("tokenizer_fingerprint")
    if fingerprint and tokenizer_fingerprint and tokenizer_fingerprint != fingerprint:
        data = meta.get("config", {}).get("data")
        old = data.get("tokenizer") if isinstance(data, dict) else None
        how = (f"data.tokenizer='train' trained a tokenizer (content {tokenizer_fingerprint})"
               + (" afresh, since the text under data.paths changed, and it is" if old == "train" else ", which is")
               if cfg.data.tokenizer == "train"
               else f"data.tokenizer {cfg.data.tokenizer!r} (content {tokenizer_fingerprint}) is")
        named = f" (resume with data.tokenizer={short(old)})" if isinstance(old, str) and old != "train" else ""
        raise UserError(f"checkpoint {path}: {how} not the tokenizer the checkpoint was trained with (content "
                        f"{fingerprint}); {_KEEP}{named}")
    return _changes(path, meta, cfg, stamps)


def compare(where: Path, meta: dict, cfg: Config, stamps: Optional[Sequence[SourceStamp]] = None) -> Optional[str]:
    """The checks of ``check_resume`` and the line of ``check_built_data`` on a checked meta.json
    (``megazero.checkpoint.meta``), without the content check of a tokenizer not yet built."""
    data = meta.get("config", {}).get("data")
    if isinstance(data, dict):
        _check_tokenizer(where, meta, data, cfg, _their_paths(meta, data), _our_paths(cfg))
    return _changes(where, meta, cfg, stamps)


def _changes(where: Path, meta: dict, cfg: Config, stamps: Optional[Sequence[SourceStamp]]) -> Optional[str]:
    config = meta.get("config", {})
    data, train = config.get("data"), config.get("train")
    if not isinstance(data, dict) or cfg.train.resume_changes == "allow":  # no data settings: nothing to compare
        return None
    there, here = _their_paths(meta, data), _our_paths(cfg)
    n = meta["step"]
    changes = []
    if [p for p, _ in there] != [p for p, _ in here]:
        change = _paths_change(there, here)
        if change.startswith("reordered"):  # the same sources: only the order of the samples changes
            changes.append(f"data.paths {change}: {_REORDERED.format(n=n)}")
        else:
            changes.append(f"data.paths {change}: the samples after step {n} are drawn from other documents, and "
                           f"the validation set is another")
    elif not _same_blend(there, here):
        moved = [f"{_cut(p)} {_weight(a)} -> {_weight(b)}" for (p, a), (_, b) in zip(there, here) if a != b]
        shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
        changes.append(f"blend weights in data.paths changed ({shown}): the samples after step {n} follow the new "
                       f"mixture, in another order than the run started with (samples already trained on may come "
                       f"again, others not at all)")
    changes += _changed_files(meta, cfg, stamps or (), n)
    old_key = data.get("text_key", "text")
    if old_key != cfg.data.text_key:
        changes.append(f"data.text_key {short(old_key)} -> {cfg.data.text_key!r}: the documents are read from "
                       f"another field, so the samples after step {n} come from other text (and so does the "
                       f"validation set)")
    old_split = data.get("split")
    if old_split is not None and _split(old_split) != _split(cfg.data.split):
        changes.append(f"data.split {short(old_split)} -> {cfg.data.split!r}: train and validation documents are "
                       f"re-split, so documents trained on may now validate (and validation losses are not "
                       f"comparable with the earlier ones)")
    old_seed = train.get("seed") if isinstance(train, dict) else None
    if old_seed is not None and old_seed != cfg.train.seed:
        changes.append(f"train.seed {short(old_seed)} -> {cfg.train.seed}: {_REORDERED.format(n=n)}, and so do the "
                       f"dropout masks")
    changes += _document_changes(data, cfg, n)
    if not changes:
        return None
    return (f"warning: resuming {where} (step {n}) with changed data settings: " + "; ".join(changes)
            + "; train.resume_changes=allow acknowledges this and silences it")


# (data key, what the run does with it on, with it off): each as "after step n, ..." against the trained weights
_DOCUMENTS = (
    ("document_mask", "a token attends only to earlier tokens of its own document in a packed sample, where the "
                      "weights were trained attending across the whole sample",
                      "a token attends to every earlier token of its packed sample, across documents, where the "
                      "weights were trained attending within its own document"),
    ("reset_positions", "positions restart at each document of a packed sample, where the weights were trained "
                        "with positions counted over the whole sample",
                        "positions are counted over the whole packed sample, where the weights were trained with "
                        "positions restarted at each document"),
)


def _document_changes(data: dict, cfg: Config, n: int) -> list[str]:
    """``data.document_mask`` and ``data.reset_positions`` turned on or off: the same samples, computed with
    other attention or positions than the weights were trained with (a key the checkpoint lacks: off)."""
    changes = []
    for key, on, off in _DOCUMENTS:
        old, new = data.get(key, False), getattr(cfg.data, key)
        if old != new:
            changes.append(f"data.{key} {short(old)} -> {new}: after step {n} {on if new else off}")
    return changes


def _check_tokenizer(where: Path, meta: dict, data: dict, cfg: Config, there: Paths, here: Paths) -> None:
    old, new = data.get("tokenizer"), cfg.data.tokenizer
    if not isinstance(old, str):
        return
    fingerprint = meta.get("tokenizer_fingerprint")
    recorded = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), str) else None  # the file it read
    if new != "train":
        same_file = os.path.realpath(new) in {recorded, None if old == "train" else os.path.realpath(old)}
        if fingerprint and Path(new).is_file():  # by content
            ours = content_fingerprint(Path(new))
            if ours == fingerprint:
                return
            if same_file:
                raise UserError(f"checkpoint {where}: data.tokenizer {new!r} holds another tokenizer than the one "
                                f"the checkpoint was trained with (content {fingerprint} there, {ours} here); "
                                f"{_KEEP} (restore that file, or start afresh)")
        elif same_file:  # by name: an older checkpoint (or a file the data build will report missing)
            return
        raise UserError(f"checkpoint {where}: data.tokenizer is {short(old)} there and {new!r} here; {_KEEP} "
                        f"(resume with data.tokenizer={short(old)}, or start afresh)")
    if old != "train":
        if fingerprint:  # by content, once trained: the file the checkpoint named may be what train makes here
            return
        raise UserError(f"checkpoint {where}: data.tokenizer is {short(old)} there and 'train' here; {_KEEP} "
                        f"(resume with data.tokenizer={short(old)}, or start afresh)")
    instead = f", or set data.tokenizer={_cut(recorded)!r} (the tokenizer it trained)" if recorded else ""
    if [p for p, _ in there] != [p for p, _ in here]:
        raise UserError(f"checkpoint {where}: data.tokenizer='train' trains on data.paths, and data.paths "
                        f"{_paths_change(there, here)}, so the tokenizer trained now would not be the "
                        f"checkpoint's; {_KEEP}: resume with the checkpoint's data.paths{instead}")
    old_key = data.get("text_key", "text")
    if old_key != cfg.data.text_key:
        raise UserError(f"checkpoint {where}: data.tokenizer='train' trains on data.text_key, which is "
                        f"{short(old_key)} there and {cfg.data.text_key!r} here, so the tokenizer trained now would "
                        f"not be the checkpoint's; {_KEEP}: resume with data.text_key={short(old_key)}{instead}")


def _changed_files(meta: dict, cfg: Config, stamps: Sequence[SourceStamp], n: int) -> list[str]:
    """The entries kept under the same resolved path whose files changed since the checkpoint: the dataset is
    built again from them. A checkpoint that recorded no files (an older megazero) is not compared."""
    recorded = meta.get("data_sources")
    theirs: dict[str, tuple[str, Optional[int]]] = {}
    for r in recorded if isinstance(recorded, list) else []:
        if isinstance(r, dict) and isinstance(r.get("path"), str) and isinstance(r.get("fingerprint"), str):
            files = r.get("files")
            count = files if isinstance(files, int) and not isinstance(files, bool) and 0 <= files < 1 << 63 else None
            theirs.setdefault(r["path"], (r["fingerprint"], count))
    changes = []
    for i, (entry, stamp) in enumerate(zip(cfg.data.paths, stamps)):
        if stamp.path not in theirs or theirs[stamp.path][0] == stamp.fingerprint:
            continue
        then = theirs[stamp.path][1]
        if stamp.files is None:
            how = "its dataset files were rewritten"
        elif then is not None and then != stamp.files:
            how = f"{then} files then, {stamp.files} now"
        else:
            how = f"{stamp.files} files, some rewritten, replaced or touched"
        changes.append(f"data.paths[{i}] {_cut(str(entry_path(entry)))!r}: its files changed since the checkpoint "
                       f"({how}), so its dataset is built again: the sample order from here differs from the one "
                       f"the run started with (samples after step {n} may be ones already trained on, or of text "
                       f"it has not seen)")
    return changes


def _our_paths(cfg: Config) -> Paths:
    return [(os.path.realpath(entry_path(e)), entry_weight(e)) for e in cfg.data.paths]


def _their_paths(meta: dict, data: dict) -> Paths:
    """The checkpoint's entries: its resolved paths where it recorded them, else its config's resolved here."""
    entries = data.get("paths", [])
    entries = entries if isinstance(entries, list) else [entries]
    raw: list[str] = []
    weights: list[Optional[float]] = []
    for e in entries:
        path = e.get("path") if isinstance(e, dict) else e
        weight = e.get("weight") if isinstance(e, dict) else None
        raw.append(str(path))
        weights.append(float(weight) if isinstance(weight, (int, float)) and not isinstance(weight, bool) else None)
    resolved = meta.get("data_paths")
    if not (isinstance(resolved, list) and len(resolved) == len(raw)):
        resolved = [os.path.realpath(p) for p in raw]
    return list(zip(resolved, weights))


def _paths_change(there: Paths, here: Paths) -> str:
    """``changed (dropped X, added Y)``, or ``reordered (...)`` where the same entries are in another order."""
    old, new = [p for p, _ in there], [p for p, _ in here]
    gone, added = [p for p in old if p not in new], [p for p in new if p not in old]
    if not gone and not added and len(old) == len(new):
        return f"reordered ({_listed(old)} -> {_listed(new)})"
    parts = [f"{word} {_listed(items)}" for word, items in (("dropped", gone), ("added", added)) if items]
    return f"changed ({', '.join(parts) if parts else f'{len(old)} entries -> {len(new)}'})"


def _listed(items: list[str], shown: int = 3) -> str:
    """``a, b, c and 7 more``, each cut short: a crafted meta.json cannot flood the one line."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(_cut(i) for i in items[:shown]) + more


def _cut(text: str, most: int = 160) -> str:
    return text if len(text) <= most else text[:most - 3] + "..."


def _same_blend(there: Paths, here: Paths) -> bool:
    """The same mixture: both by the sources' sizes, or weights in the same proportions (``1, 1`` is ``2, 2``)."""
    a, b = [w for _, w in there], [w for _, w in here]
    if None in a or None in b or not (sum(a) > 0 and sum(b) > 0):
        return a == b
    return all(math.isclose(x / sum(a), y / sum(b), rel_tol=1e-9) for x, y in zip(a, b))


def _weight(w: Optional[float]) -> str:
    return "by size" if w is None else f"{w:g}"


def _split(split: Any) -> Any:
    """``98,2`` as (train, validation) fractions; a split that does not parse compares as written."""
    from megazero.data.samples import parse_split

    try:
        return tuple(round(f, 12) for f in parse_split(str(split)))
    except UserError:
        return split
