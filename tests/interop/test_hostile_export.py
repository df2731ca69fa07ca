"""Hostile exports: an output where a checkpoint's rotation would delete it, a meta.json that disagrees with the
tensors, --force on what is not an export, outputs that hold the working folder, a recorded tokenizer replaced
by another, a full disk, an output that is a mount point. Through ``python -m megazero.export``'s main in this
process (the full disk and the mount points in a process of its own, for its mounts):
exit code 2, one line on stderr, nothing written, nothing lost.

One small GPT-2 checkpoint (untied head, biases, vocab_size 300 padded to 384 rows, a 300-id tokenizer.json)
is made once per module in a run folder's layout; each case works on a copy of that folder.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.checkpoint import store as checkpoint
from megazero.config.load import load_config
from megazero.data.cache_plan import content_fingerprint
from megazero.interop.export import main as export_main
from megazero.models.build import build_gpt
from tests.hostile import ROOT, assert_one_line, call

VOCAB = 300
MODEL = ["model.layers=2", "model.hidden=32", "model.heads=2", "model.seq_len=16", f"model.vocab_size={VOCAB}",
         "model.tie_embeddings=false"]
STEP = "step_00000001"


def _tokenizer_json(path: Path, shift: int = 0) -> Path:
    """A WordLevel tokenizer.json with ids 0..VOCAB-1, the last one the end-of-text token; ``shift`` rotates the
    ids of the words (the same pieces, other meanings)."""
    words = VOCAB - 2
    vocab = {f"w{i}": (i + shift) % words for i in range(words)} | {"<unk>": VOCAB - 2, "<|endoftext|>": VOCAB - 1}
    body = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
            "decoder": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "added_tokens": [{"id": VOCAB - 1, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    path.write_text(json.dumps(body))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """base/run: a log.dir holding metrics.jsonl and checkpoints/step_00000001 (meta.json records base/tok.json
    and its content fingerprint, as a save does)."""
    base = tmp_path_factory.mktemp("hostile_export")
    write_run(base, MODEL)
    (base / "run" / "metrics.jsonl").write_text("")
    return base


def write_run(base: Path, overrides: list[str]) -> None:
    """base/run/checkpoints/step_00000001 of the model ``overrides`` make, its tokenizer base/tok.json recorded
    with its content fingerprint, as a save records it."""
    cfg = load_config(None, overrides)
    model = build_gpt(cfg.model, seed=0)
    tok = _tokenizer_json(base / "tok.json")
    meta = {"config": cfg.to_dict(), "consumed_samples": 0, "optimizer_step": 0, "tokenizer": str(tok),
            "tokenizer_fingerprint": content_fingerprint(tok)}
    state = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    checkpoint.save(base / "run" / "checkpoints", 1, state, meta, keep_last=1)


@pytest.fixture
def ck(made, tmp_path) -> Path:
    """A fresh copy of the run folder for one case; returns its checkpoint."""
    shutil.copytree(made / "run", tmp_path / "run")
    return tmp_path / "run" / "checkpoints" / STEP


def export(capsys, *argv) -> tuple[int, str]:
    code, _, err = call(export_main, [str(a) for a in argv], capsys)
    return code, err


def tree(path: Path) -> list[str]:
    """Every path under ``path``, relative, sorted: what a refused export must leave as it was."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def edit_meta(ck: Path, **model) -> None:
    meta = json.loads((ck / "meta.json").read_text())
    meta["config"]["model"].update(model)
    (ck / "meta.json").write_text(json.dumps(meta))


# --- where the output may go -----------------------------------------------------------------------------

@pytest.mark.parametrize("where, fragment", [
    ("CK/hf", "inside the checkpoint"),
    ("CK/new/deeper", "inside the checkpoint"),
    ("CK/../step_00000001/hf", "inside the checkpoint"),  # `..` resolved
    ("LINK/hf", "inside the checkpoint"),  # a link to the checkpoint, resolved
    ("BEST/hf", "inside the checkpoint"),  # a checkpoint copied under a name of the user's: meta.json + .metadata
    ("CKS/hf", "holds checkpoints"),  # log.dir/checkpoints: a save's clean-up and rotation work there
    ("CKS/step_00000009/hf", "holds checkpoints"),  # a step a later save would write
])
def test_an_output_inside_a_checkpoint_or_its_folder_is_refused(ck, capsys, tmp_path, where, fragment):
    (tmp_path / "link").symlink_to(ck)
    if where.startswith("BEST"):
        shutil.copytree(ck, tmp_path / "best")
    out = (where.replace("CKS", str(ck.parent)).replace("CK", str(ck)).replace("LINK", str(tmp_path / "link"))
           .replace("BEST", str(tmp_path / "best")))
    before = tree(tmp_path)
    code, err = export(capsys, ck, out, "--force")
    assert_one_line(code, err, fragment)
    assert tree(tmp_path) == before


