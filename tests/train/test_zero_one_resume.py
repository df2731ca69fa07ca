"""What a 0/1 Adam or 1-bit LAMB checkpoint demands of a resume (megazero.train.onebit_resume) and the switch to a
full-precision optimizer (megazero.train.optimizer_resume), on meta.json contents as a save writes them, without
training: before 0/1 Adam's first compressed step another dp resumes (the states are AdamW's); from it another
dp or another policy is refused in one line naming the key (1-bit LAMB: another warm-up or dp from its first
step); optim.switch_from continues the states as AdamW or LAMB with one line that says so, and is refused,
naming the valid targets, for another optimizer or without the request. The 4-rank runs are
tests/parallel/test_compressed_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.errors import UserError
from megazero.train.onebit_resume import check_zero_one_layout
from megazero.train.optimizer_resume import check_optimizer_resume
from tests.runs import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")
ZERO_ONE = ["optim.name=zero_one_adam", "optim.zero_one_adam.var_freeze_step=6",
            "optim.zero_one_adam.var_update_scaler=2", "train.steps=30", "parallel.tp=1", "parallel.pp=1",
            "parallel.sequence_parallel=false"]


def _meta(step: int, *overrides: str) -> dict:
    return {"optimizer_step": step,
            "config": load_config(TINY, ZERO_ONE + ["parallel.dp=2"] + list(overrides)).to_dict()}


def _here(*overrides: str):
    return load_config(TINY, ZERO_ONE + ["parallel.dp=2"] + list(overrides))


def test_before_the_first_compressed_step_another_dp_resumes():
    check_zero_one_layout(Path("ckpt"), _meta(2), _here("parallel.dp=4"))  # T_v = 1, 2: AdamW-shaped states


@pytest.mark.parametrize("here, named", [
    (["parallel.dp=4"], "parallel.dp is 2 there and 4 here"),
    (["optim.zero_one_adam.var_freeze_step=7"], "optim.zero_one_adam.var_freeze_step is 6 there and 7 here"),
    (["optim.zero_one_adam.local_step_clipper=8"], "optim.zero_one_adam.local_step_clipper is 16 there and 8 here"),
])
def test_from_the_first_compressed_step_a_change_is_refused_naming_it(here, named):
    for step in (3, 20):
        with pytest.raises(UserError) as e:
            check_zero_one_layout(Path("ckpt"), _meta(step), _here(*here))
        assert "\n" not in str(e.value) and named in str(e.value), str(e.value)


def test_a_switch_to_adamw_or_lamb_is_one_line_and_only_on_request():
    for target in ("adamw", "lamb"):
        note = check_optimizer_resume(Path("ckpt"), _meta(20), _here(f"optim.name={target}",
                                                                     "optim.switch_from=zero_one_adam"))
        assert note is not None and "\n" not in note and f"optim.name={target}" in note and "dropped" in note, note
    for asked in (["optim.name=adamw"], ["optim.name=muon", "optim.switch_from=zero_one_adam"]):
        with pytest.raises(UserError) as e:
            check_optimizer_resume(Path("ckpt"), _meta(20), _here(*asked))
        assert "\n" not in str(e.value) and "optim.switch_from=zero_one_adam continues its states with adamw or " \
            "lamb" in str(e.value), str(e.value)
    assert check_optimizer_resume(Path("ckpt"), _meta(20), _here()) is None  # the same optimizer: no line


def test_a_onebit_lamb_checkpoint_keeps_its_warm_up_and_layout():
    """1-bit LAMB's per-layer figures are per rank from its first step: another freeze_step or dp is refused."""
    from megazero.train.onebit_resume import check_onebit_lamb_layout

    lamb = ["optim.name=onebit_lamb", "optim.onebit_lamb.freeze_step=6", "train.steps=30", "parallel.tp=1",
            "parallel.pp=1", "parallel.sequence_parallel=false", "parallel.dp=2"]
    meta = {"optimizer_step": 3, "config": load_config(TINY, lamb).to_dict()}
    check_onebit_lamb_layout(Path("ckpt"), meta, load_config(TINY, lamb))
    for here, named in ((["optim.onebit_lamb.freeze_step=7"], "optim.onebit_lamb.freeze_step is 6 there and 7 here"),
                        (["parallel.dp=4"], "parallel.dp is 2 there and 4 here")):
        with pytest.raises(UserError) as e:
            check_onebit_lamb_layout(Path("ckpt"), meta, load_config(TINY, lamb + here))
        assert "\n" not in str(e.value) and named in str(e.value), str(e.value)
