"""Hugging Face mixtures of experts: MixtralForCausalLM and Qwen3MoeForCausalLM in (train.init_from) and out
(megazero.export), at tp 2 (sequence parallel) x ep 2 x pp 2.

transformers builds a random tiny Mixtral (every layer a mixture of 4 experts, top 2, renormalised) and a
Qwen3-MoE (q/k norms: model.qk_norm; a dense first layer through mlp_only_layers; top 2 not renormalised) and
saves them here (nothing is downloaded). Their matrices are drawn with std 0.2 and their norms moved off 1, so
the first loss depends on every mapping (at std 0.02 every model's loss is log V to 1e-5). One 8-rank spawn
imports each at tp2 x ep2 x pp2 x dp2 (ep inside dp) with ZeRO-1, trains 3 steps and saves; the single-process
run of the same import is the reference, and megazero.export writes the ep-2 checkpoint as a folder that
transformers loads.

Tolerances: the first loss is the imported weights' loss on the first global batch, computed by the same fp32
operations up to the order of sums (tp shards, microbatches, dp ranks), so 1e-5 relative against transformers
(the DESIGN's parity bound); the loss curve against one process likewise 1e-5, the gradient norms 1e-4
(tests/models/test_llama.py's bound); the exported model's logits through a save and a load of the same fp32
values, 1e-4 as tests/interop/test_export.py; the routers' top-k choices exactly.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megazero.checkpoint.store import read_model_state  # noqa: E402
from megazero.config.load import load_config  # noqa: E402
from megazero.config.resolve import resolve_arch  # noqa: E402
from megazero.data import build_data  # noqa: E402
from megazero.errors import UserError  # noqa: E402
from megazero.interop.export import export, to_hf_state_dict, write_hf_folder  # noqa: E402
from megazero.interop.export import main as export_main  # noqa: E402
from megazero.interop.hf_import import load_into, open_hf_model  # noqa: E402
from megazero.train.run import run  # noqa: E402
from megazero.models.build import build_gpt, count_parameters  # noqa: E402
from megazero.models.moe import route  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.hostile import assert_one_line, call, pretrain_main  # noqa: E402
from tests.interop.test_hf_roundtrip import _tokenizer_json  # noqa: E402
from tests.interop.moe_runs import (  # noqa: E402
    CONFIG,
    HIDDEN,
    LAYERS,
    LAYOUT,
    ONE,
    SEQ,
    STEPS,
    VOCAB,
    keys,
    overrides,
    train_layout,
)
from tests.runs import read_metrics, write_corpus  # noqa: E402

HF_COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=VOCAB, tie_word_embeddings=False, num_experts_per_tok=2)
HF_CONFIGS = {  # tests/interop/moe_runs.py's KEYS, as transformers' configs
    "mixtral": lambda **kw: transformers.MixtralConfig(**{**HF_COMMON, "intermediate_size": 32, "num_local_experts": 4,
                                                          "rms_norm_eps": 1e-5, **kw}),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(**{**HF_COMMON, "head_dim": 16, "intermediate_size": 96,
                                                             "moe_intermediate_size": 32, "num_experts": 4,
                                                             "norm_topk_prob": False, "mlp_only_layers": [0],
                                                             "rms_norm_eps": 1e-6, **kw}),
}
MODELS = list(HF_CONFIGS)
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _sets(name: str, **extra) -> list[str]:
    return [f"{k}={v}" for k, v in {**keys(name), "train.precision": "fp32", **extra}.items()]


def _randomise(model, seed: int = 0) -> None:
    """Matrices N(0, 0.2) (a router transformers leaves at zero would tie every choice), norms 1 + N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _save_hf(name: str, path, **config) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name](**config), dtype=torch.float32).eval()
    _randomise(model)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_moe")
    write_corpus(base / "text")
    _tokenizer_json(base / "text", base / "tokenizer.json")
    for name in MODELS:
        _save_hf(name, base / f"hf_{name}")
        run(CONFIG, overrides(base, name, ONE, f"{name}_one"))  # the reference, in this process
    run_ranks(8, train_layout, base)
    return base


