"""log.wandb: an offline W&B run receives TensorBoard's scalars and the resolved config, a resume continues the
same run, a missing package is one line, and with the project unset nothing of wandb is imported.

W&B's offline files are read back with the package's own record definitions (``wandb_internal_pb2``): its
``run-<id>.wandb`` is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of records, each with a 7-byte
header: checksum, length, kind) of those records; the package no longer ships a Python reader for it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megazero.errors import UserError
from megazero.train.run import run
from tests.runs import ROOT, read_metrics, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
BLOCK, HEADER = 32768, 7


def _records(path):
    """The protobuf records of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, pending = path.read_bytes(), HEADER, [], b""
    assert data[:4] == b":W&B", data[:8]
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            out.append(record)
            pending = b""
        elif kind in (2, 3):  # its first or a middle piece
            pending += chunk
    return out


def _history(folder):
    """{step: {key: value}} and the config items, over every offline run file of the folder."""
    steps, config = {}, {}
    for path in sorted((folder / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in _records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                steps[items["_step"]] = items
            elif kind in ("run", "config"):
                update = r.run.config.update if kind == "run" else r.config.update
                config.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in update})
    return steps, config


def _over(tmp_path, folder, steps, *extra):
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    return small_overrides(text, cache, tmp_path / folder, steps=steps) + ["log.wandb.project=megazero-test",
                                                                            *extra]


def test_an_offline_run_gets_the_scalars_and_the_config_and_a_resume_continues_it(tmp_path):
    run(TINY, _over(tmp_path, "run", 4, "train.save_every=2", "train.exit_after=2"))
    run(TINY, _over(tmp_path, "run", 4, "train.save_every=2", "train.resume=auto"))
    folder = tmp_path / "run"
    ids = {p.name.rsplit("-", 1)[1] for p in (folder / "wandb").glob("offline-run-*")}
    assert len(list((folder / "wandb").glob("offline-run-*"))) == 2 and ids == {(folder / "wandb_run_id")
                                                                                 .read_text().strip()}, ids
    steps, config = _history(folder)
    want = {r["step"]: r for r in read_metrics(folder) if "loss" in r}
    assert sorted(steps) == sorted(want) == [1, 2, 3, 4]
    for step, r in want.items():  # TensorBoard's tags and values
        assert steps[step]["train/loss"] == pytest.approx(r["loss"], rel=1e-12)
        assert steps[step]["train/grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-12)
    assert config["model"]["hidden"] == 64 and config["parallel"]["dp"] == 1  # the resolved config


def test_a_missing_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without it gives: ImportError
    with pytest.raises(UserError) as err:
        run(TINY, _over(tmp_path, "run", 1))
    assert str(err.value).endswith("log.wandb.project='megazero-test' needs the wandb package; install it with "
                                   "pip install 'megazero[wandb]', or set log.wandb.project=''"), str(err.value)


def test_with_no_project_nothing_of_wandb_is_imported(tmp_path):
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    code = ("import sys; from megazero.train.run import run; "
            f"run({TINY!r}, {small_overrides(text, cache, tmp_path / 'run', steps=1)!r}); "
            "print(sorted(m for m in sys.modules if m == 'wandb' or m.startswith('wandb.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_an_unknown_mode_is_one_line():
    from megazero.config.load import load_config

    with pytest.raises(UserError, match=rf"^{TINY}: log.wandb.mode='cloud' is invalid; valid: offline \| online$"):
        load_config(TINY, ["log.wandb.mode=cloud"])
