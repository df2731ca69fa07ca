"""The plan counts only the attention a document mask leaves (data.document_tokens, the length L of a token's
document): the share of causal attention documents of L tokens leave in samples cut at random offsets, in the
plan's FLOPs, its per-stage FLOPs and the step-time model, where less attention also hides less of a ring's
transfers. Without the mask, or without an estimate, nothing changes. Exact arithmetic (relative 1e-12: float
sums in another order)."""
from __future__ import annotations

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.costs import attention_flops_per_token, expected_document_share, model_flops_per_token
from megazero.plan.cluster import load_cluster
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import step_time
from megazero.parallel.sequence import document_mask_share
from tests.runs import ROOT

SEQ = 8192


def _cfg(*sets: str):
    base = ["model.seq_len=8192", "parallel.tp=8", "parallel.pp=1", "parallel.cp=4", "train.global_batch=64",
            "train.micro_batch=1"]
    return resolve(load_config(ROOT / "configs" / "llama3-8b.yaml", base + list(sets)), 256, "cuda")


@pytest.mark.parametrize("length", [1, 5, 16, 37, 64, 100])
def test_the_expected_share_is_that_of_samples_cut_at_every_offset(length):
    """The formula is the mean of what document_mask_share measures on samples cut from a stream of documents
    of ``length`` tokens at each of the ``length`` offsets (every phase equally likely), shorter and longer
    than the sample."""
    import torch

    s, eos = 64, 0
    shares = []
    for offset in range(length):
        row = torch.ones(1, s, dtype=torch.long)
        row[0, (torch.arange(s) + offset + 1) % length == 0] = eos  # a document ends every length tokens
        shares.append(document_mask_share(row, eos))
    assert sum(shares) / length == pytest.approx(expected_document_share(length, s), rel=1e-12)
    assert expected_document_share(0, s) == 1.0


def test_the_plan_counts_the_attention_the_documents_leave():
    causal, masked, off = _cfg(), _cfg("data.document_mask=true", "data.document_tokens=1024"), \
        _cfg("data.document_tokens=1024")  # no mask: the estimate is not used
    share = expected_document_share(1024, SEQ)
    assert 0.1 < share < 0.2  # 1k-token documents in 8k samples keep a little over an eighth
    attention = attention_flops_per_token(causal.model)
    tokens = 64 * SEQ
    p_causal, p_masked, p_off = make_plan(causal), make_plan(masked), make_plan(off)
    assert p_causal.flops_per_step == pytest.approx(model_flops_per_token(causal.model) * tokens, rel=1e-12)
    assert p_masked.flops_per_step == pytest.approx(p_causal.flops_per_step - attention * (1 - share) * tokens,
                                                    rel=1e-12)
    assert p_off.flops_per_step == p_causal.flops_per_step
    world = p_masked.world_size
    assert p_masked.stages[0].flops == pytest.approx(p_masked.flops_per_step / world, rel=1e-12)
    # the step: less compute, and a ring at cp 4 hides less under the smaller blocks of attention
    cluster = load_cluster(ROOT / "configs" / "clusters" / "h100-80g.yaml")
    t_causal, t_masked = step_time(causal, cluster, plan=p_causal), step_time(masked, cluster, plan=p_masked)
    assert t_masked.compute < t_causal.compute
    assert t_masked.cp_comm > t_causal.cp_comm


def test_the_plan_counts_the_mask_the_attention_path_builds():
    """Llama-3-8B's shape at seq 8192, bf16, tp 8, micro_batch 1, pp 1 (one microbatch held). The dense path
    (kernels.attention=torch): SDPA keeps its bf16 copy of the (1, 1, s, s) mask in each layer not recomputed
    (32 layers) and builds the boolean one per call; with every layer recomputed only the one being recomputed
    keeps it. The blocks path keeps nothing: one block's bf16 and three boolean masks (256 x s) and the keys'
    k/v widened to the 4 query heads of this rank; in a cp 2 ring the same over the rank's s/2 keys. Triton
    builds none. Each figure named by --dry-run's notes."""
    from megazero.plan.table import format_plan

    def cfg(*sets: str):  # "blocks" runs on the CPU: planned for it, as the other paths are for CUDA
        base = ["model.seq_len=8192", "parallel.tp=8", "parallel.pp=1", "parallel.dp=auto", "train.global_batch=64",
                "train.micro_batch=1", *sets]
        device = "cpu" if any(x.endswith("=blocks") for x in sets) else "cuda"
        return resolve(load_config(ROOT / "configs" / "llama3-8b.yaml", base), 64, device)

    layers, heads, d = 32, 32 // 8, 128
    s2 = SEQ * SEQ
    blocks = 256 * SEQ * 5 + 2 * heads * SEQ * d * 2
    ring = 256 * (SEQ // 2) * 5 + 2 * heads * (SEQ // 2) * d * 2
    cases = [(["parallel.cp=1", "kernels.attention=torch"], layers * 2 * s2 + s2, 2 * s2 + s2, "keeps a dense"),
             (["parallel.cp=1", "kernels.attention=blocks"], blocks, blocks, "blocks keeps none"),
             (["parallel.cp=2", "parallel.cp_mode=ring", "kernels.attention=blocks"], ring, ring, "blocks keeps none"),
             (["parallel.cp=1", "kernels.attention=triton"], 0, 0, None)]
    for sets, full, ckpt, note in cases:
        plain = make_plan(cfg(*sets[:-1], "kernels.attention=torch"))
        plan = make_plan(cfg(*sets, "data.document_mask=true"))
        for got, want in zip(plan.stages, plain.stages):
            assert (got.act_full - want.act_full, got.act_ckpt - want.act_ckpt) == (full, ckpt), sets
        lines = [ln for ln in format_plan(plan).splitlines() if ln.startswith("  document mask:")]
        assert (lines == []) if note is None else (len(lines) == 1 and note in lines[0]), (sets, lines)