def test_an_output_inside_a_log_dirs_checkpoints_folder_is_refused_before_its_first_save(ck, capsys, tmp_path):
    """A log.dir whose checkpoints/ is still empty (a run that has not saved yet) is recognised by its metrics."""
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "metrics.jsonl").write_text("")
    code, err = export(capsys, ck, other / "checkpoints" / "hf")
    assert_one_line(code, err, str(other / "checkpoints"))
    assert tree(other) == ["checkpoints", "metrics.jsonl"]


@pytest.mark.parametrize("where", [".", "..", "CWD", "/"])
def test_an_output_that_is_or_holds_the_working_folder_is_refused(ck, capsys, tmp_path, monkeypatch, where):
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    (cwd / "notes.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    before = tree(tmp_path)
    code, err = export(capsys, ck, where.replace("CWD", str(cwd)), "--force")
    assert_one_line(code, err, "working folder")
    assert tree(tmp_path) == before  # no `.old` or `.tmp` sibling left anywhere


# --- --force replaces a previous export, and nothing else -----------------------------------------------

def test_force_replaces_a_previous_export_and_nothing_else(ck, capsys, tmp_path):
    out = tmp_path / "hf"
    assert export(capsys, ck, out)[0] == 0
    exported = tree(out)
    assert exported == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert export(capsys, ck, out, "--force")[0] == 0  # a previous export is replaced whole
    assert tree(out) == exported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no sibling left

    (out / "README.md").write_text("my notes")  # an export the user added to: not all ours any more
    code, err = export(capsys, ck, out, "--force")
    assert_one_line(code, err, str(out), "README.md", "--force")
    assert tree(out) == sorted(exported + ["README.md"])

    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "config.json").write_text("{}")  # a name an export writes, but not an export's folder
    code, err = export(capsys, ck, mine, "--force")
    assert_one_line(code, err, str(mine), "not a previous export")
    assert tree(mine) == ["config.json", "sub"]


