"""``model.head_dim``: llama heads wider (or narrower) than hidden / heads, as Qwen3's (32 heads of 128 beside
hidden 2048): the built model and its counts, transformers' logits from a folder with head_dim set (1e-5, the
same fp32 operations), the export read back by transformers, and the config's one-line refusals."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import transformers  # noqa: E402

from megazero.config.load import load_config  # noqa: E402
from megazero.config.resolve import resolve_arch  # noqa: E402
from megazero.costs import model_flops_per_token  # noqa: E402
from megazero.errors import UserError  # noqa: E402
from megazero.interop.export import to_hf_state_dict, write_hf_folder  # noqa: E402
from megazero.interop.hf_import import load_into, open_hf_model  # noqa: E402
from megazero.plan.activations import activation_bytes_per_layer  # noqa: E402
from megazero.models.build import build_gpt, count_parameters  # noqa: E402

VOCAB, SEQ = 300, 16
OURS = ["model.arch=llama", "model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
        "model.head_dim=32", "model.ffn_hidden=128", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
        "model.norm_eps=1.0e-6", "model.init_std=0.2"]
HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
          intermediate_size=128, vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
          initializer_range=0.2)


def _cfg(extra=()):
    cfg = load_config(None, OURS + list(extra))
    resolve_arch(cfg.model)
    return cfg


def test_heads_of_their_own_width_build_count_and_flop():
    m = _cfg().model
    model = build_gpt(m, seed=0)
    params = dict(model.named_parameters())
    assert params["layers.0.attn.q.weight"].shape == (4 * 32, 64) and params["layers.0.attn.k.weight"].shape == (64, 64)
    assert params["layers.0.attn.proj.weight"].shape == (64, 128)
    assert count_parameters(m) == sum(p.numel() for p in params.values())
    narrow = _cfg(["model.head_dim=16"]).model  # hidden / heads: the default's model exactly
    assert count_parameters(narrow) == count_parameters(_cfg(["model.head_dim=null"]).model)
    matmul = count_parameters(m) - m.padded_vocab * 64 - 5 * 64  # less the input embedding and the norms
    assert model_flops_per_token(m) == 6 * matmul + 12 * 2 * SEQ * 128  # the attention products at q's width
    y = model(torch.randint(0, VOCAB, (2, SEQ)))
    assert y.shape == (2, SEQ, 384)


def test_a_transformers_folder_with_head_dim_gives_its_logits_and_exports_back(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path / "in", safe_serialization=True)
    cfg = _cfg()
    model = build_gpt(cfg.model, seed=0).eval()
    load_into(model, open_hf_model(tmp_path / "in", cfg.model))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids)[..., :VOCAB]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.std() > 0.5
    hf_config, hf_state = to_hf_state_dict(model.state_dict(), cfg.model)
    assert hf_config["head_dim"] == 32
    write_hf_folder(tmp_path / "out", hf_config, hf_state)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, theirs, rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match="model.head_dim is 32 there and 16 here"):
        open_hf_model(tmp_path / "in", _cfg(["model.head_dim=null"]).model)


def test_activation_bytes_scale_q_k_v_and_the_attention_output():
    s, b, h, a = 128, 2, 64, 4
    sbh = s * b * h
    default = activation_bytes_per_layer(s, b, h, a, 1, ffn=4 * h, kv_heads=a)
    assert default == activation_bytes_per_layer(s, b, h, a, 1, ffn=4 * h, kv_heads=a, head_dim=16) == 34 * sbh
    # q, k, v and the attention output are 8 sbh at 16 bits: twice as wide, 8 sbh more
    assert activation_bytes_per_layer(s, b, h, a, 1, ffn=4 * h, kv_heads=a, head_dim=32) == 42 * sbh


@pytest.mark.parametrize("sets, says", [
    (["model.arch=gpt2", "model.kv_heads=null", "model.head_dim=32"], "model.head_dim=32 is invalid"),
    (["model.head_dim=7"], "odd head dim 7"),
    (["model.head_dim=0"], "model.head_dim=0 is invalid"),
])
def test_bad_head_dims_are_one_line(sets, says):
    with pytest.raises(UserError) as e:
        load_config(None, OURS + sets)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_heads_need_not_divide_hidden_when_their_width_is_set():
    m = load_config(None, OURS + ["model.heads=6", "model.kv_heads=2", "model.head_dim=16"]).model
    assert count_parameters(m) == sum(p.numel() for p in build_gpt(m, seed=0).parameters())
    with pytest.raises(UserError, match="model.heads=6 is invalid; must divide model.hidden=64"):
        load_config(None, OURS + ["model.heads=6", "model.kv_heads=2", "model.head_dim=null"])
