"""A damaged data cache: an entry that is not the regular file megazero wrote is rebuilt, never waited on,
never followed out of the cache.

``data.cache_dir`` is megazero's own (the trained tokenizer, tokenised datasets, token-range entries, the
blend's index files, the built-in corpus). A FIFO there blocks ``open()`` until a writer comes; a link leads
outside the cache; a folder cannot be read, nor replaced by a rename. Each case puts one kind of damage in
place of every entry of a warm cache at once and builds again, under a watchdog (SIGALRM), so a reader that
blocks fails its test instead of hanging the suite.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from megazero.data import build_data
from megazero.errors import UserError
from tests.hostile import call, pretrain_main, watchdog
from tests.runs import ROOT, small_overrides, write_corpus

VOCAB = 512
SEQ = 32
WATCHDOG_S = 30  # a cold build here takes about 1.5 s; a blocked open() takes forever


def _cfg(paths: list[Path], cache: Path, tokenizer: str | Path = "train") -> SimpleNamespace:
    return SimpleNamespace(paths=[str(p) for p in paths], tokenizer=str(tokenizer), split="98,2",
                           cache_dir=str(cache), text_key="text")


def _build(cfg: SimpleNamespace, **kw) -> None:
    with watchdog(WATCHDOG_S):
        build_data(cfg, VOCAB, SEQ, 0, True, lambda: None, train_samples=16, **kw)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two sources (so a blend index is written) and a trained tokenizer, built once: the cache's entries
    and their bytes, which every case's rebuild must give back."""
    root = tmp_path_factory.mktemp("hostile_cache")
    folders = [root / "a", root / "b"]
    for f in folders:
        f.mkdir()
    for i, path in enumerate(sorted(write_corpus(root / "all").iterdir())):
        path.rename(folders[i % 2] / path.name)
    cfg = _cfg(folders, root / "cache")
    _build(cfg)
    cache = Path(cfg.cache_dir)
    entries = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    kinds = {p.parts[0] if len(p.parts) > 1 else p.name.split("-")[0] for p in entries}
    assert kinds == {"tokenizer", "data", "token-ranges", "indices"}, entries
    return SimpleNamespace(root=root, cfg=cfg, cache=cache, entries=entries,
                           content={p: (cache / p).read_bytes() for p in entries})


