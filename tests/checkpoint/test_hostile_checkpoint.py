"""Hostile checkpoints: crafted metadata pickles, tampered meta.json, damaged shards, a checkpoint folder the
user keeps things in, export into an occupied folder. Through resume (pretrain.py's main) and export
(megazero.interop.export's main), in this process: exit code 2, one line on stderr, nothing executed, nothing lost.

One real checkpoint folder (a tiny model trained 2 steps, saved at steps 1 and 2) is made per module; each
case tampers with a copy of it.
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megazero.checkpoint import store as checkpoint
from megazero.errors import UserError
from megazero.interop.export import main as export_main
from tests.hostile import ROOT, assert_one_line, call, pretrain_main
from tests.runs import small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
STEP1, STEP2 = "step_00000001", "step_00000002"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(base folder, the run's model state at step 1): the run lives in base/run."""
    base = tmp_path_factory.mktemp("hostile_ckpt")
    write_corpus(base / "corpus")
    assert pretrain_main(_argv(base, base / "run")) == 0
    return base, checkpoint.read_model_state(base / "run" / "checkpoints" / STEP1)


def _argv(base: Path, log_dir: Path, *sets: str) -> list[str]:
    overrides = small_overrides(base / "corpus", base / "cache", log_dir, steps=2,
                                **{"train.save_every": 1, "train.keep_last": 5}) + list(sets)
    return ["--config", TINY] + [a for o in overrides for a in ("--set", o)]


@pytest.fixture
def case(made, tmp_path):
    """A fresh copy of the run for one case: (base, run copy, its checkpoints folder)."""
    base, _ = made
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    return base, run, run / "checkpoints"


def resume(case, capsys, target: str) -> tuple[int, str]:
    base, run, ckpts = case
    code, _, err = call(pretrain_main, _argv(base, run, f"train.resume={target}"), capsys)
    return code, err


def export(capsys, *argv: str) -> tuple[int, str]:
    code, _, err = call(export_main, [str(a) for a in argv], capsys)
    return code, err


def assert_nothing_lost(made, ckpts: Path, names: list[str]) -> None:
    """The folder holds what it held, and step 1 (untouched by every case) loads and equals the original."""
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(names)
    state = checkpoint.read_model_state(ckpts / STEP1)
    assert state.keys() == made[1].keys() and all(torch.equal(state[k], made[1][k]) for k in state)


# --- crafted .metadata pickles: nothing runs ------------------------------------------------------------

