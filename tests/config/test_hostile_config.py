"""Hostile config input: every bad file or --set is one line, exit 2, fast — never a traceback or a hang.

Each case calls pretrain.py's main in this process with --dry-run and fails before anything is built, so a
case costs milliseconds. Cases that hung before the loader was hardened (alias bombs, deep nesting, huge
schedules) run under a time limit, so a regression fails instead of stalling the suite.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.errors import UserError
from tests.hostile import assert_one_line, call, pretrain_main

LIMIT_S = 10.0  # far above the milliseconds these take; a hang fails here instead of stalling the suite


def within(seconds: float, fn):
    """fn() on a daemon thread; a test failure (not a stuck suite) when it runs past ``seconds``."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def dry(capsys, config: Path | str, *sets: str) -> tuple[int, str]:
    argv = ["--config", str(config), "--dry-run"]
    for s in sets:
        argv += ["--set", s]
    code, _, err = call(pretrain_main, argv, capsys)
    return code, err


def config_file(tmp_path: Path, content: str | bytes, name: str = "run.yaml") -> Path:
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


def fails(tmp_path: Path, capsys, content: str | bytes, *fragments: str, sets: tuple[str, ...] = ()) -> str:
    """The config (and --set items) fail in one line holding every fragment, within LIMIT_S."""
    path = config_file(tmp_path, content)
    code, err = within(LIMIT_S, lambda: dry(capsys, path, *sets))
    return assert_one_line(code, err, *fragments)


# --- YAML traps -------------------------------------------------------------------------------------


