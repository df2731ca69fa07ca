"""Hostile Hugging Face folders at ``train.init_from``: each gives one line naming the file and the key or tensor.

The folders are written here by hand (config.json and safetensors with HF's tensor names, written out below
rather than taken from megazero's layout table), a few hundred KB each: nothing is downloaded and transformers
is not imported. Every case but the non-finite weights is found by pretrain.py's check before any process
group, so it runs as ``--dry-run`` in this process.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megazero.config.load import load_config
from megazero.errors import UserError
from megazero.interop.hf_import import open_hf_model
from tests.hostile import ROOT, assert_one_line, call, pretrain_main

VOCAB, SEQ, HIDDEN, LAYERS = 512, 32, 64, 2
GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": LAYERS, "n_embd": HIDDEN,
               "n_head": 4, "n_positions": SEQ, "vocab_size": VOCAB, "activation_function": "gelu_new",
               "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS,
                "hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                "vocab_size": VOCAB, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "max_position_embeddings": SEQ}
# megazero's side of each: configs/tiny.yaml made as small as the folders
OURS = {"gpt2": ["model.arch=gpt2"],
        "llama": ["model.arch=llama", "model.kv_heads=2", "model.ffn_hidden=128", "model.norm_eps=1.0e-5",
                  "model.rope_theta=10000", "model.tie_embeddings=false"]}
COMMON = [f"model.layers={LAYERS}", f"model.hidden={HIDDEN}", "model.heads=4", f"model.seq_len={SEQ}",
          f"model.vocab_size={VOCAB}", "parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false",
          "zero.stage=0", "train.precision=fp32"]


def _gpt2_block(i: int, prefix: str = "transformer.") -> dict[str, tuple[int, ...]]:
    h, p = HIDDEN, f"{prefix}h.{i}."
    return {p + "ln_1.weight": (h,), p + "ln_1.bias": (h,), p + "attn.c_attn.weight": (h, 3 * h),
            p + "attn.c_attn.bias": (3 * h,), p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
            p + "ln_2.weight": (h,), p + "ln_2.bias": (h,), p + "mlp.c_fc.weight": (h, 4 * h),
            p + "mlp.c_fc.bias": (4 * h,), p + "mlp.c_proj.weight": (4 * h, h), p + "mlp.c_proj.bias": (h,)}


def _llama_block(i: int) -> dict[str, tuple[int, ...]]:
    h, kv, f, p = HIDDEN, 32, 128, f"model.layers.{i}."
    return {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}


def _shapes(arch: str, layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """HF's tensor names and shapes of the small model, with ``layers`` blocks."""
    if arch == "gpt2":
        out = {"transformer.wte.weight": (VOCAB, HIDDEN), "transformer.wpe.weight": (SEQ, HIDDEN)}
        for i in range(layers):
            out.update(_gpt2_block(i))
        return {**out, "transformer.ln_f.weight": (HIDDEN,), "transformer.ln_f.bias": (HIDDEN,)}
    out = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        out.update(_llama_block(i))
    return {**out, "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def _folder(path: Path, arch: str, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None,
            **extra: tuple[int, ...]) -> Path:
    """An HF folder: config.json and one model.safetensors of small random weights (std 0.02, as HF
    initialises), the given ``tensors`` replacing or adding to them."""
    path.mkdir(parents=True, exist_ok=True)
    raw = dict(GPT2_CONFIG if arch == "gpt2" else LLAMA_CONFIG)
    raw.update(config or {})
    (path / "config.json").write_text(json.dumps(raw))
    g = torch.Generator().manual_seed(0)
    state = {k: 0.02 * torch.randn(s, generator=g) for k, s in {**_shapes(arch), **extra}.items()}
    state.update(tensors or {})
    save_file(state, str(path / "model.safetensors"))
    return path


def _dry_run(folder: Path, arch: str, capsys, *sets: str) -> tuple[int, str]:
    tokenizer = folder.parent / "tokenizer.json"  # a dry run reads no tokenizer; the config must name one
    tokenizer.write_text("{}")
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--dry-run"]
    for s in OURS[arch] + COMMON + [f"train.init_from={folder}", f"log.dir={folder.parent / 'run'}",
                                    f"data.tokenizer={tokenizer}", *sets]:
        argv += ["--set", s]
    code, _, err = call(pretrain_main, argv, capsys)
    return code, err