def _s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def _call4(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: STACK_GLOBAL(module, name), then REDUCE it with one string argument."""
    return b"\x80\x04" + _s(module) + _s(name) + b"\x93" + _s(arg) + b"\x85R."


def _payloads(marker: Path) -> dict[str, bytes]:
    shell = f"touch {marker}"
    return {
        # a dotted name under an admitted module: protocol 4 resolves it to os.system
        "dotted": _call4("torch.distributed.checkpoint.filesystem", "os.system", shell),
        "dotted_metadata": _call4("torch.distributed.checkpoint.metadata", "os.system", shell),
        "reduce_os_system": _call4("os", "system", shell),
        "reduce_exec": _call4("builtins", "exec", f"open({str(marker)!r}, 'w').close()"),
        "global_protocol0": b"cos\nsystem\n(S'" + shell.encode() + b"'\ntR.",
        "inst_protocol0": b"(S'" + shell.encode() + b"'\nios\nsystem\n.",
    }


@pytest.mark.parametrize("kind", list(_payloads(Path("m"))))
@pytest.mark.parametrize("via", ["resume", "export"])
def test_crafted_metadata_executes_nothing(made, case, capsys, tmp_path, kind, via):
    base, run, ckpts = case
    marker = tmp_path / "pwned"
    (ckpts / STEP2 / ".metadata").write_bytes(_payloads(marker)[kind])
    names = sorted(p.name for p in ckpts.iterdir())
    if via == "resume":
        code, err = resume(case, capsys, str(ckpts / STEP2))
    else:
        code, err = export(capsys, ckpts / STEP2, tmp_path / "hf")
        assert not (tmp_path / "hf").exists()
    assert not marker.exists(), "the payload ran"
    assert_one_line(code, err, str(ckpts / STEP2), "not allowed")
    assert_nothing_lost(made, ckpts, names)


def test_build_on_an_admitted_class_is_refused(made, case, capsys):
    """BUILD on a class would set its attributes process-wide (here Metadata.version)."""
    from torch.distributed.checkpoint.metadata import Metadata

    base, run, ckpts = case
    payload = (b"\x80\x04" + _s("torch.distributed.checkpoint.metadata") + _s("Metadata") + b"\x93"
               + b"N}" + _s("version") + _s("tampered") + b"s\x86b.")  # (None, {version: ...}) BUILD
    (ckpts / STEP2 / ".metadata").write_bytes(payload)
    try:
        code, err = resume(case, capsys, "auto")
        assert Metadata.version is None
        assert_one_line(code, err, ".metadata", "not allowed")
    finally:
        Metadata.version = None


def test_build_on_an_enum_member_is_refused(made, case, capsys):
    """_MEM_FORMAT_ENCODING(0) is an admitted call that returns the process-wide enum member: BUILD on it
    would rename (or renumber) it for everything after, checkpoints this process writes included."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    base, run, ckpts = case
    member = _MEM_FORMAT_ENCODING(0)
    name = member._name_
    payload = (b"\x80\x04" + _s("torch.distributed.checkpoint.metadata") + _s("_MEM_FORMAT_ENCODING") + b"\x93"
               + b"K\x00\x85R" + b"}" + _s("_name_") + _s("EVIL") + b"sb.")  # member(0), then BUILD {_name_}
    (ckpts / STEP2 / ".metadata").write_bytes(payload)
    try:
        code, err = resume(case, capsys, "auto")
        assert member._name_ == name
        assert_one_line(code, err, ".metadata", "not allowed")
    finally:
        member._name_ = name


def _rewrite_metadata(path: Path, edit) -> None:
    """Unpickle a real .metadata (trusted: we wrote it), edit it, pickle it back."""
    md = pickle.loads(path.read_bytes())
    edit(md)
    path.write_bytes(pickle.dumps(md, protocol=4))


def _traversal(md) -> None:
    for info in md.storage_data.values():
        info.relative_path = "../" + info.relative_path


def _bytes_entry(md) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    key = next(k for k in md.state_dict_metadata if k.startswith("model/"))
    md.state_dict_metadata[key] = BytesStorageMetadata()


def _chunk_outside(md) -> None:
    entry = md.state_dict_metadata["model/embed.tokens.weight"]
    entry.size = torch.Size([1] * len(entry.size))


@pytest.mark.parametrize("edit,fragment", [
    (_traversal, "plain file name"),  # would read ../__0_0.distcp, outside the checkpoint
    (_bytes_entry, "not allowed"),  # DCP reads byte entries with torch.load(weights_only=False)
    (_chunk_outside, "lies outside"),
])
@pytest.mark.parametrize("via", ["resume", "export"])
def test_well_formed_but_tampered_metadata(made, case, capsys, tmp_path, edit, fragment, via):
    base, run, ckpts = case
    _rewrite_metadata(ckpts / STEP2 / ".metadata", edit)
    shutil.copy(ckpts / STEP2 / "__0_0.distcp", ckpts / "__0_0.distcp")  # what the traversal would read
    names = sorted(p.name for p in ckpts.iterdir())
    code, err = resume(case, capsys, "auto") if via == "resume" else export(capsys, ckpts / STEP2, tmp_path / "o")
    assert_one_line(code, err, str(ckpts / STEP2), fragment)
    assert_nothing_lost(made, ckpts, names)


# --- meta.json, field by field -------------------------------------------------------------------------

def _set(*path, value):
    def edit(meta):
        for key in path[:-1]:
            meta = meta[key]
        meta[path[-1]] = value
    return edit


def _drop(*path):
    def edit(meta):
        for key in path[:-1]:
            meta = meta[key]
        del meta[path[-1]]
    return edit


META_CASES = {  # name: (edit of the parsed meta.json, fragments the error line must hold)
    "step_string": (_set("step", value="abc"), ["step='abc'", "an integer in [0, 99999999]"]),
    "step_bool": (_set("step", value=True), ["step=True", "an integer"]),
    "step_negative": (_set("step", value=-1), ["step=-1", "[0, 99999999]"]),
    "step_huge": (_set("step", value=10 ** 30), ["step=1000000000000000000000000000000", "[0, 99999999]"]),
    "step_missing": (_drop("step"), ["step is missing"]),
    "consumed_float": (_set("consumed_samples", value=16.0), ["consumed_samples=16.0", "an integer"]),
    "consumed_huge": (_set("consumed_samples", value=2 ** 64), ["consumed_samples=", "9223372036854775807"]),
    "optimizer_step_missing": (_drop("optimizer_step"), ["optimizer_step is missing"]),
    "optimizer_step_ahead": (_set("optimizer_step", value=7), ["optimizer_step=7", "at most step=2"]),
    "scale_nan": (_set("loss_scaler", "scale", value=float("nan")), ["loss_scaler.scale=nan", "finite"]),
    "scale_zero": (_set("loss_scaler", "scale", value=0), ["loss_scaler.scale=0", "> 0"]),
    "scaler_list": (_set("loss_scaler", value=[1, 2]), ["loss_scaler=[1, 2]", "clean_steps"]),
    "hysteresis_negative": (_set("loss_scaler", "hysteresis_left", value=-2), ["hysteresis_left=-2", "[0,"]),
    "format_2": (_set("format", value=2), ["format=2", "expected 1"]),
    "run_id_int": (_set("run_id", value=5), ["run_id=5", "letters"]),
    "run_id_path": (_set("run_id", value="../x"), ["run_id='../x'", "letters"]),
    "fingerprint_int": (_set("tokenizer_fingerprint", value=5), ["tokenizer_fingerprint=5", "16 hexadecimal"]),
    "fingerprint_path": (_set("tokenizer_fingerprint", value="../tok"), ["tokenizer_fingerprint='../tok'", "hex"]),
    "data_paths_string": (_set("data_paths", value="/x"), ["data_paths='/x'", "a list of paths"]),
    "data_paths_long": (_set("data_paths", value=["x" * 5000]), ["data_paths=['xxx", "1-4096 characters"]),
    "loss_window_nan": (_set("loss_window", value=[1.0, float("nan")]), ["loss_window=[1.0, nan]", "finite losses"]),
    "loss_window_dict": (_set("loss_window", value={"a": 1}), ["loss_window={'a': 1}", "a list of at most"]),
    "rollbacks_negative": (_set("rollbacks", value=-1), ["rollbacks=-1", "an integer in [0,"]),
    "skipped_batches_float": (_set("skipped_batches", value=1.5), ["skipped_batches=1.5", "an integer"]),
    "config_missing": (_drop("config"), ["config is missing"]),
    "config_string": (_set("config", value="x"), ["config='x'", "config sections"]),
    "model_list": (_set("config", "model", value=[]), ["config.model=[]", "an object of settings"]),
    "section_list": (_set("config", "train", value=[1]), ["config.train=[1]", "settings"]),
    "heads_zero": (_set("config", "model", "heads", value=0), ["model.heads=0", ">= 1"]),
    "heads_not_dividing": (_set("config", "model", "heads", value=3), ["model.heads=3", "hidden=64"]),
    "heads_string": (_set("config", "model", "heads", value="4"), ["model.heads='4'", "an integer"]),
    "hidden_bool": (_set("config", "model", "hidden", value=True), ["model.hidden=True", "an integer"]),
    "layers_huge": (_set("config", "model", "layers", value=10 ** 40), ["model.layers=", "at most"]),
    "layers_missing": (_drop("config", "model", "layers"), ["config.model.layers is missing"]),
    "unknown_model_key": (_set("config", "model", "evil", value=1), ["unknown key 'model.evil'"]),
    "dropout_one": (_set("config", "model", "dropout", value=1.0), ["model.dropout=1.0", "[0, 1)"]),
    "long_value": (_set("config", "model", "seq_len", value="9" * 5000), ["model.seq_len=", "..."]),
}


def _tamper_meta(ckpt: Path, edit) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["run_id"] = meta.get("run_id", "r1")  # present, so run_id edits have something to change
    edit(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))  # NaN is written as NaN, as a hand edit might


