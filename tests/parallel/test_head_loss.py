"""The chunked head and cross entropy (megazero.parallel.head_loss) against the unchunked pair: the same loss and
gradients at tp 1, 2 and 4 with padded vocabulary rows and ignored tokens, at chunk sizes from one token to more
than the microbatch; and its logits memory, measured by the memory tracker, bounded by one chunk.

Tolerance: fp32, 1e-6 relative (the issue's bound). Both compute the same fp32 logits; the chunked loss takes
its exponentials relative to each rank's maximum and rescales them to the global one (one rounding more), and
sums the weight gradient chunk by chunk (another order): measured ~1e-7.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.parallel.head_loss import chunked_head_cross_entropy
from megazero.plan.tracker import MemoryTracker
from tests.dist import run_ranks
from tests.runs import (ROOT, assert_curves_match, assert_resume_exact, read_metrics, run_saved_and_resumed,
                        small_overrides, write_corpus)

B, S, H, VOCAB, PADDED = 2, 37, 16, 53, 64  # 11 padded rows: the last tp 4 slice is mostly padding
TOL = 1e-6


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, S, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g)
    targets = torch.randint(0, VOCAB, (B, S), generator=g)
    targets[0, :5] = -100  # ignored tokens
    grad = torch.rand(B, S, generator=g)  # a weight per token: the loss's gradient need not be uniform
    return h, weight, targets, grad


def _loss_and_grads(chunk, h, weight, targets, grad, vocab_start=0, tp=None, vocab=VOCAB):
    """(loss, d h, d weight) of this rank's slice ``weight``; chunk None: the unchunked head and loss."""
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
    if chunk is None:
        loss = vocab_parallel_cross_entropy(F.linear(h, weight), targets, vocab_start, vocab, tp)
    else:
        loss = chunked_head_cross_entropy(h, weight, targets, vocab_start, vocab, tp, chunk)
    (loss * grad).sum().backward()
    return loss.detach(), h.grad, weight.grad


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the largest value (0 where both are 0: a slice of padding's gradients;
    nan where ``a`` has one)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("chunk", [1, 7, B * S, 1000])
def test_chunks_equal_the_whole_at_tp1(chunk):
    inputs = _inputs()
    want, got = _loss_and_grads(None, *inputs), _loss_and_grads(chunk, *inputs)
    assert got[0][0, :5].eq(0).all() and want[0][0, 5:].gt(0).all()
    for name, a, b in zip(("loss", "dh", "dweight"), got, want):
        assert _close(a, b) <= TOL, (name, chunk, _close(a, b))


