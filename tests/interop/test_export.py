"""Export to Hugging Face GPT-2: the folder loads in transformers and gives megazero's logits."""

import json
import os

import pytest
import torch

from megazero.config.schema import ModelConfig

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from megazero.interop.export import main, to_hf_state_dict, write_hf_folder  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402

import transformers  # noqa: E402  (a test dependency, installed by the Makefile)


def Cfg(**overrides) -> ModelConfig:
    """A small model config; tests override what they exercise."""
    values = dict(layers=2, hidden=64, heads=4, seq_len=32, vocab_size=300, ffn_hidden=192, dropout=0.1,
                  init_std=0.2)
    values.update(overrides)
    return ModelConfig(**values)


@pytest.mark.parametrize("bias", [True, False])
def test_exported_folder_gives_megazero_logits(tmp_path, bias):
    cfg = Cfg(bias=bias)
    model = build_gpt(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases 0 and norms 1 at init would hide a mapping mistake
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    hf_config, hf_state = to_hf_state_dict(model.state_dict(), cfg)
    write_hf_folder(tmp_path, hf_config, hf_state)

    written = json.loads((tmp_path / "config.json").read_text())
    assert written["vocab_size"] == 300 and written["n_inner"] == 192 and written["n_positions"] == 32
    assert written["resid_pdrop"] == written["embd_pdrop"] == 0.1

    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied, not a copy
    assert hf.transformer.wte.weight.shape == (300, 64)
    x = torch.randint(0, 300, (2, 32), generator=g)
    with torch.no_grad():
        ours = model(x)
        theirs = hf(x).logits
    assert theirs.shape == (2, 32, 300)
    torch.testing.assert_close(theirs, ours[..., :300], atol=1e-4, rtol=1e-4)
    # the comparison is not vacuous: logits vary well beyond the tolerance
    assert ours[..., :300].std() > 0.1


def test_state_without_a_layer_is_a_user_error():
    from megazero.errors import UserError

    cfg = Cfg()
    state = build_gpt(cfg, seed=0).state_dict()
    del state["layers.1.mlp.fc2.weight"]
    model = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab_size": 300, "ffn_hidden": 192}
    with pytest.raises(UserError, match="layers.1.mlp.fc2.weight"):
        to_hf_state_dict(state, model)


def test_tensors_that_disagree_with_the_config_are_a_user_error():
    """A config edited after the save (here ffn_hidden left to its 4*hidden default) is refused by name."""
    from megazero.errors import UserError

    state = build_gpt(Cfg(), seed=0).state_dict()
    model = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab_size": 300}
    with pytest.raises(UserError, match=r"'layers.0.mlp.fc1.weight' has shape \(192, 64\).*gives \(256, 64\)"):
        to_hf_state_dict(state, model)
    with pytest.raises(UserError, match=r"more layers than .* layers=1"):
        to_hf_state_dict(state, {**model, "ffn_hidden": 192, "layers": 1})


def test_write_hf_folder_is_all_or_nothing(tmp_path):
    """A non-empty folder needs force, and force replaces only a previous export, once the new one is whole;
    no leftovers. A link is followed: the folder is written where it points, the link kept."""
    from megazero.errors import UserError

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(UserError, match="is not empty; pass --force"):
        write_hf_folder(out, {"a": 1}, {"w": torch.zeros(2)})
    with pytest.raises(UserError, match="not a previous export: it holds old.txt"):
        write_hf_folder(out, {"a": 1}, {"w": torch.zeros(2)}, force=True)
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    (out / "old.txt").unlink()
    write_hf_folder(out, {"a": 1}, {"w": torch.zeros(2)})
    write_hf_folder(out, {"a": 2}, {"w": torch.ones(2)}, force=True)  # a previous export: replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    write_hf_folder(link, {"a": 1}, {"w": torch.zeros(2)})
    assert link.is_symlink() and (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out", "target"]


def test_cli_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_is_one_line_error(tmp_path):
    from megazero.errors import UserError
    from megazero.interop.export import write_hf_folder

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="exists and is not a directory"):
        write_hf_folder(blocker, {}, {})
    with pytest.raises(UserError, match=r"export output '.*file/sub': cannot write it"):  # a file in the path
        write_hf_folder(blocker / "sub", {}, {"w": torch.zeros(2)})
