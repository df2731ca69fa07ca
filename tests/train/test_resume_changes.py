"""A resume whose data settings differ from the checkpoint's: a changed tokenizer is refused in one line (the ids
would change meaning); a changed corpus, blend, split, text field or seed is named in one line, with what it does
to the sample stream, unless train.resume_changes=allow acknowledges it.

Most cases compare a checkpoint's meta (made as a save makes it) with a config, without a process; a few go
through pretrain.py on one 1-step run, resumed with train.steps=1 (the resume stops at once: no step is run).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.errors import UserError
from megazero.data.cache_plan import content_fingerprint
from megazero.data.gpt_data import SourceStamp
from megazero.train.resume_changes import compare, resume_record
from tests.hostile import ROOT, assert_one_line, call, pretrain_main
from tests.runs import small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
WHERE = Path("runs/x/checkpoints/step_00000004")


# --- the comparison, without a process ----------------------------------------------------------

@pytest.fixture()
def here(tmp_path, monkeypatch):
    """A folder with corpora a/ and b/ and two tokenizer files of different content; the cwd."""
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.txt").write_text(f"text of {name}\n")
    (tmp_path / "tok.json").write_text('{"one": 1}')
    (tmp_path / "other.json").write_text('{"two": 2}')
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cfg(*overrides: str):
    base = ["data.paths=[a, b]", "data.tokenizer=tok.json", "train.seed=7", "data.split=98,2"]
    return load_config(TINY, base + list(overrides))


def _meta(cfg, tokenizer: str | None = None, old: bool = False) -> dict:
    """meta.json as save_state writes it (``old``: as a megazero that did not record the data yet)."""
    tok = tokenizer if tokenizer is not None else (None if cfg.data.tokenizer == "train" else cfg.data.tokenizer)
    meta = {"format": 1, "step": 4, "consumed_samples": 32, "optimizer_step": 4, "config": cfg.to_dict(),
            "tokenizer": str(Path(tok).resolve()) if tok else None}
    if not old:
        meta.update(resume_record(cfg, content_fingerprint(Path(tok)) if tok else None, ()))
    return meta


@pytest.mark.parametrize("change,fragments", [
    (["train.seed=8"], ["train.seed 7 -> 8", "sample order after step 4 differs"]),
    (["data.split=90,10"], ["data.split '98,2' -> '90,10'", "re-split", "trained on may now validate"]),
    (["data.paths=[a, c]"], ["data.paths changed (dropped", "/b, added", "/c)", "other documents"]),
    (["data.paths=[b, a]"], ["data.paths", "reordered", "sample order after step 4 differs"]),
    (["data.text_key=body"], ["data.text_key 'text' -> 'body'", "another field"]),
])
def test_each_changed_data_setting_is_named_in_one_line(here, change, fragments):
    note = compare(WHERE, _meta(_cfg()), _cfg(*change))
    assert note is not None and "\n" not in note
    for f in fragments + ["train.resume_changes=allow", str(WHERE)]:
        assert f in note, (f, note)


def test_a_changed_blend_weight_is_named(here):
    blend = "data.paths=[{path: a, weight: 0.5}, {path: b, weight: 0.5}]"
    note = compare(WHERE, _meta(_cfg(blend)), _cfg("data.paths=[{path: a, weight: 0.7}, {path: b, weight: 0.5}]"))
    assert note is not None and "blend weights" in note and "0.5 -> 0.7" in note and "/a" in note, note
    assert str(here / "b") not in note, note  # only the weight that changed
    assert compare(WHERE, _meta(_cfg(blend)), _cfg("data.paths=[{path: a, weight: 2}, {path: b, weight: 2}]")) \
        is None  # the same proportions
    note = compare(WHERE, _meta(_cfg(blend)), _cfg())  # a blend given up for the sources' sizes
    assert note is not None and "0.5 -> by size" in note, note


def test_several_changes_are_one_line_and_allow_silences_them(here):
    changed = _cfg("train.seed=8", "data.split=90,10", "data.paths=[a, c]")
    note = compare(WHERE, _meta(_cfg()), changed)
    assert "\n" not in note and "train.seed" in note and "data.split" in note and "data.paths" in note, note
    assert compare(WHERE, _meta(_cfg()), _cfg("train.seed=8", "data.split=90,10", "data.paths=[a, c]",
                                              "train.resume_changes=allow")) is None


def test_the_same_settings_spelled_otherwise_are_no_change(here):
    (here / "link").symlink_to(here / "a")
    meta = _meta(_cfg())
    for paths in ("[a/, b]", "[./a, b/.]", "[a/../a, b]", f"[{here / 'a'}, {here / 'b'}/]", "[link, b]"):
        assert compare(WHERE, meta, _cfg(f"data.paths={paths}")) is None, paths
    assert compare(WHERE, meta, _cfg("data.split=49,1")) is None  # the same fractions
    assert compare(WHERE, meta, _cfg("data.tokenizer=./tok.json")) is None
    # an older checkpoint records no resolved paths: its config's are resolved here
    assert compare(WHERE, _meta(_cfg(), old=True), _cfg("data.paths=[a/, ./b]")) is None


def test_another_tokenizer_is_refused_naming_both(here):
    with pytest.raises(UserError) as e:
        compare(WHERE, _meta(_cfg()), _cfg("data.tokenizer=other.json"))
    line = str(e.value)
    assert "\n" not in line and "data.tokenizer" in line and "'tok.json'" in line and "'other.json'" in line, line
    with pytest.raises(UserError, match="data.tokenizer is 'tok.json' there and 'train' here"):
        compare(WHERE, _meta(_cfg(), old=True), _cfg("data.tokenizer=train"))  # by name: an older checkpoint
    # where the checkpoint recorded its tokenizer's content, what train makes is compared by content, once made
    assert compare(WHERE, _meta(_cfg()), _cfg("data.tokenizer=train")) is None
    # allow acknowledges changes of the stream, never a change of what the ids mean
    with pytest.raises(UserError, match="data.tokenizer"):
        compare(WHERE, _meta(_cfg()), _cfg("data.tokenizer=other.json", "train.resume_changes=allow"))


def test_the_same_tokenizer_path_with_other_content_is_refused(here):
    meta = _meta(_cfg())
    (here / "tok.json").write_text('{"one": 2}')
    with pytest.raises(UserError, match=r"data.tokenizer 'tok.json' holds another tokenizer than the one"):
        compare(WHERE, meta, _cfg())


def test_a_copy_of_the_tokenizer_is_the_same_tokenizer_when_the_checkpoint_recorded_its_content(here):
    shutil.copy(here / "tok.json", here / "copy.json")
    assert compare(WHERE, _meta(_cfg()), _cfg("data.tokenizer=copy.json")) is None
    with pytest.raises(UserError, match="data.tokenizer is 'tok.json' there and 'copy.json' here"):
        compare(WHERE, _meta(_cfg(), old=True), _cfg("data.tokenizer=copy.json"))  # older: by name only


def test_a_trained_tokenizer_changes_with_the_corpus_it_is_trained_on(here):
    trained = here / "cache" / "tokenizer-512-abc.model"
    trained.parent.mkdir()
    trained.write_bytes(b"trained")
    meta = _meta(_cfg("data.tokenizer=train"), tokenizer=str(trained))
    with pytest.raises(UserError) as e:
        compare(WHERE, meta, _cfg("data.tokenizer=train", "data.paths=[a, c]"))
    line = str(e.value)
    assert "data.tokenizer='train' trains on data.paths" in line and "/c" in line and str(trained) in line, line
    with pytest.raises(UserError, match="data.tokenizer='train' trains on data.text_key"):
        compare(WHERE, meta, _cfg("data.tokenizer=train", "data.text_key=body"))
    assert compare(WHERE, meta, _cfg("data.tokenizer=train", "data.paths=[a/, b]")) is None
    # the tokenizer it trained, named: the same ids, so the corpus may then change (and is named)
    note = compare(WHERE, meta, _cfg(f"data.tokenizer={trained}", "data.paths=[a, c]"))
    assert note is not None and "data.paths" in note, note


def test_crafted_data_settings_in_a_checkpoint_are_named_not_a_traceback(here):
    meta = _meta(_cfg())
    meta["config"]["data"].update({"paths": [{"weight": 1}, 5], "split": [1], "text_key": ["x" * 500]})
    meta["config"]["train"]["seed"] = "seven"
    note = compare(WHERE, meta, _cfg())
    assert "\n" not in note and len(note) < 2000, note
    for key in ("data.paths", "data.split [1]", "data.text_key ['xxx", "train.seed 'seven' -> 7"):
        assert key in note, (key, note)


# --- through pretrain.py ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-step run with data.tokenizer=train on its own corpus; each test resumes a copy of it."""
    base = tmp_path_factory.mktemp("resume")
    corpus, cache, log = write_corpus(base / "text"), base / "cache", base / "run"
    assert pretrain_main(_argv(corpus, cache, log)) == 0
    return corpus, cache, log


