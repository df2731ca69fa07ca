"""What a 1-bit Adam checkpoint demands of a resume (megazero.train.onebit_resume), checked on meta.json
contents as a save writes them, without training: past the warm-up another dp, beta2 or eps is refused in one
line naming the key; within it, another dp resumes; a checkpoint past the warm-up without the per-rank error
feedback (written before it was saved) is refused naming that, not a model change. The 4-rank runs, the
resumes themselves and the SIGTERM path are tests/parallel/test_onebit_adam_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.errors import UserError
from megazero.train.onebit_resume import check_onebit_layout, check_rank_state_stored
from tests.runs import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")
ONEBIT = ["optim.name=onebit_adam", "optim.onebit_adam.freeze_step=3", "train.steps=10", "parallel.tp=1", "parallel.pp=1",
          "parallel.sequence_parallel=false"]


def _meta(step: int, *overrides: str) -> dict:
    return {"optimizer_step": step, "config": load_config(TINY, ONEBIT + ["parallel.dp=2"] + list(overrides)).to_dict()}


def _here(*overrides: str):
    return load_config(TINY, ONEBIT + ["parallel.dp=2"] + list(overrides))


@pytest.mark.parametrize("here, named", [
    (["parallel.dp=1"], "parallel.dp is 2 there and 1 here"),
    (["optim.onebit_adam.beta2=0.99"], "optim.onebit_adam.beta2 is 0.95 there and 0.99 here"),
    (["optim.onebit_adam.eps=1.0e-6"], "optim.onebit_adam.eps is 1e-08 there and 1e-06 here"),
    (["optim.onebit_adam.freeze_step=4"], "optim.onebit_adam.freeze_step is 3 there and 4 here"),
])
def test_past_the_warm_up_a_change_is_refused_naming_it(here, named):
    with pytest.raises(UserError) as e:
        check_onebit_layout(Path("ckpt"), _meta(6), _here(*here))
    assert "\n" not in str(e.value) and named in str(e.value), str(e.value)


def test_within_the_warm_up_another_dp_and_beta2_resume():
    check_onebit_layout(Path("ckpt"), _meta(2), _here("parallel.dp=1", "optim.onebit_adam.beta2=0.99"))


def test_a_checkpoint_without_the_error_feedback_is_refused_for_what_it_lacks():
    wanted = ["rank/0/dense/0/worker", "rank/0/dense/0/server"]
    with pytest.raises(UserError) as e:
        check_rank_state_stored(Path("ckpt"), wanted, {"model/embed.tokens.weight"})
    line = str(e.value)
    assert "\n" not in line and "no per-rank optimizer state" in line and "model config" not in line, line
    check_rank_state_stored(Path("ckpt"), wanted, {"model/x", "rank/1/dense/0/worker"})  # saved: loads
    check_rank_state_stored(Path("ckpt"), [], {"model/x"})  # nothing per rank asked for (the warm-up, AdamW)


def test_the_warm_ups_last_step_resumes_at_another_layout_and_a_longer_warm_up():
    """At optimizer step == freeze_step only AdamW's steps have run (the first compressed step is the next):
    another dp and a longer warm-up resume (the same steps as a run that had them from the start); a shorter
    warm-up, whose run would have compressed this step, is refused, as is a longer one a step later."""
    check_onebit_layout(Path("ckpt"), _meta(3), _here("parallel.dp=1"))
    check_onebit_layout(Path("ckpt"), _meta(3), _here("optim.onebit_adam.freeze_step=5"))
    for step, freeze in ((3, 2), (4, 5)):
        with pytest.raises(UserError) as e:
            check_onebit_layout(Path("ckpt"), _meta(step), _here(f"optim.onebit_adam.freeze_step={freeze}"))
        assert f"optim.onebit_adam.freeze_step is 3 there and {freeze} here" in str(e.value), str(e.value)