def _tp_ranks(rank, world):
    """tp 4 over the world and tp 2 over two pairs: each rank's slice, chunked against unchunked."""
    import torch.distributed as dist

    from megazero.parallel.comm import Comm

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for tp, comm in ((4, Comm(dist.group.WORLD, "tp")), (2, Comm(pairs[rank // 2], "tp"))):
        r, width = comm.rank, PADDED // tp
        h, weight, targets, grad = _inputs()
        part = weight[r * width:(r + 1) * width]
        want = _loss_and_grads(None, h, part, targets, grad, r * width, comm)
        for chunk in (5, B * S):
            got = _loss_and_grads(chunk, h, part, targets, grad, r * width, comm)
            out[(tp, chunk)] = [_close(a, b) for a, b in zip(got, want)]
        out[(tp, "whole")] = want[0].tolist()  # plain numbers: a tensor would outlive its rank
    # tp 4, the last rank's slice all padding (40 real rows of 64) and every logit below -88, where exp of the
    # distance to the maximum overflows fp32
    h, weight, targets, grad = _inputs()
    h, weight, targets = h.abs() + 1, -6 * (weight.abs() + 1), targets % 40
    part = weight[rank * 16:(rank + 1) * 16]
    comm = Comm(dist.group.WORLD, "tp")
    want = _loss_and_grads(None, h, part, targets, grad, rank * 16, comm, vocab=40)
    got = _loss_and_grads(5, h, part, targets, grad, rank * 16, comm, vocab=40)
    assert want[0].max() < 1e3 and (F.linear(h, weight[:40]).max() < -88).item()
    out["padding"] = [_close(a, b) for a, b in zip(got, want)]
    return out


def test_chunks_equal_the_whole_at_tp2_and_tp4():
    """Each rank's loss (every token's, after the exchange), its partial input gradient and its slice's weight
    gradient; the tp loss is also the one-rank loss."""
    one = _loss_and_grads(None, *_inputs())[0]
    for rank, out in enumerate(run_ranks(4, _tp_ranks)):
        for tp in (2, 4):
            assert _close(torch.tensor(out[(tp, "whole")]), one) <= TOL, (rank, tp)
            for chunk in (5, B * S):
                assert all(x <= TOL for x in out[(tp, chunk)]), (rank, tp, chunk, out[(tp, chunk)])
        assert all(x <= TOL for x in out["padding"]), (rank, out["padding"])  # a nan fails its comparison


def _peak_beyond_inputs(chunk, h, weight, targets) -> int:
    tracker = MemoryTracker()
    with tracker:
        h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
        tracker.name([h, weight, targets], "params")
        tracker.restart_peak("step")
        base = tracker.device_bytes
        if chunk is None:
            loss = vocab_parallel_cross_entropy(F.linear(h, weight), targets, 0, weight.shape[0])
        else:
            loss = chunked_head_cross_entropy(h, weight, targets, 0, weight.shape[0], None, chunk)
        loss.sum().backward()
        return tracker.report().peak_bytes - base


def test_logits_memory_is_one_chunk_at_vocab_32000_seq_1024():
    """fp32 at vocab 32000, seq 1024, hidden 64: the peak beyond the inputs is one chunk's fp32 logits (16 MB at
    128 tokens) plus the weight-sized gradients (the sum and one chunk's term) and per-token vectors; the
    unchunked pair keeps the microbatch's whole fp32 softmax (131 MB) and makes logits of the same size."""
    vocab, seq, hidden, chunk = 32000, 1024, 64, 128
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(1, seq, hidden, generator=g), 0.02 * torch.randn(vocab, hidden, generator=g)
    targets = torch.randint(0, vocab, (1, seq), generator=g)
    one_chunk = chunk * vocab * 4
    weight_grads = 2 * vocab * hidden * 4
    chunked = _peak_beyond_inputs(chunk, h, weight, targets)
    assert chunked <= one_chunk + weight_grads + seq * hidden * 4 + 64 * seq, (chunked, one_chunk, weight_grads)
    whole = _peak_beyond_inputs(None, h, weight, targets)
    assert whole >= seq * vocab * 4 and whole >= 4 * chunked, (whole, chunked)


# --- in training: the chunked loss at layouts that reach the head by each path --------------------------------

CHUNK = ["train.loss_chunk_tokens=24"]  # 64 tokens a microbatch (2 x 32): chunks of 24, 24 and 16
GPT2 = str(ROOT / "configs" / "tiny.yaml")
LLAMA = ["model.arch=llama", "model.kv_heads=2", "model.tie_embeddings=false"]
LAYOUTS = [  # (name, reference, sets): the tied embedding under sequence parallelism and across pp stages; the
    # untied head (a ColumnParallelLinear called as a module) under ZeRO-3's gathers
    ("gpt2_tp2_sp_dp2", "one", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]),
    ("gpt2_pp2_dp2_z1", "one", ["parallel.pp=2", "parallel.dp=2", "zero.stage=1"]),
    ("llama_tp2_dp2_z3", "one_llama", LLAMA + ["parallel.tp=2", "parallel.dp=2", "zero.stage=3"]),
    ("llama_tp2_sp_dp2", "one_llama", LLAMA + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]),
]


def _train(rank, world, text, cache, base, layouts, resume=None):
    """Each layout for 6 steps; ``resume``: (name, sets) stopped at step 3 and resumed at the same layout."""
    from megazero.train.run import run

    for name, extra in layouts:
        run(GPT2, small_overrides(text, cache, base / name, steps=6) + extra)
    if resume is not None:
        name, extra = resume
        run_saved_and_resumed(GPT2, lambda log, sets: small_overrides(text, cache, log, steps=6) + sets,
                              (base / f"{name}_saved", extra), (base / f"{name}_resumed", extra), 3)
    return True


def test_training_with_chunks_follows_the_unchunked_run(tmp_path):
    """fp32, 6 steps: the loss and gradient norm within 1e-5 relative of the one-process unchunked run (the
    layouts' bound, tests/runs.py); the one-process chunked run within 1e-6 (the loss's own bound, above). Llama
    at tp2 x dp2 ZeRO-3, stopped at step 3 and resumed at its layout, equals its uninterrupted run bit for bit."""
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    _train(0, 1, text, cache, tmp_path, [("one", []), ("one_llama", LLAMA), ("one_chunked", CHUNK)])
    z3 = next(sets for name, _, sets in LAYOUTS if name == "llama_tp2_dp2_z3") + CHUNK
    run_ranks(4, _train, text, cache, tmp_path, [(name, sets + CHUNK) for name, _, sets in LAYOUTS], ("z3", z3))
    assert_resume_exact(tmp_path / "llama_tp2_dp2_z3", tmp_path / "z3_resumed", 3, 6)
    records = {p.name: [r for r in read_metrics(p) if "loss" in r] for p in tmp_path.iterdir() if p.name != "text"
               and (p / "metrics.jsonl").exists()}
    assert_curves_match("one_chunked", records["one"], records["one_chunked"], rel=1e-6)
    for name, reference, _ in LAYOUTS:
        assert_curves_match(name, records[reference], records[name])


def test_the_plan_counts_one_chunk():
    """The stage plan's logits: the microbatch's fp32 softmax unchunked; one chunk's fp32 and bf16 logits with
    train.loss_chunk_tokens (llama3-8b at tp 4: seq 8192, 128256 rows padded, a quarter each)."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.stage_plan import make_plan

    def last_logits(*sets):
        cfg = resolve(load_config(ROOT / "configs" / "llama3-8b.yaml", list(sets)), 64, "cuda")
        return cfg, make_plan(cfg).stages[-1].logits

    cfg, whole = last_logits()
    rows = cfg.model.padded_vocab // cfg.parallel.tp
    assert whole == cfg.train.micro_batch * cfg.model.seq_len * rows * 4
    _, chunked = last_logits("train.loss_chunk_tokens=2048")
    assert chunked == 2048 * rows * (4 + 2) and chunked < whole / 2