def _argv(corpus: Path, cache: Path, log: Path, *extra: str, paths: str | None = None) -> list[str]:
    overrides = small_overrides(corpus, cache, log, steps=1, **{"train.resume": "auto"})
    if paths is not None:
        overrides = [o for o in overrides if not o.startswith("data.paths=")] + [f"data.paths={paths}"]
    argv = ["--config", TINY]
    for o in overrides + list(extra):
        argv += ["--set", o]
    return argv


def _resume(trained, tmp_path: Path, capsys, *extra: str, paths: str | None = None):
    corpus, cache, log = trained
    copy = tmp_path / "run"
    shutil.copytree(log, copy)
    return call(pretrain_main, _argv(corpus, cache, copy, *extra, paths=paths), capsys)


def test_a_resume_with_another_seed_says_so_once(trained, tmp_path, capsys):
    code, out, err = _resume(trained, tmp_path, capsys, "train.seed=99")
    assert code == 0, err
    lines = [line for line in out.splitlines() if "train.seed" in line]
    assert len(lines) == 1 and "1234 -> 99" in lines[0] and "after step 1" in lines[0], out
    code, out, err = _resume(trained, tmp_path / "allowed", capsys, "train.seed=99", "train.resume_changes=allow")
    assert code == 0 and "train.seed" not in out, out