@pytest.mark.parametrize("name", list(META_CASES))
def test_tampered_meta_json_is_one_line_before_anything_is_touched(made, case, capsys, name):
    base, run, ckpts = case
    edit, fragments = META_CASES[name]
    _tamper_meta(ckpts / STEP2, edit)
    names = sorted(p.name for p in ckpts.iterdir())
    metrics = (run / "metrics.jsonl").read_bytes()
    code, err = resume(case, capsys, str(ckpts / STEP2))
    line = assert_one_line(code, err, str(ckpts / STEP2 / "meta.json"), *fragments)
    assert len(line) < 600, line  # a crafted value is cut short, not echoed whole
    assert_nothing_lost(made, ckpts, names)
    assert (run / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("content,fragment", [
    (b"[1, 2]", "expected a JSON object"),
    (b'{"format": 1, "step": ', "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[" * 100000, "not valid JSON"),  # nested past the parser's recursion limit
])
def test_meta_json_that_is_not_an_object(made, case, capsys, content, fragment):
    base, run, ckpts = case
    (ckpts / STEP2 / "meta.json").write_bytes(content)
    names = sorted(p.name for p in ckpts.iterdir())
    code, err = resume(case, capsys, str(ckpts / STEP2))
    assert_one_line(code, err, str(ckpts / STEP2), fragment)
    assert_nothing_lost(made, ckpts, names)


def test_export_checks_the_stored_model_config(made, case, capsys, tmp_path):
    base, run, ckpts = case
    _tamper_meta(ckpts / STEP2, _set("config", "model", "heads", value=0))
    code, err = export(capsys, ckpts / STEP2, tmp_path / "hf")
    assert_one_line(code, err, "model.heads=0", ">= 1")
    _tamper_meta(ckpts / STEP2, _set("config", "model", "heads", value=8))  # valid, but wider than the tensors
    _tamper_meta(ckpts / STEP2, _set("config", "model", "hidden", value=128))
    code, err = export(capsys, ckpts / STEP2, tmp_path / "hf")
    assert_one_line(code, err, "shape", "hidden=128")
    assert not (tmp_path / "hf").exists()


# --- damaged files -------------------------------------------------------------------------------------

def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _fifo(path: Path) -> None:
    """The shard becomes a FIFO. A reader that opened it would block for ever: a thread feeds it EOF after
    20 s, so a regression fails instead of hanging the suite."""
    import os
    import threading
    import time

    path.unlink()
    os.mkfifo(path)

    def unblock() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # only succeeds while a reader waits
                return
            except OSError:
                time.sleep(0.1)

    threading.Thread(target=unblock, daemon=True).start()


def _link_outside(path: Path) -> None:
    outside = path.parent.parent.parent / "outside.distcp"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


@pytest.mark.parametrize("damage,fragment", [
    (lambda c: _cut(c / "__0_0.distcp"), "unreadable"),
    (lambda c: (c / "__0_0.distcp").unlink(), "unreadable (FileNotFoundError"),
    (lambda c: _cut(c / ".metadata"), "unreadable metadata"),
    (lambda c: (c / ".metadata").write_bytes(bytes(range(256)) * 4), "unreadable metadata"),
    (lambda c: (c / ".metadata").unlink(), "no .metadata"),
    (lambda c: _fifo(c / "__0_0.distcp"), "is not a regular file"),
    (lambda c: _link_outside(c / "__0_0.distcp"), "is not a regular file"),
])
@pytest.mark.parametrize("via", ["resume", "export"])
def test_damaged_files_are_one_line(made, case, capsys, tmp_path, damage, fragment, via):
    base, run, ckpts = case
    damage(ckpts / STEP2)
    names = sorted(p.name for p in ckpts.iterdir())
    code, err = resume(case, capsys, "auto") if via == "resume" else export(capsys, ckpts / STEP2, tmp_path / "o")
    assert_one_line(code, err, str(ckpts / STEP2), fragment)
    assert_nothing_lost(made, ckpts, names)


# --- the checkpoint folder is the user's too -----------------------------------------------------------

def test_foreign_entries_are_ignored_and_kept(made, case, capsys):
    """A user's copy step_00000007_good crashed every later start (int('00000007_good'))."""
    base, run, ckpts = case
    shutil.copytree(ckpts / STEP1, ckpts / "step_00000007_good")
    shutil.copytree(ckpts / STEP1, ckpts / "step_00000009.bak")
    (ckpts / "notes.txt").write_text("lr 3e-4 was better")
    (ckpts / "step_00000008").symlink_to(ckpts / STEP1)  # our name, but a link: the user's
    (ckpts / "step_00000006.tmp").write_text("a file, not a folder")
    foreign = ["notes.txt", "step_00000006.tmp", "step_00000007_good", "step_00000008", "step_00000009.bak"]
    assert checkpoint.foreign_entries(ckpts) == foreign
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)] == [STEP1, STEP2]
    code, _, err = call(pretrain_main, _argv(base, run, "train.resume=auto", "train.steps=4",
                                             "train.keep_last=1"), capsys)
    assert code == 0, err
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)] == ["step_00000004"]  # rotation: ours only
    assert checkpoint.foreign_entries(ckpts) == foreign
    assert (ckpts / "notes.txt").read_text() == "lr 3e-4 was better"
    for copy in ("step_00000007_good", "step_00000009.bak"):
        state = checkpoint.read_model_state(ckpts / copy)
        assert all(torch.equal(state[k], made[1][k]) for k in state)
    assert (ckpts / "step_00000008").is_symlink() and (ckpts / "step_00000006.tmp").is_file()