def test_alias_bomb_is_refused_fast(tmp_path, capsys):
    """Nine levels of nine aliases: 9**9 strings once expanded (the "billion laughs")."""
    lines = ["data:", "  paths:", '    - &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"    - &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    fails(tmp_path, capsys, "\n".join(lines) + "\n", "run.yaml", "line 3", "anchor")


def test_alias_in_a_value_is_refused(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  lr: &x 0.001\n  min_lr: *x\n", "line 2", "anchor")


@pytest.mark.parametrize("text", [
    "- " * 20000 + "x\n",  # block sequences
    "[" * 20000 + "]" * 20000 + "\n",  # flow sequences
    "{a: " * 20000 + "1" + "}" * 20000 + "\n",  # flow mappings
])
def test_deep_nesting_is_one_line(tmp_path, capsys, text):
    fails(tmp_path, capsys, text, "run.yaml", "line 1", "nested deeper than")


def test_duplicate_key_in_a_section(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n", "duplicate key 'lr'", "line 4",
          "line 2")


def test_duplicate_section(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  steps: 3\nmodel:\n  layers: 2\ntrain:\n  lr: 0.1\n",
          "duplicate key 'train'", "line 5")


def test_duplicate_key_deeper_down(tmp_path, capsys):
    fails(tmp_path, capsys, "data:\n  paths: [{a: 1, a: 2}]\n", "duplicate key 'a'", "line 2")


def test_leading_zero_integer_is_ambiguous(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  steps: 010\n", "'010'", "line 2", "ambiguous", "0o10")


def test_sexagesimal_is_a_string_not_90(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  steps: 1:30\n", "train.steps='1:30'", "integer")


@pytest.mark.parametrize("word", ["yes", "on", "Off", "y"])
def test_yaml11_booleans_are_strings(tmp_path, capsys, word):
    fails(tmp_path, capsys, f"model:\n  bias: {word}\n", f"model.bias='{word}'", "true or false")


def test_python_tags_are_refused(tmp_path, capsys):
    marker = tmp_path / "ran"
    fails(tmp_path, capsys, f"train:\n  resume: !!python/object/apply:os.system ['touch {marker}']\n",
          "line 2", "tag", "python/object")
    assert not marker.exists()


def test_merge_key_is_refused(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  <<: {steps: 3}\n  lr: 0.1\n", "line 2", "merge key")


def test_two_documents_are_refused(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  steps: 3\n---\ntrain:\n  steps: 4\n", "run.yaml", "one YAML document")


def test_tabs_in_indentation(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n\tsteps: 3\n", "run.yaml", "not valid YAML", "line 2")


def test_huge_integer_literal(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  steps: " + "9" * 5000 + "\n", "line 2", "5000 digits")


# --- shapes of the document --------------------------------------------------------------------------


@pytest.mark.parametrize("content,fragment", [
    ("- train\n- model\n", "['train', 'model']"),
    ("0\n", "0"),
    ("false\n", "False"),
    ("'just a string'\n", "'just a string'"),
])
def test_config_that_is_not_a_mapping(tmp_path, capsys, content, fragment):
    fails(tmp_path, capsys, content, "run.yaml", fragment, "expected a mapping of sections")


def test_section_that_is_a_list(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  - steps\n  - 3\n", "section 'train'", "['steps', 3]", "mapping")


@pytest.mark.parametrize("content,fragment", [
    ("1: 2\n", "unknown section 1"),
    ("null: x\n", "unknown section None"),
    ("train:\n  1: 2\n", "unknown key 1 in section 'train'"),
    ("[a]: b\n", "line 1"),
])
def test_non_string_keys(tmp_path, capsys, content, fragment):
    fails(tmp_path, capsys, content, "run.yaml", fragment)


def test_unknown_key_names_a_close_one(tmp_path, capsys):
    fails(tmp_path, capsys, "train:\n  stpes: 3\n", "train.stpes", "did you mean 'steps'")


# --- the file itself ---------------------------------------------------------------------------------


def test_config_path_is_a_directory(tmp_path, capsys):
    code, err = dry(capsys, tmp_path)
    assert_one_line(code, err, str(tmp_path), "is a directory")


def test_config_path_is_a_fifo(tmp_path, capsys):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    code, err = within(LIMIT_S, lambda: dry(capsys, fifo))
    assert_one_line(code, err, "pipe.yaml", "not a regular file")


def test_binary_file(tmp_path, capsys):
    fails(tmp_path, capsys, bytes(range(256)) * 4, "run.yaml", "unreadable", "UTF-8")


def test_nul_bytes_in_a_utf8_file(tmp_path, capsys):
    fails(tmp_path, capsys, b"train:\n  steps: 3\x00\n", "run.yaml", "not valid YAML", "#x0000")


def test_utf16_with_bom_is_read(tmp_path, capsys):
    """UTF-16 with a byte-order mark (Windows editors) is decoded, not misread: the bad value inside shows."""
    fails(tmp_path, capsys, "train:\n  steps: -4\n".encode("utf-16"), "train.steps=-4", ">= 1")


def test_oversized_file(tmp_path, capsys):
    fails(tmp_path, capsys, "# padding\n" * 200_000, "run.yaml", "bytes", "at most")


# --- values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets,fragments", [
    (("train.seed=18446744073709551616",), ("train.seed=18446744073709551616", "<= ")),
    (("train.seed=-1",), ("train.seed=-1", ">= 0")),
    (("zero.bucket_mb=1e308",), ("zero.bucket_mb=1e+308", "<= ")),
    (("zero.bucket_mb=.inf",), ("zero.bucket_mb=inf", "finite")),
    (("train.lr=.nan",), ("train.lr=nan", "finite")),
    (("train.grad_clip=" + "9" * 400,), ("--set train.grad_clip", "400 digits")),
    (("train.grad_clip=1e400",), ("train.grad_clip=inf", "finite")),
    (("train.grad_clip=" + str(10 ** 400) + ".0",), ("train.grad_clip=inf", "finite")),
    (("model.hidden=-64",), ("model.hidden=-64", ">= 1")),
    (("model.hidden=" + str(2 ** 40),), ("model.hidden=1099511627776", "<= ")),
    (("model.layers=2147483648",), ("model.layers=2147483648", "<= ")),
    (("model.checkpoint_layers=-1",), ("model.checkpoint_layers=-1", ">= 0")),
    (("model.activation_checkpointing=false", "model.checkpoint_layers=2"),
     ("model.checkpoint_layers=2", "model.activation_checkpointing=true")),
    (("train.steps='10'",), ("train.steps='10'", "integer")),
    (("train.lr='1e-3'",), ("train.lr='1e-3'", "number")),
    (("train.steps=1e3",), ("train.steps=1000.0", "integer")),
    (("parallel.world_size=" + str(2 ** 40),), ("parallel.world_size=1099511627776", "<= ")),
    (("parallel.tp=16777216", "model.heads=16777216", "model.hidden=16777216"), ("<= ",)),
    (("launch.timeout_minutes=0",), ("launch.timeout_minutes=0.0", ">= ")),
    (("launch.timeout_minutes=1e6",), ("launch.timeout_minutes=1000000.0", "<= 10080")),
    (("train.on_nonfinite=ignore",), ("train.on_nonfinite='ignore'", "stop | skip")),
    (("train.max_skipped=0",), ("train.max_skipped=0", ">= 1")),
    (("train.async_save=yes",), ("train.async_save='yes'", "true or false")),
    (("log.overwrite=1",), ("log.overwrite=1", "true or false")),
    (("data.split=nan,1",), ("data.split='nan,1'",)),
    (("train.seed=*a",), ("train.seed",)),
])
def test_bad_values(tmp_path, capsys, sets, fragments):
    fails(tmp_path, capsys, "", *fragments, sets=sets)


def test_schedule_too_long_to_build_is_refused_fast(tmp_path, capsys):
    """16M microbatches per rank would take the dry run hours to list; refused in one line instead."""
    fails(tmp_path, capsys, "", "train.global_batch=16777216", "microbatches",
          sets=("model.layers=2", "parallel.pp=2", "train.global_batch=16777216", "train.micro_batch=1",
                "parallel.dp=1"))


@pytest.mark.parametrize("content,fragments", [
    ('data:\n  paths: [1, 2]\n', ("data.paths=[1, 2]", "list of paths")),
    ('data:\n  paths: ["a\\0b"]\n', ("data.paths=", "control character")),
    ('log:\n  dir: "runs/a\\0b"\n', ("log.dir=", "control character")),
    ('log:\n  dir: "runs/a\\nb"\n', ("log.dir=", "control character")),
    ('log:\n  dir: "\\ud800"\n', ("log.dir=", "UTF-8")),
    ('train:\n  resume: "' + "r" * 100_000 + '"\n', ("train.resume='rrrr", "characters")),
    ('log:\n  dir: "' + "d" * 100_000 + '"\n', ("log.dir='dddd", "characters")),
    ("data:\n  paths: [" + "p" * 300 + "]\n", ("data.paths='pppp", "File name too long")),
    ("train:\n  resume: " + "r" * 300 + "\n", ("train.resume='rrrr", "File name too long")),
    ("data:\n  tokenizer: " + "t" * 300 + "\n", ("data.tokenizer='tttt", "File name too long")),
])
def test_bad_strings(tmp_path, capsys, content, fragments):
    fails(tmp_path, capsys, content, *fragments)


def test_huge_value_is_truncated_in_the_message(tmp_path, capsys):
    line = fails(tmp_path, capsys, "train:\n  steps: [" + ", ".join(["123456789"] * 50_000) + "]\n",
                 "train.steps=[123456789", "integer")
    assert len(line) < 300, len(line)


# --- --set -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("item,fragments", [
    ("train.steps", ("--set", "'train.steps'", "section.key=value")),
    ("nosuch.key=1", ("unknown section 'nosuch'",)),
    ("train.steps=010", ("--set train.steps", "'010'", "ambiguous")),
    ("train.steps=" + "[" * 5000, ("--set", "train.steps", "nested deeper than")),
    ("x" * 100_000, ("--set", "section.key=value")),
])
def test_bad_set_items(tmp_path, capsys, item, fragments):
    line = fails(tmp_path, capsys, "", *fragments, sets=(item,))
    assert len(line) < 400, len(line)


# --- what is accepted, by the YAML 1.2 core schema -----------------------------------------------------


def test_core_schema_values_are_read_as_yaml_1_2(tmp_path):
    p = config_file(tmp_path, "train:\n  lr: 1e-3\n  min_lr: 0\n  seed: 0x10\n  steps: 0o17\n"
                              "model:\n  bias: FALSE\n  ffn_hidden: ~\n  init_std: .5\n"
                              "log:\n  dir: 1:30\n  tensorboard: True\n")
    cfg = resolve(load_config(p, ["train.warmup_steps=+3", "launch.timeout_minutes=2", "train.on_nonfinite=skip"]),
                  1, "cpu")
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.seed, cfg.train.steps) == (1e-3, 0.0, 16, 15)
    assert cfg.model.bias is False and cfg.model.ffn_hidden == 4 * cfg.model.hidden and cfg.model.init_std == 0.5
    assert cfg.log.dir == "1:30" and cfg.log.tensorboard is True
    assert cfg.train.warmup_steps == 3 and cfg.launch.timeout_minutes == 2.0 and cfg.train.on_nonfinite == "skip"


def test_new_keys_have_their_defaults():
    cfg = load_config(None)
    assert (cfg.train.on_nonfinite, cfg.train.max_skipped, cfg.train.async_save) == ("stop", 10, False)
    assert cfg.log.overwrite is False and cfg.launch.timeout_minutes == 30.0


def test_largest_accepted_seed_loads():
    assert load_config(None, [f"train.seed={2 ** 63 - 1}"]).train.seed == 2 ** 63 - 1
    with pytest.raises(UserError):
        load_config(None, [f"train.seed={2 ** 63}"])