def test_a_resume_with_another_tokenizer_is_refused_before_any_data_is_built(trained, tmp_path, capsys):
    from megazero.data.tokenizer import train_tokenizer

    corpus = trained[0]
    other = train_tokenizer(sorted(corpus.iterdir())[:40], 512, tmp_path / "other")
    fresh = tmp_path / "fresh-cache"
    code, _, err = _resume(trained, tmp_path, capsys, f"data.tokenizer={other}", f"data.cache_dir={fresh}")
    assert_one_line(code, err, "data.tokenizer is 'train' there", repr(str(other)))
    assert not fresh.exists()  # refused before the data was prepared


def test_a_trained_tokenizer_with_another_corpus_is_refused(trained, tmp_path, capsys):
    corpus = trained[0]
    part = tmp_path / "part"
    part.mkdir()
    for f in sorted(corpus.iterdir())[:20]:
        shutil.copy(f, part / f.name)
    code, _, err = _resume(trained, tmp_path, capsys, paths=f"[{corpus}, {part}]")
    assert_one_line(code, err, "data.tokenizer='train' trains on data.paths", str(part))


def test_a_trained_tokenizer_retrained_on_changed_files_is_refused(tmp_path, capsys):
    """The same data.paths, but a file's text changed: the tokenizer trained again differs, found by content
    once it is trained (before the checkpoint's weights are loaded)."""
    corpus = write_corpus(tmp_path / "text")
    for f in sorted(corpus.iterdir())[60:]:
        f.unlink()  # a smaller corpus: this test trains two tokenizers
    cache, log = tmp_path / "cache", tmp_path / "run"
    assert pretrain_main(_argv(corpus, cache, log)) == 0
    capsys.readouterr()
    first = sorted(corpus.iterdir())[0]
    text = first.read_text()
    first.write_text(text.upper())
    code, _, err = call(pretrain_main, _argv(corpus, cache, log), capsys)
    assert_one_line(code, err, "data.tokenizer='train' trained", "not the tokenizer the checkpoint was trained with")
    # the same text again (a later mtime: trained afresh): the same tokenizer, so the resume goes on
    first.write_text(text)
    os.utime(first)
    code, out, err = call(pretrain_main, _argv(corpus, cache, log), capsys)
    assert code == 0, err


def _trained_tokenizer(trained, to: Path) -> Path:
    """A copy, under another name, of the tokenizer the module's run trained."""
    (made,) = (trained[1]).glob("tokenizer-*.model")
    shutil.copy(made, to)
    return to


def _meta_of(log: Path, step: int) -> dict:
    import json

    return json.loads((log / "checkpoints" / f"step_{step:08d}" / "meta.json").read_text())


def test_a_save_records_the_tokenizer_the_data_was_read_with_not_the_file_as_it_is_then(trained, tmp_path, capsys,
                                                                                         monkeypatch):
    """The tokenizer file replaced while the run trains: the checkpoint records the one its ids are of."""
    from megazero.data.cache_plan import content_fingerprint
    from megazero.train.trainer import Trainer

    tok = _trained_tokenizer(trained, tmp_path / "tok.model")
    original = content_fingerprint(tok)
    step = Trainer.train_step

    def replaced_then_step(self):
        tok.write_bytes(b"another tokenizer now")
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", replaced_then_step)
    code, _, err = _resume(trained, tmp_path, capsys, f"data.tokenizer={tok}", "train.steps=2")
    assert code == 0, err
    assert _meta_of(tmp_path / "run", 2)["tokenizer_fingerprint"] == original


