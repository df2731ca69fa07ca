"""Hugging Face interop: a transformers GPT-2 or Llama folder read by megazero (train.init_from), and a megazero
model written as one (megazero.interop.export), each giving the same logits as transformers itself.

Every model is built here from a config (random weights, fp32, a few hundred KB): nothing is downloaded.
Tolerances: import compares the same fp32 operations in the same order (only matmul blocking may differ), so
1e-5; export goes through a save and a load of the same fp32 values, 1e-4 as tests/interop/test_export.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megazero.checkpoint import store as checkpoint  # noqa: E402
from megazero.config.load import load_config  # noqa: E402
from megazero.config.resolve import resolve_arch  # noqa: E402
from megazero.errors import UserError  # noqa: E402
from megazero.interop.export import main as export_main  # noqa: E402
from megazero.interop.export import to_hf_state_dict, write_hf_folder  # noqa: E402
from megazero.interop.hf_import import load_into, open_hf_model  # noqa: E402
from megazero.interop.hf_layout import links  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402

VOCAB, SEQ = 300, 32
LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=500000.0,
             tie_word_embeddings=False, initializer_range=0.2)
OURS_LLAMA = ["model.arch=llama", "model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
              "model.ffn_hidden=128", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", "model.norm_eps=1.0e-6",
              "model.rope_theta=500000", "model.init_std=0.2"]
OURS_GPT2 = ["model.layers=2", "model.hidden=64", "model.heads=4", f"model.vocab_size={VOCAB}",
             f"model.seq_len={SEQ}", "model.init_std=0.2"]


def _cfg(overrides: list[str]):
    cfg = load_config(None, overrides)
    resolve_arch(cfg.model)  # the model section as a run reads it (megazero.config.resolve)
    return cfg


def _jitter(params, seed: int = 1) -> None:
    """Norm weights 1 and biases 0 at init would hide a swapped or dropped mapping: move them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_llama(path, **overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **overrides})).eval()
    _jitter(hf.parameters())
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")  # sharded: index + several files
    return hf


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)[..., :VOCAB]


def _one_line(excinfo, *fragments: str) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def _check_layout_matches_model(cfg, model) -> None:
    """hf_layout lists exactly the model's parameters at their full shapes (catches drift in models/)."""
    params = dict(model.named_parameters())
    table = links(cfg.model)
    assert set(table) == set(params)
    assert all(table[n].shape == tuple(p.shape) for n, p in params.items())