def test_a_users_file_with_a_tmp_name_is_not_deleted(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "step_00000003.tmp").write_text("mine")
    with pytest.raises(UserError, match=r"step_00000003.tmp is not a folder megazero wrote"):
        checkpoint.save(root, 3, {"model/w": torch.ones(2)}, {}, keep_last=1, run_id="r")
    assert (root / "step_00000003.tmp").read_text() == "mine"
    checkpoint.save(root, 4, {"model/w": torch.ones(2)}, {}, keep_last=1, run_id="r")  # other steps go on
    assert (root / "step_00000003.tmp").read_text() == "mine"


def test_keep_last_removes_only_this_runs_checkpoints(tmp_path):
    root = tmp_path / "c"
    w = {"model/w": torch.ones(2)}
    checkpoint.save(root, 1, w, {}, keep_last=1, run_id="other")
    checkpoint.save(root, 2, w, {}, keep_last=1)  # no run id: an older megazero's, never rotated
    for s in (3, 4, 5):
        checkpoint.save(root, s, w, {}, keep_last=2, run_id="mine")
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000001", "step_00000002",
                                                                   "step_00000004", "step_00000005"]
    assert checkpoint.checkpoint_run_id(root / "step_00000001") == "other"
    assert checkpoint.checkpoint_run_id(root / "step_00000002") is None


