"""Llama (model.arch: llama) against its single-process run wherever its own parts (grouped-query k/v replicated
over tp, the untied head, rotary positions) meet a parallelism: tp 2 and 4 with and without sequence parallelism,
each schedule at pp 2 with a ZeRO stage, tp 2 x pp 2. The schedules at pp 4 are GPT's
(tests/parallel/test_pipeline.py, every schedule): a schedule moves a stage's activations and gradients whatever
the model computes, and Llama's stages run under each schedule here at pp 2.

A tiny Llama with grouped-query attention (8 query heads, 2 k/v heads: kv_heads < tp at tp 4, so each k/v head
is replicated on two ranks) and an untied head trains 5 steps at each layout; its loss curve must equal the
single-process curve to 1e-5 relative (fp32 on CPU: only the order of sums over tp shards, microbatches and dp
ranks differs, ~1e-7 in practice; 1e-5 is the DESIGN's bound). Its gradient norms, which see a wrong gradient
in the step that computes it, must agree to 1e-4 relative, test_zero.py's bound: the norm is a sum of squares
over ~10^5 fp32 entries whose order follows the shards, and differs by up to 1e-5 in practice. A replicated
k/v head whose gradient were not summed over its ranks (measured, with the sum removed) moves the gradient
norm by 1.6% at step 1 and the loss by 3e-5 to 9e-5 at step 2 and ~3e-4 from step 3 on, so 5 steps separate
right from wrong as 10 did. The tp 4 runs cost most (four ranks taking turns on two cores for every
collective): the one at m = 16 is also the one that stops and resumes, not a third run.
"""
from __future__ import annotations

import json
import shutil

import pytest

from megazero.config.load import load_config
from megazero.costs import flops_per_token, model_flops_per_token
from megazero.plan.activations import activation_bytes_per_layer
from megazero.train.run import run
from megazero.models.build import count_parameters
from tests.dist import run_ranks, start_ranks
from tests.hostile import assert_one_line, call, pretrain_main
from tests.runs import ROOT, read_metrics, small_overrides, write_corpus

CONFIG = str(ROOT / "configs" / "tiny-llama.yaml")
STEPS = 5
STOP = 3  # tp 4 stops here, saves, and resumes
LLAMA = {"model.arch": "llama", "model.layers": 4, "model.heads": 8, "model.kv_heads": 2, "model.ffn_hidden": 96,
         "model.tie_embeddings": "false", "model.rope_theta": 500000.0,
         # Llama 3.1's scaled frequencies, from an original context of 16 (< seq 32: they matter)
         "model.rope_scaling": "llama3", "model.rope_original_positions": 16}
SCHEDULES = {"gpipe": ["parallel.schedule=gpipe"], "1f1b": ["parallel.schedule=1f1b"],
             "interleaved": ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]}

# (only the checkpoints of one, tp4_m16, tp2_pp2_sp and tp4_sp_z3 are read: the others end without one)
NO_SAVE = ["train.save_at_end=false"]
TWO = [("tp2", ["parallel.tp=2"] + NO_SAVE), ("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true"] + NO_SAVE)]
# pp 2 runs at dp 2, each with a ZeRO stage: stages 1-3 with dp > 1 (stage 0's dp 2 is the tp 2 runs'). Stages
# 1-2 with 20 KB buckets: q, k, v, gate, up and the head each fill buckets of their own, whose post-step
# gathers a forward must wait for although their modules are never called (column_parallel_linears)
M16 = ["train.global_batch=32"]  # 16 microbatches of 2: per-microbatch replica sums and buckets at m >= 16
FOUR = [("tp4_sp_z3", ["parallel.tp=4", "parallel.sequence_parallel=true", "zero.stage=3"])] + \
       [(f"pp2_{s}_z{z}", SCHEDULES[s] + ["parallel.pp=2", f"zero.stage={z}"] + NO_SAVE
         + (["zero.bucket_mb=0.02"] if z < 3 else [])) for s, z in zip(SCHEDULES, (1, 2, 3))]
# tp x pp with sequence parallelism at four ranks, interleaved (2 chunks a rank: the one tp x interleaved run;
# GPT's tp2 x pp2 x dp2 runs the other schedules in test_pipeline.py and test_zero.py); dp is covered above (tp 2
# and pp 2 at dp 2): an 8-rank spawn for Llama cost ~18 s here
TP_PP = [("tp2_pp2_sp", ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
          + SCHEDULES["interleaved"])]


