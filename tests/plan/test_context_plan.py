"""Context parallelism in the layout planner (megazero.plan.context and its callers): a cp rank's activations,
logits and model state, the bytes its attention sends (by hand, and as the ring and Ulysses code counts them on
the fake process group, in this process), what the ring hides, the dp x cp reduction, and the search."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.errors import UserError
from megazero.plan import cli, layouts, search
from megazero.plan.cluster import load_cluster
from megazero.plan.context import GRAD_BYTES, context_bytes, cp_seconds, ulysses_kept_bytes
from megazero.plan.links import group_link, ring
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import Constants, step_time

ROOT = Path(__file__).resolve().parents[2]
H100 = load_cluster("h100-80g")
# a small Llama: 8 heads of 32, 2 k/v heads (fewer than tp 4: one, replicated, per tp rank), 4 layers
SMALL = ["model.hidden=256", "model.heads=8", "model.kv_heads=2", "model.ffn_hidden=512", "model.seq_len=256",
         "model.vocab_size=1024", "model.dropout=0.0", "parallel.pp=1", "parallel.schedule=1f1b",
         "parallel.sequence_parallel=true", "train.global_batch=32", "train.micro_batch=2", "train.precision=bf16",
         "model.activation_checkpointing=false", "zero.stage=1"]
LLAMA8B = str(ROOT / "configs" / "llama3-8b.yaml")


def small(gpus: int, *sets: str):
    return resolve(load_config(ROOT / "configs" / "tiny-llama.yaml", SMALL + list(sets)), gpus, "cuda", planned=True)


def test_a_cp_rank_keeps_a_cp_th_of_the_activations_and_the_same_model_state():
    one = make_plan(small(8, "parallel.tp=1", "parallel.dp=8", "parallel.cp=1")).stages[0]
    four = make_plan(small(8, "parallel.tp=1", "parallel.dp=2", "parallel.cp=4")).stages[0]
    assert four.act_full * 4 == one.act_full and four.act_ckpt * 4 == one.act_ckpt
    assert four.logits * 4 == one.logits
    assert four.model_state == one.model_state  # ZeRO shards over dp x cp: 8 ranks either way
    assert one.context == 0 and four.context > 0


def test_ring_bytes_are_the_hand_formula():
    cfg = small(16, "parallel.tp=4", "parallel.dp=1", "parallel.cp=4")
    b, local, width = 2, 256 // 4, 32  # micro-batch, tokens on a cp rank, one k/v head of 32 per tp rank
    kv = 2 * b * local * width * 2  # K and V in bf16
    grads = 2 * b * local * width * GRAD_BYTES
    assert context_bytes(cfg).kv == kv and context_bytes(cfg).grads == grads
    per_layer = 3 * kv + (3 * kv + 4 * grads)  # forward (cp-1) K/V; backward again, and cp fp32 dK/dV
    stage = make_plan(cfg).stages[0]
    assert stage.context == 4 * cfg.microbatches * per_layer  # 4 layers, 16 microbatches
    recomputed = make_plan(small(16, "parallel.tp=4", "parallel.dp=1", "parallel.cp=4",
                                 "model.activation_checkpointing=true")).stages[0]
    assert recomputed.context - stage.context == 4 * cfg.microbatches * 3 * kv  # the forward's K/V again


def test_ulysses_bytes_are_the_hand_formula():
    cfg = small(4, "parallel.tp=1", "parallel.dp=1", "parallel.cp=4", "parallel.cp_mode=all_to_all")
    b, local, d = 2, 256 // 4, 32
    q = b * local * 8 * d  # q and the output: 8 heads
    kv = b * local * 4 * d  # 2 k/v heads travel repeated to 4, the least multiple of 2 that cp 4 divides
    one_pass = (2 * q + 2 * kv) * 3 // 4 * 2  # (cp-1)/cp of each leaves the rank, bf16
    assert context_bytes(cfg).a2a == one_pass
    assert make_plan(cfg).stages[0].context == 4 * cfg.microbatches * 2 * one_pass  # forward and backward


def _counted(cfg, mode: str) -> float:
    """Bytes one cp rank's attention sends in a forward and backward of one layer, counted by the code's Comm
    on the fake process group (transfers return at once; the receive buffers stay unset)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megazero.parallel.context import context_attention
    from megazero.parallel.topology import Grid
    from megazero.parallel.ulysses import ulysses_attention

    m, cp, b = cfg.model, cfg.parallel.cp, cfg.train.micro_batch
    local = m.seq_len // cp
    dist.init_process_group("fake", rank=0, world_size=cp, store=FakeStore())
    try:
        grid = Grid.build(1, 1, 1, "cpu", cp=cp)
        q = torch.randn(b, m.heads, local, m.head_width, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, m.kv_head_count, local, m.head_width, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        attend = context_attention if mode == "ring" else ulysses_attention
        attend(q, k, v, grid.cp_comm).float().sum().backward()
        return grid.counter.sent_bytes()["cp"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_the_plan_s_bytes_are_what_the_attention_sends(mode):
    cfg = small(4, "parallel.tp=1", "parallel.dp=1", "parallel.cp=4", f"parallel.cp_mode={mode}")
    assert _counted(cfg, mode) == context_bytes(cfg).per_layer(cfg)


def test_ulysses_keeps_its_exchanged_k_v_and_a_second_output():
    """Measured on fake tensors: what Ulysses' attention keeps beyond the ring's (which keeps this rank's q, k,
    v and one output, as the plan's per-layer count does) is ``ulysses_kept_bytes``."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megazero.plan.tracker import MemoryTracker
    from megazero.parallel.context import context_attention
    from megazero.parallel.topology import Grid
    from megazero.parallel.ulysses import ulysses_attention

    cfg = small(8, "parallel.tp=2", "parallel.dp=1", "parallel.cp=4", "parallel.cp_mode=all_to_all")
    assert ulysses_kept_bytes(small(8, "parallel.tp=2", "parallel.dp=1", "parallel.cp=4")) == 0
    m, cp, b = cfg.model, 4, cfg.train.micro_batch
    dist.init_process_group("fake", rank=0, world_size=cp, store=FakeStore())
    try:
        grid, held = Grid.build(1, 1, 1, "cpu", cp=cp), {}
        for attend in (context_attention, ulysses_attention):
            with FakeTensorMode(allow_non_fake_inputs=True):  # a tp rank's 4 heads and 1 k/v head
                q, k, v = (torch.zeros(b, n, m.seq_len // cp, m.head_width, dtype=torch.bfloat16, requires_grad=True)
                           for n in (4, 1, 1))
                tracker = MemoryTracker()
                tracker.name([q, k, v], "params")
                with tracker, tracker.acting("activations"):
                    out = attend(q, k, v, grid.cp_comm)
                    held[attend] = tracker.current["activations"]
                del out
    finally:
        dist.destroy_process_group()
    inputs = (q.numel() + k.numel() + v.numel()) * 2  # the ring keeps them; Ulysses lets them go
    assert held[ulysses_attention] - (held[context_attention] + inputs) == ulysses_kept_bytes(cfg)
    plain = make_plan(small(8, "parallel.tp=2", "parallel.dp=1", "parallel.cp=4")).stages[0]
    assert make_plan(cfg).stages[0].act_full - plain.act_full == 4 * ulysses_kept_bytes(cfg)  # 4 layers, 1 held


def test_the_ring_hides_under_long_attention_and_not_under_short():
    cfg = small(16, "parallel.tp=4", "parallel.dp=1", "parallel.cp=4")
    c, one = Constants(), context_bytes(cfg)
    bandwidth, latency = H100.link(True)  # 16 ranks: the cp group spans two nodes

    def hop(nbytes):
        return nbytes / (bandwidth * c.comm_eff) + latency

    # under a long attention only the last hop of dK/dV home shows; with none, every transfer
    assert cp_seconds(cfg, H100, c, attention=1.0, recomputed=0.0) == pytest.approx(hop(one.grads))
    exposed = 3 * hop(one.kv) + hop(one.kv) + 2 * hop(one.kv + one.grads) + hop(one.grads) + hop(one.grads)
    assert cp_seconds(cfg, H100, c, attention=0.0, recomputed=0.0) == pytest.approx(exposed)
    # short documents (a mask keeping under 1/cp of causal attention): the rank's own block holds all of it, so
    # even a long attention hides only the first hop each way; the later steps' blocks are skipped
    short = small(16, "parallel.tp=4", "parallel.dp=1", "parallel.cp=4", "data.document_mask=true",
                  "data.document_tokens=4")
    later = 2 * hop(one.kv) + 2 * hop(one.kv + one.grads) + hop(one.grads) + hop(one.grads)
    assert cp_seconds(short, H100, c, attention=1.0, recomputed=0.0) == pytest.approx(later)
    # in the step: Llama 3 8B at 131072 tokens over cp 8 (16384 a rank) hides all but the last hop; at 8192
    # tokens (1024 a rank) the blocks are 256 times smaller and the transfers show
    def step(seq: int):
        sets = [f"model.seq_len={seq}", "parallel.tp=8", "parallel.cp=8", "parallel.pp=2", "parallel.dp=1",
                "train.global_batch=16", "model.activation_checkpointing=false"]
        cfg = resolve(load_config(LLAMA8B, sets), 128, "cuda", planned=True)
        st, one = step_time(cfg, H100), context_bytes(cfg)
        bw, lat = H100.link(True)
        last_hop = 16 * cfg.microbatches * (one.grads / (bw * c.comm_eff) + lat)  # 16 layers a stage
        return st, last_hop

    long, last_hop = step(131072)
    assert long.cp_comm == pytest.approx(last_hop) and long.terms["cp_comm"] == long.cp_comm
    short, last_hop = step(8192)
    assert short.cp_comm > 2 * last_hop
    assert short.total > short.compute + short.elementwise + short.cp_comm  # on the critical path


def test_gradients_reduce_over_dp_times_cp():
    base = ["parallel.tp=2", "zero.stage=1"]
    cp4 = step_time(small(16, *base, "parallel.dp=2", "parallel.cp=4"), H100)
    dp8 = step_time(small(16, *base, "parallel.dp=8", "parallel.cp=1"), H100)
    assert cp4.terms["dp_reduce"] == pytest.approx(dp8.terms["dp_reduce"])  # 8 ranks, 2 apart, either way
    assert cp4.optimizer == pytest.approx(dp8.optimizer)  # the same shard
    psi = make_plan(small(16, *base, "parallel.dp=2", "parallel.cp=4")).stages[0].params
    over_dp = ring(psi * 4, 2, group_link(H100, 2, 2), Constants(), passes=1.0)  # fp32 gradients over dp alone
    assert cp4.terms["dp_reduce"] == pytest.approx(ring(psi * 4, 8, group_link(H100, 8, 2), Constants(), 1.0))
    assert not math.isclose(cp4.terms["dp_reduce"], over_dp)
    assert dp8.cp_comm == 0.0 and cp4.cp_comm > 0.0


def test_search_splits_a_131072_token_sequence():
    base = load_config(LLAMA8B, ["model.seq_len=131072", "train.global_batch=128", "parallel.dp=auto"])
    found = search.search(base, H100, 128, {"pp": 1, "micro_batch": 1, "zero_stage": 3, "schedule": "1f1b"})
    top = found.ranked[0].layout
    assert top.cp > 1  # at cp 1 even tp 8 must recompute its 4 GB-a-layer activations
    assert any(r.layout.cp == 1 for r in found.ranked)  # it was offered, and ranks below
    for r in found.ranked:
        assert 131072 % (2 * r.layout.cp) == 0
        assert r.layout.cp_mode == "ring" or (32 // r.layout.tp) % r.layout.cp == 0
        cfg = search.configure(base, r.layout, 128)
        assert (cfg.parallel.cp, cfg.parallel.cp_mode) == (r.layout.cp, r.layout.cp_mode)


def test_search_refuses_an_invalid_cp():
    base = load_config(LLAMA8B, ["model.seq_len=131072", "train.global_batch=96", "parallel.dp=auto"])
    # Ulysses at tp 4 splits 8 heads a tp rank: not over cp 16
    offered = {(lay.cp, lay.cp_mode) for lay in layouts.candidates(base, 128, {"tp": 4, "pp": 1})}
    assert (16, "ring") in offered and (16, "all_to_all") not in offered and (8, "all_to_all") in offered
    with pytest.raises(UserError, match="parallel.cp_mode"):
        search.configure(base, layouts.Layout(4, 1, 2, 1, "1f1b", 3, 1, "none", 1, 16, "all_to_all"), 128)
    # 131072 tokens do not split into 2 x 3 chunks: the rules' own line
    found = search.search(base, H100, 96, {"cp": 3, "pp": 1, "tp": 1})
    assert not found.ranked and "2*parallel.cp = 6" in found.first_refusal


def test_layout_cp_filter_through_the_cli(capsys):
    assert layouts.parse_layout("cp=8,cp_mode=all_to_all") == {"cp": 8, "cp_mode": "all_to_all"}
    with pytest.raises(UserError, match="cp_mode=zigzag is invalid; valid: ring | all_to_all"):
        layouts.parse_layout("cp_mode=zigzag")
    args = ["--config", LLAMA8B, "--cluster", "h100-80g", "--set", "model.seq_len=131072", "--global-batch", "16",
            "--layout"]
    fixed = "cp=8,tp=4,pp=2,micro_batch=1,zero_stage=1"
    assert cli.main(args + [fixed, "--gpus", "128", "--json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {(r["cp"], r["tp"], r["pp"], r["dp"]) for r in rows} == {(8, 4, 2, 2)}
    assert {r["cp_mode"] for r in rows} == {"ring", "all_to_all"}  # 32 heads / tp 4 split over cp 8
    assert cli.main(args + [fixed, "--gpus", "128", "--top", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:4] == ["tp", "pp", "dp", "cp"]
    assert table[2].split()[4] == "8" and table[2].split()[5] in ("ring", "a2a")
    # at tp 8 each tp rank has 4 heads: Ulysses cannot split them over cp 8, only the ring is left
    assert cli.main(args + ["cp=8,tp=8,pp=2,cp_mode=all_to_all", "--gpus", "128"]) == 2
    assert "parallel.cp_mode" in capsys.readouterr().err
    assert cli.main(args + ["cp=3,tp=1,pp=1", "--gpus", "48"]) == 2
    assert "2*parallel.cp = 6" in capsys.readouterr().err


def test_pruned_search_over_cp_modes_finds_what_an_exhaustive_one_finds(tmp_path):
    """Ulysses starts from the ring's recompute floor (it keeps what the ring keeps and more): per layout, the
    least recompute level that fits is still the one costing every level finds."""
    import dataclasses

    from megazero.plan.cluster import CLUSTER_DIR
    from megazero.plan.memo import PlanMemo

    base, gpus, fixed = load_config(ROOT / "configs" / "tiny.yaml"), 8, {"cp": 2}
    memo, need = PlanMemo(), {}
    for lay in layouts.candidates(base, gpus, {**fixed, "recompute": "none"}):
        try:
            cfg = search.configure(base, lay, gpus, memo)
        except UserError:
            continue
        need[lay] = step_time(cfg, H100, plan=make_plan(cfg, memo)).memory_bytes
    assert {lay.cp_mode for lay in need} == {"ring", "all_to_all"}
    budget = sorted(need.values())[len(need) // 2]  # about half fit without recomputation
    path = tmp_path / "small.yaml"
    text = (CLUSTER_DIR / "h100-80g.yaml").read_text()
    path.write_text(text.replace("memory_gb: 80", f"memory_gb: {budget / search.MEMORY_MARGIN / 1e9:.9f}"))
    small_cluster = load_cluster(path)
    budget = small_cluster.memory_gb * 1e9 * search.MEMORY_MARGIN  # as the search reads it
    found = search.search(base, small_cluster, gpus, fixed)
    got = {dataclasses.replace(r.layout, recompute="none"): r.layout.recompute for r in found.ranked}
    assert set(got.values()) > {"none"}  # recomputation was needed somewhere
    want = {}
    for lay in need:
        per_chunk = math.ceil(base.model.layers / (lay.pp * lay.virtual_stages))
        for rec in ["none"] + [str(k) for k in range(1, per_chunk)] + ["full"]:
            cfg = search.configure(base, dataclasses.replace(lay, recompute=rec), gpus, memo)
            if step_time(cfg, small_cluster, plan=make_plan(cfg, memo)).memory_bytes <= budget:
                want[lay] = rec
                break
    assert got == want
    twins = [(rec, want.get(dataclasses.replace(lay, cp_mode="ring"))) for lay, rec in want.items()
             if lay.cp_mode == "all_to_all"]
    assert any(ulysses != ring for ulysses, ring in twins)  # where Ulysses needs more recomputation than the ring


def test_the_memory_refusal_offers_more_cp():
    """A long sequence whose activations do not fit: halving dp for twice the cp is one of the knobs that fit."""
    import torch

    from megazero.plan.fits import check_fits, needed_bytes

    cfg = small(8, "parallel.tp=1", "parallel.dp=8", "parallel.cp=1", "model.seq_len=8192", "train.micro_batch=1",
                "train.global_batch=8")
    need = needed_bytes(cfg, range(1), "cuda")
    with pytest.raises(UserError, match=r"fits with any of: .*parallel\.cp=2 \(dp 4\)"):
        check_fits(cfg, torch.device("cpu"), 0, 0, 1, available=int(need * 0.7))
