"""Mixture-of-experts parameter counts: the closed form (models.build.count_parameters) against the built model,
total and active; the FLOPs formula on active parameters (megazero.costs); and the published totals, read from
the --dry-run of the shipped configs."""
from __future__ import annotations

import math

import pytest

from megazero.config.schema import ModelConfig, MoeConfig
from megazero.costs import model_flops_per_token
from megazero.models.build import build_gpt, count_parameters
from tests.runs import ROOT

SHAPES = [
    MoeConfig(experts=4, top_k=2),
    MoeConfig(experts=6, top_k=3, expert_hidden=40, shared_experts=2, dense_layers=1, every=2, router="sigmoid"),
    MoeConfig(experts=8, top_k=8, expert_hidden=24, shared_experts=1, dense_layers=2),
]


def _cfg(moe: MoeConfig, **extra) -> ModelConfig:
    values = dict(arch="llama", layers=5, hidden=64, heads=4, kv_heads=2, seq_len=16, vocab_size=300, ffn_hidden=96,
                  moe=moe)
    values.update(extra)
    return ModelConfig(**values)


@pytest.mark.parametrize("moe", SHAPES)
@pytest.mark.parametrize("extra", [{}, {"bias": True}, {"tie_embeddings": True}])
def test_count_parameters_is_the_built_models(moe, extra):
    """Total: every parameter the model builds. Active: a token's, the routed experts' stacked weights counted
    top_k / E of the way (k of the E experts), everything else whole."""
    cfg = _cfg(moe, **extra)
    model = build_gpt(cfg, seed=0, materialise=False)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert experts and count_parameters(cfg) == total
    assert count_parameters(cfg, active=True) == total - experts + experts * moe.top_k // moe.experts


def test_dense_counts_are_unchanged():
    dense = _cfg(MoeConfig())
    model = build_gpt(dense, seed=0, materialise=False)
    assert count_parameters(dense) == count_parameters(dense, active=True) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("moe", SHAPES)
def test_flops_count_the_active_matmul_parameters(moe):
    """6 FLOPs per active matmul parameter per token (the active count less the input embedding and the norms:
    routers, k routed and the shared experts, attention, the head) plus the attention products, 12·L·s·h."""
    cfg = _cfg(moe)
    h, L = cfg.hidden, cfg.layers
    norms = (2 * L + 1) * h
    matmul = count_parameters(cfg, active=True) - cfg.padded_vocab * h - norms
    assert model_flops_per_token(cfg) == 6 * matmul + 12 * L * cfg.seq_len * h


def _by_hand(layers, h, heads, kv, d, experts, k, f, vocab, qk_norm) -> tuple[int, int]:
    """(total, active) from a model card's shapes: per layer two norms, q/o (h x heads*d), k/v (h x kv*d), Qwen3's
    q/k norms (d each), a router (E x h) and E SwiGLU experts of 3 x f x h (k active); two untied vocab x h
    embeddings and a final norm."""
    attention = 2 * h + 2 * h * heads * d + 2 * h * kv * d + experts * h + (2 * d if qk_norm else 0)
    ends = 2 * vocab * h + h
    return ends + layers * (attention + experts * 3 * f * h), ends + layers * (attention + k * 3 * f * h)


@pytest.mark.parametrize("name, total, active, shape", [
    ("mixtral-8x7b", 46.7, 12.9, (32, 4096, 32, 8, 128, 8, 2, 14336, 32000, False)),
    ("qwen3-30b-a3b", 30.5, 3.3, (48, 2048, 32, 4, 128, 128, 8, 768, 151936, True)),
])
def test_dry_run_counts_the_published_totals(name, total, active, shape, capsys):
    """Mixtral-8x7B: 46.7B parameters, 12.9B active (Jiang et al. 2024); Qwen3-30B-A3B: 30.5B, 3.3B (its model
    card), from the --dry-run at each config's own layout: exactly the count by hand from the published shapes,
    and the published figure to its 0.1B. Active counts every embedding and router: Qwen3's 3.353B is published
    as 3.3B (cut to 0.1B, or without its 12.6M router weights: 3.340B), Mixtral's 12.88B as 12.9B."""
    from megazero.train.run import dry_run

    plan = dry_run(str(ROOT / "configs" / f"{name}.yaml"), [])
    assert (plan.total_params, plan.active_params) == _by_hand(*shape)
    assert round(plan.total_params / 1e9, 1) == total
    got = plan.active_params / 1e9
    assert active in (round(got, 1), math.floor(got * 10) / 10), got
    out = capsys.readouterr().out
    assert f"({plan.total_params / 1e9:.2f}B)" in out and f"({plan.active_params / 1e9:.2f}B) per token" in out