def _overrides(text, cache, log_dir, extra=()):
    return small_overrides(text, cache, log_dir, steps=STEPS, **LLAMA) + list(extra)


def _train_layouts(rank, world, text, cache, base, layouts):
    for name, extra in layouts:
        run(CONFIG, _overrides(text, cache, base / name, extra))
    return True


def _four_ranks(rank, world, text, cache, base):
    """The gather check at dp 4 (_gathers_waited); tp 4 at m = 16 stops after STOP steps (replicated k/v heads
    saved) and resumes: the checkpoint holds each replicated piece once and a load hands every replica its whole
    piece back; then the other 4-rank layouts. One spawn: each process costs ~2 s of imports."""
    gathers = _gathers_waited(rank, world)
    over = _overrides(text, cache, base / "tp4_m16", ["parallel.tp=4"] + M16)
    run(CONFIG, over + [f"train.exit_after={STOP}"])
    run(CONFIG, over + ["train.resume=auto"])
    _train_layouts(rank, world, text, cache, base, TWO + FOUR + TP_PP)
    return gathers


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the runs' folder, each rank's _gathers_waited result)."""
    base = tmp_path_factory.mktemp("llama")
    text, cache = write_corpus(base / "text"), base / "cache"
    run(CONFIG, _overrides(text, cache, base / "one"))  # builds the data every other run reads
    # the other one-process references in a process of their own, beside the four ranks
    references = start_ranks(1, _train_layouts, text, cache, base, [("one_m16", M16)])
    gathers = run_ranks(4, _four_ranks, text, cache, base)  # the tp 2 layouts too, at dp 2 (one spawn fewer)
    references.results()
    return base, gathers


@pytest.fixture(scope="module")
def runs(trained):
    return trained[0]


REFERENCE = {"tp4_m16": "one_m16"}


@pytest.mark.parametrize("name", [n for n, _ in TWO + FOUR + TP_PP] + ["tp4_m16"])
def test_loss_curve_matches_one_process(runs, name):
    want = [r for r in read_metrics(runs / REFERENCE.get(name, "one")) if "loss" in r]
    got = [r for r in read_metrics(runs / name) if "loss" in r]
    assert len(want) == len(got) == STEPS, (len(want), len(got))
    for step, (a, b) in enumerate(zip(want, got), 1):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (name, step, a["grad_norm"],
                                                                              b["grad_norm"])


def test_the_runs_were_llama_with_replicated_kv_heads(runs):
    """The layouts ran the model under test: the stored config is llama, GQA, untied (not a silent GPT-2)."""
    metas = sorted((runs / "tp4_m16" / "checkpoints").glob("step_*/meta.json"))
    assert [p.parent.name for p in metas] == [f"step_{STOP:08d}", f"step_{STEPS:08d}"], metas
    meta = json.loads(metas[0].read_text())
    m = meta["config"]["model"]
    assert (m["arch"], m["kv_heads"], m["heads"], m["tie_embeddings"], m["bias"]) == ("llama", 2, 8, False, False)
    assert meta["config"]["parallel"]["tp"] == 4  # 2 k/v heads on 4 ranks: each replicated twice


def test_published_sizes_and_flops():
    """Llama 3 8B and 70B count their published parameters (8.03B, 70.6B); the FLOPs formula counts SwiGLU's
    three matrices and GQA's narrower k/v, and reduces to GPT-2's at full heads and two MLP matrices."""
    for name, params in (("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        m = cfg.model
        assert count_parameters(m) == params
        h, f, kv = m.hidden, m.ffn_hidden, m.kv_head_count * m.head_width
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
        want = 6 * (m.layers * per_layer + m.padded_vocab * h) + 12 * m.layers * m.seq_len * h
        assert model_flops_per_token(m) == want
        # 6 x (matmul params): the matmul params are the model's params less embeddings and norms
        matmul = count_parameters(m) - m.padded_vocab * h - (2 * m.layers + 1) * h
        assert want == 6 * matmul + 12 * m.layers * m.seq_len * h
    assert flops_per_token(2, 64, 256, 32, 512) == flops_per_token(2, 64, 256, 32, 512, kv_hidden=64, mlp_matrices=2)


def test_activation_count_of_a_llama_layer():
    """At kv_heads = heads and ffn = 4h without SwiGLU the count is Korthikanti's 34 sbh; a Llama 3 8B layer
    (ffn 3.5h, k/v a quarter of q) keeps 10 + 4 + 1 + 28 = 43 sbh, over tp 4 with sequence parallelism /4."""
    s, b, h, a = 8192, 1, 4096, 32
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a, 1, ffn=4 * h, kv_heads=a) == 34 * sbh
    assert activation_bytes_per_layer(s, b, h, a, 1, ffn=14336, kv_heads=8, swiglu=True) == 43 * sbh
    assert activation_bytes_per_layer(s, b, h, a, 4, True, ffn=14336, kv_heads=8, swiglu=True) == 43 * sbh // 4
    # 2 k/v heads over tp 8: each rank holds one (replicated on 4 ranks), not 2/8 of one
    one_head = activation_bytes_per_layer(s, b, h, a, 8, True, ffn=14336, kv_heads=2, swiglu=True)
    assert one_head == sbh * (10 + 4 + 4 * 2 / 32 * 8 / 2 + 28) // 8


@pytest.mark.parametrize("sets, key", [
    (["model.kv_heads=3"], "model.kv_heads"),  # does not divide 8 heads
    (["model.kv_heads=4", "model.arch=gpt2"], "model.kv_heads"),  # grouped-query attention is llama's
    (["model.arch=mistral"], "model.arch"),
    (["model.arch=gpt2", "model.kv_heads=8", "model.rope_scaling=llama3"], "model.rope_scaling"),
    (["model.rope_scaling=llama3", "model.rope_high_freq_factor=1"], "model.rope_high_freq_factor"),
    (["model.heads=12", "model.kv_heads=3", "parallel.tp=4"], "model.kv_heads"),  # 3 k/v heads on 4 ranks
    # 2 k/v heads on 6 ranks: each on 3, which must divide the head dim (here 32) for the checkpoint's split
    (["model.hidden=192", "model.heads=6", "model.kv_heads=2", "parallel.tp=6", "parallel.world_size=12",
      "model.ffn_hidden=516", "model.vocab_pad_multiple=768", "parallel.sequence_parallel=false"],
     "must divide the head dim 32"),
])
def test_bad_attention_shapes_are_one_line(sets, key, capsys):
    """kv_heads that do not divide heads (or tp, or its multiple), GQA on gpt2, an unknown arch: pretrain.py
    --dry-run says so in one line naming the key, exit 2."""
    argv = ["--config", CONFIG, "--dry-run", "--set", "model.heads=8", "--set", "parallel.world_size=16"]
    for s in sets:
        argv += ["--set", s]
    code, _, err = call(pretrain_main, argv, capsys)
    assert_one_line(code, err, key)


def _gathers_waited(rank, world):
    """ZeRO-1 at dp = world with small buckets: after each step the gatherer starts one all-gather per bucket, and a
    forward must wait for every bucket whose parameters it reads. Llama reads q, k, v, gate, up through their
    parent's forward (column_parallel_linears) and the untied head at the chunk's end."""
    import torch

    from megazero.config.schema import ModelConfig, ZeroConfig
    from megazero.config.resolve import resolve_arch
    from megazero.engine.build import make_zero
    from megazero.engine.step import train_step
    from megazero.models.build import build_gpt
    from megazero.parallel.topology import Grid
    from megazero.parallel.dims import ParallelDims
    from tests.runs import executor_for

    m = ModelConfig(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512,
                    seq_len=16)
    resolve_arch(m)
    model = build_gpt(m, 0)
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=world), "cpu")
    zero = make_zero([model], grid, ZeroConfig(stage=1, bucket_mb=0.02, reshard_after_forward=True), "fp32", 0.0)
    ids = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(rank))
    pending, buckets = [], len(zero.buckets)
    # after each step's forward (the executor's call of the model), before its backward
    model.register_forward_hook(lambda *_: pending.append(
        sorted(n for b in zero.buckets if zero.gatherer.work[b.index] is not None for n, _ in b.params)))
    executor, schedule = executor_for(model, grid, [ids])
    for _ in range(3):
        train_step(zero, executor, schedule, [ids], 1e-1, 0.0)
    return buckets, pending


def test_a_forward_waits_for_every_gathered_bucket_it_reads(trained):
    """At dp 4, in the training fixture's spawn (_four_ranks)."""
    for buckets, pending in trained[1]:
        assert buckets > 10  # q, k, v, gate, up, head... in buckets of their own
        assert pending == [[], [], []], pending