def _hf(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _first_batch(base, name) -> torch.Tensor:
    cfg = load_config(CONFIG, overrides(base, name, LAYOUT, name))
    data = build_data(cfg.data, VOCAB, SEQ, cfg.train.seed, is_builder=False, barrier=lambda: None)
    return torch.cat(data.train_microbatches(0, 0, 1, cfg.train.micro_batch, cfg.train.global_batch))


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_at_tp2_ep2_pp2_trains_as_one_process_and_exports(runs, name, tmp_path):
    base = runs
    batch = _first_batch(base, name)
    with torch.no_grad():
        logits = _hf(base / f"hf_{name}")(input_ids=batch[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item()
    got = [r for r in read_metrics(base / name) if "loss" in r]
    one = [r for r in read_metrics(base / f"{name}_one") if "loss" in r]
    print(f"{name}: megazero step-1 loss {got[0]['loss']:.7f}, transformers {want:.7f}")
    assert len(got) == len(one) == STEPS
    assert abs(got[0]["loss"] - want) <= 1e-5 * want, (got[0]["loss"], want)
    for step, (a, b) in enumerate(zip(one, got), 1):  # q/k norms' and experts' gradients summed as they must be
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (step, a, b)

    ckpt = base / name / "checkpoints" / f"step_{STEPS:08d}"
    out = export(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[name]] and config["model_type"] == name
    cfg = load_config(CONFIG, overrides(base, name, LAYOUT, name))
    resolve_arch(cfg.model)
    ours = build_gpt(cfg.model, 0).eval()
    state = read_model_state(ckpt)  # the ep-2 checkpoint holds every expert, whole
    assert state["layers.3.mlp.experts.gate"].shape == (4, 32, HIDDEN)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(state[n])
        ids = batch[:2, :-1]
        exported = _hf(out)
        assert type(exported).__name__ == CLASSES[name]
        got_logits = exported(input_ids=ids).logits
        mine = ours(ids)[..., :VOCAB]
        imported = _hf(base / f"hf_{name}")(input_ids=ids).logits
    print(f"{name}: export logits max diff {(got_logits - mine).abs().max().item():.2e}")
    assert (got_logits - mine).abs().max().item() <= 1e-4
    assert (got_logits - imported).abs().max().item() > 1e-3  # the trained weights, not the import's


def _imported(folder, sets):
    cfg = load_config(None, sets)
    resolve_arch(cfg.model)
    weights = open_hf_model(folder, cfg.model)
    return build_gpt(cfg.model, lambda n, shape: weights.value(n)).eval(), cfg


@pytest.mark.parametrize("name", list(MODELS))
def test_router_choices_equal_transformers(name, tmp_path):
    """Each mixture-of-experts layer's top-k experts per token, megazero's (``models.moe.route`` on the hidden
    states its MLP receives) against transformers' router's, exactly; the inputs agree to 1e-5 and so do the
    logits (the same fp32 operations)."""
    hf = _save_hf(name, tmp_path)
    ours, cfg = _imported(tmp_path, _sets(name))
    sparse = [i for i in range(LAYERS) if cfg.model.moe.is_moe_layer(i)]
    assert sparse == ([0, 1, 2, 3] if name == "mixtral" else [1, 2, 3])
    theirs, mine = {}, {}
    for i in sparse:
        hf.model.layers[i].mlp.gate.register_forward_hook(
            lambda mod, args, out, i=i: theirs.__setitem__(i, (args[0].reshape(-1, HIDDEN), out[2])))
        ours.layers[str(i)].mlp.register_forward_hook(
            lambda mod, args, out, i=i: mine.__setitem__(i, args[0].reshape(-1, HIDDEN)))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)[..., :VOCAB]
    assert (want - got).abs().max().item() <= 1e-5 * want.abs().max().item()
    for i in sparse:
        x_hf, idx_hf = theirs[i]
        x = mine[i]
        assert (x - x_hf).abs().max().item() <= 1e-5 * x_hf.abs().max().item()
        mlp = ours.layers[str(i)].mlp
        idx, _, _ = route(torch.nn.functional.linear(x, mlp.router.weight).float(), cfg.model.moe,
                          mlp.router.expert_bias)
        assert torch.equal(idx.sort(-1).values, idx_hf.sort(-1).values), i
        assert len(set(idx.reshape(-1).tolist())) == 4  # every expert chosen somewhere: not a degenerate router


def test_a_folder_of_stacked_experts_imports(tmp_path):
    """transformers 5's own tensor names (its modules': ``mlp.experts.gate_up_proj`` (E, 2f, h) and ``down_proj``
    stacks, Mixtral's router as ``mlp.gate``), which from_pretrained reads as well as the per-expert ones
    save_pretrained writes, give the same model."""
    hf = _save_hf("mixtral", tmp_path / "saved")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(tmp_path / "saved" / "config.json", stacked / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids).logits
        assert (_hf(stacked)(ids).logits - want).abs().max().item() <= 1e-5  # transformers reads it too
        got = _imported(stacked, _sets("mixtral"))[0](ids)[..., :VOCAB]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_qwen3_dense_in_and_out(tmp_path):
    """model.qk_norm without experts is Qwen3ForCausalLM, both ways (load_into fills a tp=1 model)."""
    config = transformers.Qwen3Config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=VOCAB,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path / "in")
    sets = ["model.arch=llama", "model.layers=2", f"model.hidden={HIDDEN}", "model.heads=4", "model.kv_heads=2",
            "model.ffn_hidden=96", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", "model.norm_eps=1.0e-6",
            "model.qk_norm=true"]
    cfg = load_config(None, sets)
    resolve_arch(cfg.model)
    ours = build_gpt(cfg.model, 0).eval()
    assert count_parameters(cfg.model) == sum(p.numel() for p in ours.parameters())  # the q/k norms counted
    load_into(ours, open_hf_model(tmp_path / "in", cfg.model))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)[..., :VOCAB]
    assert (want - got).abs().max().item() <= 1e-5 * want.abs().max().item()
    config, state = to_hf_state_dict({n: p.detach() for n, p in ours.named_parameters()}, cfg.model)
    write_hf_folder(tmp_path / "out", config, state)
    back = _hf(tmp_path / "out")
    assert type(back).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert (back(ids).logits - got).abs().max().item() <= 1e-4
    with pytest.raises(UserError, match="model.qk_norm is true there and false here"):
        open_hf_model(tmp_path / "in", load_config(None, sets[:-1]).model)


