"""Training with the Triton kernels (attention, AdamW, RMSNorm) follows the torch fallback, step for step.

The kernels run in Triton's CPU interpreter, in this process: conftest sets
TRITON_INTERPRET=1 before anything imports Triton (a subprocess per run only
added ~3 s of imports). The kernels' own tests check their arithmetic
(test_attention_kernel.py: head dims, GQA groups and masks against float64;
test_adam_kernel.py: 10 steps against torch's AdamW); these runs check their
wiring into training: a one-layer model (every layer calls the kernels the
same way) at two microbatches a step (m > 1), for five steps.

Each step's loss and gradient norm are compared. fp32: the flash-attention
kernel sums the softmax in another order than torch SDPA (online, block by
block); measured at this shape, both agree to <= 2.2e-7 relative over 10
steps (often bit for bit), and 1e-5 is the DESIGN's bound. The gradient norm
is the sharp check: it sees a wrong gradient in the step that computes it,
where the loss only drifts through Adam's sign-like updates. Measured with a
kernel broken on purpose, the norm leaves 1e-5 within three steps (dQ reading
the wrong k/v head under GQA: 3.9e-5 at step 1; AdamW without weight decay:
1.9e-5 and 2.6e-5 at step 3), while the loss needs four steps for the first
and stays under 1e-5 for all of 10 steps with the second.
"""
from __future__ import annotations

import math

import pytest

from megazero.train.run import run
from tests.hostile import assert_one_line, call, pretrain_main
from tests.runs import ROOT, read_metrics, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 5
LLAMA = {"model.arch": "llama", "model.kv_heads": 2, "model.ffn_hidden": 128}  # 4 query heads over 2 k/v heads
# seq 24: not a multiple of the interpreter's blocks (masked edges); two microbatches of 2 (m > 1: gradients
# accumulated over microbatches, batch strides inside the kernels)
SHAPE = {"model.layers": 1, "model.seq_len": 24, "train.global_batch": 4, "train.micro_batch": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One corpus and tokenizer cache for both architectures (the tokenizer is trained once)."""
    base = tmp_path_factory.mktemp("kernels")
    return write_corpus(base / "text"), base / "cache"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_kernels_follow_the_torch_fallback(corpus, tmp_path, monkeypatch, arch):
    """GPT-2 (q, k, v strided views of one projection) and Llama (separate q, k, v; grouped-query attention,
    the kernel reading each k/v head for two query heads). The kernels' launches are counted: the two runs
    often agree bit for bit, so a run that silently fell back to torch would pass the comparison alone."""
    import megazero.kernels.adam
    import megazero.kernels.flash_attention

    text, cache = corpus
    extra = {**SHAPE, **(LLAMA if arch == "llama" else {})}
    launches = {"attention": 0, "adam": 0, "norm": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            launches[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    flash = megazero.kernels.flash_attention.FlashAttention
    monkeypatch.setattr(flash, "forward", staticmethod(counted("attention", flash.forward)))
    adam = megazero.kernels.adam
    monkeypatch.setattr(adam, "adamw_step_triton", counted("adam", adam.adamw_step_triton))
    import megazero.models.gpt2 as gpt2
    import megazero.models.llama as llama

    monkeypatch.setattr(llama, "rms_norm_triton", counted("norm", llama.rms_norm_triton))
    monkeypatch.setattr(gpt2, "layer_norm_triton", counted("norm", gpt2.layer_norm_triton))
    norm = "triton" if arch == "llama" else "torch"
    for name, impl in (("torch", "torch"), ("triton", "triton")):
        run(TINY, small_overrides(text, cache, tmp_path / name, steps=STEPS, **extra)
            + [f"kernels.attention={impl}", f"kernels.adam={impl}",
               f"kernels.norm={norm if impl == 'triton' else impl}"])
        if name == "torch":
            assert launches == {"attention": 0, "adam": 0, "norm": 0}, launches
    m = SHAPE["train.global_batch"] // SHAPE["train.micro_batch"]
    assert launches["attention"] == STEPS * m * SHAPE["model.layers"] and launches["adam"] >= STEPS, launches
    # Llama's RMSNorms (two a layer and the final one) run the norm kernel; GPT-2's LayerNorm kernel is checked
    # by tests/kernels/test_norm_kernels.py (each interpreted norm kernel doubles a run's time here)
    assert launches["norm"] == (STEPS * m * (2 * SHAPE["model.layers"] + 1) if arch == "llama" else 0), launches
    ref, got = read_metrics(tmp_path / "torch"), read_metrics(tmp_path / "triton")
    assert len(ref) == len(got) == STEPS
    for a, b in zip(ref, got):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"],
                                                                              b["grad_norm"])
    assert got[-1]["loss"] < got[0]["loss"]


def _refused(capsys, *sets: str) -> str:
    """pretrain.py's main, in this process (its error path is the CLI's: one line, exit 2, no traceback)."""
    argv = ["--config", TINY, "--set", "parallel.tp=1", "--set", "parallel.pp=1"]
    for s in sets:
        argv += ["--set", s]
    code, _, err = call(pretrain_main, argv, capsys)
    return assert_one_line(code, err)


def test_triton_where_it_cannot_run_is_a_config_error(monkeypatch, capsys):
    """Without CUDA and without the interpreter. Whether Triton can run is read from TRITON_INTERPRET when the
    config is resolved, so this process can say 0 (the kernels imported under 1 are not called)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "kernels.attention" in _refused(capsys, "kernels.attention=triton")
    assert "kernels.adam" in _refused(capsys, "kernels.adam=triton")


def test_a_head_dim_without_a_kernel_is_a_config_error(capsys):
    """hidden 768 / 3 heads = 256: runnable (TRITON_INTERPRET=1) but no kernel for that head dim."""
    assert "kernels.attention='triton' supports head dims up to 128 (model.hidden / model.heads), this model's " \
           "is 256" in _refused(capsys, "kernels.attention=triton", "model.hidden=768", "model.heads=3")