NEW_MODEL_KEYS = ("arch", "kv_heads", "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_factor",
                  "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")  # since Llama


def test_a_resume_keeps_the_architecture(runs, tmp_path):
    """A Llama checkpoint resumed as GPT-2 (or with other k/v heads) is one line naming the key, not a load
    that fails deep inside, or worse, succeeds."""
    from megazero.errors import UserError

    text, cache = runs / "text", runs / "cache"
    ckpt = runs / "one" / "checkpoints" / f"step_{STEPS:08d}"
    # a GPT-2 checkpoint of the same sizes written before model.arch existed: its stored model section lacks
    # arch, kv_heads and tie_embeddings, which then mean gpt2, every head, tied
    old = tmp_path / "old" / f"step_{STEPS:08d}"
    shutil.copytree(ckpt, old)
    meta = json.loads((old / "meta.json").read_text())
    for key in NEW_MODEL_KEYS:
        del meta["config"]["model"][key]
    (old / "meta.json").write_text(json.dumps(meta))
    for sets, where, message in (
            (["model.arch=gpt2", "model.kv_heads=8", "model.rope_scaling=none"], ckpt,
             "model.arch is 'llama' there and 'gpt2' here"),
            (["model.kv_heads=4"], ckpt, "model.kv_heads is 2 there and 4 here"),
            ([], old, "model.arch is 'gpt2' there and 'llama' here")):
        with pytest.raises(UserError, match=message):
            run(CONFIG, _overrides(text, cache, tmp_path / str(len(sets)), sets + [f"train.resume={where}",
                                                                                 "train.steps=11"]))
    # and an older GPT-2 checkpoint still resumes as GPT-2 (its absent keys mean what they meant)
    gpt2 = ["model.arch=gpt2", "model.kv_heads=8", "model.tie_embeddings=auto", "model.rope_scaling=none"]
    run(CONFIG, _overrides(text, cache, tmp_path / "gpt2", gpt2 + ["train.steps=2"]))
    meta_file = tmp_path / "gpt2" / "checkpoints" / "step_00000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    for key in NEW_MODEL_KEYS:
        del meta["config"]["model"][key]
    meta_file.write_text(json.dumps(meta))
    run(CONFIG, _overrides(text, cache, tmp_path / "gpt2", gpt2 + ["train.steps=3", "train.resume=auto"]))
    assert [r["step"] for r in read_metrics(tmp_path / "gpt2") if "loss" in r] == [1, 2, 3]


def test_checkpoints_hold_the_same_model_at_every_layout(runs):
    """Checkpoints are layout-free: tp 4's (k/v heads replicated on two ranks each, stored as their even tp
    split; the run resumed from such a checkpoint), tp 2 x pp 2's and ZeRO-3's hold the single-process run's
    tensors under the same names. Compared as a relative Frobenius distance: after steps of the same arithmetic
    in another order most entries agree to ~1e-9, but Adam turns the sign noise of a near-zero gradient into a
    full step of up to lr (1e-3) for a few entries (measured 1.3e-5 on one); a piece stored in another rank's
    place differs by the weights' own size, a relative distance of order 1."""
    from megazero.checkpoint.store import read_model_state

    for name in ("tp4_m16", "tp2_pp2_sp", "tp4_sp_z3"):
        want = read_model_state(runs / REFERENCE.get(name, "one") / "checkpoints" / f"step_{STEPS:08d}")
        got = read_model_state(runs / name / "checkpoints" / f"step_{STEPS:08d}")
        assert set(got) == set(want), name
        for key, value in want.items():
            assert got[key].shape == value.shape, (name, key)
            assert (got[key] - value).norm().item() <= 1e-3 * value.norm().item(), (name, key)