def test_a_trained_tokenizer_resumed_from_its_copy_resumes_with_train_again(trained, tmp_path, capsys):
    """train -> the trained tokenizer's copy by name -> train: the same tokenizer throughout, by content;
    and a resume that changes nothing says nothing."""
    tok = _trained_tokenizer(trained, tmp_path / "tok.model")
    code, out, err = _resume(trained, tmp_path, capsys, f"data.tokenizer={tok}", "train.steps=2")
    assert code == 0 and "warning" not in out, (err, out)
    code, out, err = call(pretrain_main, _argv(*trained[:2], tmp_path / "run", "train.steps=2"), capsys)
    assert code == 0, err
    assert "warning" not in out and "resumed from" in out, out


def test_a_changed_corpus_under_the_same_path_is_named_once(trained, tmp_path, capsys):
    """New files in a data.paths folder: the dataset is built again and the sample stream is another, named
    in the one warning line; an unchanged resume says nothing."""
    corpus = write_corpus(tmp_path / "corpC")
    later = sorted(corpus.iterdir())[30:]
    spare = tmp_path / "spare"
    spare.mkdir()
    for f in later:  # kept aside, to come back as new files
        f.rename(spare / f.name)
    tok = _trained_tokenizer(trained, tmp_path / "tok.model")
    cache, log = tmp_path / "cache", tmp_path / "run"
    argv = _argv(corpus, cache, log, f"data.tokenizer={tok}")
    assert pretrain_main(argv) == 0
    capsys.readouterr()
    code, out, err = call(pretrain_main, argv, capsys)
    assert code == 0 and "warning" not in out, (err, out)  # unchanged: not a word
    for f in spare.iterdir():
        shutil.copy(f, corpus / f"new_{f.name}")
    code, out, err = call(pretrain_main, argv, capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if "warning" in line]
    assert len(lines) == 1, out
    added = len(list(spare.iterdir()))
    for fragment in (f"data.paths[0] {str(corpus)!r}: its files changed since the checkpoint",
                     f"30 files then, {30 + added} now",
                     "after step 1", "train.resume_changes=allow"):
        assert fragment in lines[0], (fragment, lines[0])
    code, out, err = call(pretrain_main, argv + ["--set", "train.resume_changes=allow"], capsys)
    assert code == 0 and "warning" not in out, (err, out)


def test_files_changed_under_a_kept_path_are_named_where_the_checkpoint_recorded_them(here):
    cfg = _cfg()
    built = (SourceStamp(str(here / "a"), "0" * 16, 3), SourceStamp(str(here / "b"), "1" * 16, 5))
    meta = _meta(cfg)
    meta.update(resume_record(cfg, meta["tokenizer_fingerprint"], built))
    assert compare(WHERE, meta, cfg, built) is None  # as built then
    now = (built[0], SourceStamp(str(here / "b"), "2" * 16, 9))
    note = compare(WHERE, meta, cfg, now)
    assert note is not None and "\n" not in note and "data.paths[0]" not in note, note
    assert "data.paths[1] 'b': its files changed since the checkpoint (5 files then, 9 now)" in note, note
    assert compare(WHERE, meta, _cfg("train.resume_changes=allow"), now) is None
    assert compare(WHERE, _meta(cfg), cfg, now) is None  # a checkpoint that recorded no files: not compared
    meta["data_sources"] = [{"path": str(here / "b"), "fingerprint": "3" * 16, "files": 10 ** 5000}, 7, {"path": 1}]
    note = compare(WHERE, meta, cfg, now)  # crafted: named, never a traceback
    assert note is not None and "data.paths[1] 'b'" in note and len(note) < 2000, note


@pytest.mark.parametrize("key,fragments", [
    ("document_mask", ["attends only to earlier tokens of its own document"]),
    ("reset_positions", ["positions restart at each document"]),
])
def test_a_document_mask_or_position_reset_turned_on_or_off_is_named(here, key, fragments):
    """What the model computes changes (not the samples): named, and acknowledged by allow like the rest."""
    for before, after in ((False, True), (True, False)):
        note = compare(WHERE, _meta(_cfg(f"data.{key}={before}")), _cfg(f"data.{key}={after}"))
        assert note is not None and "\n" not in note, note
        for f in [f"data.{key} {before} -> {after}", "after step 4", "train.resume_changes=allow"] + \
                (fragments if after else []):
            assert f in note, (f, note)
        assert compare(WHERE, _meta(_cfg(f"data.{key}={before}")),
                       _cfg(f"data.{key}={after}", "train.resume_changes=allow")) is None
        assert compare(WHERE, _meta(_cfg(f"data.{key}={before}")), _cfg(f"data.{key}={before}")) is None
    meta = _meta(_cfg())  # a checkpoint of a megazero before the key: trained without it
    del meta["config"]["data"][key]
    assert compare(WHERE, meta, _cfg()) is None
    assert f"data.{key} False -> True" in compare(WHERE, meta, _cfg(f"data.{key}=true"))
