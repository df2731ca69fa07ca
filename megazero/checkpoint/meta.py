"""meta.json of a checkpoint, checked field by field before any state is touched.

A checkpoint folder may have been copied, edited or crafted: every field a
resume or an export reads is checked for type and range here, and a bad one is
one line naming the file, the field, the value (cut to ~60 characters) and what
is valid. The stored model config is checked with the project's own config
rules (``megazero.config.load.apply_value`` on a fresh Config, then
``megazero.config.rules.check_model``: ranges, choices and how the keys constrain
each other), so a checkpoint cannot hold a model a config file could not.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from megazero.errors import UserError

FORMAT_VERSION = 1
META = "meta.json"
MAX_STEP = 10 ** 8 - 1  # checkpoint folders are named with 8 digits
INT_LIMIT = 2 ** 63 - 1  # counters end up in int64 tensors
MAX_META_BYTES = 16 << 20  # a real meta.json is a few KB; this bounds what a crafted one makes us read
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
FINGERPRINT = re.compile(r"[0-9a-f]{16}")
MAX_PATH = 4096
MAX_SPIKE_WINDOW = 100_000  # train.spike_window's bound: the window is stored in meta.json
# what a resume needs beyond format and step; an export needs only the config
RESUME_FIELDS = ("consumed_samples", "optimizer_step", "config")
# the model keys an export and a resume cannot do without (checkpoints of every megazero version hold them)
MODEL_KEYS = ("layers", "hidden", "heads", "seq_len", "vocab_size")
_SCALER = {"scale": "a finite number > 0", "clean_steps": "an integer >= 0", "hysteresis_left": "an integer >= 0"}
_MAX_SHOWN = 60


def short(value: Any) -> str:
    """repr(value), cut to ~60 characters: a crafted value must not flood the one error line."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


