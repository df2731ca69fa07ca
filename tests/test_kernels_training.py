"""Training with the Triton kernels (attention and AdamW) follows the torch fallback, step for step.

The kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), in a
subprocess so the interpreter mode is set before Triton is imported. fp32:
the flash-attention kernel sums the softmax in another order than torch SDPA
(online, block by block), ~1e-7 relative per step; after 10 AdamW steps the
losses agree to 1e-5 relative.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.runs import ROOT, read_metrics, small_overrides, write_corpus
from tests.test_config import assert_one_line_error, cli

STEPS = 10
LLAMA = {"model.arch": "llama", "model.kv_heads": 2, "model.ffn_hidden": 128}  # 4 query heads over 2 k/v heads


def _run(overrides, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TRITON_INTERPRET")}
    env.update(env_extra)
    args = [sys.executable, str(ROOT / "pretrain.py"), "--config", str(ROOT / "configs" / "tiny.yaml")]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_kernels_follow_the_torch_fallback(tmp_path, arch):
    """GPT-2 (q, k, v strided views of one projection) and Llama (separate q, k, v; grouped-query attention,
    the kernel reading each k/v head for two query heads)."""
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    extra = {"model.seq_len": 24, **(LLAMA if arch == "llama" else {})}
    base = small_overrides(text, cache, tmp_path / "torch", steps=STEPS, **extra)
    _run(base + ["kernels.attention=torch", "kernels.adam=torch"], {})
    fused = small_overrides(text, cache, tmp_path / "triton", steps=STEPS, **extra)
    _run(fused + ["kernels.attention=triton", "kernels.adam=triton"], {"TRITON_INTERPRET": "1"})
    ref, got = read_metrics(tmp_path / "torch"), read_metrics(tmp_path / "triton")
    assert len(ref) == len(got) == STEPS
    for a, b in zip(ref, got):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    assert got[-1]["loss"] < got[0]["loss"]


def test_triton_where_it_cannot_run_is_a_config_error():
    env = {"TRITON_INTERPRET": "0"}
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "kernels.attention=triton",
                               "--set", "parallel.tp=1", "--set", "parallel.pp=1"], env), "kernels.attention")
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "kernels.adam=triton",
                               "--set", "parallel.tp=1", "--set", "parallel.pp=1"], env), "kernels.adam")


def test_a_head_dim_without_a_kernel_is_a_config_error():
    """hidden 768 / 3 heads = 256: runnable (TRITON_INTERPRET=1) but no kernel for that head dim."""
    assert_one_line_error(cli(["--config", "configs/tiny.yaml", "--set", "kernels.attention=triton",
                               "--set", "model.hidden=768", "--set", "model.heads=3",
                               "--set", "parallel.tp=1", "--set", "parallel.pp=1"], {"TRITON_INTERPRET": "1"}),
                          "kernels.attention='triton' supports head dims up to 128 (model.hidden / "
                          "model.heads), this model's is 256")