def _model(arch: str):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), OURS[arch] + COMMON).model


# --- non-finite weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad,dtype,what", [
    (float("nan"), torch.float32, "1 NaN"),
    (float("inf"), torch.bfloat16, "1 Inf"),
    (-float("inf"), torch.float16, "1 Inf"),
    (1e300, torch.float64, "beyond float32's range"),  # finite in the file, Inf in the float32 megazero trains
])
def test_a_non_finite_weight_is_named_with_its_file_as_it_is_read(tmp_path, bad, dtype, what):
    """Sharded: two files and an index, so the file named is the one that holds the tensor."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    g = torch.Generator().manual_seed(0)
    state = {k: 0.02 * torch.randn(s, generator=g) for k, s in _shapes("llama").items()}
    key = "model.layers.1.mlp.up_proj.weight"
    state[key] = state[key].to(dtype)
    state[key][7, 3] = bad
    first = {k: v for k, v in state.items() if not k.startswith("model.layers.1.")}
    second = {k: v for k, v in state.items() if k.startswith("model.layers.1.")}
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in first},
        **{k: "model-00002-of-00002.safetensors" for k in second}}}))
    weights = open_hf_model(folder, _model("llama"))  # the headers alone: no tensor is read yet
    for name in weights.names:
        if name == "layers.1.mlp.up.weight":
            with pytest.raises(UserError) as excinfo:
                weights.value(name)
            text = str(excinfo.value)
            assert "\n" not in text
            for fragment in (f"train.init_from {folder}", f"'{key}'", "model-00002-of-00002.safetensors", what,
                             "[7, 3]"):
                assert fragment in text, (fragment, text)
        else:
            assert torch.isfinite(weights.value(name)).all(), name  # every other tensor reads as before


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A few KB of text and a 300-id byte-level BPE trained on it (the folder's tokenizer, as a run needs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    base = tmp_path_factory.mktemp("corpus")
    text = base / "text"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(p) for p in sorted(text.iterdir())], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(base / "tokenizer.json"))
    return text, base / "tokenizer.json"


def _run_argv(tmp_path: Path, folder: Path, corpus: tuple[Path, Path], *sets: str) -> list[str]:
    text, tokenizer = corpus
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml")]
    for s in OURS["gpt2"] + COMMON + [
            f"train.init_from={folder}", f"data.tokenizer={tokenizer}", f"data.paths=[{text}]",
            f"data.cache_dir={tmp_path / 'cache'}", f"log.dir={tmp_path / 'run'}", "train.steps=2",
            "train.global_batch=2", "train.micro_batch=1", "train.warmup_steps=1", "train.eval_every=0",
            "train.save_every=1", "log.every=1", "log.tensorboard=false", "log.peak_tflops=1.0", *sets]:
        argv += ["--set", s]
    return argv


def _nothing_ran(run: Path) -> None:
    assert not list((run / "checkpoints").iterdir())
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()


def test_a_run_from_a_folder_with_a_nan_weight_stops_before_step_one(tmp_path, corpus, capsys):
    """Through pretrain.py: one line naming the tensor and the file, exit 2, before any step (not exit 3,
    a non-finite loss blamed on the gradients)."""
    wte = 0.02 * torch.randn(VOCAB, HIDDEN)
    wte[5, 1] = float("nan")
    folder = _folder(tmp_path / "hf", "gpt2", {"transformer.wte.weight": wte})
    code, _, err = call(pretrain_main, _run_argv(tmp_path, folder, corpus), capsys)
    assert_one_line(code, err, "'transformer.wte.weight'", "model.safetensors", "1 NaN")
    _nothing_ran(tmp_path / "run")


def _rank_main(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_main(argv)
    return code, err.getvalue()


def test_a_nan_weight_only_a_later_pipeline_stage_reads_is_reported_by_rank_0(tmp_path, corpus):
    """pp=2 on two gloo ranks, the NaN in the last layer: only rank 1 reads it (and, not rank 0, prints nothing);
    rank 0, whose collective with it then fails, reports rank 1's line instead of the collective, exit 2."""
    from tests.dist import run_ranks

    w = 0.02 * torch.randn(HIDDEN)
    w[3] = float("nan")
    folder = _folder(tmp_path / "hf", "gpt2", {"transformer.h.1.ln_2.weight": w})
    (code0, err0), (code1, err1) = run_ranks(2, _rank_main, _run_argv(tmp_path, folder, corpus, "parallel.pp=2"))
    assert_one_line(code0, err0, "'transformer.h.1.ln_2.weight'", "model.safetensors", "1 NaN", "found by rank 1")
    assert (code1, err1) == (2, "")
    _nothing_ran(tmp_path / "run")