@pytest.mark.parametrize("bias", [False, True])
def test_llama_folder_gives_transformers_logits(tmp_path, bias):
    """RoPE (rotate_half, HF's frequencies), RMSNorm, GQA and SwiGLU equal transformers' Llama, from a sharded
    folder."""
    hf = _hf_llama(tmp_path, attention_bias=bias, mlp_bias=bias)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = _cfg(OURS_LLAMA + [f"model.bias={str(bias).lower()}"])
    weights = open_hf_model(tmp_path, cfg.model)
    model = build_gpt(cfg.model, seed=0).eval()
    _check_layout_matches_model(cfg, model)
    load_into(model, weights)
    tokens = weights.value("embed.tokens.weight")
    assert tokens.dtype == torch.float32 and tokens.shape == (384, 64) and not tokens[VOCAB:].any()
    ids = _ids()
    ours = _logits(model, ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.std() > 0.5  # not vacuous: logits vary far beyond the tolerance


def test_gpt2_folder_gives_transformers_logits(tmp_path):
    """GPT-2: Conv1D transposed, c_attn regrouped per head, the first seq_len of n_positions rows, a tied head."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB, initializer_range=0.2)).eval()
    _jitter(hf.parameters())
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = _cfg(OURS_GPT2)
    model = build_gpt(cfg.model, seed=0).eval()
    _check_layout_matches_model(cfg, model)
    load_into(model, open_hf_model(tmp_path, cfg.model))
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(_logits(model, ids), theirs, rtol=1e-5, atol=1e-5)
    assert theirs.std() > 0.5


@pytest.mark.parametrize("arch,tie,bias", [("llama", False, False), ("llama", True, True), ("gpt2", True, True),
                                           ("gpt2", False, False)])
def test_export_loads_in_transformers_and_imports_back_exactly(tmp_path, arch, tie, bias):
    base = OURS_LLAMA if arch == "llama" else OURS_GPT2
    cfg = _cfg(base + [f"model.tie_embeddings={str(tie).lower()}", f"model.bias={str(bias).lower()}"])
    model = build_gpt(cfg.model, seed=3).eval()
    _check_layout_matches_model(cfg, model)
    _jitter(model.parameters())
    state = model.state_dict()
    hf_config, hf_state = to_hf_state_dict(state, cfg.model)
    write_hf_folder(tmp_path, hf_config, hf_state)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["tie_word_embeddings"] is tie
    if arch == "llama":
        assert written["architectures"] == ["LlamaForCausalLM"] and written["num_key_value_heads"] == 2
        assert written["rope_theta"] == 500000.0 and written["rms_norm_eps"] == 1e-6
        assert written["max_position_embeddings"] == SEQ and written["eos_token_id"] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if arch == "llama" else "GPT2LMHeadModel")
    ids = _ids(1)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert theirs.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(theirs, _logits(model, ids), rtol=1e-4, atol=1e-4)
    assert theirs.std() > 0.5
    if arch == "gpt2" and not bias:  # HF's GPT-2 always has biases (zeros here): bias must match to import
        with pytest.raises(UserError, match="model.bias is true there and false here"):
            open_hf_model(tmp_path, cfg.model)
        return
    weights = open_hf_model(tmp_path, cfg.model)  # and back: every parameter exactly, padding rows zero
    for name, value in state.items():
        got = weights.value(name)
        if name in ("embed.tokens.weight", "head.weight"):
            assert not got[VOCAB:].any()
            got, value = got[:VOCAB], value[:VOCAB]
        assert torch.equal(got, value), name


def _sentencepiece(tmp_path):
    from megazero.data.tokenizer import train_tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"def f{i}(x):\n    return x * {i}  # héllo wörld" for i in range(300)))
    return train_tokenizer([text], VOCAB, tmp_path / "sp")


def _tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x * 2  # héllo"] * 50, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tok.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["sentencepiece", "tokenizer.json", "none"])
def test_export_cli_writes_the_runs_tokenizer(tmp_path, capsys, kind):
    """`python -m megazero.export` on a saved Llama checkpoint: the model and the run's tokenizer load with
    Auto classes, and AutoTokenizer gives the ids megazero's tokenizer gives; an older checkpoint (no
    tokenizer in meta.json) exports without one, with a note."""
    from megazero.data.tokenizer import Tokenizer

    model = build_gpt(_cfg(OURS_LLAMA).model, seed=0)
    tok_path = {"sentencepiece": _sentencepiece, "tokenizer.json": _tokenizer_json}.get(kind, lambda p: None)(tmp_path)
    ckpt = _checkpoint(tmp_path, model, tok_path and str(tok_path))
    out = tmp_path / "hf"
    assert export_main([str(ckpt), str(out)]) == 0
    printed = capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, _logits(model.eval(), ids), rtol=1e-4, atol=1e-4)
    if tok_path is None:
        assert "note:" in printed and "no tokenizer" in printed
        assert not (out / "tokenizer_config.json").exists()
        return
    ours = Tokenizer.load(tok_path)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["def f7(x):\n    return x * 7", "  two  spaces héllo 😀", "x"]:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text
    written = json.loads((out / "config.json").read_text())
    assert written["eos_token_id"] == ours.eos_id >= 0


def _checkpoint(tmp_path, model, tokenizer):
    """A one-process checkpoint of ``model`` whose meta.json records ``tokenizer`` (None: no such key)."""
    meta = {"config": _cfg(OURS_LLAMA).to_dict(), "consumed_samples": 0, "optimizer_step": 0}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    state = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    return checkpoint.save(tmp_path / "ckpts", 1, state, meta, keep_last=1)


def test_export_of_a_recorded_tokenizer_that_is_gone_or_bad(tmp_path, capsys):
    """A tokenizer file moved away since the run: the weights still export, with a note. A recorded value
    that is no path, or a file that is no tokenizer: one line, exit 2, nothing written."""
    from tests.hostile import assert_one_line

    model = build_gpt(_cfg(OURS_LLAMA).model, seed=0)
    ckpt = _checkpoint(tmp_path, model, str(tmp_path / "moved.model"))
    assert export_main([str(ckpt), str(tmp_path / "hf")]) == 0
    assert "moved.model is no longer there" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    (tmp_path / "junk.model").write_bytes(b"\x0anot a sentencepiece model")
    for value, fragment in ((7, "tokenizer=7 is invalid"), (str(tmp_path / "junk.model"), "junk.model")):
        ckpt = _checkpoint(tmp_path, model, value)
        code = export_main([str(ckpt), str(tmp_path / "out")])
        assert_one_line(code, capsys.readouterr().err, fragment)
        assert not (tmp_path / "out").exists()


def _raises(folder, overrides=OURS_LLAMA, *fragments):
    with pytest.raises(UserError) as excinfo:
        open_hf_model(folder, _cfg(overrides).model)
    return _one_line(excinfo, "train.init_from", str(folder), *fragments)


def test_a_model_that_differs_from_the_config_names_every_key(tmp_path):
    _hf_llama(tmp_path)
    changed = OURS_LLAMA + ["model.hidden=128", "model.heads=8", "model.kv_heads=4", "model.norm_eps=1.0e-5",
                            "model.tie_embeddings=true"]
    text = _raises(tmp_path, changed, "model.hidden is 64 there and 128 here", "model.heads is 4 there and 8 here",
                   "model.kv_heads is 2 there and 4 here", "model.norm_eps is 1e-06 there and 1e-05 here",
                   "model.tie_embeddings is false there and true here")
    assert "model.layers" not in text and "model.ffn_hidden" not in text  # only what differs
    _raises(tmp_path, OURS_GPT2, "model.arch is llama there and gpt2 here")


def test_folders_megazero_cannot_read_are_one_line_errors(tmp_path):
    mistral = tmp_path / "mistral"
    transformers.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, vocab_size=VOCAB).save_pretrained(mistral)
    _raises(mistral, OURS_LLAMA, "model_type 'mistral'", "valid: GPT-2", "Llama")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 64}))
    _raises(bert, OURS_LLAMA, "model of architectures ['BertModel']")
    (tmp_path / "empty").mkdir()
    _raises(tmp_path / "empty", OURS_LLAMA, "no config.json")
    scaled = tmp_path / "scaled"
    transformers.LlamaConfig(**LLAMA).save_pretrained(scaled)
    raw = json.loads((scaled / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps(raw))
    _raises(scaled, OURS_LLAMA, "rope type 'yarn'", "'llama3'")
    (scaled / "config.json").write_text(json.dumps({**raw, "rope_parameters": None, "hidden_size": "64"}))
    _raises(scaled, OURS_LLAMA, "hidden_size='64' is invalid")


def test_missing_misshapen_and_pickled_weights_are_one_line_errors(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    _raises(tmp_path, OURS_LLAMA, "'model.layers.1.mlp.up_proj.weight'", "megazero's layers.1.mlp.up.weight")
    save_file({**tensors, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}, weights)
    _raises(tmp_path, OURS_LLAMA, "'model.layers.0.self_attn.k_proj.weight'", "(64, 64)", "(32, 64)")
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    _raises(tmp_path, OURS_LLAMA, "model.safetensors is not a readable safetensors file")
    weights.unlink()
    torch.save({}, tmp_path / "pytorch_model.bin")
    _raises(tmp_path, OURS_LLAMA, "pytorch_model.bin, a pickle")


def test_pretrain_refuses_a_folder_of_another_model_before_starting(tmp_path, capsys):
    """Through pretrain.py (--dry-run and a run alike, before any process group): one line, exit 2."""
    from tests.hostile import assert_one_line, call, pretrain_main

    mistral = tmp_path / "mistral"
    transformers.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, vocab_size=VOCAB).save_pretrained(mistral)
    llama = tmp_path / "llama"
    _hf_llama(llama)
    capsys.readouterr()  # transformers' own progress output
    tokenizer = tmp_path / "tokenizer.json"  # read only once data is built, after the refusals under test
    tokenizer.write_text("{}")
    base = ["--config", "configs/tiny-llama.yaml", "--set", f"log.dir={tmp_path / 'run'}",
            "--set", f"data.tokenizer={tokenizer}"]
    for s in OURS_LLAMA + ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false"]:
        base += ["--set", s]
    for extra, fragments in (([f"train.init_from={mistral}", "--dry-run"], ("model_type 'mistral'",)),
                             ([f"train.init_from={mistral}"], ("model_type 'mistral'",)),
                             ([f"train.init_from={llama}", "--set", "model.kv_heads=4", "--dry-run"],
                              ("model.kv_heads is 2 there and 4 here",)),
                             # a run that would train a new vocabulary for imported weights
                             ([f"train.init_from={llama}", "--set", "data.tokenizer=train", "--dry-run"],
                              ("data.tokenizer", "the model's own tokenizer"))):
        argv = base + ["--set"] + extra
        code, _, err = call(pretrain_main, argv, capsys)
        assert_one_line(code, err, "train.init_from", *fragments)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything ran


def test_llama_gradients_equal_transformers(tmp_path):
    """Backward too: every parameter's gradient of the mean token loss equals transformers' (RoPE's, RMSNorm's
    own autograd function, GQA's k/v summed over their query heads, SwiGLU). fp32, the same sums in another
    order: 1e-4 relative to each gradient's largest entry, with 1e-6 absolute for tiny ones."""
    hf = _hf_llama(tmp_path)
    cfg = _cfg(OURS_LLAMA)
    model = build_gpt(cfg.model, seed=0)
    load_into(model, open_hf_model(tmp_path, cfg.model))
    ids = _ids()
    model(ids[:, :-1], ids[:, 1:]).mean().backward()
    logits = hf(input_ids=ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    theirs = dict(hf.named_parameters())
    for name, link in links(cfg.model).items():
        ours = dict(model.named_parameters())[name].grad
        want = theirs[link.hf].grad
        if name in ("embed.tokens.weight", "head.weight"):
            ours = ours[:VOCAB]
        scale = want.abs().max().item()
        assert scale > 0 and (ours - want).abs().max().item() <= 1e-4 * scale + 1e-6, name


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # 16 < SEQ: the scaled frequencies matter here
OURS_LLAMA3_ROPE = ["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
                    "model.rope_high_freq_factor=4", "model.rope_original_positions=16"]


def test_llama31_scaled_rope_folder_gives_transformers_logits_and_exports_back(tmp_path):
    """Llama 3.1's rope_scaling ('llama3': long wavelengths divided by factor, short ones kept, the band
    between blended) equals transformers' at tp 1 (1e-5, as the unscaled case); the export writes it back
    and transformers' logits on the export equal megazero's (1e-4). A config without the scaling is refused,
    naming the key."""
    hf = _hf_llama(tmp_path / "in", rope_scaling=LLAMA3_ROPE)
    cfg = _cfg(OURS_LLAMA + OURS_LLAMA3_ROPE)
    model = build_gpt(cfg.model, seed=0).eval()
    load_into(model, open_hf_model(tmp_path / "in", cfg.model))
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(_logits(model, ids), theirs, rtol=1e-5, atol=1e-5)
    unscaled = build_gpt(_cfg(OURS_LLAMA).model, seed=0).eval()
    unscaled.load_state_dict(model.state_dict())
    assert (_logits(unscaled, ids) - theirs).abs().max() > 1e-2  # the scaling changes the logits here
    _raises(tmp_path / "in", OURS_LLAMA, "model.rope_scaling is llama3 there and none here")

    hf_config, hf_state = to_hf_state_dict(model.state_dict(), cfg.model)
    write_hf_folder(tmp_path / "out", hf_config, hf_state)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, _logits(model, ids), rtol=1e-4, atol=1e-4)