# ----- what is refused, in one line ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved Mixtral and Qwen3-MoE (config.json and weights), copied and edited by the cases below."""
    base = tmp_path_factory.mktemp("moe_folders")
    for name in MODELS:
        _save_hf(name, base / name)
    return base


def _edited(folders, name, tmp_path, **keys):
    path = tmp_path / f"{name}_edited"
    shutil.copytree(folders / name, path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(keys)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _one_line(excinfo, *fragments: str) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def test_expert_count_and_deepseek_refused_by_pretrain(folders, tmp_path, capsys):
    """pretrain.py refuses, before any process group, in one line and exit 2: a config of 8 experts over a
    folder of 4; q/k norms on GPT-2; a DeepSeek folder (multi-head latent attention)."""
    tokenizer = tmp_path / "tokenizer.json"
    _tokenizer_json(write_corpus(tmp_path / "text"), tokenizer)
    base = ["--config", CONFIG, "--dry-run", "--set", "parallel.world_size=1", "--set", "parallel.tp=1",
            "--set", "parallel.pp=1", "--set", "parallel.sequence_parallel=false", "--set", "zero.stage=0",
            "--set", f"data.tokenizer={tokenizer}"]
    argv = list(base)
    for k, v in keys("mixtral").items():
        argv += ["--set", f"{k}={v}"]
    code, _, err = call(pretrain_main, argv + ["--set", f"train.init_from={folders / 'mixtral'}",
                                               "--set", "model.moe.experts=8"], capsys)
    assert_one_line(code, err, "model.moe.experts is 4 there and 8 here")
    code, _, err = call(pretrain_main, base + ["--set", "model.qk_norm=true"], capsys)  # tiny.yaml's GPT-2
    assert_one_line(code, err, "model.qk_norm", "llama's q and k")
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"model_type": "deepseek_v3",
                                                      "architectures": ["DeepseekV3ForCausalLM"]}))
    code, _, err = call(pretrain_main, argv + ["--set", f"train.init_from={deepseek}"], capsys)
    assert_one_line(code, err, "deepseek_v3", "multi-head latent attention is not supported")