def test_force_through_a_link_writes_where_it_points_and_never_replaces_a_non_export(ck, capsys, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("y")
    link = tmp_path / "link"
    link.symlink_to(target)
    code, err = export(capsys, ck, link, "--force")
    assert_one_line(code, err, "keep.txt")
    assert link.is_symlink() and tree(target) == ["keep.txt"]
    (target / "keep.txt").unlink()
    assert export(capsys, ck, link)[0] == 0  # an empty folder behind the link: the export lands there
    assert link.is_symlink() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run", "target"]


# --- meta.json that disagrees with the tensors: every stored tensor is accounted for --------------------

@pytest.mark.parametrize("edit, fragments", [
    ({"tie_embeddings": True}, ("'head.weight'", "tie_embeddings=true")),  # the trained head would be dropped
    ({"bias": False}, (".bias'", "bias=false")),  # the trained biases would be written as zeros
    ({"vocab_size": 200}, ("'embed.tokens.weight'", "384 rows", "256")),  # rows beyond the padded vocabulary
    ({"vocab_size": 290}, ("tok.json", "300 pieces", "model.vocab_size 290")),  # rows the tokenizer uses
    ({"layers": 1}, ("'layers.1.", "layers=1")),
    ({"arch": "llama"}, ("'embed.positions.weight'", "llama")),
])
def test_a_meta_json_that_disagrees_with_the_tensors_is_refused_naming_the_tensor(ck, capsys, tmp_path, edit,
                                                                                   fragments):
    edit_meta(ck, **edit)
    code, err = export(capsys, ck, tmp_path / "hf")
    assert_one_line(code, err, str(ck), *fragments)
    assert not (tmp_path / "hf").exists()


# --- the recorded tokenizer: read as data.tokenizer is, one line whatever the file -----------------------

PANICS_AT_LOAD = {"version": "1.0", "normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"},
                  "pre_tokenizer": None, "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}


@pytest.mark.parametrize("damage, fragment", [
    ("panic", "panicked"),  # the tokenizers library raises a BaseException (a Rust panic) on this normalizer
    ("huge", "MiB"),  # 5 GiB, sparse: refused by its size, never read
    ("fifo", "FIFO"),  # a read would block forever
])
def test_a_recorded_tokenizer_that_cannot_be_read_is_one_line(ck, capsys, tmp_path, damage, fragment):
    tok = tmp_path / "tokenizer.json"
    if damage == "panic":
        tok.write_text(json.dumps(PANICS_AT_LOAD))
    elif damage == "huge":
        with open(tok, "wb") as f:
            f.truncate(5 << 30)
    else:
        os.mkfifo(tok)
    meta = json.loads((ck / "meta.json").read_text())
    meta.update(tokenizer=str(tok), tokenizer_fingerprint=None)  # none recorded: the file itself is what is read
    (ck / "meta.json").write_text(json.dumps(meta))
    code, err = export(capsys, ck, tmp_path / "hf")
    assert_one_line(code, err, str(tok), fragment)
    assert "thread '" not in err and "panicked at" not in err, err  # no Rust backtrace on stderr
    assert not (tmp_path / "hf").exists()


def test_a_recorded_tokenizer_whose_content_changed_is_refused(ck, capsys, tmp_path):
    """The file at the recorded path was replaced by another tokenizer the vocabulary check accepts (the same
    pieces, their ids rotated): exported, it would give the model ids it was not trained on."""
    tok = _tokenizer_json(tmp_path / "tok.json")
    recorded = content_fingerprint(tok)
    meta = json.loads((ck / "meta.json").read_text())
    meta.update(tokenizer=str(tok), tokenizer_fingerprint=recorded)
    (ck / "meta.json").write_text(json.dumps(meta))
    _tokenizer_json(tok, shift=1)
    now = content_fingerprint(tok)
    assert now != recorded
    code, err = export(capsys, ck, tmp_path / "hf")
    assert_one_line(code, err, str(tok), recorded, now)
    assert not (tmp_path / "hf").exists()
    _tokenizer_json(tok)  # the file the run trained with, back in place: exported
    assert export(capsys, ck, tmp_path / "hf")[0] == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok.read_bytes()


# --- a full disk ------------------------------------------------------------------------------------------

FULL_DISK = r"""
import io, json, os, shutil, sys
from pathlib import Path
mnt, ck, cases, reference, bind = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), *sys.argv[4:6]
bind = Path(bind)
from megazero.interop.export import main

def run(*argv):
    sys.stderr, err = io.StringIO(), sys.stderr
    code = main([ck, *map(str, argv)])
    sys.stderr, text = err, sys.stderr.getvalue()
    return {"code": code, "err": text}

results = []
for pages in cases:
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the file system, then free exactly `pages` pages
        try:
            while f.write(b"x" * 4096):
                pass
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - pages * 4096))
    results.append({**run(mnt / "out" / "hf"), "left": sorted(p.name for p in mnt.iterdir())})
    filler.unlink()
mounts = {}  # OUT is itself a mount point: the tmpfs (os.path.ismount sees it), a bind mount on the same disk (not)
for name, out in (("tmpfs", mnt), ("bind", bind)):
    empty = run(out)
    empty["left"] = sorted(p.name for p in out.iterdir())
    for f in Path(reference).iterdir():  # a previous export in the mount point
        shutil.copy(f, out / f.name)
    forced = run(out, "--force")
    forced["left"] = sorted(p.name for p in out.iterdir())
    mounts[name] = [empty, forced]
print(json.dumps({"full": results, "mounts": mounts,
                  "beside": sorted(p.name for p in mnt.parent.iterdir() if p.name.startswith("."))}))
"""


def _tmpfs_usable() -> str:
    """Why a small tmpfs cannot be mounted in a user and mount namespace here, or "" where it can."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()[:120]}"


@pytest.fixture(scope="module")
def tmpfs_reason() -> str:
    return _tmpfs_usable()


def _pages(path: Path) -> int:
    return -(-path.stat().st_size // 4096)


def test_a_full_disk_or_a_mount_point_is_one_line_and_leaves_no_partial_folder(ck, capsys, tmp_path, tmpfs_reason):
    """On a 1 MB tmpfs filled up but for the pages of the files written before it, each of config.json, the
    weights and the tokenizer finds the disk full in turn (tmpfs counts whole 4 KiB pages, folders free).

    Then OUT is the mount point itself (a volume mounted into a container): it cannot be replaced by a rename,
    and writing into it file by file would not be all or nothing, so it is refused, empty or holding a previous
    export (--force), naming it and the way out, with nothing left beside it. The tmpfs is a mount point
    os.path.ismount sees (refused before the tensors are read); a bind mount of a folder onto itself on the
    same disk is one it does not (the rename's EBUSY)."""
    if tmpfs_reason:
        pytest.skip(tmpfs_reason)
    reference = tmp_path / "reference"
    assert export(capsys, ck, reference)[0] == 0
    order = ["config.json", "model.safetensors", "tokenizer.json"]
    cases = [sum(_pages(reference / name) for name in order[:i]) for i in range(len(order))]
    mnt, bind = tmp_path / "mnt", tmp_path / "bind"
    mnt.mkdir()
    bind.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    shell = (f'mount -t tmpfs -o size=1m tmpfs "{mnt}" && mount --bind "{bind}" "{bind}" && '
             f'exec "{sys.executable}" "{script}" "{mnt}" "{ck}" "{json.dumps(cases)}" "{reference}" "{bind}"')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for failing, result in zip(order, found["full"]):
        assert_one_line(result["code"], result["err"], "no space left on", str(mnt / "out" / "hf"), "needs about")
        assert result["left"] == ["filler"], failing  # no partial folder, not even the parent the export made
    for name, out in (("tmpfs", mnt), ("bind", bind)):
        empty, forced = found["mounts"][name]
        assert_one_line(empty["code"], empty["err"], str(out), "mount point", "subfolder")
        assert empty["left"] == [], name
        assert_one_line(forced["code"], forced["err"], str(out), "mount point", "subfolder")
        assert forced["left"] == sorted(p.name for p in reference.iterdir()), name  # the previous export kept
    assert found["beside"] == []  # no `.old` or `.tmp` sibling left beside either mount point