def _remove(path: Path) -> None:
    """Whatever is at ``path`` (never following a link), so a case starts from its own damage."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _assert_rebuilt(warm: SimpleNamespace) -> None:
    """Every entry is a regular file again (not a link), with the bytes the first build wrote (token-range
    entries hold the new .bin's inode, so only their kind is compared)."""
    for rel in warm.entries:
        path = warm.cache / rel
        assert stat.S_ISREG(os.lstat(path).st_mode), (path, os.lstat(path))
        if rel.parts[0] != "token-ranges":
            assert path.read_bytes() == warm.content[rel], path


def _special(path: Path, i: int) -> None:
    if i % 2:
        os.mknod(path, 0o600 | stat.S_IFSOCK)
    else:
        os.mkfifo(path)


def test_fifos_and_sockets_in_the_cache_are_rebuilt(warm) -> None:
    """Before: the token-range entry and the blend index were opened as they were, and the open blocked."""
    for i, rel in enumerate(warm.entries):
        _remove(warm.cache / rel)
        _special(warm.cache / rel, i)
    _build(warm.cfg)
    _assert_rebuilt(warm)


def test_links_in_the_cache_are_replaced_never_followed(warm, tmp_path: Path) -> None:
    """Every entry a link out of the cache, to a FIFO or to a file of the user's: neither is opened, written
    or deleted; the links are replaced by the rebuilt files. Before: followed, and the FIFO blocked."""
    fifo, precious = tmp_path / "outside.fifo", tmp_path / "outside.txt"
    os.mkfifo(fifo)
    precious.write_text("the user's own file\n")
    for i, rel in enumerate(warm.entries):
        _remove(warm.cache / rel)
        (warm.cache / rel).symlink_to(fifo if i % 2 == 0 else precious)
    _build(warm.cfg)
    _assert_rebuilt(warm)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and precious.read_text() == "the user's own file\n"


def test_empty_folders_in_place_of_cache_files_are_rebuilt(warm) -> None:
    """Before: the rename of the rebuilt file onto the folder failed ("cannot write ... (Is a directory)")."""
    for rel in warm.entries:
        _remove(warm.cache / rel)
        (warm.cache / rel).mkdir()
    _build(warm.cfg)
    _assert_rebuilt(warm)


def test_a_folder_with_files_in_place_of_a_cache_file_is_kept_and_named(warm) -> None:
    """Not megazero's to delete: one line naming it, and its contents stay. Before: "cannot write
    <name>.tmp-... (Is a directory)", naming a temporary file and not what to do."""
    (tok,) = [rel for rel in warm.entries if rel.name.startswith("tokenizer-")]
    path = warm.cache / tok
    try:
        _remove(path)
        path.mkdir()
        (path / "notes.txt").write_text("kept\n")
        with pytest.raises(UserError) as e:
            _build(warm.cfg)
        message = str(e.value)
        assert "\n" not in message and f"{path} is a folder" in message, message
        assert (path / "notes.txt").read_text() == "kept\n"
    finally:
        _remove(path)
    _build(warm.cfg)
    _assert_rebuilt(warm)


def test_cache_subfolders_that_link_out_are_not_written_through(warm, tmp_path: Path) -> None:
    """``indices`` and ``token-ranges`` linked to folders outside the cache: nothing is written there (before:
    the index files and entries were written into the user's folders)."""
    outside = {}
    for sub in ("indices", "token-ranges"):
        outside[sub] = tmp_path / f"outside-{sub}"
        outside[sub].mkdir()
        _remove(warm.cache / sub)
        (warm.cache / sub).symlink_to(outside[sub], target_is_directory=True)
    _build(warm.cfg)
    for sub, folder in outside.items():
        assert list(folder.iterdir()) == [], sub
        assert not (warm.cache / sub).is_symlink()
    _assert_rebuilt(warm)


def test_damaged_builtin_corpus_file_is_written_again(warm, tmp_path: Path) -> None:
    """The built-in corpus (data.paths empty) is a cache file too: a FIFO, a link out or a folder there is
    replaced when the dataset made from it is rebuilt. Before: a folder there failed the build."""
    tok = tmp_path / "given.model"
    tok.write_bytes(next(v for k, v in warm.content.items() if k.name.startswith("tokenizer-")))
    cfg = _cfg([], tmp_path / "cache", tok)
    _build(cfg, builtin_max_bytes=200_000)
    cache = Path(cfg.cache_dir)
    (corpus,) = cache.glob("corpus-*.jsonl")
    (idx,) = cache.glob("data-builtin-*.idx")
    good = corpus.read_bytes(), idx.read_bytes()
    precious = tmp_path / "outside.txt"
    precious.write_text("the user's own file\n")
    for damage in (os.mkfifo, lambda p: p.symlink_to(precious), Path.mkdir):
        for path in (corpus, idx):
            _remove(path)
            damage(path)
        _build(cfg, builtin_max_bytes=200_000)
        assert all(stat.S_ISREG(os.lstat(p).st_mode) for p in (corpus, idx))
        assert (corpus.read_bytes(), idx.read_bytes()) == good
    assert precious.read_text() == "the user's own file\n"


def test_a_run_with_a_fifo_for_its_blend_index_trains(warm, tmp_path: Path, capsys) -> None:
    """Through pretrain.py: the FIFO is rebuilt as an index file and the run finishes (before: it blocked in
    open() before the first step)."""
    (blend,) = [warm.cache / rel for rel in warm.entries if rel.suffix == ".npy"]
    _remove(blend)
    os.mkfifo(blend)
    overrides = small_overrides(Path("unused"), warm.cache, tmp_path / "log", steps=1)
    overrides = [o for o in overrides if not o.startswith("data.paths=")]
    overrides += ["data.tokenizer=train", "data.paths=[" + ", ".join(warm.cfg.paths) + "]"]
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml")]
    for o in overrides:
        argv += ["--set", o]
    with watchdog(WATCHDOG_S):
        code, _, err = call(pretrain_main, argv, capsys)
    assert code == 0, err[-3000:]
    _assert_rebuilt(warm)
