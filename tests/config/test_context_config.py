"""Context parallelism's bad inputs: one line naming the key, the value and what is valid; exit 2; no traceback.
(A corpus without document boundaries under data.document_mask: tests/data/test_data.py.)"""
from __future__ import annotations

import pytest

from tests.hostile import assert_one_line, call, pretrain_main
from tests.runs import ROOT

LLAMA = ROOT / "configs" / "tiny-llama.yaml"  # seq_len 128, 6 heads, tp 2 x pp 2
ONE = ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false"]


@pytest.mark.parametrize("sets,fragments", [
    (["parallel.cp=3", "parallel.world_size=3"], ("model.seq_len", "128", "2*parallel.cp = 6")),
    (["parallel.cp=4", "parallel.world_size=6"], ("parallel.cp", "4", "must divide the world size 6")),
    (["parallel.cp=4", "parallel.cp_mode=all_to_all", "parallel.world_size=4"],
     ("parallel.cp_mode", "all_to_all", "6 is not divisible by parallel.cp=4")),
    (["data.document_mask=true", "parallel.tp=2", "parallel.tp_overlap=true", "parallel.world_size=2"],
     ("data.document_mask", "tp_overlap")),
    (["data.reset_positions=true", "parallel.tp=2", "parallel.tp_overlap=true", "parallel.world_size=2"],
     ("data.reset_positions", "tp_overlap")),
    (["parallel.cp=0"], ("parallel.cp", "0")),
    (["parallel.cp_mode=zigzag"], ("parallel.cp_mode", "zigzag", "ring")),
    (["data.document_mask=true", "data.document_tokens=-1"], ("data.document_tokens", "-1")),
])
def test_bad_context_parallel_input_is_one_line(capsys, sets, fragments):
    argv = ["--config", str(LLAMA), "--dry-run"]
    for s in ONE + sets:
        argv += ["--set", s]
    code, _, err = call(pretrain_main, argv, capsys)
    assert_one_line(code, err, *fragments)


def test_a_valid_context_parallel_layout_plans(capsys):
    argv = ["--config", str(LLAMA), "--dry-run"]
    for s in ONE + ["parallel.cp=4", "parallel.world_size=8"]:
        argv += ["--set", s]
    code, out, err = call(pretrain_main, argv, capsys)
    assert code == 0, err[-2000:]
