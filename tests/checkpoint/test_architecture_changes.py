"""A resume with another mixture of experts is refused naming the key that differs (``model.moe.top_k is 2
there and 1 here``), as the Hugging Face import names it, never the two whole sections. The checkpoint is a
meta.json made as a save makes it: no training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megazero.checkpoint.architecture import model_differences
from megazero.config.load import load_config
from megazero.config.schema import ModelConfig
from megazero.errors import UserError
from megazero.interop.hf_layout import model_config
from megazero.train.checkpoint_state import check_architecture
from tests.hostile import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")
MOE = ["model.arch=llama", "model.kv_heads=1", "model.ffn_hidden=32", "model.moe.experts=4", "model.moe.top_k=2"]


def _model(*overrides: str) -> ModelConfig:
    return model_config(load_config(TINY, MOE + list(overrides)).model)


def _checkpoint(folder: Path, *overrides: str) -> Path:
    cfg = load_config(TINY, MOE + list(overrides))
    meta = {"format": 1, "step": 4, "consumed_samples": 32, "optimizer_step": 4, "config": cfg.to_dict()}
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("there,here,named", [
    (["model.moe.experts=4"], ["model.moe.experts=8"], "model.moe.experts is 4 there and 8 here"),
    (["model.moe.top_k=2"], ["model.moe.top_k=1"], "model.moe.top_k is 2 there and 1 here"),
    (["model.moe.router=softmax"], ["model.moe.router=sigmoid"], "model.moe.router is 'softmax' there and "
                                                                  "'sigmoid' here"),
    (["model.moe.experts=4"], ["model.moe.experts=0"], "model.moe.experts is 4 there and 0 here"),
])
def test_a_changed_moe_key_is_named_alone(tmp_path, there, here, named):
    with pytest.raises(UserError) as e:
        check_architecture(_checkpoint(tmp_path / "ckpt", *there), _model(*here))
    line = str(e.value)
    assert "\n" not in line and named in line, line
    assert "{" not in line and "shared_experts" not in line, line  # not the whole sections


def test_each_differing_moe_key_is_its_own_difference():
    diffs = model_differences(_model("model.moe.experts=4", "model.moe.top_k=2"),
                              _model("model.moe.experts=8", "model.moe.top_k=1"), ModelConfig.ARCHITECTURE)
    assert diffs == [("moe.experts", 4, 8), ("moe.top_k", 2, 1)], diffs
    dense = _model("model.moe.experts=0")
    assert model_differences(dense, dense, ModelConfig.ARCHITECTURE) == []
    assert model_differences(dense, _model(), ModelConfig.ARCHITECTURE) == [("moe.experts", 0, 4)]


def test_moe_training_settings_and_the_same_expert_width_are_no_change(tmp_path):
    """aux_loss and the like may change on a resume; expert_hidden unset is the model's ffn_hidden."""
    check_architecture(_checkpoint(tmp_path / "a", "model.moe.aux_loss=0.01"), _model("model.moe.aux_loss=0.1"))
    check_architecture(_checkpoint(tmp_path / "b"), _model("model.moe.expert_hidden=32"))
    with pytest.raises(UserError, match="model.moe.expert_hidden is 32 there and 16 here"):
        check_architecture(_checkpoint(tmp_path / "c"), _model("model.moe.expert_hidden=16"))


def test_every_differing_key_is_named_in_the_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        check_architecture(_checkpoint(tmp_path / "ckpt", "model.moe.experts=4", "model.moe.top_k=2"),
                           _model("model.moe.experts=8", "model.moe.top_k=1"))
    line = str(e.value)
    assert "\n" not in line and "model.moe.experts is 4 there and 8 here" in line, line
    assert "model.moe.top_k is 2 there and 1 here" in line, line
