"""What a resume compares with the checkpoint it continues: the data settings its meta.json records.

A resume continues the sample stream at the checkpoint's ``consumed_samples``; that is the run's own stream only
while what decides it is unchanged. Two kinds of change:

* The tokenizer. The checkpoint's weights are of its token ids, and another tokenizer gives the same ids other
  meanings: refused, in one line, whatever ``train.resume_changes`` says. Where the checkpoint recorded the
  content of its tokenizer (``tokenizer_fingerprint``) the tokenizers compare by content (a renamed copy is the
  same tokenizer, the same path rewritten is not); older checkpoints compare by name. ``data.tokenizer: train``
  trains on the files of ``data.paths``, in order, read by ``data.text_key``: a change of those is a change of
  the tokenizer, refused before anything is built; a change of the files' text under the same paths is found
  by content once the tokenizer is trained, before the weights are loaded (``check_tokenizer_content``).
* The sample stream: ``data.paths`` (by resolved path: ``a``, ``a/`` and a link to ``a`` are one folder) and
  their blend weights, ``data.text_key``, ``data.split`` (as fractions: ``98,2`` is ``49,1``) and
  ``train.seed``. The run goes on, and the writing rank says in one line what changed and what it does to the
  samples, unless ``train.resume_changes: allow`` acknowledges it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional

from megazero.checkpoint.meta import read_meta, short
from megazero.config.data_paths import entry_path, entry_weight
from megazero.config.schema import Config
from megazero.data.cache_plan import content_fingerprint
from megazero.errors import UserError

_KEEP = "a resume keeps the tokenizer, since another gives the token ids other meanings"
_REORDERED = ("the sample order after step {n} differs from the one the run started with (samples already trained "
              "on may come again, others not at all)")

Paths = list[tuple[str, Optional[float]]]  # (resolved path, blend weight or None) per data.paths entry


def resume_record(cfg: Config, tokenizer: str | Path | None) -> dict:
    """What a save records beside the config, for a later resume to compare: ``data.paths`` resolved (against
    this run's working folder, which a later one may not share) and the content fingerprint of the tokenizer
    file the run reads."""
    file = Path(tokenizer) if tokenizer is not None else None
    fingerprint = content_fingerprint(file) if file is not None and file.is_file() else None
    return {"data_paths": [os.path.realpath(entry_path(e)) for e in cfg.data.paths],
            "tokenizer_fingerprint": fingerprint}


def check_resume(path: Path, cfg: Config) -> Optional[str]:
    """Before anything is built: refuse a resume of checkpoint ``path`` with another tokenizer; return the one
    line that names the other changes (None where nothing changed, or train.resume_changes=allow)."""
    return compare(path, read_meta(path), cfg)


def check_tokenizer_content(path: Path, cfg: Config, tokenizer: Optional[Path]) -> None:
    """Once the data is built: the tokenizer file this run reads must hold what checkpoint ``path`` recorded
    (``data.tokenizer: train`` trains again when the text under ``data.paths`` changed)."""
    fingerprint = read_meta(path).get("tokenizer_fingerprint")
    if not fingerprint or tokenizer is None or not Path(tokenizer).is_file():
        return
    ours = content_fingerprint(Path(tokenizer))
    if ours != fingerprint:
        how = (f"data.tokenizer='train' trained {tokenizer} (content {ours}) afresh, since the text under "
               f"data.paths changed, and it is" if cfg.data.tokenizer == "train"
               else f"data.tokenizer {str(tokenizer)!r} (content {ours}) is")
        raise UserError(f"checkpoint {path}: {how} not the tokenizer the checkpoint was trained with (content "
                        f"{fingerprint}); {_KEEP}")


def compare(where: Path, meta: dict, cfg: Config) -> Optional[str]:
    """The checks of ``check_resume`` on a checked meta.json (``megazero.checkpoint.meta``)."""
    config = meta.get("config", {})
    data, train = config.get("data"), config.get("train")
    if not isinstance(data, dict):  # a checkpoint that recorded no data settings: nothing to compare
        return None
    there, here = _their_paths(meta, data), _our_paths(cfg)
    _check_tokenizer(where, meta, data, cfg, there, here)
    if cfg.train.resume_changes == "allow":
        return None
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
    if not changes:
        return None
    return (f"warning: resuming {where} (step {n}) with changed data settings: " + "; ".join(changes)
            + "; train.resume_changes=allow acknowledges this and silences it")


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