def test_resaving_another_runs_step_moves_it_aside(tmp_path):
    root = tmp_path / "c"
    checkpoint.save(root, 2, {"model/w": torch.ones(2)}, {}, keep_last=1, run_id="old")
    checkpoint.save(root, 2, {"model/w": torch.zeros(2)}, {}, keep_last=1, run_id="new")
    assert checkpoint.foreign_entries(root) == ["step_00000002.other-run-old"]
    kept = {"model/w": torch.zeros(2)}
    checkpoint.load(root / "step_00000002.other-run-old", kept)
    assert torch.equal(kept["model/w"], torch.ones(2))
    checkpoint.save(root, 2, {"model/w": torch.full((2,), 3.0)}, {}, keep_last=1, run_id="new")  # own: replaced
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000002.other-run-old"]


# --- export's output folder ----------------------------------------------------------------------------

def test_export_refuses_a_non_empty_folder_and_force_replaces_it_whole(made, case, capsys, tmp_path):
    base, run, ckpts = case
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, err = export(capsys, ckpts / STEP2, out)
    assert_one_line(code, err, str(out), "not empty", "--force")
    code, err = export(capsys, ckpts / STEP2, out, "--force")  # --force replaces only a previous export
    assert_one_line(code, err, str(out), "mine.txt", "not a previous export")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (out / "mine.txt").unlink()
    assert export(capsys, ckpts / STEP1, out)[0] == 0  # an empty folder needs no --force
    code, err = export(capsys, ckpts / STEP2, out, "--force")
    assert code == 0, err
    # the weights and the run's tokenizer (a GPT-2 run's sentencepiece model, as tokenizer.model)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporary siblings left
    from safetensors.torch import load_file
    weights = load_file(out / "model.safetensors")
    step2 = checkpoint.read_model_state(ckpts / STEP2)["layers.0.mlp.fc1.weight"]
    assert torch.equal(weights["transformer.h.0.mlp.c_fc.weight"], step2.t())  # step 2 replaced step 1


def test_export_with_force_keeps_the_old_folder_until_the_new_one_is_complete(made, case, capsys, tmp_path,
                                                                              monkeypatch):
    import safetensors.torch

    base, run, ckpts = case
    out = tmp_path / "hf"
    assert export(capsys, ckpts / STEP1, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, err = export(capsys, ckpts / STEP2, out, "--force")
    assert_one_line(code, err, f"no space left on {out}", "needs about")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


def test_export_never_replaces_the_folder_holding_the_checkpoint(made, case, capsys):
    base, run, ckpts = case
    names = sorted(p.name for p in ckpts.iterdir())
    code, err = export(capsys, ckpts / STEP2, run, "--force")
    assert_one_line(code, err, "holds the checkpoint")
    assert_nothing_lost(made, ckpts, names)