# --- tensors the config does not use ----------------------------------------------------------------

BUFFERS = {  # in many folders, and no parameters: GPT-2's causal-mask buffers, Llama's rotary frequencies
    "gpt2": {f"transformer.h.{i}.attn.{n}": s for i in range(LAYERS)
             for n, s in (("bias", (1, 1, SEQ, SEQ)), ("masked_bias", ()))},
    "llama": {**{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": (8,) for i in range(LAYERS)},
              "model.rotary_emb.inv_freq": (8,)},
}


@pytest.mark.parametrize("arch,extra,named,more", [
    ("llama", {**_llama_block(2), **_llama_block(3)}, "model.layers.2.input_layernorm.weight", 17),
    ("gpt2", {**_gpt2_block(2), **_gpt2_block(10)}, "transformer.h.2.attn.c_attn.bias", 23),
    ("gpt2", {"lm_head.weight": (VOCAB, HIDDEN)}, "lm_head.weight", 0),  # a head beside a tied config
    ("llama", {"model.layers.0.self_attn.q_norm.weight": (16,)}, "model.layers.0.self_attn.q_norm.weight", 0),
    ("gpt2", {"h.0.ln_1.weight": (HIDDEN,)}, "h.0.ln_1.weight", 0),  # a second copy under the bare prefix
    ("gpt2", {"transformer.h.2.attn.bias": (1, 1, SEQ, SEQ)}, "transformer.h.2.attn.bias", 0),  # beyond layers
    ("llama", {"model.layers.2.self_attn.rotary_emb.inv_freq": (8,)},
     "model.layers.2.self_attn.rotary_emb.inv_freq", 0),
])
def test_tensors_the_config_does_not_use_are_refused_unless_dropped(tmp_path, capsys, arch, extra, named, more):
    """Refused before any process group, naming the first (in layer order) and counting the others; the
    buffers beside them are neither named nor counted, and alone they start the run."""
    folder = _folder(tmp_path / "hf", arch, **BUFFERS[arch], **extra)
    code, err = _dry_run(folder, arch, capsys)
    line = assert_one_line(code, err, f"train.init_from {folder}", f"'{named}'", "train.init_unused=drop")
    assert (f"and {more} more" in line) == (more > 0), line
    code, err = _dry_run(folder, arch, capsys, "train.init_unused=drop")
    assert code == 0, err
    code, err = _dry_run(_folder(tmp_path / "buffers", arch, **BUFFERS[arch]), arch, capsys)
    assert code == 0, err


# --- config.json values of the wrong type -----------------------------------------------------------

@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("value", ["llama3", "default", ["llama3"], 8.0, True])
def test_a_rope_setting_that_is_no_object_is_one_line(tmp_path, capsys, key, value):
    folder = _folder(tmp_path / "hf", "llama", config={key: value})
    code, err = _dry_run(folder, "llama", capsys)
    assert_one_line(code, err, f"train.init_from {folder}", f"config.json {key}=", "a JSON object")


@pytest.mark.parametrize("config,fragment", [
    ({"rope_theta": 10 ** 400}, "rope_theta=<an integer of 401 digits> is invalid"),  # float() would overflow
    ({"rms_norm_eps": 10 ** 330}, "rms_norm_eps=<an integer of 331 digits> is invalid"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4,
                       "original_max_position_embeddings": 16}}, "rope_scaling.factor='8' is invalid"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 10 ** 20}},
     "rope_scaling.original_max_position_embeddings=100000000000000000000 is invalid"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": "1e4"}}, "rope_parameters.rope_theta='1e4'"),
])
def test_config_json_values_of_the_wrong_type_are_one_line(tmp_path, capsys, config, fragment):
    folder = _folder(tmp_path / "hf", "llama", config=config)
    code, err = _dry_run(folder, "llama", capsys)
    assert_one_line(code, err, f"train.init_from {folder}", fragment)