def test_config_json_that_disagrees_with_its_weights(folders, tmp_path):
    """config.json's expert count against the experts the weights hold (fewer or more: the router's shape says
    it first); an expert's tensor missing; two counts that disagree."""
    for count in (3, 5):
        m = load_config(None, _sets("mixtral", **{"model.moe.experts": count})).model
        with pytest.raises(UserError) as e:
            open_hf_model(_edited(folders, "mixtral", tmp_path / str(count), num_local_experts=count), m)
        _one_line(e, "tensor 'model.layers.0.block_sparse_moe.gate.weight'", "shape (4, 64)",
                  f"config.json gives ({count}, 64) ({count} experts)")
    path = _edited(folders, "mixtral", tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.1.w3.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(UserError) as e:
        open_hf_model(path, load_config(None, _sets("mixtral")).model)
    _one_line(e, "no tensor 'model.layers.2.block_sparse_moe.experts.1.w3.weight' (megazero's "
                 "layers.2.mlp.experts.1.up) (config.json gives 4 experts)", "MixtralForCausalLM")
    with pytest.raises(UserError) as e:
        open_hf_model(_edited(folders, "qwen3_moe", tmp_path / "c", num_experts=4, num_local_experts=6),
                      load_config(None, _sets("qwen3_moe")).model)
    _one_line(e, "num_local_experts=6 and num_experts=4 disagree")


@pytest.mark.parametrize("edits, sets, fragments", [
    ({"norm_topk_prob": True}, {}, ["model.moe.norm_topk_prob is true there and false here"]),
    ({"moe_intermediate_size": 16}, {}, ["model.moe.expert_hidden is 16 there and 32 here"]),
    ({"num_experts_per_tok": 3}, {}, ["model.moe.top_k is 3 there and 2 here"]),
    ({"mlp_only_layers": [0, 1]}, {}, ["model.moe.dense_layers is 2 there and 1 here"]),
    ({"mlp_only_layers": [2]}, {}, ["mlp_only_layers", "[0, 1, 3]", "model.moe.dense_layers"]),
    ({"mlp_only_layers": "0"}, {}, ["mlp_only_layers='0' is invalid"]),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, {"model.moe.top_k": 1},
     ["num_experts_per_tok=1 with renormalised gates", "gate 1"]),
    ({"use_sliding_window": True, "sliding_window": 16}, {}, ["model.seq_len is at most 16 there (sliding_window"]),
    ({"head_dim": 32}, {}, ["model.head_dim is 32 there and 16 here"]),
])
def test_qwen3_moe_keys_are_checked_one_by_one(folders, tmp_path, edits, sets, fragments):
    with pytest.raises(UserError) as e:
        open_hf_model(_edited(folders, "qwen3_moe", tmp_path, **edits),
                      load_config(None, _sets("qwen3_moe", **sets)).model)
    _one_line(e, *fragments)


def test_the_same_layers_placed_by_other_keys_are_no_difference(folders, tmp_path):
    """Layers 1 and 3 as Qwen3's decoder_sparse_step=2 and as megazero's dense_layers=1, every=2: the configs
    agree, so what is named is the weights' layer 2 (saved as a mixture of experts), not a key."""
    path = _edited(folders, "qwen3_moe", tmp_path, mlp_only_layers=[], decoder_sparse_step=2)
    with pytest.raises(UserError) as e:
        open_hf_model(path, load_config(None, _sets("qwen3_moe", **{"model.moe.every": 2})).model)
    _one_line(e, "no tensor 'model.layers.2.mlp.gate_proj.weight'")


@pytest.mark.parametrize("sets, fragments", [
    ({"model.moe.shared_experts": 1}, ["model.moe.shared_experts=1", "valid: 0"]),
    ({"model.moe.router": "sigmoid"}, ["model.moe.router=sigmoid", "valid: softmax"]),
    ({"model.moe.routed_scaling_factor": 2.5}, ["model.moe.routed_scaling_factor=2.5"]),
    ({"model.moe.dense_layers": 1}, ["model.moe.dense_layers=1", "model.qk_norm=true"]),
    ({"model.moe.every": 2}, ["model.moe.every=2"]),
    ({"model.moe.norm_topk_prob": "false"}, ["model.moe.norm_topk_prob=false", "Mixtral renormalises"]),
    ({"model.moe.top_k": 1}, ["model.moe.top_k=1"]),
    ({"model.bias": "true"}, ["model.bias=true", "MixtralForCausalLM"]),
    ({"model.bias": "true", "model.qk_norm": "true", "model.moe.dense_layers": 1}, ["model.bias=true",
                                                                                    "Qwen3MoeForCausalLM"]),
])
def test_an_export_no_hf_class_holds_is_refused(sets, fragments):
    """What neither Mixtral nor Qwen3-MoE computes is refused before any tensor is looked at."""
    cfg = load_config(None, _sets("mixtral", **sets))
    with pytest.raises(UserError) as e:
        to_hf_state_dict({}, cfg.model, where="checkpoint c")
    _one_line(e, "checkpoint c: ", *fragments)


def test_export_refuses_before_reading(runs, tmp_path, capsys):
    """python -m megazero.export of a checkpoint whose meta.json says dense_layers=1 without q/k norms: one line,
    exit 2, nothing written."""
    ckpt = tmp_path / "ckpt" / f"step_{STEPS:08d}"
    shutil.copytree(runs / "mixtral" / "checkpoints" / f"step_{STEPS:08d}", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["model"]["moe"]["dense_layers"] = 1
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code, _, err = call(export_main, [str(ckpt), str(tmp_path / "out")], capsys)
    assert_one_line(code, err, "model.moe.dense_layers=1 cannot be written")
    assert not (tmp_path / "out").exists()