def _bad(where: Path, field: str, value: Any, valid: str) -> UserError:
    return UserError(f"checkpoint {where}: {field}={short(value)} is invalid; expected {valid}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(where: Path, meta: dict, field: str, low: int, high: int) -> None:
    value = meta[field]
    if not _is_int(value) or not low <= value <= high:
        raise _bad(where, field, value, f"an integer in [{low}, {high}]")


def _loss_scaler(where: Path, value: Any) -> None:
    if not isinstance(value, dict) or set(value) != set(_SCALER):
        raise _bad(where, "loss_scaler", value, f"an object with exactly {', '.join(_SCALER)}")
    scale = value["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise _bad(where, "loss_scaler.scale", scale, _SCALER["scale"])
    for key in ("clean_steps", "hysteresis_left"):
        if not _is_int(value[key]) or not 0 <= value[key] <= INT_LIMIT:
            raise _bad(where, f"loss_scaler.{key}", value[key], f"an integer in [0, {INT_LIMIT}]")


def check_model_section(where: Path, model: Any) -> None:
    """The stored model config obeys the rules a config file's model section does."""
    from megazero.config.load import apply_value
    from megazero.config.rules import check_model
    from megazero.config.schema import Config

    if not isinstance(model, dict):
        raise _bad(where, "config.model", model, "an object of model settings")
    for key in MODEL_KEYS:
        if key not in model:
            raise UserError(f"checkpoint {where}: config.model.{key} is missing; expected the model's "
                            f"{', '.join(MODEL_KEYS)}")
    cfg = Config()
    source = f"checkpoint {where}: config"
    for key, value in model.items():
        if not isinstance(key, str) or not key.isidentifier() or len(key) > _MAX_SHOWN:
            raise _bad(where, "config.model key", key, "a model setting name")
        if _is_int(value) and abs(value) > INT_LIMIT:
            raise _bad(where, f"config.model.{key}", value, f"at most {INT_LIMIT}")
        try:
            apply_value(cfg, "model", key, value, source)
        except UserError as e:  # the config's own message, with the value cut short
            raise UserError(str(e).replace(repr(value), short(value), 1)) from None
    check_model(cfg, source)


def _config(where: Path, config: Any) -> None:
    if not isinstance(config, dict):
        raise _bad(where, "config", config, "an object of config sections")
    for section, values in config.items():
        if section == "name":
            if not isinstance(values, str):
                raise _bad(where, "config.name", values, "a string")
        elif not isinstance(values, dict):
            name = section if section.isidentifier() and len(section) <= _MAX_SHOWN else short(section)
            raise _bad(where, f"config.{name}", values, "an object of settings")
    if "model" not in config:
        raise UserError(f"checkpoint {where}: config.model is missing; expected the run's model settings")
    check_model_section(where, config["model"])


def check_meta(where: Path, meta: Any, require: Iterable[str] = RESUME_FIELDS) -> dict:
    """Check a parsed meta.json; ``require`` names the optional fields the caller cannot do without."""
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint {where}: holds {short(meta)}; expected a JSON object")
    for field in ("format", "step", *require):
        if field not in meta:
            raise UserError(f"checkpoint {where}: {field} is missing; a megazero checkpoint records format, step, "
                            f"sequence, consumed_samples, optimizer_step and config")
    if meta["format"] != FORMAT_VERSION or not _is_int(meta["format"]):
        raise _bad(where, "format", meta["format"], f"{FORMAT_VERSION} (the format this megazero reads)")
    _int(where, meta, "step", 0, MAX_STEP)
    for field in ("sequence", "consumed_samples", "optimizer_step"):
        if field in meta:
            _int(where, meta, field, 0, INT_LIMIT)
    if "optimizer_step" in meta and meta["optimizer_step"] > meta["step"]:
        raise _bad(where, "optimizer_step", meta["optimizer_step"], f"at most step={meta['step']} (updates made)")
    if "loss_scaler" in meta:
        _loss_scaler(where, meta["loss_scaler"])
    if "run_id" in meta and not (isinstance(meta["run_id"], str) and RUN_ID.fullmatch(meta["run_id"])):
        raise _bad(where, "run_id", meta["run_id"], "1-64 letters, digits, '-' or '_'")
    _data_record(where, meta)
    _spike_record(where, meta)
    if "config" in meta:
        _config(where, meta["config"])
    return meta


def _data_record(where: Path, meta: dict) -> None:
    """What a resume compares of the data (megazero.train.resume_changes): the tokenizer's content fingerprint
    and the resolved data.paths, where the checkpoint recorded them."""
    fingerprint = meta.get("tokenizer_fingerprint")
    if fingerprint is not None and not (isinstance(fingerprint, str) and FINGERPRINT.fullmatch(fingerprint)):
        raise _bad(where, "tokenizer_fingerprint", fingerprint, "16 hexadecimal digits, or null")
    paths = meta.get("data_paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and 0 < len(p) <= MAX_PATH for p in paths):
        raise _bad(where, "data_paths", paths, f"a list of paths (each 1-{MAX_PATH} characters)")


def _spike_record(where: Path, meta: dict) -> None:
    """train.on_spike's state (megazero.train.loss_spikes): the window of recent losses, rollbacks made, global
    batches skipped."""
    window = meta.get("loss_window", [])
    if not isinstance(window, list) or len(window) > MAX_SPIKE_WINDOW or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in window):
        raise _bad(where, "loss_window", window, f"a list of at most {MAX_SPIKE_WINDOW} finite losses")
    for field in ("rollbacks", "skipped_batches"):
        if field in meta:
            _int(where, meta, field, 0, INT_LIMIT)


def _load_json(meta_file: Path) -> Any:
    if not meta_file.is_file():
        raise UserError(f"checkpoint {meta_file.parent}: not a complete megazero checkpoint (no {META})")
    try:
        if meta_file.stat().st_size > MAX_META_BYTES:
            raise UserError(f"checkpoint {meta_file}: {meta_file.stat().st_size} bytes; a meta.json is at most "
                            f"{MAX_META_BYTES}")
        return json.loads(meta_file.read_bytes())
    except OSError as e:
        raise UserError(f"checkpoint {meta_file}: unreadable ({e.strerror or e})") from None
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(f"checkpoint {meta_file}: not valid JSON; expected the object megazero writes") from None


def read_meta(path: str | Path, require: Iterable[str] = RESUME_FIELDS) -> dict:
    """The checked meta.json of checkpoint folder ``path`` (by default: everything a resume needs)."""
    meta_file = Path(path) / META
    return check_meta(meta_file, _load_json(meta_file), require)


def peek_meta(path: Path) -> dict:
    """meta.json read leniently, for ordering and rotation over folders that may be damaged: {} if unusable."""
    try:
        meta_file = path / META
        if meta_file.stat().st_size > MAX_META_BYTES:
            return {}
        meta = json.loads(meta_file.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def checkpoint_run_id(path: str | Path) -> Optional[str]:
    """The id of the run that wrote checkpoint ``path``, or None (older megazero, or unreadable)."""
    run_id = peek_meta(Path(path)).get("run_id")
    return run_id if isinstance(run_id, str) and RUN_ID.fullmatch(run_id) else None
