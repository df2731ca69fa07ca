"""parallel.tp_overlap (Domino-style halves): the same numbers as without it, and collectives really in flight.

fp32 on CPU, one spawn of 4 gloo ranks for everything. Values: a block run as two halves sums the same products
per token (the weight gradients as two halves' sums), so losses agree to ~1e-7 and gradients to ~1e-6 of their
scale; 1e-5 is the DESIGN's parity bound. Dropout (p = 0.1) must draw the very masks of a run without overlap:
half A's mask used for both halves moves the loss by 1.4%. Training (6 steps, the loss curve of one process to
1e-5): GPT-2 at tp 2 x dp 2 with sequence parallelism and at tp 4, Llama with 2 k/v heads at tp 4 with sequence
parallelism, and tp 2 x pp 2 under zb1p, whose weight-gradient pass runs the segments' nodes again.

Overlap is checked from the order of the collectives on the host (bench.tp_overlap.Timeline): in each block,
each direction, the second half's collective is launched (so its matmuls were issued) before the first half's
is waited, and so on: ``L0 L1 W0 L2 W1 L3 W2 W3``. A wait moved next to its launch, a wait removed, or the
halves run one after the other each break that sequence.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bench.tp_overlap import Timeline
from megazero.config.schema import ModelConfig
from megazero.train.run import run
from megazero.models.build import build_gpt
from megazero.models.llama import kv_replicas_needed
from megazero.parallel.topology import Grid
from megazero.parallel.dims import ParallelDims
from tests.dist import run_ranks
from tests.runs import NO_FINAL_SAVE, ROOT, read_metrics, small_overrides, write_corpus

GPT2 = ModelConfig(layers=2, hidden=64, heads=4, seq_len=32, vocab_size=500, ffn_hidden=128)
LLAMA = replace(GPT2, arch="llama", heads=8, kv_heads=2, tie_embeddings=False, bias=False, norm_eps=1e-5)
STEPS = 6
LLAMA_SETS = {"model.arch": "llama", "model.heads": 8, "model.kv_heads": 2, "model.ffn_hidden": 96,
              "model.tie_embeddings": "false"}
CURVES = [("gpt_tp2_dp2_sp", {}, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
          ("gpt_tp4", {}, ["parallel.tp=4"]),
          ("llama_tp4_sp", LLAMA_SETS, ["parallel.tp=4", "parallel.sequence_parallel=true"]),
          # zero-bubble: the weight-gradient pass runs each segment's node again
          ("gpt_tp2_pp2_zb1p_sp", {}, ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb1p",
                                       "parallel.sequence_parallel=true"])]


def _tokens(seed: int, b: int = 4) -> torch.Tensor:
    return torch.randint(0, GPT2.vocab_size, (b, GPT2.seq_len), generator=torch.Generator().manual_seed(seed))


def _grads(cfg, grid, sp, overlap, x, t):
    """Loss and gradients of one forward/backward (sequence-parallel gradients summed over tp), with the
    random streams seeded as a trainer seeds them."""
    model = build_gpt(cfg, seed=7, tp=None if grid is None else grid.tp_comm, sequence_parallel=sp,
                      tp_overlap=overlap,
                      kv_replicas=None if grid is None else grid.tp_replica_comm(kv_replicas_needed(cfg, grid.tp)))
    torch.manual_seed(11 + (0 if grid is None else grid.dp_rank))
    model.rng.seed(100 + (0 if grid is None else grid.tp_rank + 10 * grid.dp_rank))
    loss = model(x, t)
    loss.sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.sequence_parallel and grid is not None:
            grid.tp_comm.all_reduce(p.grad, tag="grad")
        grads[n] = (p.grad, p.tp_split_dim, p.tp_replicas)
    return loss.detach(), grads


class _Problems(list):
    """Mismatches, collected rather than raised: a rank that stopped early would leave the others' collectives
    unmatched."""

    def close(self, got, want, what):
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        if not err <= 1e-5 * max(scale, 1e-12):
            self.append(f"{what}: max error {err:.3g} vs scale {scale:.3g}")

    def same_run(self, a, b, what):
        (la, ga), (lb, gb) = a, b
        self.close(la, lb, f"{what} loss")
        for n in ga:
            self.close(ga[n][0], gb[n][0], f"{what} {n}")


def _parity(grid, tp) -> dict:
    """tp_overlap against the same layout without it (dropout 0.1: same masks) and against one process
    (no dropout: each tp gradient is its slice of the single-process one)."""
    x, t = _tokens(1 + grid.dp_rank), _tokens(2 + grid.dp_rank)
    t[0, :3] = -100
    problems = _Problems()
    for cfg in (GPT2, LLAMA):
        single = _grads(cfg, None, False, False, x, t)
        for sp in (False, True):
            what = f"{cfg.arch} tp{tp} sp={sp}"
            wet = replace(cfg, dropout=0.1)
            problems.same_run(_grads(wet, grid, sp, True, x, t), _grads(wet, grid, sp, False, x, t),
                              what + " dropout")
            loss, grads = _grads(cfg, grid, sp, True, x, t)
            problems.close(loss, single[0], what + " loss vs one process")
            for n, (g, dim, replicas) in grads.items():
                want = single[1][n][0]
                pieces = tp // replicas
                if dim is not None:
                    want = want.chunk(pieces, dim)[grid.tp_rank * pieces // tp]
                problems.close(g, want, f"{what} {n} vs one process")
    # activation checkpointing recomputes the matmuls around the halves' segments, with the same masks
    wet = replace(GPT2, dropout=0.1)
    problems.same_run(_grads(replace(wet, activation_checkpointing=True), grid, True, True, x, t),
                      _grads(wet, grid, True, False, x, t), f"tp{tp} checkpointed")
    # no autograd (evaluation): the same logits (padding ids are -inf in both)
    with torch.no_grad():
        on, off = (build_gpt(GPT2, seed=7, tp=grid.tp_comm, tp_overlap=o).eval()(x) for o in (True, False))
    if not torch.equal(on.isinf(), off.isinf()):
        problems.append("evaluation: -inf logits differ")
    problems.close(on.nan_to_num(neginf=0.0), off.nan_to_num(neginf=0.0), "evaluation logits")
    # a k/v weight replicated over ranks has its gradient summed once, not once per half
    kv = grid.tp_replica_comm(kv_replicas_needed(LLAMA, tp))
    sums = []
    for overlap in (True, False):
        grid.counter.reset()
        _grads(LLAMA, grid, False, overlap, x, t)
        sums.append(grid.counter.count("all_reduce", kv.name, "grad"))
    return {"problems": problems[:5], "kv_sums": sums}


def _pattern(records):
    """The order of launches (L) and waits (W) of the asynchronous activation collectives, numbered by launch."""
    records = [r for r in records if r["async"] and r["tag"] == "activation"]
    events = [(r["start"], f"L{i}") for i, r in enumerate(records)]
    events += [(r["wait_start"], f"W{i}") for i, r in enumerate(records) if r["wait_start"] is not None]
    return " ".join(e for _, e in sorted(events))


def _waited_in_place(n, first=0):
    return " ".join(f"L{i} W{i}" for i in range(first, first + n))


def _overlapped(blocks, first=0):
    """Per block: the second half's collective launched before the first's is waited, and so on."""
    return " ".join(" ".join(f"L{b} L{b + 1} W{b} L{b + 2} W{b + 1} L{b + 3} W{b + 2} W{b + 3}".split())
                    for b in range(first, first + 4 * blocks, 4))


def _order(grid, timeline, sp):
    """The launches and waits of one forward and one backward, and the calls per kind against no overlap."""
    x, t = _tokens(1 + grid.dp_rank), _tokens(2 + grid.dp_rank)
    out = {}
    for on in (True, False):
        model = build_gpt(GPT2, seed=7, tp=grid.tp_comm, sequence_parallel=sp, tp_overlap=on)
        grid.counter.reset()
        timeline.clear()
        loss = model(x, t).sum()
        fwd, fwd_counts = list(timeline.records), dict(grid.counter.totals)
        timeline.clear()
        grid.counter.reset()
        loss.backward()
        bwd, bwd_counts = list(timeline.records), dict(grid.counter.totals)
        out[on] = {"fwd": _pattern(fwd), "bwd": _pattern(bwd),
                   "counts": {d: {k: (v.calls, v.numel) for k, v in c.items()}
                              for d, c in (("fwd", fwd_counts), ("bwd", bwd_counts))},
                   "unwaited": sum(r["async"] and r["wait_end"] is None for r in fwd + bwd)}
    return out


def _four_ranks(rank, world, text, cache, base):
    out = {}
    for tp in (4, 2):
        grid = Grid.build(ParallelDims(tp=tp, pp=1, dp=world // tp), "cpu")
        out[tp] = _parity(grid, tp)
        if tp == 2:
            timeline = Timeline(grid.tp_comm)
            out["order"] = {sp: _order(grid, timeline, sp) for sp in (False, True)}
        dist.barrier()
    for name, model_sets, extra in CURVES:
        run(str(ROOT / "configs" / "tiny.yaml"),
            small_overrides(text, cache, base / name, steps=STEPS, **model_sets, **NO_FINAL_SAVE) + extra
            + ["parallel.tp_overlap=true"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp_overlap")
    text, cache = write_corpus(base / "text"), base / "cache"
    for name, model_sets in (("gpt_one", {}), ("llama_one", LLAMA_SETS)):
        run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(text, cache, base / name, steps=STEPS, **model_sets,
                                                                  **NO_FINAL_SAVE))
    return base, run_ranks(4, _four_ranks, text, cache, base)


@pytest.mark.parametrize("tp", [2, 4])
def test_values_and_gradients_match_without_overlap_and_one_process(results, tp):
    """GPT-2 and Llama (2 k/v heads: replicated over pairs of ranks at tp 4), with and without sequence
    parallelism, dropout, activation checkpointing, evaluation, on every rank."""
    for rank, r in enumerate(results[1]):
        assert r[tp]["problems"] == [], (rank, r[tp]["problems"])


def test_replicated_kv_gradients_are_summed_once_for_both_halves(results):
    on, off = results[1][0][4]["kv_sums"]
    assert on == off == 2 * GPT2.layers, (on, off)  # k and v of each layer


@pytest.mark.parametrize("sp", [False, True])
def test_each_half_reduces_behind_the_other_halfs_compute(results, sp):
    """Sequence parallelism's column-parallel backward (the tied head's, and without overlap each block's)
    launches its reduce-scatter and waits in the same node: the check tells that apart from an overlap."""
    order = results[1][0]["order"][sp]
    head = 1 if sp else 0
    assert order[True]["fwd"] == _overlapped(GPT2.layers)
    assert order[True]["bwd"] == " ".join(filter(None, [_waited_in_place(head), _overlapped(GPT2.layers, head)]))
    assert order[True]["unwaited"] == 0
    assert order[False]["fwd"] == ""
    assert order[False]["bwd"] == _waited_in_place((1 + 2 * GPT2.layers) if sp else 0)


@pytest.mark.parametrize("sp", [False, True])
def test_the_same_bytes_in_twice_as_many_block_collectives(results, sp):
    """Each block collective runs once per half, half as large; the embedding's, the head's and the loss's
    are unchanged (2 layers, 2 sub-layers: 4 more each way per kind)."""
    order = results[1][0]["order"][sp]
    more = {"fwd": {("reduce_scatter", "activation"): 4, ("all_gather", "activation"): 4},
            "bwd": {("reduce_scatter", "activation"): 4, ("all_gather", "activation"): 4,
                    ("all_gather", "activation_regather"): 4}} if sp else \
        {"fwd": {("all_reduce", "activation"): 4}, "bwd": {("all_reduce", "activation"): 4}}
    for direction in ("fwd", "bwd"):
        on, off = order[True]["counts"][direction], order[False]["counts"][direction]
        assert on.keys() == off.keys()
        for (kind, group, tag, size), (calls, numel) in on.items():
            assert numel == off[(kind, group, tag, size)][1], (direction, kind, tag)
            want = off[(kind, group, tag, size)][0] + more[direction].get((kind, tag), 0)
            assert calls == want, (direction, kind, tag, calls, want)


@pytest.mark.parametrize("name", [n for n, _, _ in CURVES])
def test_loss_curve_matches_one_process(results, name):
    base = results[0]
    want = [r["loss"] for r in read_metrics(base / ("llama_one" if name.startswith("llama") else "gpt_one"))]
    got = [r["loss"] for r in read_metrics(base / name)]
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(want, got), 1):
        assert math.isclose(a, b, rel_tol=1e-5), (name, step, a, b)
